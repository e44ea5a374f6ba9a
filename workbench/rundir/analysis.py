"""Analyses of a run directory's events (no torch): what the trainer measured, summarised per step.

Every function takes the list of events (``RunRecord.events()`` or ``read_events(run_dir)``) and
returns plain numbers under the planner's names, so that :mod:`workbench.rundir.compare` can set them
next to the predictions. Steps before :data:`WARMUP_STEPS` are skipped where timing matters (the
first step pays one-off costs: lazy initialisation, allocator growth, first-touch of buffers); if
a run has no later step, its first is used.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping

from workbench.predict.stats import percentile
from workbench.rundir.events import fields_problem

WARMUP_STEPS = 1
Events = Iterable[Mapping[str, Any]]


def _of(events: Events, kind: str, rank: int | None = None,
        needs: tuple[str, ...] = ("step",)) -> list[Mapping[str, Any]]:
    """The events of ``kind`` (of ``rank``) that carry the fields ``needs`` names, with every field as
    the schema types it (:func:`workbench.rundir.events.fields_problem`). Events read from a run
    directory were checked already; a list from elsewhere (a stream, a test) may not have been, and a
    malformed event is left out here rather than met as a TypeError further down."""
    return [e for e in events if isinstance(e, Mapping) and e.get("kind") == kind
            and (rank is None or e.get("rank") == rank) and all(n in e for n in needs) and fields_problem(e) is None]


def ranks_with(events: Events, kind: str) -> set[int]:
    """The ranks that have at least one usable event of ``kind``."""
    return {e["rank"] for e in _of(events, kind, needs=("rank",))}


def _timed_steps(steps: Iterable[int]) -> set[int]:
    """The steps to average timings over: those after the warm-up (all of them if none is)."""
    s = set(steps)
    later = {x for x in s if x >= WARMUP_STEPS}
    return later or s


def collective_bytes(events: Events, rank: int) -> dict[tuple[tuple[int, ...], str], dict[str, Any]]:
    """Per step on ``rank``, per (group ranks, op): ``bytes`` (S by nccl-tests, summed), ``count``,
    ``time_s`` (summed durations), ``dim`` (the plan's name for the group), averaged over the
    measured steps. Point-to-point counts the sends (each transfer once, as the planner does);
    single-element bookkeeping calls (loss, gradient-norm reductions) are left out: the planner
    does not model them (see :func:`bookkeeping_calls`)."""
    per_step = _of(events, "collectives", rank, ("step", "calls"))
    keep = _timed_steps(e["step"] for e in per_step)  # step 0 also runs one-off setup traffic
    per_step = [e for e in per_step if e["step"] in keep]
    if not per_step:
        return {}
    out: dict[tuple[tuple[int, ...], str], dict[str, Any]] = {}
    for e in per_step:
        for c in e["calls"]:
            if c.get("scalar") or c.get("dir") == "recv":
                continue
            key = (tuple(c["group"]), c["op"])
            d = out.setdefault(key, {"bytes": 0, "count": 0, "time_s": 0.0, "dim": c["dim"]})
            d["bytes"] += c["bytes"]
            d["count"] += 1
            if c.get("end") is not None:
                d["time_s"] += c["end"] - c["start"]
    n = len(per_step)
    for d in out.values():
        d["bytes"] /= n
        d["count"] /= n
        d["time_s"] /= n
    return out


def collective_bytes_by_step(events: Events, rank: int) -> dict[int, dict[tuple[tuple[int, ...], str], int]]:
    """Non-bookkeeping bytes per (group, op) of every measured step of ``rank`` (to check that
    every step issues the same traffic)."""
    out: dict[int, dict[tuple[tuple[int, ...], str], int]] = {}
    for e in _of(events, "collectives", rank, ("step", "calls")):
        d = out.setdefault(e["step"], defaultdict(int))
        for c in e["calls"]:
            if not c.get("scalar") and c.get("dir") != "recv":
                d[(tuple(c["group"]), c["op"])] += c["bytes"]
    return {k: dict(v) for k, v in out.items()}


def bookkeeping_calls(events: Events, rank: int) -> int:
    """Single-element calls per step on ``rank`` (loss and norm reductions)."""
    per_step = _of(events, "collectives", rank, ("step", "calls"))
    if not per_step:
        return 0
    return round(sum(sum(1 for c in e["calls"] if c.get("scalar")) for e in per_step) / len(per_step))


def memory(events: Events, rank: int) -> dict[str, int]:
    """Measured bytes per component on ``rank``: model states from the last memory event (they do
    not change), activations as the largest peak over the measured steps after the first."""
    mem = _of(events, "memory", rank, ("step", "parameters", "gradients", "optimizer", "activations"))
    keep = _timed_steps(e["step"] for e in mem)  # step 0: pipelining's shape inference saves too
    mem = [e for e in mem if e["step"] in keep]
    if not mem:
        return {}
    last = mem[-1]
    out = {k: int(last[k]) for k in ("parameters", "gradients", "optimizer")}
    out["activations"] = max(int(e["activations"]) for e in mem)
    for k in ("cuda_peak_allocated", "cuda_peak_reserved"):
        if last.get(k) is not None:
            out[k] = max(int(e[k]) for e in mem if e.get(k) is not None)
    return out


# A rank whose process was on a CPU for less than this share of the time it was not blocked was
# preempted by another process during the step (on a core of its own the share is ~1; the gloo
# and Python threads around the work only raise it).
MIN_CPU_SHARE = 0.85


def cpu_share(e: Mapping[str, Any]) -> float | None:
    """The share of a pipeline event's unblocked window its process spent on a CPU (None: not
    measured, as on CUDA)."""
    cpu = e.get("cpu_s")
    if cpu is None:
        return None
    active = (e["window"][1] - e["window"][0]) - e.get("wait_s", 0.0)
    return cpu / active if active > 0 else 1.0


def uncontended(evs: list[Mapping[str, Any]]) -> bool:
    """True unless some rank of the step was measurably preempted (:data:`MIN_CPU_SHARE`)."""
    return all((share := cpu_share(e)) is None or share >= MIN_CPU_SHARE for e in evs)


def _pipeline_steps(events: Events) -> dict[int, list[Mapping[str, Any]]]:
    """The timed pipeline steps (after the warm-up), and of those only the steps
    no rank was preempted in, when any is: on a shared machine a preempted rank's actions stretch
    and its neighbours' idle shrinks, so those steps measure the load of the machine, not the
    schedule. With every step contended all are kept (the best measurement there is)."""
    by_step: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for e in _of(events, "pipeline", None, ("step", "rank", "window")):
        by_step[e["step"]].append(e)
    keep = _timed_steps(by_step)
    timed = {s: v for s, v in by_step.items() if s in keep}
    clean = {s: v for s, v in timed.items() if uncontended(v)}
    return clean or timed


def _idle(e: Mapping[str, Any], t0: float, t1: float) -> float:
    """A rank's idle time in the step's makespan [t0, t1]: before and after its own
    ``schedule.step()``, and blocked waiting on its neighbours inside it. The schedule's own work
    between actions (posting transfers, the loss, Python) is not idle: it is per-action cost,
    which :func:`stage_times` folds into the stage times."""
    return (e["window"][0] - t0) + (t1 - e["window"][1]) + e.get("wait_s", 0.0)


def bubble_fractions(events: Events) -> dict[int, float]:
    """Median measured bubble per rank: idle / T, T the step's pipeline makespan from the earliest
    start to the latest end of ``schedule.step()`` over all ranks (one host's clock; across hosts,
    NTP-synchronised wall clocks). The planner's ``ScheduleResult.per_rank_bubble``."""
    per_rank: dict[int, list[float]] = defaultdict(list)
    for evs in _pipeline_steps(events).values():
        t0, t1 = min(e["window"][0] for e in evs), max(e["window"][1] for e in evs)
        for e in evs:
            per_rank[e["rank"]].append(_idle(e, t0, t1) / (t1 - t0) if t1 > t0 else 0.0)
    return {r: statistics.median(xs) for r, xs in per_rank.items()}


def bubble_fraction(events: Events) -> float | None:
    """The run's bubble fraction, median over steps of total idle / (ranks x makespan): the
    planner's ``ScheduleResult.bubble_fraction``."""
    steps = list(step_bubbles(events).values())
    return statistics.median(steps) if steps else None


def step_bubbles(events: Events) -> dict[int, float]:
    """Per timed step, the run's bubble fraction: total idle / (ranks x makespan)."""
    out = {}
    for step, evs in _pipeline_steps(events).items():
        t0, t1 = min(e["window"][0] for e in evs), max(e["window"][1] for e in evs)
        if t1 > t0:
            out[step] = sum(_idle(e, t0, t1) for e in evs) / (len(evs) * (t1 - t0))
    return out


def step_actions(events: Events) -> dict[int, dict[tuple[str, int, int], float]]:
    """Per timed step, every action's seconds keyed ``(kind, stage, micro_batch)``, each with its
    share of its rank's schedule work between actions (window - actions - waits, spread evenly
    over the actions): the input of a step's action-by-action replay
    (``simulate_schedule(action_times=...)``) and of :func:`stage_times`."""
    out: dict[int, dict[tuple[str, int, int], float]] = {}
    for step, evs in _pipeline_steps(events).items():
        acts: dict[tuple[str, int, int], float] = {}
        for e in evs:
            actions = e.get("actions")
            if not actions or "busy_s" not in e:
                continue
            window = e["window"][1] - e["window"][0]
            overhead = max(0.0, window - e["busy_s"] - e.get("wait_s", 0.0)) / len(actions)
            for kind, stage, mb, start, end in actions:
                acts[(str(kind), int(stage), int(mb))] = end - start + overhead
        out[step] = acts
    return out


def stage_times(events: Events) -> dict[int, dict[str, float]]:
    """Median seconds per action kind (F, B, I, W) per stage over the measured steps (medians: a
    shared CPU stretches a few actions by a lot), each including its share of the schedule's own
    work between actions on that rank (as :func:`step_actions`)."""
    acc: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for acts in step_actions(events).values():
        for (kind, stage, _), seconds in acts.items():
            acc[stage][kind].append(seconds)
    return {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in acc.items()}


def step_times(events: Events) -> dict[int, list[float]]:
    """Per step, every rank's step time (``step_stats`` of rank 0, else each rank's step events)."""
    stats = _of(events, "step_stats", None, ("step", "step_time_s"))
    if stats:
        return {e["step"]: list(e["step_time_s"]) for e in stats}
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for e in _of(events, "step", None, ("step", "rank", "step_time_s")):
        out[e["step"]][e["rank"]] = e["step_time_s"]
    return {s: [d[r] for r in sorted(d)] for s, d in out.items()}


def stragglers(events: Events) -> dict[str, Any]:
    """Which rank is slowest how often, and p50 / p95 / max of the per-rank step times."""
    times = step_times(events)
    keep = _timed_steps(times)
    slowest: dict[int, int] = defaultdict(int)
    flat = []
    for s, ts in times.items():
        if s in keep and ts:
            slowest[max(range(len(ts)), key=ts.__getitem__)] += 1
            flat.extend(ts)
    if not flat:
        return {}
    return {"slowest_rank_counts": dict(slowest), "p50_s": percentile(flat, 50),
            "p95_s": percentile(flat, 95), "max_s": max(flat)}


def step_breakdown(events: Events, rank: int, exclude_s: float = 0.0) -> dict[str, float]:
    """Mean seconds per step on ``rank``: ``step_time``, ``data_wait``, ``bubble`` (pipeline idle
    inside ``schedule.step()``), ``comm_<dim>`` (summed durations of its calls, start to completion:
    calls that overlap compute are counted whole), and ``compute``, never negative:

    * on a pipeline rank, the time of its own F/B/I/W actions (``busy_s``), measured. The residual
      cannot be used there: the pipeline's sends and receives (comm_pp) run during the actions and
      the bubble's waits, so the step less bubble and comm_pp counts them twice;
    * elsewhere, the step less what is named (data wait, each comm_<dim>, and ``exclude_s``, the
      caller's bookkeeping calls), floored at 0: asynchronous calls (FSDP's prefetching all-gathers)
      overlap compute, and when they are longer than the compute they hide, the residual would be
      negative. :func:`compute_overlap` says by how much it was floored."""
    steps = _of(events, "step", rank, ("step", "step_time_s"))
    keep = _timed_steps(e["step"] for e in steps)
    steps = [e for e in steps if e["step"] in keep]
    if not steps:
        return {}
    out = {"step_time": statistics.fmean(e["step_time_s"] for e in steps),
           "data_wait": statistics.fmean(max(0.0, e.get("data_wait_s", 0.0)) for e in steps)}
    pipe = [e for e in _of(events, "pipeline", rank, ("step", "window", "bubble_fraction")) if e["step"] in keep]
    if pipe:
        out["bubble"] = statistics.fmean(max(0.0, (e["window"][1] - e["window"][0]) * e["bubble_fraction"])
                                         for e in pipe)
    comm: dict[str, float] = defaultdict(float)
    coll = [e for e in _of(events, "collectives", rank, ("step", "calls")) if e["step"] in keep]
    for e in coll:
        for c in e["calls"]:
            if c.get("end") is not None and not c.get("scalar"):
                comm[f"comm_{c['dim']}"] += max(0.0, c["end"] - c["start"]) / len(coll)
    out.update(sorted(comm.items()))
    busy = [e["busy_s"] for e in pipe if "busy_s" in e]
    if busy:
        out["compute"] = max(0.0, statistics.fmean(busy))
    else:
        out["compute"] = max(0.0, compute_residual(out, exclude_s))
    return out


def compute_residual(breakdown: Mapping[str, float], exclude_s: float = 0.0) -> float:
    """The step less everything :func:`step_breakdown` named (and ``exclude_s``); negative when
    calls that overlap compute are longer than it."""
    named = sum(v for k, v in breakdown.items() if k not in ("step_time", "compute"))
    return breakdown["step_time"] - named - exclude_s


def compute_overlap(breakdown: Mapping[str, float], exclude_s: float = 0.0) -> float:
    """Seconds by which the named parts exceed the step (0: they fit in it): what flooring the
    derived compute at 0 left out."""
    return max(0.0, -compute_residual(breakdown, exclude_s)) if "step_time" in breakdown else 0.0


def bookkeeping_time(events: Events, rank: int) -> float | None:
    """Mean seconds per timed step of ``rank``'s single-element calls (None: none recorded)."""
    per_step = _of(events, "collectives", rank, ("step", "calls"))
    keep = [e for e in per_step if e["step"] >= WARMUP_STEPS] or per_step
    if not keep or not any(c.get("scalar") for e in keep for c in e["calls"]):
        return None
    return sum(c["end"] - c["start"] for e in keep for c in e["calls"]
               if c.get("scalar") and c.get("end") is not None) / len(keep)


def mean_mfu(events: Events) -> float | None:
    """Mean MFU of rank 0's timed steps (None: the run logged none)."""
    xs = [e["mfu"] for e in _of(events, "step", 0, ("step", "mfu"))
          if e["mfu"] is not None and e["step"] >= WARMUP_STEPS]
    return sum(xs) / len(xs) if xs else None
