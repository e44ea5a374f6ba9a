"""Trained how: :class:`TrainSettings`; and the whole job: :class:`RunConfig`.

Precision is five fields, so that every recipe in use can be written down:

================  =======  ======  ======  =====  =======  ==========================================
preset            param    grad    master  optim  compute  bytes/param with Adam (params+grads+states)
================  =======  ======  ======  =====  =======  ==========================================
``fp32``          fp32     fp32    --      fp32   fp32     16
``bf16-megatron`` bf16     fp32    fp32    fp32   bf16     18 (Megatron: fp32 main grads)
``bf16-zero``     bf16     bf16    fp32    fp32   bf16     16 (ZeRO paper, K = 12)
``fsdp2-bf16``    fp32     fp32    --      fp32   bf16     16 + bf16 all-gathered copies (FSDP2
                                                           MixedPrecisionPolicy(bf16, reduce fp32))
``bf16``          bf16     bf16    --      bf16   bf16     8 (pure bf16, no master copy)
================  =======  ======  ======  =====  =======  ==========================================

``param_dtype`` is how parameters are stored; ``master_dtype`` is a separate higher-precision copy
the optimizer updates (None when the stored parameters are themselves the master copy);
``compute_dtype`` is the dtype of activations and of the unsharded weights used in matmuls.

A sixth field, ``fp8_recipe``, runs the block Linears' GEMMs on FP8 tensor cores
(:mod:`workbench.spec.float8` holds each recipe's facts and sources). The FP8 recipes keep a bf16
recipe's five dtypes; what changes is which GEMMs run at the FP8 peak, the casts, and a few stored
bytes:

=====================  ===============  =====================================  ===================================
preset (dtypes of)     FP8 GEMMs        extra work per Linear                  stored differently
=====================  ===============  =====================================  ===================================
``float8-tensorwise``  attention, MLP   dynamic tensorwise casts of input,     FSDP all-gathers the Linear weights
(``fsdp2-bf16``,       (and shared      weight, output gradient (amax pass +   in fp8 (1 byte/param, not 2); SP
torchao)               experts); not    cast: 6/8/6 bytes per element); one    all-gathers in fp8; activations as
                       head, router,    weight-amax all-reduce a step (FSDP)   bf16 (bf16 inputs saved)
                       routed experts
``float8-rowwise``     as above, at     rowwise casts (8/10/8 bytes per        nothing: all communication bf16,
(``fsdp2-bf16``,       0.9 of the       element, a transposed bf16 copy each)  activations as bf16
torchao)               tensorwise rate
``te-fp8``             attention, MLP,  delayed-scaling fused cast-transpose   fp8 saved inputs of the Linears (1
(``bf16-megatron``,    experts; not     (4 bytes per element); weights cast    byte, not 2); cached fp8 weight +
Transformer Engine)    head, router     once a step; amax all-reduce per       transpose (2 bytes/local param);
                                        forward and per backward               amax history 1024 x fp32 per tensor
=====================  ===============  =====================================  ===================================

An FP8 recipe needs FP8 tensor cores: on a GPU without them (``fp8_flops = 0``: A100, the CPU
cluster) :class:`RunConfig` refuses it. MFU stays against the dense bf16 peak (the convention of
torchtitan and Megatron); :func:`workbench.predict.perf.mfu` gives the FP8-peak figure beside it.
"""

from __future__ import annotations

import copy

import json
from dataclasses import asdict, dataclass, replace
import os
from typing import Any, Mapping

from workbench.spec.acceptance import format_accept, parse_accept
from workbench.spec.cluster import Cluster
from workbench.spec.errors import ConfigError, check_choice, check_fraction, check_int, check_positive, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.files import parse_json, read_user_json
from workbench.spec.float8 import FLOAT8_RECIPES, Float8Recipe, float8_recipe
from workbench.spec.model import ModelSpec
from workbench.spec.plan import PLAN_ALIASES, ParallelPlan
from workbench.spec.data import DATASETS
from workbench.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORKS, FrameworkProfile, resolve_framework
from workbench.spec.schedules import check_schedule, degenerate_form, torch_schedule_limits

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "eager")
OPTIMIZERS = ("adamw", "adam", "sgd")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # Adam: m and v; SGD: momentum

PRECISIONS: dict[str, dict[str, str | None]] = {
    "fp32": dict(param_dtype="fp32", grad_dtype="fp32", master_dtype=None, optim_dtype="fp32", compute_dtype="fp32"),
    "bf16-megatron": dict(param_dtype="bf16", grad_dtype="fp32", master_dtype="fp32", optim_dtype="fp32", compute_dtype="bf16"),
    "bf16-zero": dict(param_dtype="bf16", grad_dtype="bf16", master_dtype="fp32", optim_dtype="fp32", compute_dtype="bf16"),
    "fsdp2-bf16": dict(param_dtype="fp32", grad_dtype="fp32", master_dtype=None, optim_dtype="fp32", compute_dtype="bf16"),
    "bf16": dict(param_dtype="bf16", grad_dtype="bf16", master_dtype=None, optim_dtype="bf16", compute_dtype="bf16"),
}
for _recipe in PRECISIONS.values():
    _recipe["fp8_recipe"] = None  # a bf16 or fp32 recipe: no FP8 GEMMs
# The FP8 recipes: a bf16 recipe's dtypes and the FP8 facts of workbench.spec.float8.
for _name, _fp8 in FLOAT8_RECIPES.items():
    PRECISIONS[_name] = {**PRECISIONS[_fp8.base_precision], "fp8_recipe": _name}


@dataclass(frozen=True)
class TrainSettings:
    """Batch, sequence, recomputation, precision, optimizer and the trainer's knobs.

    ``global_batch_size`` counts sequences per optimizer step (0: one micro-batch per
    data-parallel rank and pipeline stage, resolved by :class:`RunConfig`).
    """

    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 0
    recompute: str = "none"
    attention: str = "flash"  # "flash": no s x s scores kept; "eager": scores and softmax kept
    dropout: bool = False  # Korthikanti's activation coefficients assume dropout masks
    dropout_rate: float = 0.1  # the bundled trainer's hidden-dropout rate, used only with dropout=true
    optimizer: str = "adamw"
    param_dtype: str = "fp32"
    grad_dtype: str = "fp32"
    master_dtype: str | None = None
    optim_dtype: str = "fp32"
    compute_dtype: str = "bf16"
    # FP8 GEMMs for the block Linears: a name of workbench.spec.float8.FLOAT8_RECIPES (None: none)
    fp8_recipe: str | None = None
    # The framework whose memory conventions and time constants price this job: a name of
    # workbench.spec.framework.FRAMEWORKS, or a FrameworkProfile (a fitted one; a path to its JSON
    # is read at construction, so a saved config holds the profile itself).
    framework: "str | FrameworkProfile" = DEFAULT_FRAMEWORK
    # Fraction of allocated bytes lost to the caching allocator's fragmentation; None: the
    # framework profile's (see :attr:`fragmentation`).
    allocator_fragmentation: float | None = None
    # the trainer
    steps: int = 100
    stop_after: int = 0  # end after this many steps of the `steps`-long schedule (0: all; a baseline's first steps)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    deterministic: bool = False
    dataset: str = "pydoc"
    data_path: str | None = None
    checkpoint_every: int = 0  # save every N steps (and at the end); 0: never
    checkpoint_async: bool = False  # dcp.async_save: stage to CPU, write in the background
    checkpoint_keep: int = 3  # keep the last k committed checkpoints
    moe_aux_loss_coeff: float = 0.01
    moe_capacity_factor: float = 0.0  # 0: dropless
    # Instrumentation and guards (workbench/trainer/instrument.py, guards.py). A fired guard stops the run
    # cleanly after that step (final checkpoint when checkpointing is on) with a "guard" event.
    instrument: bool = True  # measure collectives, pipeline actions, memory (env WORKBENCH_INSTRUMENT=0: off)
    guard_nonfinite: bool = True  # stop on a non-finite loss or gradient norm
    guard_grad_spike: float = 0.0  # stop when grad_norm > k x its running median (k > 1; 0: off)
    guard_min_tokens_per_s: float = 0.0  # stop when global tokens/s falls under this floor (0: off)
    # Acceptance thresholds declared before the run (workbench.spec.acceptance), e.g.
    # "tokens_per_s_per_gpu>=2000,step_time_error<=0.25"; kept in their canonical text.
    accept: str = ""

    @property
    def steps_to_run(self) -> int:
        """The steps the run trains: ``stop_after`` of the ``steps``-long schedule, or all of it."""
        return self.stop_after or self.steps

    def __post_init__(self) -> None:
        # a profile given as a dict (read from JSON) or a path becomes the profile itself first
        if not (isinstance(self.framework, str) and self.framework in FRAMEWORKS):
            object.__setattr__(self, "framework", resolve_framework(self.framework))
        check_types(self)
        check_int("seq_len", self.seq_len, maximum=1 << 26)
        check_int("micro_batch_size", self.micro_batch_size, maximum=1 << 24)
        check_int("global_batch_size", self.global_batch_size, minimum=0, maximum=1 << 40)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("attention", self.attention, ATTENTION)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        require(0 <= self.dropout_rate < 1, f"dropout_rate={self.dropout_rate} must be in [0, 1) (the fraction of "
                "elements dropout zeroes)", field="dropout_rate", value=self.dropout_rate)
        for f in ("param_dtype", "grad_dtype", "optim_dtype", "compute_dtype"):
            check_choice(f, getattr(self, f), tuple(DTYPE_BYTES))
        if self.master_dtype is not None:
            check_choice("master_dtype", self.master_dtype, tuple(DTYPE_BYTES))
        if self.fp8_recipe is not None:
            check_choice("fp8_recipe", self.fp8_recipe, tuple(FLOAT8_RECIPES))
            require(self.compute_dtype in ("bf16", "fp16"),
                    f"fp8_recipe={self.fp8_recipe!r} needs a bf16 or fp16 compute_dtype (the dtype of everything "
                    f"outside the FP8 GEMMs), not {self.compute_dtype!r}", field="fp8_recipe", value=self.fp8_recipe)
        # resolved once: the advisor reads it for every one of thousands of bills
        object.__setattr__(self, "_profile", resolve_framework(self.framework))
        if self.allocator_fragmentation is not None:
            check_positive("allocator_fragmentation", self.allocator_fragmentation, allow_zero=True)
            require(
                self.allocator_fragmentation < 1,
                f"allocator_fragmentation={self.allocator_fragmentation} must be in [0, 1)",
                field="allocator_fragmentation",
            )
        check_int("steps", self.steps, minimum=0, maximum=1 << 40)
        check_int("stop_after", self.stop_after, minimum=0, maximum=1 << 40)
        require(self.stop_after <= self.steps, f"stop_after={self.stop_after} exceeds steps={self.steps} (it ends "
                "the run early within its schedule; 0: run every step)", field="stop_after", value=self.stop_after)
        check_positive("lr", self.lr)
        check_fraction("min_lr_ratio", self.min_lr_ratio)
        check_int("warmup_steps", self.warmup_steps, minimum=0, maximum=1 << 40)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        for i, beta in enumerate(self.betas):
            check_fraction(f"betas[{i}]", beta, closed=False)
        check_positive("grad_clip", self.grad_clip, allow_zero=True)
        check_int("seed", self.seed, minimum=0, maximum=(1 << 63) - 1)
        check_choice("dataset", self.dataset, DATASETS)
        if self.dataset in ("text", "bin"):
            require(bool(self.data_path), f"dataset={self.dataset!r} needs data_path", field="data_path")
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        object.__setattr__(self, "accept", format_accept(parse_accept(self.accept)))
        require(isinstance(self.checkpoint_async, bool), f"checkpoint_async={self.checkpoint_async!r} must be true or false",
                field="checkpoint_async", value=self.checkpoint_async)
        check_int("checkpoint_keep", self.checkpoint_keep, minimum=1)
        check_positive("moe_aux_loss_coeff", self.moe_aux_loss_coeff, allow_zero=True)
        check_positive("moe_capacity_factor", self.moe_capacity_factor, allow_zero=True)
        require(
            self.moe_capacity_factor == 0 or self.moe_capacity_factor >= 1,
            f"moe_capacity_factor={self.moe_capacity_factor} must be 0 (dropless) or >= 1",
            field="moe_capacity_factor",
        )
        for f in ("instrument", "guard_nonfinite"):
            require(isinstance(getattr(self, f), bool), f"{f}={getattr(self, f)!r} must be true or false",
                    field=f, value=getattr(self, f))
        check_positive("guard_grad_spike", self.guard_grad_spike, allow_zero=True)
        require(self.guard_grad_spike == 0 or self.guard_grad_spike > 1,
                f"guard_grad_spike={self.guard_grad_spike} must be 0 (off) or > 1 (k x the running median)",
                field="guard_grad_spike", value=self.guard_grad_spike)
        check_positive("guard_min_tokens_per_s", self.guard_min_tokens_per_s, allow_zero=True)
        object.__setattr__(self, "betas", tuple(self.betas))

    @staticmethod
    def precisions() -> tuple[str, ...]:
        return tuple(PRECISIONS)

    def with_precision(self, name: str) -> "TrainSettings":
        """The same settings under a named precision recipe (see the module docstring)."""
        if name not in PRECISIONS:
            raise ConfigError(
                f"precision={name!r} is not one of {', '.join(PRECISIONS)}", field="precision", value=name
            )
        return replace(self, **PRECISIONS[name])

    @property
    def precision(self) -> str | None:
        """The preset name these dtypes match, or None for a custom mix."""
        mine = {k: getattr(self, k) for k in PRECISIONS["fp32"]}
        return next((n for n, p in PRECISIONS.items() if p == mine), None)

    @property
    def fp8(self) -> "Float8Recipe | None":
        """The FP8 recipe of this job's block Linears (None: no FP8 GEMMs)."""
        return float8_recipe(self.fp8_recipe)

    @property
    def profile(self) -> FrameworkProfile:
        """The framework profile this job is priced under."""
        return self._profile  # type: ignore[attr-defined]  (set by __post_init__)

    @property
    def fragmentation(self) -> float:
        """The allocator's fragmentation share: this job's, else its framework profile's."""
        if self.allocator_fragmentation is not None:
            return self.allocator_fragmentation
        return self.profile.memory.allocator_fragmentation

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        if isinstance(self.framework, FrameworkProfile):
            d["framework"] = self.framework.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainSettings":
        return from_mapping(cls, data, "train")


@dataclass(frozen=True)
class RunConfig:
    """A training job: model, cluster, plan, settings. Construction validates the whole and
    resolves the defaults that depend on the others (``dp_shard=-1``, ``global_batch_size=0``)."""

    model: ModelSpec
    cluster: Cluster
    plan: ParallelPlan
    train: TrainSettings

    def __post_init__(self) -> None:
        check_types(self)
        # Validate once with the batch unresolved (model and degree rules), then resolve the batch.
        plan = validate_plan(self.plan, self.model, self.cluster, replace(self.train, global_batch_size=0))
        train = self.train
        if train.global_batch_size == 0:
            # One micro-batch per data-parallel rank, times enough to fill the pipeline.
            m = plan.pp * (2 if plan.pp > 1 else 1)
            train = replace(train, global_batch_size=train.micro_batch_size * plan.dp * m)
            object.__setattr__(self, "train", train)
        object.__setattr__(self, "plan", validate_plan(plan, self.model, self.cluster, train))
        fp8 = train.fp8
        gpu = self.cluster.gpu
        require(fp8 is None or gpu.fp8_flops > 0,
                f"fp8_recipe={train.fp8_recipe!r} runs the block GEMMs on FP8 tensor cores, which gpu={gpu.name} does "
                f"not have (fp8_flops=0); choose a bf16 recipe, or a GPU with FP8 (H100, H200, L40S)",
                field="fp8_recipe", value=train.fp8_recipe)
        m = self.model
        # A learned position table has max_seq_len rows: a longer sequence has no embedding. RoPE
        # has no table; a sequence past the trained context is a context extension (Llama 3.1
        # trains 128k on the 8k architecture), priced like any other and noted (plan_notes).
        require(m.position != "learned" or train.seq_len <= m.max_seq_len,
                f"seq_len={train.seq_len} exceeds max_seq_len={m.max_seq_len}, the rows of the model's learned "
                "position table", field="seq_len", value=train.seq_len)

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def n_microbatches(self) -> int:
        """Micro-batches each data-parallel rank runs per step (gradient accumulation or pipeline)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.plan.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    def replace(self, **changes: Any) -> "RunConfig":
        return replace(self, **changes)

    def with_framework(self, profile: FrameworkProfile) -> "RunConfig":
        """This job priced under another profile. No check of a RunConfig or of its TrainSettings
        reads the profile (``validate_plan`` reads degrees, batch and schedule; a FrameworkProfile
        validates itself on construction), so the copy is as valid as ``self`` without running
        them again: the fitter reprices every measured run at each of thousands of parameter
        points (``workbench/predict/fit.py``), where a full ``replace`` was two thirds of the time."""
        require(isinstance(profile, FrameworkProfile), f"framework={profile!r} is not a FrameworkProfile",
                field="framework")
        train = copy.copy(self.train)
        object.__setattr__(train, "framework", profile)
        object.__setattr__(train, "_profile", profile)
        out = copy.copy(self)
        object.__setattr__(out, "train", train)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "plan": self.plan.to_dict(),
            "train": self.train.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        return from_mapping(cls, data, "config", {"model": ModelSpec.from_dict, "cluster": Cluster.from_dict,
                                                   "plan": ParallelPlan.from_dict, "train": TrainSettings.from_dict})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(parse_json(text, "config"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunConfig":
        """Read a RunConfig JSON file (a regular file of at most a few MiB)."""
        return cls.from_dict(read_user_json(path, "config"))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())


# ---------------------------------------------------------------------------- from loose values
# The cluster preset each GPU name comes in (``--gpu h200-141gb`` is a DGX H200 node).
GPU_CLUSTERS = {"h100-80gb": "dgx-h100", "h200-141gb": "dgx-h200", "a100-80gb": "dgx-a100",
                "l40s-48gb": "pcie-l40s", "cpu": "local-cpu"}


def build_model(model: str | ModelSpec = "llama3-8b", hf_config: str | os.PathLike | Mapping[str, Any] | None = None
                ) -> ModelSpec:
    """A ModelSpec from a preset name, a Hugging Face ``config.json`` (path or dict), or as given."""
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping):
        return ModelSpec.from_dict(model)
    return ModelSpec.preset(model)


def build_cluster(cluster: str | Cluster | None = None, gpu: str | None = None, gpus: int | None = None,
                  nodes: int | None = None) -> Cluster:
    """A Cluster from a preset name, a cluster JSON file (``*.json``) or a GPU name, sized by
    ``gpus`` (total) or ``nodes``. Fewer GPUs than a node holds make one partial node."""
    if cluster is not None and gpu is not None:
        raise ConfigError("give a cluster or a gpu, not both", field="gpu", value=gpu)
    if isinstance(cluster, Cluster):
        base = cluster
    elif isinstance(cluster, Mapping):
        base = Cluster.from_dict(cluster)
    elif isinstance(cluster, (str, os.PathLike)) and str(cluster).endswith(".json"):
        base = Cluster.from_dict(read_user_json(cluster, "cluster"))
    elif cluster is not None and not isinstance(cluster, str):
        raise ConfigError(f"cluster={cluster!r} must be a preset name, a cluster .json path or a Cluster",
                          field="cluster", value=cluster)
    else:
        if gpu is not None and gpu not in GPU_CLUSTERS:
            raise ConfigError(f"gpu={gpu!r} is not one of {', '.join(GPU_CLUSTERS)}", field="gpu", value=gpu)
        base = Cluster.preset(cluster or GPU_CLUSTERS[gpu or "h100-80gb"])
    per_node = base.gpus_per_node
    if nodes is not None:
        check_int("nodes", nodes)
    if gpus is not None:
        check_int("gpus", gpus)
        if nodes is not None and nodes * per_node != gpus and not (nodes == 1 and gpus < per_node):
            raise ConfigError(f"gpus={gpus} differs from nodes x GPUs per node = {nodes} x {per_node}",
                              field="gpus", value=gpus)
        if gpus < per_node:
            return replace(base, nodes=1, gpus_per_node=gpus)
        if gpus % per_node:
            raise ConfigError(f"gpus={gpus} is not a multiple of {per_node} GPUs per node of {base.name}",
                              field="gpus", value=gpus)
        nodes = gpus // per_node
    return replace(base, nodes=1 if nodes is None else nodes)


def build_plan(plan: str | Mapping[str, Any] | ParallelPlan | None = None, **defaults: Any) -> ParallelPlan:
    """A ParallelPlan from text (``"tp=8,pp=4"``), a mapping of fields (short names allowed:
    ``schedule``, ``zero``, ``v``, ``dp``), or as given; ``defaults`` fill the fields not named."""
    if isinstance(plan, ParallelPlan):
        return plan
    if isinstance(plan, str):
        return ParallelPlan.parse(plan, **defaults)
    if plan is not None and not isinstance(plan, Mapping):
        raise ConfigError(f"plan={plan!r} must be text like 'tp=8,pp=4', a mapping of degrees or a ParallelPlan",
                          field="plan", value=plan)
    fields_ = {PLAN_ALIASES.get(k, k): v for k, v in {**defaults, **dict(plan or {})}.items()}
    return ParallelPlan.from_dict(fields_)


def build_run_config(model: str | ModelSpec = "llama3-8b", *, hf_config: Any = None,
                     cluster: str | Cluster | None = None, gpu: str | None = None, gpus: int | None = None,
                     nodes: int | None = None, plan: str | Mapping[str, Any] | ParallelPlan | None = None,
                     plan_defaults: Mapping[str, Any] | None = None, size_from_plan: bool = False,
                     precision: str | None = None, **train: Any) -> RunConfig:
    """The one way loose values (CLI options, launcher arguments, the app's fields) become a
    validated RunConfig. Raises :class:`ConfigError` naming the field.

    ``train`` holds TrainSettings fields and ``precision`` a recipe of :data:`PRECISIONS` (None: the
    fields as given). ``size_from_plan``: with neither ``gpus`` nor ``nodes``, the cluster gets as
    many GPUs as the plan's degrees multiply to (its dp_shard must then be explicit), in whole nodes
    or, when they do not fill whole nodes, one node holding them all.
    """
    spec = build_model(model, hf_config)
    parsed = build_plan(plan, **dict(plan_defaults or {}))
    if size_from_plan and gpus is None and nodes is None:
        require(parsed.dp_shard > 0, "sizing the cluster from the plan needs an explicit dp_shard",
                field="dp_shard", value=parsed.dp_shard)
        world = parsed.pp * parsed.dp_replicate * parsed.dp_shard * parsed.cp * parsed.tp
        base = build_cluster(cluster, gpu)
        per_node = base.gpus_per_node if world % base.gpus_per_node == 0 else world
        machines = replace(base, nodes=world // per_node, gpus_per_node=per_node)
    else:
        machines = build_cluster(cluster, gpu, gpus, nodes)
    settings = TrainSettings.from_dict(train)
    return RunConfig(spec, machines, parsed, settings.with_precision(precision) if precision else settings)


def validate_plan(plan: ParallelPlan, model: ModelSpec, cluster: Cluster, train: "TrainSettings") -> ParallelPlan:
    """Check the plan against the model, the cluster and the training settings (the rules that need
    more than one object, so they live here and not in the plan); return it with ``dp_shard`` resolved. Raises :class:`ConfigError` whose message spells out the rule."""
    # Model divisibility first: "tp=3 does not divide n_heads=32" says more than a world-size mismatch.
    t = plan.tp
    require(model.n_heads % t == 0, f"tp={t} does not divide n_heads={model.n_heads}", field="tp", value=t)
    require(
        model.n_kv_heads % t == 0,
        f"tp={t} does not divide n_kv_heads={model.n_kv_heads} (KV heads are split across TP ranks, "
        f"not replicated; use a tp that divides {model.n_kv_heads})",
        field="tp",
        value=t,
    )
    if plan.ep > 1:
        require(model.is_moe, f"ep={plan.ep} needs an MoE model (n_experts=0)", field="ep", value=plan.ep)
        require(
            model.n_experts % plan.ep == 0,
            f"ep={plan.ep} does not divide n_experts={model.n_experts}",
            field="ep",
            value=plan.ep,
        )
    plan = plan.resolve(cluster.world_size)
    stages = plan.n_stages
    require(
        stages <= model.n_layers,
        f"pp x virtual_stages = {plan.pp} x {plan.virtual_stages} = {stages} exceeds n_layers={model.n_layers}",
        field="pp",
        value=plan.pp,
    )
    if plan.pp == 1:
        require(
            plan.virtual_stages == 1,
            f"virtual_stages={plan.virtual_stages} needs pp > 1",
            field="virtual_stages",
            value=plan.virtual_stages,
        )
    else:
        _validate_schedule(plan, train)
    if plan.stage_layers is not None:
        require(
            len(plan.stage_layers) == stages and sum(plan.stage_layers) == model.n_layers
            and min(plan.stage_layers) >= 1,
            f"stage_layers={list(plan.stage_layers)} must give {stages} stages of >= 1 layer summing to "
            f"n_layers={model.n_layers}",
            field="stage_layers",
            value=plan.stage_layers,
        )
    s = train.seq_len
    if plan.cp > 1:
        require(
            s % (2 * plan.cp) == 0,
            f"seq_len={s} is not divisible by 2 x cp = {2 * plan.cp} (load-balanced context parallel "
            "gives each CP rank two chunks)",
            field="cp",
            value=plan.cp,
        )
    if t > 1 and plan.sequence_parallel:
        local = s // plan.cp
        require(
            local % t == 0,
            f"seq_len / cp = {s} / {plan.cp} = {local} is not divisible by tp={t} (sequence parallel "
            "splits each rank's tokens across TP ranks)",
            field="tp",
            value=t,
        )
    if plan.ep > 1:
        borrow = plan.dp_shard * plan.cp
        require(
            borrow % plan.ep == 0,
            f"ep={plan.ep} does not divide dp_shard x cp = {plan.dp_shard} x {plan.cp} = {borrow} "
            "(expert parallelism borrows its ranks from them)",
            field="ep",
            value=plan.ep,
        )
    if plan.loss_parallel:
        require(t > 1, "loss_parallel needs tp > 1", field="loss_parallel", value=True)
        require(model.vocab_size % t == 0, f"tp={t} does not divide vocab_size={model.vocab_size}", field="tp", value=t)
    mb = train.micro_batch_size * plan.dp
    require(
        train.global_batch_size % mb == 0,  # 0: resolved later by RunConfig
        f"global_batch_size={train.global_batch_size} is not divisible by micro_batch_size x dp = "
        f"{train.micro_batch_size} x {plan.dp} = {mb}",
        field="global_batch_size",
        value=train.global_batch_size,
    )
    return plan


def _validate_schedule(plan: ParallelPlan, train: TrainSettings) -> None:
    """The rules that define each schedule (:func:`workbench.spec.schedules.check_schedule`):
    virtual stages, and DualPipeV's micro-batch count. Torch's further limits on micro-batch
    counts are not errors here: the plan is predicted with a note (:func:`plan_notes`) and the
    bundled trainer refuses it (:func:`workbench.spec.trainable.unsupported`)."""
    name, v, p = plan.pp_schedule, plan.virtual_stages, plan.pp
    gbs, mbs = train.global_batch_size, train.micro_batch_size
    per_step = mbs * plan.dp if plan.dp_shard > 0 else 0
    # Without a resolved micro-batch count (global_batch_size=0, or not divisible: reported by
    # validate() itself) only the virtual-stage rules can be checked; m = 2 x pp passes them all.
    m = gbs // per_step if per_step and gbs and gbs % per_step == 0 else 0
    try:
        check_schedule(name, p, m or 2 * p, v)
    except ConfigError as err:
        if err.field != "n_microbatches":
            raise
        raise ConfigError(
            f"global_batch_size / (micro_batch_size x dp) = {gbs} / ({mbs} x {plan.dp}) = {m} micro-batches: {err}",
            field="global_batch_size",
            value=gbs,
        ) from None


def torch_limits(config: RunConfig) -> list[str]:
    """Why ``torch.distributed.pipelining`` would refuse the schedule of a valid config, one line
    each (:func:`workbench.spec.schedules.torch_schedule_limits` at its micro-batch count; empty
    when torch builds it, or pp = 1)."""
    plan = config.plan
    if plan.pp == 1:
        return []
    return torch_schedule_limits(plan.pp_schedule, plan.pp, config.n_microbatches, plan.virtual_stages)


def plan_notes(config: RunConfig) -> list[str]:
    """What a user should know next to the prediction of a valid config, one line each: the
    torch limits it breaks and how it is predicted anyway (as another framework runs it), e.g.
    1F1B with fewer micro-batches than stages, predicted as the degenerate pipeline Megatron runs."""
    plan, limits = config.plan, torch_limits(config)
    notes = []
    if limits:
        form = degenerate_form(plan.pp_schedule, plan.pp, config.n_microbatches, plan.virtual_stages)
        notes = [f"{why}; {form}" for why in limits]
    m, s = config.model, config.train.seq_len
    if s > m.max_seq_len:  # RoPE only: a learned table refuses it (RunConfig)
        notes.append(f"seq_len={s} exceeds the model's trained context max_seq_len={m.max_seq_len}: a context "
                     "extension (RoPE scaling), priced as any sequence of that length")
    return notes


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
