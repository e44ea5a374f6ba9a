"""Frameworks as explicit profiles: what a training framework keeps in memory, how fast its kernels
run and how much of its communication it hides.

The same plan costs different bytes and seconds under different frameworks. Torch's DTensor
sequence parallelism keeps the all-gathered input of the QKV and MLP linears for backward;
Megatron keeps its 1/t shard and gathers again (Korthikanti et al. 2022, section 4.2.2). Megatron
with Transformer Engine overlaps TP communication with the GEMMs; torch TP without async-TP does
not. A :class:`FrameworkProfile` names these conventions, so a bill or a step time says which
framework it prices, and a user's measured runs can refit the constants
(:func:`workbench.predict.fit.fit_framework`).

Built in (``FRAMEWORKS``):

``bundled``
    The bundled trainer (workbench/trainer): torch TP/SP via DTensor, FSDP2, torch pipelining, its
    own ring attention. The default: it is what ``workbench train`` runs.
``megatron``
    Megatron-LM / Megatron-Core: Korthikanti's activation accounting (SP inputs kept sharded),
    the distributed optimizer, TP communication overlapped with the GEMMs (``--tp-comm-overlap``).
``fsdp``
    PyTorch FSDP / FSDP2 with flash attention and no TP (torchtitan-FSDP, Composer, Accelerate).
``torchtitan``
    torchtitan: the bundled trainer's torch stack (DTensor TP/SP, FSDP2, torch pipelining) with
    torchtitan's own choices: per-op selective checkpointing (``selective_ac_option = "op"``), one
    RoPE table for the model (``freqs_cis``), a reduce-scatter every micro-batch.
``fsdp-flash1``
    The same with FlashAttention v1's kernels: runs of the torch 1.x era (before torch 2.0's SDPA
    and FlashAttention-2, July 2023), such as the MPT benchmark tables that ship in
    ``workbench/predict/data``. FlashAttention-2's paper measures it at about twice v1's speed
    (Dao 2023, abstract and Fig. 4-7), so the attention constant is half FA2's.

A profile is JSON: :meth:`FrameworkProfile.to_dict` / :meth:`from_dict`, ``load`` / ``save``;
``--framework NAME|profile.json`` on the CLI. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from workbench.spec.errors import ConfigError, check_int, check_positive, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.files import read_user_json

TIERS = ("intra_node", "inter_node", "inter_leaf")
FLASH_ATTENTION_2 = 0.34  # of dense bf16 peak, fwd + bwd, causal, H100 (Dao 2023, Fig. 7: 338 of 989 TFLOP/s)
FA2_SPEEDUP_OVER_FA1 = 2.0  # "around 2x speedup compared to FlashAttention" (Dao 2023, abstract)
SELECTIVE_POLICIES = ("attention", "op")


@dataclass(frozen=True)
class Efficiency:
    """The time model's constants: achievable fractions of peak and fixed costs.

    matmul: large bf16 GEMMs in training reach 0.70-0.75 of dense peak on H100 and A100
      (cuBLAS at the shapes of 2k-16k hidden sizes). A cluster calibration's measured
      ``flops_per_s[dtype]`` replaces ``peak x matmul``.
    attention: FlashAttention-2 forward + backward reaches 0.34 of peak on H100 (Dao 2023,
      Fig. 7: 335-338 TFLOP/s fwd+bwd, causal, head dim 128, against the 989 TFLOP/s dense bf16
      peak; the paper counts a causal kernel's FLOPs as half the full ones, as the planner's
      context of seq_len / 2 does). FlashAttention-3's Hopper kernels reach ~0.6-0.75.
    memory: element-wise kernels reach ~0.7-0.8 of HBM bandwidth.
    gemm_half_dim: the smallest GEMM dimension at which a GEMM runs at half the large-GEMM rate
      (tiles and waves under-filled, operands re-read).
    launch_overhead_s_per_layer: kernel launches and synchronisation of one block's forward
      (~20-30 kernels of a few microseconds each); backward pays it twice.
    overhead_s_per_microbatch: fixed host-side cost of one micro-batch on one stage (data loading,
      the schedule's bookkeeping, the loss); 0 on GPUs where it hides behind queued kernels.
    overhead_s_per_collective: the host's cost of issuing one collective call (DTensor dispatch
      and redistribution, the process group's bookkeeping), beyond its alpha-beta wire time; 0 on
      GPUs, where calls are queued ahead of the stream; ~1.5-2.5 ms per call measured for the
      bundled trainer over gloo on a CPU (benchmarks/bench_cpu_loop.py), fitted there.
    elementwise_bytes_per_hidden: bytes through HBM per d_model element per token per block in
      forward, in compute-dtype units of 2 bytes: 32 = 16 reads/writes of the hidden state (two
      norms in and out, two residual adds, bias adds, RoPE on q and k, layout copies for attention).
    elementwise_bytes_per_ff: accesses per d_ff element (activation function in and out).
    backward_attention_ratio: FlashAttention-2's backward runs five matmuls to the forward's two.
    """

    matmul: float = 0.75
    attention: float = FLASH_ATTENTION_2
    memory: float = 0.75
    elementwise_bytes_per_hidden: float = 32.0
    elementwise_bytes_per_ff: float = 4.0
    backward_attention_ratio: float = 2.5
    gemm_half_dim: float = 128.0
    launch_overhead_s_per_layer: float = 100e-6
    overhead_s_per_microbatch: float = 0.0
    overhead_s_per_collective: float = 0.0

    def __post_init__(self) -> None:
        check_types(self, "efficiency.")
        for name in ("matmul", "attention", "memory"):
            value = getattr(self, name)
            check_positive(f"efficiency.{name}", value)
            require(0 < value <= 1, f"efficiency.{name}={value} must be a fraction of peak in (0, 1]",
                    field=f"efficiency.{name}", value=value)
        for f in fields(self):
            if f.name not in ("matmul", "attention", "memory"):
                check_positive(f"efficiency.{f.name}", getattr(self, f.name), allow_zero=True)


@dataclass(frozen=True)
class MemoryConventions:
    """What a framework keeps beyond Korthikanti's accounting (the bill's ``activations`` and
    ``buffers``, :mod:`workbench.predict.memory`).

    sp_inputs_gathered: under sequence parallelism the QKV and MLP linears save their all-gathered,
      full-sequence input (torch DTensor ``PrepareModuleInput`` + ``ColwiseParallel``), not the
      1/t shard Megatron saves and gathers again in backward: + 2 e s b h (1 - 1/t) per layer.
    cp_fp32_output: context-parallel ring attention keeps its fp32 output and log-sum-exp besides
      the output projection's input (the bundled trainer's ring): + 4 s b q_dim / t per layer.
    rope_cache_per_layer: every block saves RoPE's cos and sin (2 s head_dim e): HF-style blocks;
      torchtitan and Megatron keep one table for the model.
    fsdp_units_in_flight: unsharded FSDP units held at once: the one computing and the one
      prefetched (FSDP2's default forward/backward prefetch of 1).
    allocator_fragmentation: reserved over allocated bytes, less 1: the caching allocator's
      fragmentation (PyTorch LLM training measures 1.03-1.10).
    selective_policy: what ``recompute="selective"`` keeps (:data:`SELECTIVE_POLICIES`).
      "attention": Korthikanti's, the attention core recomputed (the bundled trainer's apply_ac,
      Megatron's ``--recompute-granularity selective``); "op": torchtitan's per-op policy (the
      outputs of every other matmul and of SDPA kept).
    vocab_parallel_loss: the cross-entropy always runs on vocabulary shards under TP (Megatron's
      vocab_parallel_cross_entropy); torch shards it only under loss_parallel.
    loss_grad_bytes_per_logit: bytes per logit the loss's backward allocates beyond the saved fp32
      log-probabilities. torch's ``F.cross_entropy(logits.float(), ...)`` (bundled, torchtitan): 8,
      nll_loss's fp32 gradient of the log-probabilities and log_softmax's fp32 gradient of its
      input, live at once. Megatron computes the gradient in place in its saved fp32 softmax and
      casts it to bf16: 2.
    pipeline_keeps_outputs: torch.distributed.pipelining's last stage keeps every micro-batch's
      output, the logits, until the step ends unless ``step(return_outputs=False)``, which the
      bundled trainer and torchtitan (since Oct 2025) pass; Megatron drops each after its loss.
      True prices a torch pipeline run that returns its outputs.
    fsdp_no_sync_accumulation: gradient accumulation without pipelining skips FSDP's
      reduce-scatter until the last micro-batch (``set_requires_gradient_sync(False)``), so FSDP2
      keeps every unit's gradients unsharded in the reduce dtype: the bundled trainer does;
      torchtitan and Composer reduce-scatter every micro-batch.
    pipeline_fsdp_no_sync: the pipeline runtime does the same on every micro-batch of a step
      (``PipelineStage.backward_maybe_with_nosync``); Megatron's pipeline accumulates into its
      gradient buffers, the model states' gradients.
    pipeline_recv_per_microbatch: torch.distributed.pipelining allocates a receive buffer for every
      micro-batch of the step and keeps them; Megatron receives each tensor into a fresh one, held
      only while its micro-batch is in flight (then it is the stage input billed in activations).
    foreach_optimizer: the optimizer step runs torch's foreach Adam, whose ``sqrt(v)`` is a
      temporary as large as the optimizer's parameters (bundled, torchtitan); Megatron's fused Adam
      (Apex / Transformer Engine) has none.
    attention_dropout: with ``dropout``, the attention probabilities are dropped out too, so eager
      attention keeps that dropout's 1-byte mask and its output beside the softmax (Korthikanti's
      accounting, Megatron's attention_dropout). The bundled trainer's dropout is hidden dropout only
      (after the embeddings, the attention and the MLP: 1-byte masks, as billed): it keeps no
      attention-dropout mask.
    """

    sp_inputs_gathered: bool = True
    cp_fp32_output: bool = True
    rope_cache_per_layer: bool = True
    fsdp_units_in_flight: int = 2
    allocator_fragmentation: float = 0.05
    selective_policy: str = "attention"
    vocab_parallel_loss: bool = False
    loss_grad_bytes_per_logit: float = 8.0
    pipeline_keeps_outputs: bool = False
    fsdp_no_sync_accumulation: bool = True
    pipeline_fsdp_no_sync: bool = True
    pipeline_recv_per_microbatch: bool = True
    foreach_optimizer: bool = True
    attention_dropout: bool = True

    def __post_init__(self) -> None:
        check_types(self, "memory.")
        require(0 <= self.allocator_fragmentation < 1,
                f"memory.allocator_fragmentation={self.allocator_fragmentation} must be in [0, 1)",
                field="memory.allocator_fragmentation", value=self.allocator_fragmentation)
        require(isinstance(self.fsdp_units_in_flight, int) and self.fsdp_units_in_flight >= 1,
                f"memory.fsdp_units_in_flight={self.fsdp_units_in_flight!r} must be an integer >= 1 "
                "(the unit computing, plus those prefetched)",
                field="memory.fsdp_units_in_flight", value=self.fsdp_units_in_flight)
        require(self.selective_policy in SELECTIVE_POLICIES,
                f"memory.selective_policy={self.selective_policy!r} is not one of {', '.join(SELECTIVE_POLICIES)}",
                field="memory.selective_policy", value=self.selective_policy)
        check_positive("memory.loss_grad_bytes_per_logit", self.loss_grad_bytes_per_logit, allow_zero=True)
        for f in fields(self):
            if f.type in ("bool", bool):
                value = getattr(self, f.name)
                require(isinstance(value, bool), f"memory.{f.name}={value!r} must be true or false",
                        field=f"memory.{f.name}", value=value)


@dataclass(frozen=True)
class ErrorBand:
    """How well a profile predicted measured runs it was not fitted to.

    ``step_error``: median absolute relative error of step time (equivalently tokens/s/GPU) on
    held-out runs; ``p90_step_error`` its 90th percentile; ``memory_error``: the same for peak
    memory (None: no memory measured); ``n_runs`` the runs behind it; ``method`` how the runs were
    held out ("5-fold", "leave-one-out")."""

    step_error: float
    p90_step_error: float
    n_runs: int
    method: str
    memory_error: float | None = None

    def __post_init__(self) -> None:
        check_types(self, "band.")
        for name in ("step_error", "p90_step_error", "memory_error"):
            if getattr(self, name) is not None:
                check_positive(f"band.{name}", getattr(self, name), allow_zero=True)
        check_int("band.n_runs", self.n_runs, minimum=0)

    def describe(self, profile: str) -> str:
        """``+/- 9 %, fsdp profile, fitted on 56 runs (5-fold)``."""
        return f"+/- {self.step_error:.0%}, {profile} profile, fitted on {self.n_runs} runs ({self.method})"


@dataclass(frozen=True)
class FrameworkProfile:
    """One framework's memory conventions and time-model constants (see the module docstring).

    in_stage_comm_exposed: the share of each tier's in-stage collectives (TP/SP, CP, EP, inside a
      stage's forward and backward) left on the critical path. 1: nothing overlaps them (torch TP,
      Megatron without ``--tp-comm-overlap``). Megatron-Core with Transformer Engine's userbuffers
      (``--tp-comm-overlap``) splits each TP GEMM and its all-gather / reduce-scatter into chunks
      and overlaps them; the first and last chunk's transfer stays exposed and the chunked GEMMs
      and the communication kernels share the SMs, so within a node (NVLink) the ``megatron``
      profile charges half the TP time: the midpoint between no and perfect overlap, an
      uncalibrated prior for :func:`~workbench.predict.fit.fit_framework` to refit. Across nodes
      the TP transfer outlasts the GEMM it would hide behind: all exposed.
    overlapped_comm_exposed: the share of each tier's overlapped collectives (FSDP gathers and
      reduce-scatters, data-parallel all-reduces) that stays exposed even when compute is long
      enough to hide them: they take SMs and memory bandwidth from the kernels they overlap.
    band: the error this profile was validated to (None: "uncalibrated").
    """

    name: str
    description: str = ""
    efficiency: Efficiency = field(default_factory=Efficiency)
    memory: MemoryConventions = field(default_factory=MemoryConventions)
    in_stage_comm_exposed: tuple[tuple[str, float], ...] = tuple((t, 1.0) for t in TIERS)
    overlapped_comm_exposed: tuple[tuple[str, float], ...] = tuple((t, 0.0) for t in TIERS)
    band: ErrorBand | None = None
    fitted: tuple[str, ...] = ()  # the constants a fit set (names as in fit_framework)

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and self.name.strip() != "",
                f"framework name={self.name!r} must be a non-empty string", field="framework.name", value=self.name)
        for attr in ("in_stage_comm_exposed", "overlapped_comm_exposed"):
            raw = getattr(self, attr)
            ok = isinstance(raw, Mapping) or (isinstance(raw, (list, tuple)) and all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in raw))
            require(ok, f"framework.{attr}={raw!r} must be an object of tier: share", field=f"framework.{attr}",
                    value=raw)
            pairs = dict(raw.items() if isinstance(raw, Mapping) else (tuple(p) for p in raw))
            unknown = sorted(map(str, set(pairs) - set(TIERS)))
            require(not unknown, f"framework.{attr} has unknown tiers {unknown}; tiers are {', '.join(TIERS)}",
                    field=f"framework.{attr}", value=unknown)
            for tier, share in pairs.items():
                require(isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1,
                        f"framework.{attr}[{tier}]={share!r} must be a share in [0, 1]",
                        field=f"framework.{attr}", value=share)
            default = 1.0 if attr == "in_stage_comm_exposed" else 0.0
            object.__setattr__(self, attr, tuple((t, float(pairs.get(t, default))) for t in TIERS))
        require(isinstance(self.fitted, (list, tuple)), f"framework.fitted={self.fitted!r} must be a list of names",
                field="framework.fitted", value=self.fitted)
        object.__setattr__(self, "fitted", tuple(self.fitted))
        check_types(self, "framework.")

    def in_stage_exposed(self, tier: str) -> float:
        return dict(self.in_stage_comm_exposed)[tier]

    def overlapped_exposed(self, tier: str) -> float:
        return dict(self.overlapped_comm_exposed)[tier]

    def describe_band(self) -> str:
        """What a prediction under this profile is good to: the band, or "uncalibrated"."""
        return self.band.describe(self.name) if self.band else f"uncalibrated, {self.name} profile"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["in_stage_comm_exposed"] = dict(self.in_stage_comm_exposed)
        d["overlapped_comm_exposed"] = dict(self.overlapped_comm_exposed)
        d["fitted"] = list(self.fitted)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FrameworkProfile":
        parts = {"efficiency": Efficiency, "memory": MemoryConventions, "band": ErrorBand}
        return from_mapping(cls, data, "framework", {
            key: (lambda v, kind=kind, key=key: from_mapping(kind, v, f"framework.{key}")) for key, kind in parts.items()})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "FrameworkProfile":
        data = read_user_json(path, "framework")
        if isinstance(data, Mapping) and "profile" in data and "name" not in data:
            data = data["profile"]  # a calibration file: the profile and its report
        return cls.from_dict(data)


FRAMEWORKS: dict[str, FrameworkProfile] = {
    "bundled": FrameworkProfile(
        name="bundled",
        description="the bundled trainer: torch DTensor TP/SP, FSDP2, torch.distributed.pipelining, ring attention",
        memory=MemoryConventions(attention_dropout=False),
    ),
    "megatron": FrameworkProfile(
        name="megatron",
        description="Megatron-LM / Megatron-Core: Korthikanti's activations (SP inputs kept sharded), "
                    "distributed optimizer, TP communication overlapped with the GEMMs",
        memory=MemoryConventions(sp_inputs_gathered=False, cp_fp32_output=False, rope_cache_per_layer=False,
                                 vocab_parallel_loss=True, loss_grad_bytes_per_logit=2.0,
                                 fsdp_no_sync_accumulation=False, pipeline_fsdp_no_sync=False, pipeline_recv_per_microbatch=False,
                                 foreach_optimizer=False),
        in_stage_comm_exposed=(("intra_node", 0.5), ("inter_node", 1.0), ("inter_leaf", 1.0)),
    ),
    "fsdp": FrameworkProfile(
        name="fsdp",
        description="PyTorch FSDP / FSDP2 with flash attention, no TP (torchtitan-FSDP, Composer, Accelerate)",
        memory=MemoryConventions(sp_inputs_gathered=False, cp_fp32_output=False, rope_cache_per_layer=False,
                                 fsdp_no_sync_accumulation=False),
    ),
}
FRAMEWORKS["torchtitan"] = replace(
    FRAMEWORKS["bundled"], name="torchtitan",
    description="torchtitan: DTensor TP/SP, FSDP2, torch pipelining, per-op selective checkpointing",
    memory=replace(FRAMEWORKS["bundled"].memory, selective_policy="op", rope_cache_per_layer=False,
                   fsdp_no_sync_accumulation=False),
)
FRAMEWORKS["fsdp-flash1"] = replace(
    FRAMEWORKS["fsdp"], name="fsdp-flash1",
    description="PyTorch FSDP with FlashAttention v1 kernels (torch 1.x era, e.g. the 2023 MPT benchmarks)",
    efficiency=replace(FRAMEWORKS["fsdp"].efficiency, attention=FLASH_ATTENTION_2 / FA2_SPEEDUP_OVER_FA1),
)
DEFAULT_FRAMEWORK = "bundled"


def resolve_framework(value: "str | FrameworkProfile | Mapping[str, Any]") -> FrameworkProfile:
    """A profile from a built-in name, a path to a profile JSON file, a dict, or a profile."""
    if isinstance(value, FrameworkProfile):
        return value
    if isinstance(value, Mapping):
        return FrameworkProfile.from_dict(value)
    if isinstance(value, str):
        if value in FRAMEWORKS:
            return FRAMEWORKS[value]
        if value.endswith(".json") or _is_file(value):
            return FrameworkProfile.load(value)
        raise ConfigError(f"framework={value!r} is not one of {', '.join(FRAMEWORKS)} nor a profile .json file",
                          field="framework", value=value)
    raise ConfigError(f"framework={value!r} must be a name ({', '.join(FRAMEWORKS)}), a profile .json path or a profile",
                      field="framework", value=value)


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long to be a path, a NUL
        return False


def with_efficiency(profile: FrameworkProfile, **changes: float) -> FrameworkProfile:
    """The profile with some efficiency constants changed (the fit's step)."""
    return replace(profile, efficiency=replace(profile.efficiency, **changes))
