"""The plan advisor: ``advise(model, cluster, train, top=10) -> Advice``.

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
predicted. The naive baseline ("just add devices": plain data parallel over every GPU with nothing
else changed) is always evaluated and returned with the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workbench.spec.cluster import Cluster
from workbench.spec.config import RunConfig, TrainSettings
from workbench.spec.errors import ConfigError
from workbench.predict.memory import MemoryBill, estimate_memory
from workbench.spec.model import ModelSpec
from workbench.predict.perf import StepPrediction, predict_step
from workbench.spec.plan import ParallelPlan

GiB = float(1 << 30)
RECOMPUTE_ORDER = ("none", "selective", "full")


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

    def summary(self) -> str:
        p, t = self.prediction, self.train
        return (
            f"{self.plan.describe()}, mbs {t.micro_batch_size}, recompute {t.recompute}: "
            f"{self.memory.peak_bytes / GiB:.1f} GiB, step {p.step_time_s:.3f} s, MFU {p.mfu:.1%}, "
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
    """The top candidates (a list, best first) plus the baseline and the search's statistics."""

    def __init__(self, candidates: list[PlanCandidate], baseline: Baseline, stats: dict[str, int],
                 rejections: dict[str, str]):
        super().__init__(candidates)
        self.baseline = baseline
        self.stats = stats
        self.rejections = rejections

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
    train: TrainSettings
    stats: dict[str, int] = field(default_factory=lambda: {"plans": 0, "invalid": 0, "too_big": 0, "predicted": 0})
    rejections: dict[str, str] = field(default_factory=dict)

    def note(self, family: str, why: str) -> None:
        self.rejections.setdefault(family, why)


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


def _candidate(s: _Search, shape: dict[str, int], schedule: str, v: int, mbs: int) -> PlanCandidate | str:
    """The cheapest recomputation and lowest ZeRO stage that fit, predicted; else why not:
    "invalid" or "too_big"."""
    base_train = replace(s.train, micro_batch_size=mbs)
    zero_stages = (1, 2, 3) if shape["dp_shard"] * shape["cp"] > 1 else (0,)

    def build(recompute: str, zero: int) -> RunConfig | None:
        plan = ParallelPlan(pp_schedule=schedule, virtual_stages=v, zero_stage=zero, sequence_parallel=True, **shape)
        try:
            return RunConfig(s.model, s.cluster, plan, replace(base_train, recompute=recompute))
        except ConfigError as e:
            s.stats["invalid"] += 1
            s.note(plan.describe(), str(e))
            return None

    # The leanest variant first: if full recomputation with the highest ZeRO stage does not fit,
    # nothing of this shape does (the 8 other variants are not evaluated).
    lean = build("full", zero_stages[-1])
    if lean is None:
        return "invalid"
    s.stats["plans"] += 1
    if not estimate_memory(lean).fits():
        s.stats["too_big"] += 1
        return "too_big"
    for recompute in RECOMPUTE_ORDER:
        for zero in zero_stages:
            s.stats["plans"] += 1
            cfg = build(recompute, zero)
            if cfg is None:
                return "invalid"  # the same rule fails for every recompute / zero stage
            bill = estimate_memory(cfg)
            if bill.fits():
                s.stats["predicted"] += 1
                return PlanCandidate(cfg, bill, predict_step(cfg, memory=bill, simulate=False))
            s.stats["too_big"] += 1
    return "too_big"


def _baseline(model: ModelSpec, cluster: Cluster, train: TrainSettings) -> Baseline:
    plan = ParallelPlan(dp_shard=cluster.world_size, zero_stage=0)
    try:
        cfg = RunConfig(model, cluster, plan, train)
    except ConfigError as e:
        return Baseline(None, None, None, f"plain data parallel is invalid: {e}")
    bill = estimate_memory(cfg)
    fit = bill.fits()
    if not fit:
        return Baseline(cfg, bill, None, (
            f"plain data parallel over {cluster.world_size} GPUs needs {bill.peak_bytes / GiB:.1f} GiB per GPU "
            f"(model states {sum(bill.components[k] for k in ('parameters', 'gradients', 'optimizer', 'master_weights')) / GiB:.1f} GiB) "
            f"> {fit.hbm_bytes / GiB:.0f} GiB"))
    return Baseline(cfg, bill, predict_step(cfg, memory=bill), "fits")


def advise(model: ModelSpec, cluster: Cluster, train: TrainSettings, top: int = 10) -> Advice:
    """Search every valid plan; return the ``top`` by predicted throughput, explained."""
    s = _Search(model, cluster, train)
    gbs = train.global_batch_size
    results: list[PlanCandidate] = []
    for shape in _plan_shapes(s):
        dp = shape["dp_replicate"] * shape["dp_shard"]
        if gbs and gbs % dp:
            s.note(f"dp={dp}", f"global_batch_size={gbs} is not divisible by dp={dp}")
            continue
        per_dp = gbs // dp if gbs else 0
        for schedule, v in _schedules(shape["pp"], model.n_layers):
            for mbs in (1, 2, 4):
                if per_dp and per_dp % mbs:
                    continue
                c = _candidate(s, shape, schedule, v, mbs)
                if c == "too_big":
                    break  # a larger micro-batch holds more activations: it will not fit either
                if isinstance(c, PlanCandidate):
                    results.append(c)
    # Screened with the equal-stage pipeline bound; the front runners get the full simulation.
    results.sort(key=lambda c: -c.prediction.tokens_per_s)
    finalists = [replace(c, prediction=predict_step(c.config, memory=c.memory)) for c in results[: 3 * top + 10]]
    results = sorted(finalists, key=lambda c: -c.prediction.tokens_per_s) + results[3 * top + 10:]
    baseline = _baseline(model, cluster, train)
    best = [replace(c, rank=i + 1, explanation=explain(c, results, baseline, cluster)) for i, c in enumerate(results[:top])]
    return Advice(best, baseline, s.stats, s.rejections)


# ---------------------------------------------------------------------------- explanations
def explain(c: PlanCandidate, others: list[PlanCandidate], baseline: Baseline, cluster: Cluster) -> tuple[str, ...]:
    """Why this plan, in the scaling order, and why the obvious alternatives lost."""
    plan, train, pred = c.plan, c.train, c.prediction
    gpn = cluster.gpus_per_node
    lines = []
    if baseline.fits:
        gain = pred.tokens_per_s / baseline.prediction.tokens_per_s
        lines.append(f"{gain:.2f}x the throughput of plain data parallel over every GPU")
    dp = plan.dp
    zero_words = {0: "no sharding", 1: "ZeRO-1 (optimizer states sharded)", 2: "ZeRO-2 (+ gradients)",
                  3: "ZeRO-3/FSDP (+ parameters)"}
    if dp > 1:
        rep = f", HSDP: replicated {plan.dp_replicate}x across groups of {plan.dp_shard}" if plan.dp_replicate > 1 else ""
        lines.append(f"data parallel over {dp} replicas with {zero_words[plan.zero_stage]}{rep}")
    if plan.tp > 1:
        lines.append(f"tp={plan.tp} inside the {gpn}-GPU NVLink domain of a node (sequence parallel on)")
    if plan.pp > 1:
        sched = plan.pp_schedule + (f", {plan.virtual_stages} stages per rank" if plan.virtual_stages > 1 else "")
        lines.append(f"pp={plan.pp} ({sched}) with {c.config.n_microbatches} micro-batches: bubble {pred.bubble_fraction:.1%}")
    if plan.cp > 1:
        lines.append(f"cp={plan.cp} splits the {train.seq_len}-token sequences ({train.seq_len // plan.cp} per rank)")
    if plan.ep > 1:
        lines.append(f"ep={plan.ep} shards the experts")
    if train.recompute != "none":
        lines.append(f"{train.recompute} recomputation: without it the activations do not fit")
    lines.append(f"memory {c.memory.peak_bytes / GiB:.1f} of {c.memory.hbm_bytes / GiB:.0f} GiB; "
                 f"time: " + ", ".join(f"{k} {v / pred.step_time_s:.0%}" for k, v in pred.breakdown.items() if v > 0.005 * pred.step_time_s))
    # alternatives: the best plan with a different structure, and why it is slower
    def best_where(pred_fn):
        return next((o for o in others if pred_fn(o.plan) and o is not c), None)

    for label, cond in (
        ("fewer pipeline stages", lambda p: p.pp < plan.pp),
        ("more pipeline stages", lambda p: p.pp > plan.pp),
        ("less tensor parallelism", lambda p: p.tp < plan.tp),
        ("more tensor parallelism", lambda p: p.tp > plan.tp),
    ):
        alt = best_where(cond)
        if alt is not None and alt.prediction.tokens_per_s < pred.tokens_per_s:
            diff = 1 - alt.prediction.tokens_per_s / pred.tokens_per_s
            lines.append(f"{label} ({alt.plan.describe()}, {alt.train.recompute} recompute) is {diff:.0%} slower: "
                         f"{_why_slower(alt, c)}")
    if plan.tp == gpn:
        lines.append(f"tp={2 * gpn} would cross nodes: its all-reduces would leave NVLink for the network")
    return tuple(lines)


def _why_slower(alt: PlanCandidate, best: PlanCandidate) -> str:
    a, b = alt.prediction.breakdown, best.prediction.breakdown
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    k = max(deltas, key=deltas.get)
    return f"more {k.replace('comm_', 'communication on ')} ({deltas[k] * 1e3:+.0f} ms per step)"
