"""Pipeline schedules simulated into per-rank timelines.

A pipeline schedule is, for every pipeline rank, an *order* of compute actions
``(kind, stage, microbatch)``: ``F`` forward, ``B`` full backward, or the split backward of the
zero-bubble family, ``I`` (gradient w.r.t. the stage input, on the critical path) and ``W``
(gradient w.r.t. the weights, free to move). :func:`schedule_order` generates that order for
each schedule the project knows (``plan.SCHEDULES``), action for action the order that
``torch.distributed.pipelining`` (torch 2.13) runs; the tests compare them. The combinations
torch's constructors refuse but the planner predicts
(:func:`workbench.spec.schedules.torch_schedule_limits`: 1F1B with fewer micro-batches than
stages, interleaved rounds that do not divide the micro-batches) get the order Megatron runs
(:func:`workbench.spec.schedules.degenerate_form`).

:func:`simulate_schedule` then plays the orders against per-stage durations. Each rank runs its
order one action at a time; an action starts when the rank is free and its inputs exist::

    F(s, m)   after F(s-1, m)                 (+ p2p_time when stage s-1 is on another rank)
    B/I(s, m) after F(s, m) and B/I(s+1, m)   (+ p2p_time when stage s+1 is on another rank)
    W(s, m)   after I(s, m)

This is a longest-path evaluation of a DAG, done in O(number of actions): a blocked rank waits
on the one action it needs and is woken when that action is timed.

Stage placement matches :meth:`workbench.spec.plan.ParallelPlan.stages_of_rank` and torch:
looped schedules put stage ``s`` on rank ``s % pp``; the V schedules (``zbv``, ``dualpipev``)
put stages ``r`` and ``2 pp - 1 - r`` on rank ``r``, so the last stage sits next to the first.

Closed forms with equal stage times (f forward, b backward per stage), checked by the tests:
GPipe and 1F1B idle ``(p-1)/(m+p-1)`` of the step (1F1B with m < p is GPipe); interleaved 1F1B
idles ``(p-1)/(v m)`` relative to the busy time when ``m >= p``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping, Sequence

from workbench.spec.errors import ConfigError, require
from workbench.spec.schedules import check_schedule, round_size, stage_ranks

Op = tuple[str, int, int]  # (kind, stage, microbatch)
KINDS = ("F", "B", "I", "W")


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of one pipeline rank, with its simulated start and end."""

    rank: int
    stage: int
    microbatch: int
    kind: str  # "F" forward, "B" full backward, "I" input-grad backward, "W" weight-grad backward
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Transfer:
    """A point-to-point send between ranks: activations (``"F"``) or gradients (``"B"``)."""

    src_rank: int
    dst_rank: int
    stage: int  # the stage that produced the tensor
    microbatch: int
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class ScheduleResult:
    """A simulated pipeline step.

    ``orders[r]`` is rank r's compute order, ``starts[r][i]``/``ends[r][i]`` the times of its
    i-th action (the raw timeline; :attr:`actions` is the same as :class:`Action` objects).
    ``bubble_fraction = idle / (pp x step_time)`` is the share of the step the ranks sit idle;
    ``bubble_ratio = idle / busy`` is the "relative to the ideal" form, ``(p-1)/(v m)`` for
    interleaved 1F1B. ``peak_in_flight[s]`` counts the micro-batches whose activations stage s
    holds at its worst moment (forward done, backward input-gradient not yet done);
    ``peak_in_flight_per_rank[r]`` is the worst moment summed over the stages rank r holds,
    the count a rank's activation memory follows when its stages are equal.
    """

    schedule: str
    pp: int
    n_microbatches: int
    virtual_stages: int
    step_time: float
    busy_time: tuple[float, ...]
    bubble_fraction: float
    per_rank_bubble: tuple[float, ...]
    bubble_ratio: float
    peak_in_flight: tuple[int, ...]
    peak_in_flight_per_rank: tuple[int, ...]
    p2p_time: float = 0.0
    orders: tuple[tuple[Op, ...], ...] = field(default=(), repr=False, compare=False)
    starts: tuple[tuple[float, ...], ...] = field(default=(), repr=False, compare=False)
    ends: tuple[tuple[float, ...], ...] = field(default=(), repr=False, compare=False)

    @cached_property
    def actions(self) -> tuple[Action, ...]:
        """Every compute action, sorted by (rank, start). Built on first use: the advisor only
        reads the summary numbers, so thousands of plans never pay for these objects."""
        return tuple(
            Action(r, s, mb, kind, t0, t1)
            for r, order in enumerate(self.orders)
            for (kind, s, mb), t0, t1 in zip(order, self.starts[r], self.ends[r])
        )

    def order(self, rank: int) -> list[Op]:
        """Rank ``rank``'s compute order as ``(kind, stage, microbatch)``."""
        require(0 <= rank < self.pp, f"rank={rank} is outside pp={self.pp}", field="rank", value=rank)
        return list(self.orders[rank])

    def timeline(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s actions in time order."""
        return tuple(a for a in self.actions if a.rank == rank)

    def transfers(self) -> tuple[Transfer, ...]:
        """Every cross-rank send of the step: the activation of F(s, m) to stage s+1 and the
        input gradient of B/I(s, m) to stage s-1, each taking ``p2p_time`` after its producer."""
        n = self.pp * self.virtual_stages
        ranks = stage_ranks(self.schedule, self.pp, self.virtual_stages)
        out: list[Transfer] = []
        for r, order in enumerate(self.orders):
            for (kind, s, mb), t1 in zip(order, self.ends[r]):
                if kind == "F" and s < n - 1 and ranks[s + 1] != r:
                    out.append(Transfer(r, ranks[s + 1], s, mb, "F", t1, t1 + self.p2p_time))
                elif kind in ("B", "I") and s > 0 and ranks[s - 1] != r:
                    out.append(Transfer(r, ranks[s - 1], s, mb, "B", t1, t1 + self.p2p_time))
        return tuple(sorted(out, key=lambda t: (t.start, t.src_rank)))


# ---------------------------------------------------------------------------- the orders
def _gpipe(p: int, m: int, v: int) -> list[list[Op]]:
    """GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism"): fill-drain.

    Warm-up: every rank runs the forwards of all m micro-batches (stage r starts r slots late).
    Steady state: none. Cool-down: the backwards of all m micro-batches, in micro-batch order.
    Every stage holds all m activations at the turn: memory grows with m.
    """
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Op]]:
    """1F1B, as in PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel
    DNN Training"): same bubble as GPipe, bounded memory.

    Warm-up: rank r runs ``p - r`` forwards (enough for the first backward to come back).
    Steady state: one backward, then one forward, until the forwards run out.
    Cool-down: the remaining ``p - r`` backwards. Stage s never holds more than p - s micro-batches.
    With m < p (torch refuses it, Megatron runs it) the warm-up is cut to m: the ranks with
    ``p - r >= m`` run GPipe's order, and the step is GPipe's.
    """
    orders = []
    for r in range(p):
        warmup = min(p - r, m)
        ops: list[Op] = [("F", r, i) for i in range(warmup)]
        nxt = warmup
        for i in range(m):
            ops.append(("B", r, i))
            if nxt < m:
                ops.append(("F", r, nxt))
                nxt += 1
        orders.append(ops)
    return orders


def _looped_bfs(p: int, m: int, v: int) -> list[list[Op]]:
    """Breadth-first looped pipeline (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism").

    Rank r holds stages r, r+p, ... Warm-up and steady state: for each local stage in order,
    the forwards of all m micro-batches (breadth first: a whole stage before the next one).
    Cool-down: for each local stage in reverse, the backwards of all micro-batches in reverse.
    A GPipe over v loops: small bubble per loop, m activations per stage.
    """
    orders = []
    for r in range(p):
        stages = [r + i * p for i in range(v)]
        ops: list[Op] = [("F", s, i) for s in stages for i in range(m)]
        ops += [("B", s, i) for s in reversed(stages) for i in reversed(range(m))]
        orders.append(ops)
    return orders


def _interleaved(p: int, m: int, v: int, zero_bubble: bool = False) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM"), and with ``zero_bubble`` its ZB-1P form (Qi et al. 2023,
    "Zero Bubble Pipeline Parallelism").

    Rank r holds stages r, r+p, ..., r+(v-1)p. Micro-batches go in rounds of ``g = m / rounds``
    (``rounds = max(1, m // p)``, torch's relaxation of Megatron's ``m % p == 0``): the k-th
    forward of a rank is for local stage ``(k // g) % v`` (depth first: a round of g
    micro-batches through one stage, then the next stage), and the j-th backward walks the local
    stages from the last one down the same way. When ``rounds`` does not divide m (torch refuses
    it: :func:`workbench.spec.schedules.torch_schedule_limits`) the rounds are Megatron-core's
    schedule table, ``g`` = :func:`workbench.spec.schedules.round_size` micro-batches each and a
    shorter last one of ``m % g >= p``.

    Warm-up: ``(v-1) g + 2 (p-1-r)`` forwards (Megatron's count when g = p; ZB-1P uses
    ``1 x (p-1-r)``: the W's it postpones fill the gap). Steady state: one forward, one backward.
    Cool-down: the remaining backwards. Zero bubble splits each backward into I then W and
    delays rank r's W's by r backwards, so the W's fill the slots where 1F1B would wait;
    the postponed W's run at the end.
    """
    g = round_size(p, m)
    total = v * m
    # (local stage, micro-batch) of a rank's k-th forward: each round through every local stage
    table = [(c, mb) for first in range(0, m, g) for c in range(v) for mb in range(first, min(first + g, m))]

    def op(kind: str, r: int, k: int, backward: bool) -> Op:
        local, mb = table[k]
        if backward:
            local = v - 1 - local
        return (kind, local * p + r, mb)

    orders = []
    for r in range(p):
        warmup = min((v - 1) * g + (1 if zero_bubble else 2) * (p - 1 - r), total)
        ops: list[Op] = [op("F", r, k, False) for k in range(warmup)]
        backward_kind = "I" if zero_bubble else "B"
        weights_done = 0
        for j in range(total):  # j-th backward; in the steady state it follows a forward
            if j < total - warmup:
                ops.append(op("F", r, warmup + j, False))
            ops.append(op(backward_kind, r, j, True))
            if zero_bubble and j >= r:
                ops.append(op("W", r, weights_done, True))
                weights_done += 1
        if zero_bubble:
            ops += [op("W", r, k, True) for k in range(weights_done, total)]
        orders.append(ops)
    return orders


class _RankOrder:
    """One rank's order under construction, numbering micro-batches as torch does: the k-th
    forward of a stage is micro-batch k, its backwards (B or I) share one count, and a W is
    taken from the I's still waiting for theirs, oldest first."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next: dict[tuple[str, int], int] = {}
        self._pending_w: list[tuple[int, int]] = []  # (stage, microbatch) of I's without their W

    def _take(self, kind: str, stage: int) -> int:
        i = self._next.get((kind, stage), 0)
        self._next[(kind, stage)] = i + 1
        return i

    def forward(self, stage: int) -> None:
        self.ops.append(("F", stage, self._take("F", stage)))

    def backward(self, stage: int, split: bool) -> None:
        """A full backward B, or with ``split`` its input-gradient half I (its W comes later)."""
        mb = self._take("B", stage)
        self.ops.append(("I" if split else "B", stage, mb))
        if split:
            self._pending_w.append((stage, mb))

    def weight(self, stage: int | None = None) -> None:
        """The oldest pending W (of ``stage``, if given); nothing when none is pending."""
        for k, (s, mb) in enumerate(self._pending_w):
            if stage is None or s == stage:
                del self._pending_w[k]
                self.ops.append(("W", s, mb))
                return


def _zbv(p: int, m: int, v: int) -> list[list[Op]]:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): two stages per rank
    in a V, rank r holding stage r (chunk 0) and 2p-1-r (chunk 1), backward split into I and W.

    Built for ``n = max(2p-1, m)`` micro-batches (the fewest that fill the V); with fewer, the
    missing micro-batches' actions are dropped. Warm-up: ``2(p-r)-1`` chunk-0 forwards, then r
    pairs (chunk-1 F, chunk-0 F), then p-r triples (chunk-1 F, I, W) as the V turns.
    Steady state: chunk-0 (F, I, W) then chunk-1 (F, I, W) until every forward is done.
    Cool-down: r pairs of input gradients (chunk 0, chunk 1), p-r pairs (chunk-0 I, oldest
    chunk-0 W), then the postponed W's of chunk 1, then of chunk 0. With F = I = W the only idle
    time is the ramp: rank r starts r forwards late.
    """
    n = max(2 * p - 1, m)
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o = _RankOrder()
        for _ in range(2 * (p - r) - 1):
            o.forward(s0)
        for _ in range(r):
            o.forward(s1)
            o.forward(s0)
        for _ in range(p - r):
            o.forward(s1)
            o.backward(s1, split=True)
            o.weight(s1)
        f0 = 2 * (p - r) - 1 + r  # chunk-0 forwards so far; chunk 1 has run p micro-batches
        for f1 in range(p, n):  # each round: one more chunk-1 micro-batch (and chunk-0 while left)
            if f0 < n:
                o.forward(s0)
                f0 += 1
            o.backward(s0, split=True)
            o.weight(s0)
            o.forward(s1)
            o.backward(s1, split=True)
            o.weight(s1)
        for _ in range(r):
            o.backward(s0, split=True)
            o.backward(s1, split=True)
        for _ in range(p - r):
            o.backward(s0, split=True)
            o.weight(s0)
        for stage in (s1, s0):
            for _ in range(n):
                o.weight(stage)
        orders.append([op for op in o.ops if op[2] < m])
    return orders


def _dualpipev(p: int, m: int, v: int) -> list[list[Op]]:
    """DualPipeV: the V-shaped ("cut in half") form of DualPipe (DeepSeek-AI 2024, "DeepSeek-V3
    Technical Report"; V form from DeepSeek's DualPipe code), rank r holding stages r and 2p-1-r.

    Its point is pairing a forward of one chunk with a backward of the other so that one's
    communication (MoE all-to-all) hides under the other's compute; torch runs each pair as
    F then B, and so does this simulation. Phases of rank r (chunk 0 = stage r, chunk 1 =
    stage 2p-1-r):

    1. warm-up: ``2(p-r-1)`` chunk-0 forwards, then ``r+1`` x (F0, F1);
    2. ``p-r-1`` x (I1, oldest pending W, F1): the first chunk-1 backwards, split so that their
       W's can wait;
    3. steady state: ``m - 2p + r + 1`` x (F0+B1, F1+B0), paired;
    4. ``p-r-1`` x (B1, F1+B0);
    5. cool-down: ``r+1`` x (B1, B0), switching to split I's halfway (their W's fill the drain);
    6. ``p-r-1`` x (oldest pending W, B0), then ``r+1`` x oldest pending W.
    """
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o = _RankOrder()
        for _ in range(2 * (p - r - 1)):
            o.forward(s0)
        for _ in range(r + 1):
            o.forward(s0)
            o.forward(s1)
        for _ in range(p - r - 1):
            o.backward(s1, split=True)
            o.weight()
            o.forward(s1)
        for _ in range(m - 2 * p + r + 1):
            o.forward(s0)
            o.backward(s1, split=False)
            o.forward(s1)
            o.backward(s0, split=False)
        for _ in range(p - r - 1):
            o.backward(s1, split=False)
            o.forward(s1)
            o.backward(s0, split=False)
        half, split = (r + 1) // 2, False
        for i in range(r + 1):
            # the switch to split backwards falls between the two chunks on even ranks
            split = split or (i == half and r % 2 == 1)
            o.backward(s1, split)
            split = split or (i == half and r % 2 == 0)
            o.backward(s0, split)
        for _ in range(p - r - 1):
            o.weight()
            o.backward(s0, split)
        for _ in range(r + 1):
            o.weight()
        orders.append(o.ops)
    return orders


_GENERATORS: dict[str, Callable[[int, int, int], list[list[Op]]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "looped-bfs": _looped_bfs,
    "zero-bubble": lambda p, m, v: _interleaved(p, m, v, zero_bubble=True),
    "zbv": _zbv,
    "dualpipev": _dualpipev,
}


@functools.lru_cache(maxsize=4096)
def _orders(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> tuple[tuple[Op, ...], ...]:
    check_schedule(schedule, pp, n_microbatches, virtual_stages)
    return tuple(tuple(o) for o in _GENERATORS[schedule](pp, n_microbatches, virtual_stages))


def schedule_order(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> dict[int, list[Op]]:
    """Per-rank compute order ``{rank: [(kind, stage, microbatch), ...]}`` of a schedule."""
    return {r: list(o) for r, o in enumerate(_orders(schedule, pp, n_microbatches, virtual_stages))}


# ---------------------------------------------------------------------------- activations held
def _peaks(
    orders: tuple[tuple[Op, ...], ...], n_stages: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Micro-batches in flight, read off the orders (a rank runs its actions one at a time, so
    its order is also its time order): a forward adds one to its stage; the backward that
    consumes the activations (B, or I when split) removes one. Returns the peak per stage, the
    peak per rank (summed over its stages at one moment) and, per rank, each of its stages'
    count at that moment (stages in ascending order, as ``ParallelPlan.stages_of_rank``)."""
    held = [0] * n_stages
    stage_peak = [0] * n_stages
    rank_peak: list[int] = []
    at_peak: list[tuple[int, ...]] = []
    for order in orders:
        mine = sorted({s for _, s, _ in order})
        on_rank = peak = 0
        snapshot = tuple(0 for _ in mine)
        for kind, s, _ in order:
            if kind == "F":
                held[s] += 1
                on_rank += 1
                if held[s] > stage_peak[s]:
                    stage_peak[s] = held[s]
                if on_rank > peak:
                    peak = on_rank
                    snapshot = tuple(held[x] for x in mine)
            elif kind != "W":
                held[s] -= 1
                on_rank -= 1
        rank_peak.append(peak)
        at_peak.append(snapshot)
    return tuple(stage_peak), tuple(rank_peak), tuple(at_peak)


@functools.lru_cache(maxsize=4096)
def _peaks_cached(
    schedule: str, pp: int, n_microbatches: int, virtual_stages: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    return _peaks(_orders(schedule, pp, n_microbatches, virtual_stages), pp * virtual_stages)


def peak_in_flight(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once (cached).

    GPipe: m on every stage. 1F1B: ``min(p - s, m)`` on stage s. For ranks holding several
    stages the stages' peaks need not coincide: a rank's activation memory follows
    :func:`in_flight_at_peak` (or :func:`peak_weighted_in_flight` when its stages differ).
    """
    return _peaks_cached(schedule, pp, n_microbatches, virtual_stages)[0]


def peak_in_flight_per_rank(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per rank, the most micro-batches in flight summed over its stages at one moment (cached).

    Interleaved 1F1B, rank 0: Megatron's warm-up plus one, ``2(p-1) + (v-1)p + 1`` stage
    micro-batches (when m is a multiple of p and large enough). ZBV: 2p on every rank.
    """
    return _peaks_cached(schedule, pp, n_microbatches, virtual_stages)[1]


def in_flight_at_peak(
    schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Per rank, how many micro-batches each of its stages holds (stages ascending) at the first
    moment the rank's total peaks (cached): what its activation memory is when stages are equal."""
    return _peaks_cached(schedule, pp, n_microbatches, virtual_stages)[2]


def peak_weighted_in_flight(
    schedule: str, pp: int, n_microbatches: int, virtual_stages: int, stage_weights: Sequence[float]
) -> tuple[float, ...]:
    """Per rank, the peak over time of ``sum_s in_flight_s x stage_weights[s]`` over its stages:
    the activation memory of a rank whose stages differ (``stage_weights`` = bytes of one
    micro-batch's activations per stage)."""
    n = pp * virtual_stages
    require(
        len(stage_weights) == n,
        f"stage_weights has {len(stage_weights)} entries; pp x virtual_stages = {pp} x {virtual_stages} = {n}",
        field="stage_weights",
        value=len(stage_weights),
    )
    out = []
    for order in _orders(schedule, pp, n_microbatches, virtual_stages):
        now = peak = 0.0
        for kind, s, _ in order:
            if kind == "F":
                now += stage_weights[s]
                peak = max(peak, now)
            elif kind != "W":
                now -= stage_weights[s]
        out.append(peak)
    return tuple(out)


# ---------------------------------------------------------------------------- simulation
def _normalize_times(
    stage_times: Sequence[Sequence[float]] | None, n: int
) -> tuple[tuple[float, float, float], ...] | None:
    """``(forward, backward)`` or ``(forward, input_grad, weight_grad)`` per stage ->
    ``(f, i, w)`` per stage; a 2-tuple splits its backward evenly into I and W."""
    if stage_times is None:
        return None
    times = list(stage_times)
    require(
        len(times) == n,
        f"stage_times has {len(times)} entries; it needs one per stage, pp x virtual_stages = {n}",
        field="stage_times",
        value=len(times),
    )
    out = []
    for s, t in enumerate(times):
        t = tuple(float(x) for x in t)
        require(
            len(t) in (2, 3),
            f"stage_times[{s}]={t} must be (forward, backward) or (forward, input_grad, weight_grad)",
            field="stage_times",
            value=t,
        )
        require(min(t) >= 0, f"stage_times[{s}]={t} has a negative duration", field="stage_times", value=t)
        out.append((t[0], t[1] / 2, t[1] / 2) if len(t) == 2 else t)
    return tuple(out)


def simulate_schedule(
    schedule: str,
    pp: int,
    n_microbatches: int,
    virtual_stages: int = 1,
    stage_times: Sequence[Sequence[float]] | None = None,
    p2p_time: float = 0.0,
    action_times: Mapping[tuple[str, int, int], float] | None = None,
) -> ScheduleResult:
    """Simulate one pipeline step of ``schedule`` into per-rank timelines.

    ``stage_times``: None (every stage: forward 1, backward 2, split into I = W = 1), or per
    stage (``pp x virtual_stages`` entries) ``(forward_s, backward_s)`` (split backwards use
    I = W = backward / 2) or ``(forward_s, input_grad_s, weight_grad_s)``. ``p2p_time`` delays a
    dependency that crosses ranks (a send of activations or gradients); sends overlap compute.
    ``action_times``: seconds of single actions, keyed ``(kind, stage, micro_batch)``, in place
    of their stage's time: a measured step replayed action by action (on hardware where an
    action's speed depends on what runs beside it, a stage's median misprices the fill and drain).
    Results are cached on all arguments, so a repeated call is free.
    """
    _orders(schedule, pp, n_microbatches, virtual_stages)  # validates (and is cached)
    times = _normalize_times(stage_times, pp * virtual_stages)
    require(p2p_time >= 0, f"p2p_time={p2p_time} must be >= 0", field="p2p_time", value=p2p_time)
    actions = None
    if action_times:
        for key, sec in action_times.items():
            require(float(sec) >= 0, f"action_times[{key}]={sec} is a negative duration",
                    field="action_times", value=sec)
        actions = tuple(sorted((tuple(k), float(v)) for k, v in action_times.items()))
    return _simulate(schedule, pp, n_microbatches, virtual_stages, times, float(p2p_time), actions)


@functools.lru_cache(maxsize=256)
def _simulate(
    schedule: str,
    pp: int,
    m: int,
    v: int,
    times: tuple[tuple[float, float, float], ...] | None,
    p2p: float,
    actions: tuple[tuple[tuple[str, int, int], float], ...] | None = None,
) -> ScheduleResult:
    orders = _orders(schedule, pp, m, v)
    n = pp * v
    if times is None:
        times = ((1.0, 1.0, 1.0),) * n
    ranks = stage_ranks(schedule, pp, v)
    # Durations per kind and stage; a full B is I + W.
    dur = {"F": [t[0] for t in times], "I": [t[1] for t in times], "W": [t[2] for t in times],
           "B": [t[1] + t[2] for t in times]}
    measured = dict(actions) if actions else {}

    def seconds(kind: str, s: int, mb: int) -> float:
        return measured.get((kind, s, mb), dur[kind][s]) if measured else dur[kind][s]

    # An action's "done" key: F -> stage s, B/I -> n + s (input gradient ready), per micro-batch.
    # W produces nothing another action waits for.
    done: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}  # key -> ranks blocked on it
    starts = [[] for _ in range(pp)]
    ends = [[] for _ in range(pp)]
    ptr = [0] * pp
    free = [0.0] * pp
    ready_ranks = list(range(pp))
    while ready_ranks:
        r = ready_ranks.pop()
        order = orders[r]
        i, t = ptr[r], free[r]
        st, en = starts[r], ends[r]
        while i < len(order):
            kind, s, mb = order[i]
            start = t
            if kind == "F":
                if s > 0:
                    key = (s - 1) * m + mb
                    e = done.get(key)
                    if e is None:
                        waiting.setdefault(key, []).append(r)
                        break
                    if ranks[s - 1] != r:
                        e += p2p
                    if e > start:
                        start = e
                own = s * m + mb
            elif kind == "W":
                key = (n + s) * m + mb
                e = done.get(key)
                if e is None:
                    waiting.setdefault(key, []).append(r)
                    break
                if e > start:
                    start = e
                own = -1
            else:  # B or I: needs this stage's forward and the next stage's input gradient
                key = s * m + mb
                e = done.get(key)
                if e is None:
                    waiting.setdefault(key, []).append(r)
                    break
                if e > start:
                    start = e
                if s < n - 1:
                    key = (n + s + 1) * m + mb
                    e = done.get(key)
                    if e is None:
                        waiting.setdefault(key, []).append(r)
                        break
                    if ranks[s + 1] != r:
                        e += p2p
                    if e > start:
                        start = e
                own = (n + s) * m + mb
            t = start + seconds(kind, s, mb)
            st.append(start)
            en.append(t)
            if own >= 0:
                done[own] = t
                woken = waiting.pop(own, None)
                if woken:
                    ready_ranks.extend(woken)
            i += 1
        ptr[r], free[r] = i, t
    stuck = [r for r in range(pp) if ptr[r] < len(orders[r])]
    if stuck:  # the generators are tested against torch; this guards future edits
        raise RuntimeError(
            f"{schedule} deadlocks: rank {stuck[0]} waits forever at {orders[stuck[0]][ptr[stuck[0]]]}"
        )
    step = max(free) if pp else 0.0
    busy = tuple(sum(seconds(k, s, mb) for k, s, mb in order) for order in orders)
    idle = tuple(step - b for b in busy)
    stage_peak, rank_peak, _ = _peaks_cached(schedule, pp, m, v)
    return ScheduleResult(
        schedule=schedule,
        pp=pp,
        n_microbatches=m,
        virtual_stages=v,
        step_time=step,
        busy_time=busy,
        bubble_fraction=sum(idle) / (pp * step) if step else 0.0,
        per_rank_bubble=tuple(x / step if step else 0.0 for x in idle),
        bubble_ratio=sum(idle) / sum(busy) if sum(busy) else 0.0,
        peak_in_flight=stage_peak,
        peak_in_flight_per_rank=rank_peak,
        p2p_time=p2p,
        orders=orders,
        starts=tuple(tuple(x) for x in starts),
        ends=tuple(tuple(x) for x in ends),
    )


def bubble_closed_form(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Textbook bubble with equal stage times: GPipe/1F1B ``(p-1)/(m+p-1)`` of the step;
    interleaved 1F1B ``(p-1)/(v m)`` relative to the busy time (Narayanan et al. 2021)."""
    p, m, v = pp, n_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    raise ConfigError(f"no closed form for pp_schedule={schedule}; simulate it", field="pp_schedule", value=schedule)

