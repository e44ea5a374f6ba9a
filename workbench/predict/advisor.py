"""The plan advisor: ``advise(model, cluster, train, top=10, headroom=0.08) -> Advice``.

Enumerate every valid plan (TP, PP up to 32 stages of >= 2 blocks, CP, EP and data-parallel degrees, HSDP, pipeline schedule
and virtual stages, micro-batch size, ZeRO stage, recomputation; sequence parallel is always on
with TP, since it only saves memory), drop those that do not fit, rank the rest by predicted
throughput, and explain the winners along the conservative scaling order:

1. data parallel first (it adds no work per GPU);
2. shard optimizer states, then gradients, then parameters (ZeRO 1-3) when the model does not fit;
3. tensor parallel inside the NVLink domain (a node), never across it;
4. pipeline parallel across nodes, with enough micro-batches to hide the bubble;
5. context parallel for long sequences;
6. expert parallel for MoE.

Pruning that cannot change the answer: a cheaper recomputation or a lower ZeRO stage that already
fits dominates the costlier ones (same plan, less work or less communication), so those are not
predicted. Nor are the plans that a bound shows cannot reach the answer: each slot of the search (a
plan shape, a pipeline schedule and a micro-batch size) has a ceiling on its tokens/s from compute
alone (:func:`_step_floor`: no communication, no optimizer step), and the slots are searched best
ceiling first until none left can reach the front runners (the screen's ``3 top + 10`` best, which
get the full pipeline simulation) nor beat the best plan of a structure an explanation compares
with (fewer or more pipeline stages, less or more tensor parallelism). The answer is the exhaustive
search's (every prediction is checked against its bound; were one under it, the search would be
redone without pruning, with a warning). ``Advice.stats`` counts what the search did: memory bills estimated (``plans``), invalid
plans, bills that did not fit (``too_big``), predictions, and slots left unsearched (``pruned``).
The naive baseline ("just add devices": plain data parallel over every GPU with nothing
else changed) is always evaluated and returned with the answer.

Every plan is compared at ONE global batch (sequences per optimizer step): the caller's
``train.global_batch_size``, or, when it is 0 ("auto"), :func:`search_batch`'s
``AUTO_SEQUENCES_PER_GPU`` (2) sequences per GPU of the cluster, fixed before the search. Plans
differ in micro-batch size and gradient accumulation (micro-batches per step), never in the batch
they train, so their step times compare like with like. A plan fits only with ``headroom`` (a
fraction of HBM, default :data:`DEFAULT_HEADROOM`) left free: peak <= (1 - headroom) x HBM; the
baseline is held to the same rule. :class:`Advice` records the inputs it was computed for
(:class:`AdviceInputs`), so a view can tell when its table no longer belongs to what is on screen.
``progress(done, total)``, if given, is called from the searching thread as slots are settled.
"""

from __future__ import annotations

import heapq
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Generator

from workbench.spec.cluster import Cluster
from workbench.spec.config import DTYPE_BYTES, RunConfig, TrainSettings
from workbench.spec.errors import ConfigError, check_instance, check_int
from workbench.predict.memory import MemoryBill, estimate_memory
from workbench.spec.model import ModelSpec
from workbench.predict.perf import StepPrediction, _fp8_matmul_rate, predict_step, unit_makespan
from workbench.spec.plan import ParallelPlan

GiB = float(1 << 30)
RECOMPUTE_ORDER = ("none", "selective", "full")
# Memory left free on every GPU by default: the allocator's spikes, NCCL's buffers and a profiler
# need room that no bill predicts to the byte (8 % of an 80 GiB H100 is 6.4 GiB).
DEFAULT_HEADROOM = 0.08
MAX_HEADROOM = 0.5
# The batch of a search whose global_batch_size is 0 ("auto"): sequences per GPU of the cluster.
# Every degree divides the world size, so every data-parallel degree divides this batch.
AUTO_SEQUENCES_PER_GPU = 2

# Words for the values the tables and explanations show (not the internal names).
RECOMPUTE_WORDS = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}
SCHEDULE_WORDS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B",
                  "looped-bfs": "looped BFS", "zero-bubble": "zero-bubble", "zbv": "zero-bubble V",
                  "dualpipev": "DualPipe-V"}
ZERO_WORDS = {0: "replicated", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
# breakdown keys of a StepPrediction -> what they are
TIME_WORDS = {"compute": "compute", "recompute": "recomputation", "bubble": "pipeline bubble",
              "optimizer": "optimizer step", "comm_tp": "tensor-parallel communication",
              "comm_cp": "context-parallel communication", "comm_ep": "expert all-to-all",
              "comm_pp": "pipeline send/receive", "comm_dp_shard_cp": "data-parallel sharding (FSDP) communication",
              "comm_dp_replicate": "communication between replicas", "comm_dp": "data-parallel gradient all-reduce",
              "comm_dp_cp": "data-parallel gradient all-reduce", "comm_efsdp": "expert sharding communication",
              "comm_edp": "expert data-parallel communication"}


def plan_words(plan: ParallelPlan) -> str:
    """The plan in words: "tensor parallel 8 × pipeline 2 (zero-bubble V, 2 stages per GPU) ×
    data parallel 2 (ZeRO-3)"."""
    parts = []
    if plan.tp > 1:
        parts.append(f"tensor parallel {plan.tp}")
    if plan.pp > 1:
        per = f", {plan.virtual_stages} stages per GPU" if plan.virtual_stages > 1 else ""
        parts.append(f"pipeline {plan.pp} ({SCHEDULE_WORDS.get(plan.pp_schedule, plan.pp_schedule)}{per})")
    sharded = plan.dp_shard * plan.cp > 1
    zero = ZERO_WORDS[plan.zero_stage] if sharded else "replicated"
    if plan.cp > 1:
        parts.append(f"context parallel {plan.cp}" + (f" ({zero})" if plan.dp == 1 else ""))
    if plan.ep > 1:
        parts.append(f"expert parallel {plan.ep}")
    if plan.dp > 1:
        how = (f"{plan.dp_replicate} replicas of {plan.dp_shard} sharded, {zero}" if plan.dp_replicate > 1 else zero)
        parts.append(f"data parallel {plan.dp} ({how})")
    return " × ".join(parts) or "one GPU"


def percent(fraction: float) -> str:
    """``0.08`` -> ``"8%"``, ``0.075`` -> ``"7.5%"``."""
    return f"{100 * fraction:.3g}%"


def search_batch(cluster: Cluster, train: TrainSettings) -> int:
    """The global batch every plan of a search is compared at: ``train.global_batch_size``, or
    for 0 ("auto") ``AUTO_SEQUENCES_PER_GPU`` sequences per GPU of ``cluster``."""
    return train.global_batch_size or AUTO_SEQUENCES_PER_GPU * cluster.world_size


def check_headroom(headroom: object) -> float:
    """``headroom`` as a fraction of HBM in [0, MAX_HEADROOM); ConfigError naming it otherwise."""
    if (isinstance(headroom, bool) or not isinstance(headroom, (int, float))
            or (isinstance(headroom, float) and not math.isfinite(headroom))):
        raise ConfigError(f"headroom={headroom!r} must be a finite number, a fraction of HBM in [0, {MAX_HEADROOM})",
                          field="headroom", value=headroom)
    if not 0 <= headroom < MAX_HEADROOM:
        raise ConfigError(f"headroom={headroom!r} must be a fraction of HBM in [0, {MAX_HEADROOM}) "
                          "(0.08 leaves 8 % free)",
                          field="headroom", value=headroom)
    return float(headroom)


@dataclass(frozen=True)
class AdviceInputs:
    """What a search was computed for: an Advice belongs to these and to nothing else.
    ``train.global_batch_size`` is the batch every plan was compared at (resolved from auto when
    ``auto_batch``; two inputs that resolve to the same batch are the same search)."""

    model: ModelSpec
    cluster: Cluster
    train: TrainSettings
    headroom: float
    auto_batch: bool = field(default=False, compare=False)

    @property
    def global_batch_size(self) -> int:
        return self.train.global_batch_size

    def batch_words(self) -> str:
        gbs = self.global_batch_size
        auto = f" (auto: {AUTO_SEQUENCES_PER_GPU} per GPU)" if self.auto_batch else ""
        return f"global batch {gbs} sequences{auto}"

    def describe(self) -> str:
        """"mixtral-8x7b on 2 × 8 h100-80gb (dgx-h100), seq 4096, global batch 64 sequences,
        bf16-megatron, megatron profile, 8 % headroom"."""
        c, t = self.cluster, self.train
        return (f"{self.model.name or 'a custom model'} on {c.nodes} × {c.gpus_per_node} {c.gpu.name} ({c.name}), "
                f"seq {t.seq_len}, {self.batch_words()}, {t.precision or 'custom precision'}, "
                f"{t.profile.name} profile, {percent(self.headroom)} headroom")

    def differences(self, other: "AdviceInputs") -> list[str]:
        """The inputs that differ from ``other``'s, in words ("model", "global batch", ...)."""
        out = []
        if self.model != other.model:
            out.append("model")
        if (self.cluster.name, self.cluster.gpu) != (other.cluster.name, other.cluster.gpu):
            out.append("cluster")
        elif self.cluster != other.cluster:
            out.append("nodes")
        a, b = self.train, other.train
        if a.seq_len != b.seq_len:
            out.append("sequence length")
        if a.global_batch_size != b.global_batch_size:
            out.append("global batch")
        if a.profile != b.profile:
            out.append("framework")
        dtypes = ("param_dtype", "grad_dtype", "master_dtype", "optim_dtype", "compute_dtype")
        if any(getattr(a, k) != getattr(b, k) for k in dtypes):
            out.append("precision")
        if a.attention != b.attention:
            out.append("attention")
        same = dict(seq_len=b.seq_len, global_batch_size=b.global_batch_size, framework=b.framework,
                    attention=b.attention, **{k: getattr(b, k) for k in dtypes})
        if replace(a, **same) != b:
            out.append("training settings")
        if self.headroom != other.headroom:
            out.append("headroom")
        return out


@dataclass(frozen=True)
class PlanCandidate:
    """A ranked plan with its bill, its prediction and the reasons it is where it is."""

    config: RunConfig
    memory: MemoryBill
    prediction: StepPrediction
    explanation: tuple[str, ...] = ()
    rank: int = 0

    @property
    def plan(self) -> ParallelPlan:
        return self.config.plan

    @property
    def train(self) -> TrainSettings:
        return self.config.train

    @property
    def headroom_bytes(self) -> int:
        """HBM left free on the most loaded GPU."""
        return self.memory.hbm_bytes - self.memory.peak_bytes

    @property
    def headroom_fraction(self) -> float:
        return self.headroom_bytes / self.memory.hbm_bytes

    def summary(self) -> str:
        p, t = self.prediction, self.train
        return (
            f"{self.plan.describe()}, global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x "
            f"{self.config.n_microbatches} per replica, {RECOMPUTE_WORDS[t.recompute]}: "
            f"{self.memory.peak_bytes / GiB:.1f} GiB ({self.headroom_bytes / GiB:.1f} GiB free), "
            f"step {p.step_time_s:.3f} s, MFU {p.mfu:.1%}"
            + (f" ({p.mfu_fp8_peak:.1%} of the FP8 peak)" if p.mfu_fp8_peak is not None else "") + ", "
            f"bubble {p.bubble_fraction:.1%}, {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
        )


@dataclass(frozen=True)
class Baseline:
    """Plain data parallel over every GPU: does it fit, and how fast would it be."""

    config: RunConfig | None
    memory: MemoryBill | None
    prediction: StepPrediction | None
    reason: str  # why it fails, or "fits"

    @property
    def fits(self) -> bool:
        return self.prediction is not None


class Advice(list):
    """The top candidates (a list, best first) plus the baseline, the search's statistics and the
    inputs it was computed for (``inputs``: every candidate trains ``inputs.global_batch_size``
    sequences per step and leaves at least ``inputs.headroom`` of HBM free)."""

    def __init__(self, candidates: list[PlanCandidate], baseline: Baseline, stats: dict[str, int],
                 rejections: dict[str, str], inputs: AdviceInputs | None = None):
        super().__init__(candidates)
        self.baseline = baseline
        self.stats = stats
        self.rejections = rejections
        self.inputs = inputs

    @property
    def global_batch_size(self) -> int | None:
        """The batch every plan was compared at."""
        return self.inputs.global_batch_size if self.inputs else None

    def gain_over_baseline(self) -> float | None:
        """Throughput of the best plan over the baseline's (None when the baseline does not fit)."""
        if not self or not self.baseline.fits:
            return None
        return self[0].prediction.tokens_per_s / self.baseline.prediction.tokens_per_s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Search:
    model: ModelSpec
    cluster: Cluster
    train: TrainSettings  # its global batch is resolved on construction (search_batch)
    prune: bool = True  # False: search every slot (what the bound must not change; tests compare)
    headroom: float = DEFAULT_HEADROOM
    progress: Callable[[int, int], None] | None = None  # (slots settled, slots), from this thread
    stats: dict[str, int] = field(
        default_factory=lambda: {"plans": 0, "invalid": 0, "too_big": 0, "predicted": 0, "pruned": 0})
    # (position in the enumeration, family, why): the search meets them out of order
    notes: list[tuple[int, str, str]] = field(default_factory=list)
    floor_broken: bool = False  # a prediction beat its slot's bound: the bound no longer holds
    _settings: dict[tuple[int, str], TrainSettings] = field(default_factory=dict)
    _plans: dict[tuple, ParallelPlan] = field(default_factory=dict)
    settled: int = 0  # slots searched to the end (or found unreachable) so far
    total: int = 0

    def __post_init__(self) -> None:
        # One batch for every plan: a plan-dependent "auto" batch would rank unlike steps.
        self.train = replace(self.train, global_batch_size=search_batch(self.cluster, self.train))
        # peak <= (1 - headroom) x HBM, in whole bytes (a bill's peak is an integer)
        self.limit_bytes = math.floor((1 - self.headroom) * self.cluster.gpu.hbm_bytes)

    def fits(self, bill: MemoryBill) -> bool:
        """Whether ``bill`` leaves the headroom free."""
        return bill.peak_bytes <= self.limit_bytes

    def settle(self, n: int = 1) -> None:
        """Count ``n`` slots settled and tell ``progress`` (every 1 % of the slots, and the last)."""
        before, self.settled = self.settled, self.settled + n
        if self.progress is not None and self.total:
            step = max(1, self.total // 100)
            if self.settled // step != before // step or self.settled >= self.total:
                self.progress(min(self.settled, self.total), self.total)

    def note(self, position: int, family: str, why: str) -> None:
        self.notes.append((position, family, why))

    @property
    def rejections(self) -> dict[str, str]:
        """The first reason each plan family was rejected, in the order of enumeration."""
        out: dict[str, str] = {}
        for _, family, why in sorted(self.notes, key=lambda n: n[0]):
            out.setdefault(family, why)
        return out

    def settings(self, mbs: int, recompute: str) -> TrainSettings:
        # A search needs at most 9 distinct settings: validate each once, not once per plan.
        key = (mbs, recompute)
        if key not in self._settings:
            self._settings[key] = replace(self.train, micro_batch_size=mbs, recompute=recompute)
        return self._settings[key]

    def plan(self, slot: "_Slot", zero: int) -> ParallelPlan:
        # shared by the micro-batch sizes and recomputations of a shape and schedule
        key = (tuple(slot.shape.items()), slot.schedule, slot.v, zero)
        if key not in self._plans:
            self._plans[key] = ParallelPlan(pp_schedule=slot.schedule, virtual_stages=slot.v, zero_stage=zero,
                                            sequence_parallel=True, **slot.shape)
        return self._plans[key]

    def config(self, slot: "_Slot", recompute: str, zero: int) -> RunConfig | ConfigError:
        try:
            return RunConfig(self.model, self.cluster, self.plan(slot, zero), self.settings(slot.mbs, recompute))
        except ConfigError as e:
            return e

    def invalid(self, slot: "_Slot", zero: int, error: ConfigError) -> None:
        self.stats["invalid"] += 1
        self.note(slot.index, self.plan(slot, zero).describe(), str(error))

    def drain(self, heap: list, needed: Callable[[float], bool],
              found: Callable[["_Slot", PlanCandidate], None]) -> None:
        """Search the slots of ``heap`` (``(-ceiling, index, slot)``), best ceiling first, while
        ``needed(ceiling)`` (always, without pruning); a slot whose bound tightens goes back in."""
        while heap and (not self.prune or needed(-heap[0][0])):
            _, index, slot = heapq.heappop(heap)
            try:
                recompute, bubble = next(slot.steps)
            except StopIteration as end:
                self.settle()
                if end.value is not None:
                    if end.value.prediction.tokens_per_s > slot.ceiling:
                        self.floor_broken = True
                    found(slot, end.value)
                continue
            slot.ceiling = slot.ceiling_at(recompute, bubble)
            heapq.heappush(heap, (-slot.ceiling, index, slot))


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    for v in (2, 4):
        if pp * v <= n_layers:
            out.append(("interleaved-1f1b", v))
    if 2 * pp <= n_layers:
        out += [("zero-bubble", 2), ("zbv", 2)]
    return out


def _plan_shapes(s: _Search) -> list[dict[str, int]]:
    """Degree combinations that divide the world and respect the model's divisibility."""
    model, cluster, train = s.model, s.cluster, s.train
    world = cluster.world_size
    shapes = []
    for tp in _divisors(cluster.gpus_per_node):
        if model.n_heads % tp or model.n_kv_heads % tp:
            continue
        for pp in _divisors(world // tp):
            # At least two blocks per stage and at most 32 stages: deeper pipelines only add
            # bubble and p2p latency (Llama 3 405B trained with pp = 16 on 16k GPUs).
            if 2 * pp > model.n_layers or pp > 32:
                continue
            rest = world // (tp * pp)
            for cp in (c for c in (1, 2, 4, 8) if rest % c == 0):
                # CP pays off only for long sequences: keep >= 4k tokens per CP rank
                if cp > 1 and train.seq_len // cp < 4096:
                    continue
                if train.seq_len % (2 * cp) or (train.seq_len // cp) % tp:
                    continue
                dp = rest // cp
                eps = [e for e in _divisors(dp * cp) if model.is_moe and model.n_experts % e == 0 and e <= 64] or [1]
                for ep in eps:
                    replicas = [1]
                    # HSDP: shard within a node, replicate across nodes
                    within = cluster.gpus_per_node // (tp * cp) if cluster.gpus_per_node % (tp * cp) == 0 else 1
                    if 1 < within < dp and dp % within == 0 and (within * cp) % ep == 0:
                        replicas.append(dp // within)
                    for rep in replicas:
                        shapes.append(dict(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=rep, dp_shard=dp // rep))
    return shapes


class _Slot:
    """One point of the search: a plan shape, a pipeline schedule and a micro-batch size. Its
    variants (recomputation x ZeRO stage) are tried cheapest first; the first that fits is its
    candidate. ``steps`` runs that search a piece at a time (see :meth:`_steps`)."""

    def __init__(self, s: _Search, index: int, shape: dict[str, int], schedule: str, v: int, mbs: int,
                 earlier: tuple["_Slot", ...]):
        self.index, self.shape, self.schedule, self.v, self.mbs = index, shape, schedule, v, mbs
        self.earlier = earlier  # the valid slots of this shape and schedule with smaller micro-batches
        self.zero_stages = (1, 2, 3) if shape["dp_shard"] * shape["cp"] > 1 else (0,)
        # The leanest variant: if full recomputation with the highest ZeRO stage does not fit,
        # nothing of this slot does (the 8 other variants are not evaluated). Validation depends on
        # neither the recomputation nor the ZeRO stage, so it decides for every variant.
        lean = s.config(self, RECOMPUTE_ORDER[-1], self.zero_stages[-1])
        self.error = lean if isinstance(lean, ConfigError) else None
        self.lean = None if self.error else lean
        self._s = s
        self._lean_bill: MemoryBill | None = None
        self._stages = _stage_floors(self.lean) if self.lean else ()
        # Without the bubble at first: simulating every slot's schedule would cost more than the
        # pruning saves; a slot that fits and is still in the race gets it before its variants.
        self.ceiling = self.ceiling_at(RECOMPUTE_ORDER[0], bubble=False) if self.lean else 0.0
        self.steps = self._steps()

    def ceiling_at(self, recompute: str, bubble: bool = True) -> float:
        """Tokens/s that no variant with ``recompute`` or a costlier recomputation can exceed."""
        floor = _step_floor(self.lean, recompute, bubble, self._stages) * (1 - 1e-9)  # rounding margin
        return self.lean.tokens_per_step / floor if floor > 0 else math.inf

    def lean_fits(self) -> bool:
        if self._lean_bill is None:
            self._s.stats["plans"] += 1
            self._lean_bill = estimate_memory(self.lean)
            self._lean_fit = self._s.fits(self._lean_bill)
            if not self._lean_fit:
                self._s.stats["too_big"] += 1
        return self._lean_fit

    def reached(self) -> bool:
        """Whether the search gets here: a shape and schedule are searched in increasing
        micro-batch size up to the first that does not fit (a larger one holds more activations:
        it will not fit either)."""
        return all(e.lean_fits() for e in self.earlier)

    def _steps(self) -> Generator[tuple[str, bool], None, PlanCandidate | None]:
        """Yields ``(recompute, bubble)``, the bound (:meth:`ceiling_at`) that holds from there on,
        each time it tightens: once the leanest variant fits (now with the bubble), and before
        each costlier recomputation. The caller resumes it only while that bound can still
        matter. Returns the candidate, predicted; or None: not reached, too big or invalid."""
        s = self._s
        if not self.reached() or not self.lean_fits():
            return None
        if self.lean.plan.pp > 1:
            yield RECOMPUTE_ORDER[0], True
        for recompute in RECOMPUTE_ORDER:
            if recompute != RECOMPUTE_ORDER[0]:
                yield recompute, True
            for zero in self.zero_stages:
                if (recompute, zero) == (RECOMPUTE_ORDER[-1], self.zero_stages[-1]):
                    cfg, bill = self.lean, self._lean_bill  # already estimated (and it fits)
                else:
                    cfg = s.config(self, recompute, zero)
                    if isinstance(cfg, ConfigError):
                        # Not while validation ignores the variant (see __init__); handled as the
                        # exhaustive search always did: the slot is invalid. (A pruned search would
                        # then miss the rejections of the variants it never builds.)
                        s.invalid(self, zero, cfg)
                        return None
                    s.stats["plans"] += 1
                    bill = estimate_memory(cfg)
                if s.fits(bill):
                    s.stats["predicted"] += 1
                    return PlanCandidate(cfg, bill, predict_step(cfg, memory=bill, simulate=False))
                s.stats["too_big"] += 1
        return None


def _stage_floors(config: RunConfig) -> tuple[tuple[float, float, float], ...]:
    """(forward, backward, attention) seconds of each distinct pipeline stage of ``config``, per
    micro-batch, from compute alone: the terms of :func:`_step_floor`."""
    model, plan, train, cluster = config.model, config.plan, config.train, config.cluster
    eff = train.profile.efficiency
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    e = DTYPE_BYTES[train.compute_dtype]
    tokens = train.micro_batch_size * train.seq_len / plan.cp
    dtype = train.compute_dtype
    rate = cluster.achieved_flops(dtype) or cluster.gpu.peak_flops(dtype) * eff.matmul
    attn_rate = rate / eff.matmul * eff.attention
    hbm = cluster.gpu.hbm_bandwidth_bytes_per_s * eff.memory or 1e12
    h, mats = model.d_model, (3 if model.activation == "swiglu" else 2)  # (gate, up,) down
    # attention projection MACs per token, x t: divided by t below with the MLP's (what is whole
    # on every TP rank, latent attention's down-projections, stays whole)
    attn_gemms = sum(k * n for _, _, k, n in model.attention_gemms(t)) * t
    # an FP8 recipe's Linears run at the FP8 rate: the block's GEMMs all at the faster of the two
    # rates stays a lower bound (its casts only add time); the output layer stays at bf16's
    block_rate = max(rate, _fp8_matmul_rate(config, eff) or 0.0)
    dense_mm = 2 * tokens * (attn_gemms + mats * h * model.d_ff) / t / block_rate
    moe_mm = 0.0
    if model.is_moe:  # the router, the top_k experts each token visits, the shared experts
        shared = model.n_shared_experts * (model.shared_d_ff or model.moe_d_ff)
        moe_mm = 2 * tokens * ((attn_gemms + mats * h * (model.top_k * model.moe_d_ff + shared)) / t
                               + h * model.n_experts) / block_rate
    hidden_moe = model.top_k * model.moe_d_ff + model.n_shared_experts * (model.shared_d_ff or 0)
    attn = 2 * tokens * (train.seq_len / 2) * (model.q_dim + model.v_dim) / t / attn_rate  # per layer, forward
    counts = plan.stage_layer_counts(model.n_layers)
    kinds = set()  # stages alike in layers, MoE layers and first/last cost the same
    start = 0
    for stage, n in enumerate(counts):
        n_moe = max(0, start + n - max(start, model.first_k_dense_layers)) if model.is_moe else 0
        kinds.add((n, n_moe, stage == 0, stage == len(counts) - 1))
        start += n
    out = []
    for n, n_moe, first, last in kinds:
        mm = (n - n_moe) * dense_mm + n_moe * moe_mm
        elem = tokens * e * (n * eff.elementwise_bytes_per_hidden * h / sp
                             + eff.elementwise_bytes_per_ff * ((n - n_moe) * model.d_ff + n_moe * hidden_moe) / t)
        if last:  # output projection and the fp32 cross-entropy
            mm += 2 * tokens * h * model.vocab_size / t / rate
            elem += tokens * 4 * 3 * model.vocab_size / (t if plan.loss_parallel else 1)
        if first:  # embedding gather
            elem += tokens * e * 2 * h / sp
        elem /= hbm
        launch = eff.launch_overhead_s_per_layer * n
        out.append((mm + n * attn + elem + launch,
                    2 * mm + eff.backward_attention_ratio * n * attn + 2 * elem + 2 * launch, n * attn))
    return tuple(out)


def _step_floor(config: RunConfig, recompute: str, bubble: bool = True,
                stages: tuple[tuple[float, float, float], ...] | None = None) -> float:
    """A lower bound, in seconds, of the screened step time (``predict_step(c, simulate=False)``)
    of every config ``c`` that is ``config`` under ``recompute`` or a costlier recomputation, at
    any ZeRO stage.

    Compute alone, at the rates of the job's profile: GEMM FLOPs at the large-GEMM rate (smaller
    GEMMs only run slower), attention at a causal flash kernel's FLOPs (eager attention computes
    more), element-wise bytes through HBM, kernel launches, the output layer on the last stage and
    the embedding on the first; forward, backward and the recomputed part of the slowest stage,
    through the schedule's equal-stage makespan as the screen does. Communication, the optimizer
    step, dropout and per-micro-batch overheads are left out: they only add time. The search prunes
    with it, so it must stay under :func:`~workbench.predict.perf.predict_step` (tests check it).
    ``bubble=False`` drops the bubble too: a rank's own work, ``v m`` forwards (1 unit) and backwards
    (2 units) of the slowest stage, with no schedule to simulate. ``stages``: the config's
    :func:`_stage_floors`, if already computed.
    """
    plan = config.plan
    slowest = 0.0
    for forward, backward, attn in stages or _stage_floors(config):
        extra = forward if recompute == "full" else attn if recompute == "selective" else 0.0
        slowest = max(slowest, forward + backward + extra)
    m = config.n_microbatches
    if plan.pp == 1:
        return m * slowest
    if not bubble:
        return plan.virtual_stages * m * slowest
    return unit_makespan(plan.pp_schedule, plan.pp, m, plan.virtual_stages) / 3 * slowest


def _search(s: _Search, top: int) -> list[PlanCandidate]:
    """Every candidate the answer depends on, ranked: the front runners (``3 top + 10``, by the
    screen) fully simulated and re-ranked, then the other candidates searched, by the screen."""
    gbs = s.train.global_batch_size
    slots: list[_Slot] = []
    position = 0  # in the enumeration: orders candidates of equal speed, and the rejections
    for shape in _plan_shapes(s):
        dp = shape["dp_replicate"] * shape["dp_shard"]
        if gbs and gbs % dp:
            s.note(position, f"dp={dp}", f"global_batch_size={gbs} is not divisible by dp={dp}")
            position += 1
            continue
        per_dp = gbs // dp if gbs else 0
        for schedule, v in _schedules(shape["pp"], s.model.n_layers):
            earlier: list[_Slot] = []
            for mbs in (1, 2, 4):  # the batch stays: micro-batch size x gradient accumulation = per_dp
                if per_dp and per_dp % mbs:
                    continue
                slot = _Slot(s, position, shape, schedule, v, mbs, tuple(earlier))
                position += 1
                if slot.error is not None:
                    if slot.reached():  # rejections are those of the slots the search reaches
                        s.invalid(slot, slot.zero_stages[-1], slot.error)
                    continue
                slots.append(slot)
                earlier.append(slot)

    # Best ceiling first, until no slot left can reach the front runners. Ties keep the order of
    # enumeration, as the stable sort of the exhaustive search did.
    n_front = 3 * top + 10
    found: list[tuple[int, PlanCandidate]] = []
    front: list[float] = []  # min-heap of the n_front best screened tokens/s

    def admit(slot: _Slot, c: PlanCandidate) -> None:
        found.append((slot.index, c))
        (heapq.heappush if len(front) < n_front else heapq.heappushpop)(front, c.prediction.tokens_per_s)

    s.total = len(slots)
    pending = [(-slot.ceiling, slot.index, slot) for slot in slots]
    heapq.heapify(pending)
    s.drain(pending, lambda ceiling: len(front) < n_front or ceiling >= front[0], admit)
    by_screen = sorted(found, key=lambda f: (-f[1].prediction.tokens_per_s, f[0]))
    # Screened with the equal-stage pipeline bound; the front runners get the full simulation.
    finalists = [replace(c, prediction=predict_step(c.config, memory=c.memory)) for _, c in by_screen[:n_front]]
    finalists.sort(key=lambda c: -c.prediction.tokens_per_s)

    # The explanations compare each winner with the best plan of each alternative structure: where
    # no front runner has it, search the slots of that structure until none left can beat the best.
    for c in finalists[:top]:
        for _, differs in _ALTERNATIVES:
            if any(differs(o.plan, c.plan) for o in finalists):
                continue
            inside = [p for p in pending if differs(p[2].lean.plan, c.plan)]
            if not inside:
                continue
            best = [max((f[1].prediction.tokens_per_s for f in found if differs(f[1].plan, c.plan)), default=-math.inf)]

            def admit_inside(slot: _Slot, cand: PlanCandidate) -> None:
                admit(slot, cand)
                best[0] = max(best[0], cand.prediction.tokens_per_s)

            pending = [p for p in pending if not differs(p[2].lean.plan, c.plan)]
            heapq.heapify(inside)
            s.drain(inside, lambda ceiling: ceiling >= best[0], admit_inside)
            pending += inside
            heapq.heapify(pending)
    s.stats["pruned"] = len(pending)
    s.settle(len(pending))  # the bound settled them: none can change the answer
    rest = sorted(found, key=lambda f: (-f[1].prediction.tokens_per_s, f[0]))[n_front:]
    return finalists + [c for _, c in rest]


def naive_baseline(model: ModelSpec, cluster: Cluster, train: TrainSettings,
                   headroom: float = DEFAULT_HEADROOM) -> Baseline:
    """The naive baseline of a job: plain data parallel over every GPU of ``cluster`` (each rank
    holds the whole model, gradients all-reduced; nothing else changed), at ``train``'s batch, and
    whether it fits with ``headroom`` of HBM left free (the reason in words where it does not)."""
    plan = ParallelPlan(dp_shard=cluster.world_size, zero_stage=0)
    try:
        cfg = RunConfig(model, cluster, plan, train)
    except ConfigError as e:
        return Baseline(None, None, None, f"plain data parallel is invalid: {e}")
    bill = estimate_memory(cfg)
    limit = math.floor((1 - headroom) * cluster.gpu.hbm_bytes)  # _Search.fits: the same rule
    if bill.peak_bytes > limit:
        free = f" less {percent(headroom)} headroom" if headroom else ""
        return Baseline(cfg, bill, None, (
            f"plain data parallel over {cluster.world_size} GPUs needs {bill.peak_bytes / GiB:.1f} GiB per GPU "
            f"(model states {sum(bill.components[k] for k in ('parameters', 'gradients', 'optimizer', 'master_weights')) / GiB:.1f} GiB) "
            f"> {limit / GiB:.1f} GiB ({bill.hbm_bytes / GiB:.0f} GiB{free})"))
    return Baseline(cfg, bill, predict_step(cfg, memory=bill), "fits")


def _baseline(s: _Search) -> Baseline:
    """Plain data parallel over every GPU, at the search's batch and under its headroom."""
    return naive_baseline(s.model, s.cluster, s.train, s.headroom)


def advise(model: ModelSpec, cluster: Cluster, train: TrainSettings, top: int = 10,
           headroom: float = DEFAULT_HEADROOM, progress: Callable[[int, int], None] | None = None) -> Advice:
    """Search every valid plan; return the ``top`` by predicted throughput, explained.

    Every plan trains the same global batch (``train.global_batch_size``; 0: :func:`search_batch`'s
    auto batch, ``Advice.inputs`` says which) and fits with ``headroom`` (a fraction of HBM in
    [0, 0.5)) left free. ``progress(done, total)``, if given, hears from the searching thread as
    the plan slots are settled. Plans that the compute-only bound shows cannot change the answer
    are not predicted (see the module docstring): the answer is the exhaustive search's;
    ``stats["pruned"]`` counts them."""
    check_instance("model", model, ModelSpec)
    check_instance("cluster", cluster, Cluster)
    check_instance("train", train, TrainSettings)
    check_int("top", top)
    headroom = check_headroom(headroom)
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress={progress!r} must be callable (done, total)", field="progress", value=progress)
    return _advise(model, cluster, train, top, headroom=headroom, progress=progress)


def _advise(model: ModelSpec, cluster: Cluster, train: TrainSettings, top: int = 10, prune: bool = True,
            headroom: float = DEFAULT_HEADROOM, progress: Callable[[int, int], None] | None = None) -> Advice:
    s = _Search(model, cluster, train, prune=prune, headroom=headroom, progress=progress)
    results = _search(s, top)
    if s.floor_broken:
        # The answer may have lost a plan the bound wrongly pruned: the time model changed under
        # _step_floor. Stay correct (and slow) until the bound is brought back under it.
        warnings.warn("the advisor's step-time bound exceeded a prediction; searching every plan",
                      RuntimeWarning, stacklevel=3)
        s = _Search(model, cluster, train, prune=False, headroom=headroom, progress=progress)
        results = _search(s, top)
    baseline = _baseline(s)
    inputs = AdviceInputs(model, cluster, s.train, headroom, auto_batch=train.global_batch_size == 0)
    best = [replace(c, rank=i + 1, explanation=explain(c, results, baseline, cluster, headroom))
            for i, c in enumerate(results[:top])]
    return Advice(best, baseline, s.stats, s.rejections, inputs)


# ---------------------------------------------------------------------------- explanations
# The alternatives each winner is compared with: (label, differs(other plan, winner's plan)). The
# search makes sure the best plan of each is in the list explain() is given.
_ALTERNATIVES: tuple[tuple[str, Callable[[ParallelPlan, ParallelPlan], bool]], ...] = (
    ("fewer pipeline stages", lambda p, best: p.pp < best.pp),
    ("more pipeline stages", lambda p, best: p.pp > best.pp),
    ("less tensor parallelism", lambda p, best: p.tp < best.tp),
    ("more tensor parallelism", lambda p, best: p.tp > best.tp),
)


def explain(c: PlanCandidate, others: list[PlanCandidate], baseline: Baseline, cluster: Cluster,
            headroom: float = DEFAULT_HEADROOM) -> tuple[str, ...]:
    """Why this plan, in the scaling order, and why the obvious alternatives lost. The
    alternatives are taken from ``others`` at ``c``'s global batch only: a plan that trains more
    sequences per step is slower per step and no worse for it."""
    plan, train, pred = c.plan, c.train, c.prediction
    gpn = cluster.gpus_per_node
    gbs = train.global_batch_size
    lines = []
    if baseline.fits and baseline.config.train.global_batch_size == gbs:
        gain = pred.tokens_per_s / baseline.prediction.tokens_per_s
        lines.append(f"{gain:.2f}x the throughput of plain data parallel over every GPU")
    lines.append(f"global batch {gbs} sequences ({gbs * train.seq_len:,} tokens) per step, as for every plan "
                 f"compared: {plan.dp} replica{'s' if plan.dp > 1 else ''} × {c.config.n_microbatches} "
                 f"micro-batch{'es' if c.config.n_microbatches > 1 else ''} of {train.micro_batch_size}")
    dp = plan.dp
    zero_words = {0: "no sharding", 1: "ZeRO-1 (optimizer states sharded)", 2: "ZeRO-2 (+ gradients)",
                  3: "ZeRO-3/FSDP (+ parameters)"}
    if dp > 1:
        rep = f", HSDP: replicated {plan.dp_replicate}x across groups of {plan.dp_shard}" if plan.dp_replicate > 1 else ""
        lines.append(f"data parallel over {dp} replicas with {zero_words[plan.zero_stage]}{rep}")
    if plan.tp > 1:
        lines.append(f"tensor parallel over {plan.tp} GPUs inside the {gpn}-GPU NVLink domain of a node "
                     "(sequence parallel on)")
    if plan.pp > 1:
        sched = SCHEDULE_WORDS.get(plan.pp_schedule, plan.pp_schedule) + " schedule"
        sched += f" with {plan.virtual_stages} stages per GPU" if plan.virtual_stages > 1 else ""
        lines.append(f"pipeline over {plan.pp} GPUs ({sched}), {c.config.n_microbatches} micro-batches per step: "
                     f"bubble {pred.bubble_fraction:.1%}")
    if plan.cp > 1:
        lines.append(f"context parallel over {plan.cp} GPUs splits the {train.seq_len}-token sequences "
                     f"({train.seq_len // plan.cp} tokens per GPU)")
    if plan.ep > 1:
        lines.append(f"expert parallel over {plan.ep} GPUs shards the experts")
    if train.recompute != "none":
        lines.append(f"{train.recompute} recomputation: without it the activations do not fit "
                     f"with {percent(headroom)} of memory left free")
    lines.append(f"memory {c.memory.peak_bytes / GiB:.1f} of {c.memory.hbm_bytes / GiB:.0f} GiB "
                 f"({c.headroom_bytes / GiB:.1f} GiB, {c.headroom_fraction:.1%} free; "
                 f"at least {percent(headroom)} required); "
                 f"time: " + ", ".join(f"{TIME_WORDS.get(k, k)} {v / pred.step_time_s:.0%}"
                                       for k, v in pred.breakdown.items() if v > 0.005 * pred.step_time_s))
    # alternatives: the best plan with a different structure at the same batch, and why it is slower
    def best_where(pred_fn):
        return next((o for o in others if pred_fn(o.plan) and o is not c and o.train.global_batch_size == gbs), None)

    for label, differs in _ALTERNATIVES:
        alt = best_where(lambda p: differs(p, plan))
        if alt is not None and alt.prediction.tokens_per_s < pred.tokens_per_s:
            diff = 1 - alt.prediction.tokens_per_s / pred.tokens_per_s
            lines.append(f"{label} ({plan_words(alt.plan)}, {RECOMPUTE_WORDS[alt.train.recompute]}) is {diff:.0%} "
                         f"slower at the same batch: {_why_slower(alt, c)}")
    if plan.tp == gpn:
        lines.append(f"tensor parallel over {2 * gpn} GPUs would cross nodes: its all-reduces would leave NVLink "
                     "for the network")
    return tuple(lines)


def _why_slower(alt: PlanCandidate, best: PlanCandidate) -> str:
    a, b = alt.prediction.breakdown, best.prediction.breakdown
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    k = max(deltas, key=deltas.get)
    return f"more {TIME_WORDS.get(k, k.replace('comm_', 'communication on '))} ({deltas[k] * 1e3:+.0f} ms per step)"
