"""Data transforms of the planning views: configuration in, plot and table data out.

Pure functions over the planning API (no Panel, no HoloViews, no torch), so that every number a
view draws can be checked in a unit test without a browser:

* model sketch: :func:`model_form_values`, :func:`build_model`, :func:`parse_hf_config`,
  :func:`model_summary`;
* the whole job: :func:`build_config` (never raises: a :class:`Checked` carries the ConfigError
  text and the field it names); framework profiles: :func:`parse_framework_profile`,
  :func:`profile_key`, :func:`band_text`;
* memory bill: :func:`memory_bars`, :func:`memory_summary`, :func:`memory_axis`;
* mesh: :func:`group_of_rank`, :func:`mesh_layout`, and from a plan's prediction (one per
  configuration, :class:`widgets.state.PlanPrediction`) :func:`group_traffic_rows`,
  :func:`tier_rows`, :func:`overloaded_links`;
* words for internal names: :func:`dim_words`, :func:`recompute_words`, :func:`tier_words`, ...;
* advisor: :func:`advice_rows`, :func:`plan_settings`;
* pipeline: :func:`gantt_rects`, :func:`bubble_fraction_of` (for simulated *and* measured
  actions: anything with ``rank, stage, microbatch, kind, start, end``).

Bytes stay bytes here; formatting (:func:`format_bytes`, :func:`format_seconds`) happens at the
edge, for the views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

from workbench import (
    PRECISIONS,
    Cluster,
    ConfigError,
    ModelSpec,
    ParallelPlan,
    RunConfig,
)
from workbench.spec.config import build_run_config
from workbench.spec.errors import check_int
from workbench.spec.files import parse_json
from workbench.spec.framework import FRAMEWORKS, FrameworkProfile
from workbench.predict.advisor import RECOMPUTE_WORDS  # the advisor's words, one table of them
from workbench.predict.perf import describe_step
from workbench.predict.memory import COMPONENTS, MemoryBill

GiB = 1 << 30
MiB = 1 << 20

# Okabe-Ito-like qualitative colours (colour-blind safe), then a second set for many groups.
PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000",
    "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF", "#9467BD", "#AEC7E8", "#FFBB78", "#98DF8A",
)
COMPONENT_COLORS = {
    "parameters": "#0072B2",
    "gradients": "#56B4E9",
    "optimizer": "#E69F00",
    "master_weights": "#F0E442",
    "activations": "#009E73",
    "buffers": "#CC79A7",
    "overhead": "#999999",
}
KIND_COLORS = {"F": "#0072B2", "B": "#009E73", "I": "#E69F00", "W": "#CC79A7"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
TIER_LABELS = {"intra_node": "intra-node", "inter_node": "network", "inter_leaf": "spine"}
COLOR_DIMS = ("tp", "pp", "dp", "cp", "ep", "dp_shard", "dp_replicate")
TIER_ORDER = ("intra_node", "inter_node", "inter_leaf")  # fastest first


# ---------------------------------------------------------------------------- words
# The one place internal names become the words people read (tables, cards, notes, hovers).
DIM_WORDS = {
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
    "cp": "context parallel",
    "ep": "expert parallel",
    "dp": "data parallel",
    "dp_shard": "data parallel (sharded)",
    "dp_replicate": "data parallel (replicated)",
    "dp_shard_cp": "data parallel (sharded) × context",
    "dp_cp": "data parallel × context",
    "efsdp": "expert data parallel (sharded)",
    "edp": "expert data parallel",
}
# short labels of the colour-by buttons: the plan's own abbreviations, with words for the two
# data-parallel halves
DIM_SHORT = {"dp_shard": "dp (sharded)", "dp_replicate": "dp (replicated)"}
RECOMPUTE_CHOICES = {"no recompute": "none", "selective": "selective", "full": "full"}  # button label -> value
ATTENTION_WORDS = {"flash": "flash attention (no scores kept)", "eager": "eager attention (scores and softmax kept)"}
ATTENTION_CHOICES = {"flash": "flash", "eager": "eager"}
# The recipe a GPU cluster trains in unless the user picks one: the CLI's default (bf16 weights,
# fp32 main gradients, master weights and Adam states); CPUs train in fp32, as the CPU trainer does.
GPU_PRECISION = "bf16-megatron"
CPU_PRECISION = "fp32"


def dim_words(dim: str) -> str:
    """``dp_shard_cp`` -> ``data parallel (sharded) × context``; an unknown name as it is."""
    return DIM_WORDS.get(dim, dim)


def dim_short(dim: str) -> str:
    """A colour-by button's label: ``tp``, ``pp``, ``dp (sharded)``."""
    return DIM_SHORT.get(dim, dim)


def recompute_words(mode: str) -> str:
    """``none`` -> ``no recompute``, ``full`` -> ``full recompute``."""
    return RECOMPUTE_WORDS.get(mode, f"{mode} recompute")


def attention_words(kernel: str) -> str:
    return ATTENTION_WORDS.get(kernel, f"{kernel} attention")


def tier_words(tier: str) -> str:
    """``inter_node`` -> ``network``."""
    return TIER_LABELS.get(tier, tier)


def component_words(component: str) -> str:
    """A memory component: ``master_weights`` -> ``master weights``."""
    return component.replace("_", " ")


def kind_words(kind: str) -> str:
    """A pipeline action: ``F`` -> ``forward``."""
    return KIND_NAMES.get(kind, kind)


def cluster_precision(cluster: str | Cluster) -> str:
    """The precision recipe a cluster trains in when the user has not chosen one."""
    c = cluster if isinstance(cluster, Cluster) else Cluster.preset(cluster)
    return CPU_PRECISION if c.gpu.name == "cpu" else GPU_PRECISION


def step_headline(step: Any) -> dict[str, str]:
    """The step's headline numbers as every view shows them (one format, so they read the same)."""
    return {
        "step": format_seconds(step.step_time_s),
        "bubble": f"{step.bubble_fraction:.1%}",
        "mfu": f"{step.mfu:.1%}",
        # against the FP8 peak, where an FP8 recipe runs the Linears on FP8 tensor cores ("": none)
        "mfu_fp8": "" if step.mfu_fp8_peak is None else f"{step.mfu_fp8_peak:.1%}",
        "tokens_per_s_per_gpu": format_rate(step.tokens_per_s_per_gpu),
    }


# ---------------------------------------------------------------------------- formatting
def format_bytes(nbytes: float) -> str:
    """Binary units: ``17.35 GiB``, ``5.6 MiB``, ``812 B``."""
    a = abs(nbytes)
    if a >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if a >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    if a >= 1024:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """``2.5 h``, ``19.6 min``, ``1.23 s``, ``545 ms``, ``38.3 ms``, ``12 µs``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 0.1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def format_count(n: float) -> str:
    """``8.03 B``, ``70.6 M``, ``435 K`` (decimal, as parameter counts are quoted)."""
    for div, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}" if abs(n) < 100 * div else f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


def format_flops(flops: float) -> str:
    """``58.2 GFLOP``, ``1.31 MFLOP`` (decimal prefixes, as FLOP counts are quoted)."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= div:
            return f"{flops / div:,.2f} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def format_rate(x: float) -> str:
    """``8,995``, ``12.3``, ``0.43``: three significant digits below 100."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The unit a chart of values up to ``nbytes`` is drawn in: GiB from 1 GiB up, else MiB."""
    return ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)


# ---------------------------------------------------------------------------- checked results
@dataclass(frozen=True)
class Checked:
    """A value built from user input, or the ConfigError that stopped it (never an exception)."""

    value: Any = None
    error: str | None = None
    field: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, err: Exception) -> "Checked":
        return cls(None, str(err), getattr(err, "field", None))


# ---------------------------------------------------------------------------- model sketch
@dataclass(frozen=True)
class FieldSpec:
    """How one ModelSpec field is edited: ``kind`` is int, float, bool, choice or text; ``auto``
    means 0 stands for the spec's derived default (shown as "0 = auto")."""

    name: str
    kind: str
    group: str
    help: str = ""
    choices: tuple[str, ...] = ()
    auto: bool = False


MODEL_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("name", "text", "Shape", "label of the model"),
    FieldSpec("n_layers", "int", "Shape", "transformer blocks"),
    FieldSpec("d_model", "int", "Shape", "hidden size"),
    FieldSpec("vocab_size", "int", "Shape", "tokens in the vocabulary"),
    FieldSpec("max_seq_len", "int", "Shape", "size of a learned position table"),
    FieldSpec("tie_embeddings", "bool", "Shape", "output projection shares the embedding table"),
    FieldSpec("n_heads", "int", "Attention", "query heads"),
    FieldSpec("n_kv_heads", "int", "Attention", "key/value heads (grouped-query attention)"),
    FieldSpec("head_dim", "int", "Attention", "0 = d_model / n_heads", auto=True),
    FieldSpec("position", "choice", "Attention", "", choices=("rope", "learned")),
    FieldSpec("rope_theta", "float", "Attention", "RoPE base"),
    FieldSpec("qkv_bias", "bool", "Attention", "bias on q, k, v (Qwen2)"),
    FieldSpec("qk_norm", "bool", "Attention", "RMSNorm on q and k (Qwen3)"),
    FieldSpec("kv_lora_rank", "int", "Latent attention", "key/value latent width; 0 = standard attention (DeepSeek-V3: 512)"),
    FieldSpec("q_lora_rank", "int", "Latent attention", "query latent width; 0 = a plain query projection (V3: 1536)"),
    FieldSpec("qk_nope_head_dim", "int", "Latent attention", "per-head key/query width without RoPE (V3: 128)"),
    FieldSpec("qk_rope_head_dim", "int", "Latent attention", "decoupled RoPE key width, shared by all heads (V3: 64)"),
    FieldSpec("v_head_dim", "int", "Latent attention", "per-head value width (V3: 128)"),
    FieldSpec("d_ff", "int", "MLP", "0 = 8/3 d_model (SwiGLU) or 4 d_model (GELU)", auto=True),
    FieldSpec("activation", "choice", "MLP", "", choices=("swiglu", "gelu")),
    FieldSpec("norm", "choice", "MLP", "", choices=("rmsnorm", "layernorm")),
    FieldSpec("linear_bias", "bool", "MLP", "bias on every linear layer (GPT-3)"),
    FieldSpec("n_experts", "int", "Mixture of experts", "0 = dense model"),
    FieldSpec("top_k", "int", "Mixture of experts", "experts per token"),
    FieldSpec("moe_d_ff", "int", "Mixture of experts", "0 = d_ff", auto=True),
    FieldSpec("n_shared_experts", "int", "Mixture of experts", "always-on experts"),
    FieldSpec("shared_d_ff", "int", "Mixture of experts", "0 = moe_d_ff", auto=True),
    FieldSpec("first_k_dense_layers", "int", "Mixture of experts", "leading dense blocks"),
    FieldSpec("shared_expert_gate", "bool", "Mixture of experts", "sigmoid gate on shared experts (Qwen2-MoE)"),
    FieldSpec("moe_layer_freq", "int", "Mixture of experts", "an MoE block every k blocks after the dense ones"),
    FieldSpec("scoring", "choice", "Mixture of experts", "router scores (DeepSeek-V3: sigmoid)", choices=("softmax", "sigmoid")),
    FieldSpec("n_expert_groups", "int", "Mixture of experts", "expert groups for group-limited routing; 1 = none"),
    FieldSpec("topk_groups", "int", "Mixture of experts", "groups a token may route to"),
    FieldSpec("routed_scaling", "float", "Mixture of experts", "scale of the routed experts' output"),
    FieldSpec("router_bias", "bool", "Mixture of experts", "per-expert score-correction bias (auxiliary-loss-free balancing)"),
    FieldSpec("n_mtp_layers", "int", "Mixture of experts", "multi-token-prediction modules, counted apart"),
)
MODEL_FIELD_NAMES = tuple(f.name for f in MODEL_FIELDS)
assert set(MODEL_FIELD_NAMES) == {f.name for f in fields(ModelSpec)}, "every ModelSpec field has an editor"


def model_form_values(spec: ModelSpec) -> dict[str, Any]:
    """The form's values for ``spec``: derived fields that equal their default read 0 (auto), so
    that editing d_model or n_heads re-derives them instead of keeping a stale number."""
    values = {f.name: getattr(spec, f.name) for f in MODEL_FIELDS}
    if spec.is_mla or (spec.d_model % spec.n_heads == 0 and spec.head_dim == spec.d_model // spec.n_heads):
        values["head_dim"] = 0  # latent attention derives it: qk_nope_head_dim + qk_rope_head_dim
    values["moe_d_ff"] = 0 if spec.is_moe and spec.moe_d_ff == spec.d_ff else spec.moe_d_ff
    values["shared_d_ff"] = 0 if spec.shared_d_ff in (None, spec.moe_d_ff) else spec.shared_d_ff
    return values


def build_model(values: Mapping[str, Any]) -> Checked:
    """A ModelSpec from form values (0 = auto for the derived fields), or the ConfigError text and
    the field it names. Missing (None) numbers are reported as such, not crashed on."""
    kw: dict[str, Any] = {}
    for f in MODEL_FIELDS:
        v = values.get(f.name)
        if f.auto and v in (0, None):
            continue  # let ModelSpec derive it
        if v is None and f.kind in ("int", "float"):
            return Checked(None, f"{f.name} is empty: enter a number", f.name)
        kw[f.name] = v
    if kw.get("moe_d_ff") is None:
        kw["moe_d_ff"] = 0
    try:
        return Checked(ModelSpec.from_dict(kw))
    except ConfigError as err:  # a float where an int belongs, a missing field: one line naming it
        return Checked.failed(err)


def parse_hf_config(text: str | bytes) -> Checked:
    """A ModelSpec from the text of a Hugging Face ``config.json`` (uploaded or pasted)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        data = parse_json(text, "hf_config")
    except ConfigError as err:
        return Checked.failed(err)
    if not isinstance(data, dict):
        return Checked(None, "hf_config must hold a JSON object", "hf_config")
    try:
        spec = ModelSpec.from_hf_config(data)
    except ConfigError as err:
        return Checked.failed(err)
    if not spec.name:
        spec = ModelSpec(**{**spec.to_dict(), "name": str(data.get("_name_or_path") or data.get("model_type") or "")})
    return Checked(spec)


def model_summary(spec: ModelSpec, seq_len: int) -> dict[str, float]:
    """The numbers the sketch shows: parameters (total, active, multi-token prediction apart), the
    KV-cache values per token and layer, training FLOPs per token."""
    return {
        "n_params": spec.n_params(),
        "n_active_params": spec.n_active_params(),
        "n_mtp_params": spec.n_mtp_params(),
        "kv_cache_values_per_token": spec.kv_cache_values_per_token(),
        "flops_per_token": spec.flops_per_token(seq_len),
        "seq_len": seq_len,
        "n_layers": spec.n_layers,
    }


# ---------------------------------------------------------------------------- the whole job
def build_config(
    model: ModelSpec | None,
    cluster: str,
    nodes: int,
    plan: Mapping[str, Any],
    train: Mapping[str, Any],
    precision: str,
) -> Checked:
    """A validated RunConfig, or the ConfigError naming the field (``tp``, ``seq_len``, ...)."""
    if model is None:
        return Checked(None, "the model sketch has an error: fix it first", "model")
    try:
        check_int("nodes", nodes)  # the app's box is required: emptied is an error, not "1 node" as on the CLI
        return Checked(build_run_config(model, cluster=cluster, nodes=nodes, plan=plan, precision=precision, **train))
    except ConfigError as err:
        return Checked.failed(err)
    except TypeError as err:  # a None from an emptied number box
        return Checked(None, str(err), None)


# ---------------------------------------------------------------------------- framework profiles
def parse_framework_profile(text: str | bytes | Mapping[str, Any]) -> Checked:
    """A FrameworkProfile from the text of a profile JSON (``FrameworkProfile.save``'s, or the
    ``{"profile": ..., "report": ...}`` that ``workbench calibrate --measured`` writes) or its
    parsed dict, or the one-line ConfigError text (field ``framework``). Never raises."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if isinstance(text, Mapping):
        data: Any = text
    else:
        try:
            data = parse_json(text, "framework profile")
        except ConfigError as err:
            return Checked(None, str(err), "framework")
    if isinstance(data, Mapping) and "profile" in data and "name" not in data:
        data = data["profile"]  # a calibration file: the profile and its report
    try:
        return Checked(FrameworkProfile.from_dict(data))
    except ConfigError as err:  # every field is type-checked on construction: one line naming it
        return Checked(None, str(err), "framework")


def profile_key(profile: FrameworkProfile) -> str:
    """The choice a loaded profile gets in the framework selector: its name, unless a built-in
    has it (``megatron (loaded)``: the built-in stays choosable)."""
    return profile.name if profile.name not in FRAMEWORKS else f"{profile.name} (loaded)"


def band_text(profile: FrameworkProfile, step_time_s: float | None = None) -> str:
    """What a prediction under ``profile`` is good to (plain text; escape it for HTML):
    ``step 0.990 s (+/- 3%, fsdp-fitted profile, fitted on 70 runs (...))``, or without a step time
    ``uncalibrated, bundled profile``; a band with a memory error says so too."""
    text = profile.describe_band() if step_time_s is None else describe_step(step_time_s, profile)
    band = profile.band
    if band is not None and band.memory_error is not None:
        text += f"; peak memory +/- {band.memory_error:.0%}"
    return text


# ---------------------------------------------------------------------------- memory bill
def bar_label(r) -> str:
    """Category of one pipeline rank's bar: ``pp 1 · stages 1, 5``."""
    stages = ", ".join(str(s) for s in r.stages)
    return f"pp {r.pp_rank} · stage{'s' if len(r.stages) > 1 else ''} {stages}"


def memory_bars(bill: MemoryBill, unit: int = GiB) -> dict[str, list[dict[str, Any]]]:
    """Stacked-bar records, one per (bar, component), heights in ``unit`` (bytes are kept too).

    ``peak``: the most loaded rank's components (``bill.components``); ``stages``: every pipeline
    rank's (``bill.per_stage``), in pipeline order. Components in :data:`COMPONENTS` order, so the
    stacks read the same in every bar.
    """
    worst = bill.most_loaded_rank
    peak = [
        {"bar": f"rank {worst}", "component": c, "bytes": bill.components[c], "value": bill.components[c] / unit}
        for c in COMPONENTS
    ]
    stages = [
        {"bar": bar_label(r), "component": c, "bytes": r.components[c], "value": r.components[c] / unit,
         "rank": r.rank, "pp_rank": r.pp_rank, "in_flight": ",".join(map(str, r.in_flight))}
        for r in bill.per_stage
        for c in COMPONENTS
    ]
    return {"peak": peak, "stages": stages}


def stack_columns(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Bar records -> columns for a stacked-bar source: ``bar`` and one column per component."""
    bars = list(dict.fromkeys(r["bar"] for r in records))
    cols: dict[str, list[Any]] = {"bar": bars}
    for c in COMPONENTS:
        by_bar = {r["bar"]: r["value"] for r in records if r["component"] == c}
        cols[c] = [by_bar.get(b, 0.0) for b in bars]
    return cols


def memory_summary(bill: MemoryBill) -> dict[str, Any]:
    """Peak, HBM, fit and headroom of the most loaded rank."""
    fit = bill.fits()
    worst = next(r for r in bill.per_stage if r.rank == bill.most_loaded_rank)
    return {
        "peak_bytes": fit.peak_bytes,
        "hbm_bytes": fit.hbm_bytes,
        "fits": fit.fits,
        "headroom_bytes": fit.headroom_bytes,
        "headroom_fraction": fit.headroom_fraction,
        "most_loaded_rank": bill.most_loaded_rank,
        "pp_rank": worst.pp_rank,
        "components": bill.components,
    }


def memory_axis(bill: MemoryBill) -> dict[str, Any]:
    """Unit and y range of the bill's charts. The HBM line is in range when the bill is at least a
    fifth of it; a tiny bill is zoomed in on (the line is then off the chart, and said so)."""
    peak, hbm = bill.peak_bytes, bill.hbm_bytes
    show_hbm = peak >= 0.2 * hbm
    top = max(peak, hbm) if show_hbm else peak
    name, unit = byte_unit(top)
    return {"unit_name": name, "unit": unit, "ymax": 1.12 * top / unit, "hbm": hbm / unit, "show_hbm": show_hbm}


# ---------------------------------------------------------------------------- the mesh
def group_of_rank(plan: ParallelPlan, dim: str) -> list[int]:
    """Index (in ``plan.group_ranks(dim)``) of the group each global rank belongs to."""
    out = [0] * plan.world_size
    for i, members in enumerate(plan.group_ranks(dim)):
        for r in members:
            out[r] = i
    return out


def group_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


@dataclass(frozen=True)
class MeshLayout:
    """What the mesh view draws. Coordinates are in GPU pitches; y grows upwards.

    ``gpus``: one record per rank (x, y, node, gpu, coordinates, group, colour); ``nodes``: the
    node boxes (x0, y0, x1, y1); ``links``: segments (x0, y0, x1, y1, tier); ``switches``: boxes
    of the network switches (one per row of nodes, or per leaf).
    """

    gpus: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    links: list[dict[str, Any]]
    switches: list[dict[str, Any]]
    dim: str
    n_groups: int
    width: float
    height: float
    warnings: tuple[str, ...] = ()
    tiers: Mapping[str, str] = field(default_factory=dict)


NODE_PITCH = 2.0  # x distance between node centres
NODE_HALF = 0.6  # half the width of a node box


def mesh_layout(cluster: Cluster, plan: ParallelPlan, dim: str, nodes_per_row: int = 16) -> MeshLayout:
    """Nodes side by side (wrapped in rows, one row per leaf switch when the cluster has leaves),
    each node a column of its GPUs; an intra-node link (NVLink/NVSwitch, PCIe) joins a node's
    GPUs; each node links down to its row's switch; the rows' switches join a spine line.
    Every GPU is coloured by its group of ``dim`` (:func:`group_of_rank`)."""
    placement = plan.placement(cluster)
    plan = placement.plan
    gpn = cluster.gpus_per_node
    per_row = cluster.nodes_per_leaf or nodes_per_row
    per_row = max(1, min(per_row, cluster.nodes))
    n_rows = math.ceil(cluster.nodes / per_row)
    row_h = gpn + 2.5  # GPUs, gap, switch, gap
    groups = group_of_rank(plan, dim)
    members = plan.group_ranks(dim)
    gpus, nodes, links, switches = [], [], [], []
    for n in range(cluster.nodes):
        row, col = divmod(n, per_row)
        x = col * NODE_PITCH
        top = -row * row_h
        nodes.append({"node": n, "x0": x - NODE_HALF, "y0": top - gpn + 0.5, "x1": x + NODE_HALF, "y1": top + 0.5})
        if gpn > 1:
            links.append({"x0": x, "y0": top, "x1": x, "y1": top - gpn + 1, "tier": "intra_node", "node": n})
        links.append({"x0": x, "y0": top - gpn + 0.5, "x1": x, "y1": top - gpn - 0.6, "tier": "inter_node",
                      "node": n})
        for g in range(gpn):
            rank = n * gpn + g
            coords = plan.rank_coords(rank)
            gi = groups[rank]
            gpus.append({
                "rank": rank, "node": n, "gpu": g, "x": x, "y": top - g,
                **coords,
                "group": gi, "color": group_color(gi),
                "members": _short_list(members[gi]),
            })
    for row in range(n_rows):
        count = min(per_row, cluster.nodes - row * per_row)
        y = -row * row_h - gpn - 0.6
        switches.append({"x0": -NODE_HALF, "y0": y - 0.35, "x1": (count - 1) * NODE_PITCH + NODE_HALF, "y1": y,
                         "row": row})
    if n_rows > 1:
        # the rows' switches meet on a spine line at the left
        x = -NODE_HALF - 0.6
        tier = "inter_leaf" if cluster.nodes_per_leaf else "inter_node"
        ys = [s["y0"] + 0.175 for s in switches]
        links.append({"x0": x, "y0": ys[0], "x1": x, "y1": ys[-1], "tier": tier, "node": None})
        for s, y in zip(switches, ys):
            links.append({"x0": x, "y0": y, "x1": s["x0"], "y1": y, "tier": tier, "node": None})
    width = (min(per_row, cluster.nodes) - 1) * NODE_PITCH + 2 * NODE_HALF
    return MeshLayout(
        gpus, nodes, links, switches, dim, len(members), width, n_rows * row_h,
        placement.warnings, dict(placement.tiers),
    )


def _short_list(ranks: Sequence[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return ", ".join(map(str, ranks))
    return ", ".join(map(str, ranks[: limit - 2])) + f", ... {ranks[-1]} ({len(ranks)} ranks)"


# Group dimensions whose collectives sit inside a stage's forward and backward (predict_step's
# in-stage dims): on a slow tier they are a bad mapping, and the mesh marks the links they load.
IN_STAGE_DIMS = ("tp", "cp", "ep")


def _tiers_of(c: Any) -> tuple[str, ...]:
    return tuple(t for t, nbytes in c.wire_by_tier if nbytes > 0) or (c.tier,)


def _part_label(tiers: Sequence[str]) -> str:
    if len(tiers) == 1:
        return tier_words(tiers[0])
    return " + ".join(tier_words(t) for t in tiers) + " (hierarchical: one time for both)"


def group_traffic_rows(prediction: Any) -> list[dict[str, Any]]:
    """The prediction's traffic per group dimension, on the pipeline rank that sets the step
    (``step.critical_pp_rank``): group size, slowest tier, calls, bytes this GPU sends, time, and
    the exposed time the step breakdown charges (``breakdown["comm_<dim>"]``; None for the
    pipeline sends, whose waits are inside the bubble).

    ``parts`` splits each group by the tiers its calls run on: a flat call on one tier, a
    hierarchical one (spanning nodes) on both at once, and the host's cost of issuing the calls
    when the profile charges one. A group's calls, bytes and time are the sums of its parts'."""
    per_call = prediction.per_call_s
    breakdown = prediction.step.breakdown
    rows: dict[str, dict[str, Any]] = {}
    for c in prediction.collectives:
        r = rows.setdefault(c.dim, {
            "dim": c.dim, "words": dim_words(c.dim), "group_size": c.group_size, "tier": c.tier,
            "calls": 0, "wire_bytes": 0.0, "time_s": 0.0, "parts": {},
        })
        if TIER_ORDER.index(c.tier) > TIER_ORDER.index(r["tier"]):
            r["tier"] = c.tier
        tiers = _tiers_of(c)
        part = r["parts"].setdefault(tiers, {"tiers": tiers, "label": _part_label(tiers), "calls": 0,
                                             "wire_bytes": 0.0, "time_s": 0.0})
        for part_or_row in (part, r):
            part_or_row["calls"] += c.count
            part_or_row["wire_bytes"] += c.wire_bytes * c.count
            part_or_row["time_s"] += c.total_time_s
        if per_call:
            host = r["parts"].setdefault(("host",), {"tiers": ("host",), "label": "issuing the calls (host)",
                                                     "calls": 0, "wire_bytes": 0.0, "time_s": 0.0})
            host["time_s"] += c.count * per_call
            r["time_s"] += c.count * per_call
    out = []
    for r in rows.values():
        r["parts"] = list(r["parts"].values())
        r["exposed_time_s"] = None if r["dim"] == "pp" else breakdown.get(f"comm_{r['dim']}", 0.0)
        out.append(r)
    out.sort(key=lambda r: -r["wire_bytes"])
    return out


def dim_traffic_rows(prediction: Any) -> list[dict[str, Any]]:
    """:func:`group_traffic_rows` without the parts (one row per group dimension)."""
    return [{k: v for k, v in r.items() if k != "parts"} for r in group_traffic_rows(prediction)]


def tier_rows(prediction: Any) -> list[dict[str, Any]]:
    """Bytes one GPU sends per step on each link tier (the prediction's collectives, hierarchical
    ones split by tier), the tier's bandwidth, and the groups whose traffic it carries."""
    c = prediction.config.cluster
    by_tier: dict[str, dict[str, float]] = {t: {} for t in TIER_ORDER}
    for coll in prediction.collectives:
        for tier, nbytes in coll.wire_by_tier:
            by_tier[tier][coll.dim] = by_tier[tier].get(coll.dim, 0.0) + nbytes * coll.count
    rows = []
    for tier, dims in by_tier.items():
        if tier == "inter_leaf" and not c.nodes_per_leaf:
            continue
        link = c.link(tier)
        rows.append({
            "tier": tier, "link": link.name, "bytes": sum(dims.values()),
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
            "by_dim": dict(sorted(dims.items(), key=lambda kv: -kv[1])),
        })
    return rows


def overloaded_links(layout: MeshLayout, prediction: Any) -> list[dict[str, Any]]:
    """The drawn links a bad mapping overloads: every node's network link (and the spine) that
    carries in-stage traffic (tensor, context or expert parallel collectives, :data:`IN_STAGE_DIMS`)
    of a group spanning nodes, with the bytes per GPU and step the prediction puts there and the
    time of the calls that cross it."""
    config = prediction.config
    loads: dict[str, dict[str, dict[str, float]]] = {}  # tier -> dim -> bytes, time
    for c in prediction.collectives:
        if c.dim not in IN_STAGE_DIMS:
            continue
        for tier, nbytes in c.wire_by_tier:
            if tier == "intra_node" or nbytes <= 0:
                continue
            d = loads.setdefault(tier, {}).setdefault(c.dim, {"bytes": 0.0, "time_s": 0.0})
            d["bytes"] += nbytes * c.count
            d["time_s"] += c.total_time_s
    if not loads:
        return []
    gpn = config.cluster.gpus_per_node
    nodes_of: dict[str, set[int]] = {}
    for dim in {d for per in loads.values() for d in per}:
        spanning = set()
        for g in config.plan.group_ranks(dim):
            ns = {r // gpn for r in g}
            if len(ns) > 1:
                spanning |= ns
        nodes_of[dim] = spanning
    out = []
    for link in layout.links:
        per = loads.get(link["tier"])
        if not per or (link.get("node") is None and link["tier"] != "inter_leaf"):
            continue  # the line joining rows of one switch level carries no group of its own
        dims = [d for d in per if link.get("node") is None or link["node"] in nodes_of[d]]
        if not dims:
            continue
        nbytes = sum(per[d]["bytes"] for d in dims)
        time_s = sum(per[d]["time_s"] for d in dims)
        what = ", ".join(dim_words(d) for d in dims)
        out.append({
            **{k: link[k] for k in ("x0", "y0", "x1", "y1", "tier")},
            "node": -1 if link.get("node") is None else link["node"], "tier_words": tier_words(link["tier"]),
            "dims": ",".join(dims), "what": what, "bytes": nbytes, "time_s": time_s,
            "sent": format_bytes(nbytes), "time": format_seconds(time_s),
            "label": f"{'+'.join(d.upper() for d in dims)} {format_bytes(nbytes)} · {format_seconds(time_s)}",
        })
    return out


# ---------------------------------------------------------------------------- the advisor
def advice_rows(advice: Iterable[Any]) -> list[dict[str, Any]]:
    """One table row per PlanCandidate (units: GiB, ms, %), in words: the batch every plan trains
    (``global batch``: the same on every row), how it is split (micro-batch size x micro-batches
    per data-parallel replica), the recomputation ("no recompute"), the peak memory and the
    headroom it leaves (GiB and % of HBM)."""
    rows = []
    for c in advice:
        p = c.prediction
        rows.append({
            "#": c.rank,
            "plan": c.plan.describe(),
            "global batch": c.train.global_batch_size,
            "micro-batch": c.train.micro_batch_size,
            "micro-batches": c.config.n_microbatches,
            "recompute": RECOMPUTE_WORDS.get(c.train.recompute, c.train.recompute),
            "memory (GiB)": round(c.memory.peak_bytes / GiB, 2),
            "headroom (GiB)": round((c.memory.hbm_bytes - c.memory.peak_bytes) / GiB, 2),
            "headroom (%)": round(100 * (c.memory.hbm_bytes - c.memory.peak_bytes) / c.memory.hbm_bytes, 1),
            "step (ms)": round(p.step_time_s * 1e3, 1),
            "tokens/s/GPU": round(p.tokens_per_s_per_gpu),
            "MFU (%)": round(100 * p.mfu, 1),
            "bubble (%)": round(100 * p.bubble_fraction, 1),
        })
    return rows


PLAN_KEYS = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "zero_stage", "pp_schedule", "virtual_stages")
TRAIN_KEYS = ("micro_batch_size", "global_batch_size", "recompute", "seq_len")


def plan_settings(candidate: Any, global_batch_size: int | None = None) -> dict[str, Any]:
    """The shared state's values that reproduce a candidate's plan and settings.

    ``global_batch_size``: the user's setting, which applying a plan keeps. The candidate was
    predicted at the advisor's batch (the user's, or for 0 = auto the one the search fixed): 0
    stays 0 where auto resolves this plan to that same batch; otherwise the advisor's batch is
    set, so the step time after applying is the candidate's. None: the candidate's batch."""
    from dataclasses import replace

    out = {k: getattr(candidate.plan, k) for k in PLAN_KEYS}
    out.update({k: getattr(candidate.train, k) for k in TRAIN_KEYS})
    if global_batch_size == 0:
        cfg = candidate.config
        auto = RunConfig(cfg.model, cfg.cluster, cfg.plan, replace(cfg.train, global_batch_size=0))
        if auto.train.global_batch_size == candidate.train.global_batch_size:
            out["global_batch_size"] = 0
    prec = candidate.train.precision
    if prec in PRECISIONS:
        out["precision"] = prec
    return out


# ---------------------------------------------------------------------------- pipeline
def _get(a: Any, name: str) -> Any:
    return a[name] if isinstance(a, Mapping) else getattr(a, name)


def gantt_rects(actions: Iterable[Any], height: float = 0.8) -> list[dict[str, Any]]:
    """One rectangle per action (simulated :class:`workbench.predict.pipeline.Action` or measured
    records with the same fields): x from start to end, y centred on the rank (rank 0 on top is
    the view's business), coloured by kind, labelled by micro-batch, and by stage too where a rank
    holds several (``chunk``: which of the rank's stages, ``stage // pp`` for interleaved and V
    schedules alike)."""
    acts = list(actions)
    n_ranks = len({int(_get(a, "rank")) for a in acts}) or 1
    chunked = any(int(_get(a, "stage")) >= n_ranks for a in acts)
    out = []
    for a in acts:
        rank, kind = int(_get(a, "rank")), str(_get(a, "kind"))
        stage, mb = int(_get(a, "stage")), int(_get(a, "microbatch"))
        start, end = float(_get(a, "start")), float(_get(a, "end"))
        out.append({
            "x0": start, "x1": end, "y0": rank - height / 2, "y1": rank + height / 2,
            "rank": rank, "stage": stage, "microbatch": mb, "chunk": stage // n_ranks,
            "kind": kind, "color": KIND_COLORS.get(kind, "#777777"), "start": start, "end": end,
            "label": f"s{stage}·{mb}" if chunked else str(mb), "xc": (start + end) / 2, "yc": rank,
        })
    return out


def unit_stage_times(pp: int, virtual_stages: int) -> tuple[tuple[float, float], ...]:
    """Unit work split over a rank's chunks: each of the ``pp x v`` stages forward 1/v and
    backward 2/v (a zero-bubble schedule splits that backward into I = W = 1/v), so one rank's
    work per micro-batch is F = 1, B = 2 whatever v: interleaved and V schedules then compare with
    1F1B on the same model (notebook 03's normalisation)."""
    v = max(1, virtual_stages)
    return ((1.0 / v, 2.0 / v),) * (pp * v)


def bubble_fraction_of(actions: Iterable[Any]) -> float:
    """Idle share of a timeline: ``1 - busy / (ranks x makespan)``, the makespan running from the
    first start to the last end (the simulator's ``bubble_fraction`` for its own actions)."""
    acts = list(actions)
    if not acts:
        return 0.0
    t0 = min(float(_get(a, "start")) for a in acts)
    t1 = max(float(_get(a, "end")) for a in acts)
    ranks = {int(_get(a, "rank")) for a in acts}
    busy = sum(float(_get(a, "end")) - float(_get(a, "start")) for a in acts)
    span = (t1 - t0) * len(ranks)
    return 0.0 if span <= 0 else 1.0 - busy / span
