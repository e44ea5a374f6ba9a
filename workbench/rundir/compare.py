"""Predicted next to measured: ``compare_run(run_dir) -> Comparison``.

For the run's own RunConfig, the planner's predictions (:mod:`workbench.predict.memory`,
:mod:`workbench.predict.comms`, :mod:`workbench.predict.pipeline`, :mod:`workbench.predict.perf`) and the trainer's
measurements (:mod:`workbench.rundir.analysis` of the run's events) side by side, with the
relative error ``(measured - predicted) / predicted``:

* memory per component on the planner's most loaded rank (parameters, gradients, optimizer
  states: exact on CPU; activations: the peak saved for backward);
* the pipeline bubble fraction, predicted twice: with the planner's stage times (its compute
  model) and with the measured mean F/B time of each stage (the schedule model alone);
* bytes per step of each collective per group (dimension, op) on one rank of every pipeline rank:
  calls join on the group's ranks, so a group the plan names twice (cp and dp_shard_cp share
  ranks when dp_shard = 1) compares once;
* the step time and its breakdown. The measured step time is the *median* over the timed steps of
  the critical rank (a shared CPU stretches a few steps by a lot, which a mean follows); the
  trainer's single-element bookkeeping calls (loss and gradient-norm reductions, one per sharded
  gradient) get a row of their own, measured, since the planner does not price them. Measured
  compute is never negative (:func:`workbench.rundir.analysis.step_breakdown`): on a pipeline rank
  it is the time of the rank's own actions, elsewhere the step less the rest, floored at 0 with a
  note saying by how much overlapping calls exceeded it.

Each row says how its measured number is taken (:attr:`Row.how`: a statistic, or a derivation):
the UI shows it as a column, :meth:`Comparison.format` as numbered footnotes. The run's state
(:func:`workbench.rundir.status.run_outcome`: finished, stopped, failed; errors a stop raised are
part of the stop) heads the table, so the compare table and the live view agree on it.

``compare_run(run_dir, cluster=..., framework=...)`` prices the run on another cluster (the
calibrated one ``workbench calibrate`` wrote: its figures, the run's shape) and under another
framework profile (a fitted one): what makes the step-time rows of a CPU run mean something, as the
recorded ``local-cpu`` preset and the bundled profile's GPU constants do not
(benchmarks/bench_cpu_loop.py calibrates, fits and predicts this machine end to end).

``workbench compare runs/<id>`` prints :meth:`Comparison.format`; the UI reads :attr:`rows` and
shows them with the same formatters (:func:`format_value`, :func:`format_error`).
No torch here.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from workbench.predict.comms import EXPERT_DIMS, group_members, p2p_time, step_collectives
from workbench.spec.config import RunConfig
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step
from workbench.spec.plan import ParallelPlan
from workbench.predict.pipeline import simulate_schedule
from workbench.rundir import analysis
from workbench.rundir.record import load_run
from workbench.rundir.status import run_outcome

if TYPE_CHECKING:
    from workbench.spec.cluster import Cluster
    from workbench.spec.framework import FrameworkProfile

MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer", "activations")
BOOKKEEPING = "bookkeeping (scalar calls)"
# How each measured number is taken (the "how" of a row; the step-time rows': step_row_how).
MEMORY_HOW = {"parameters": "local shards, latest memory event", "gradients": "local shards, latest memory event",
              "optimizer": "local shards, latest memory event", "activations": "peak over the timed steps"}
BUBBLE_HOW = "median over the timed steps"
# The schedule model checked on its own: each timed step simulated with that step's measured
# actions. Not a stage's median time: on a host whose cores share a chip (or a GPU sharing its
# node's power), an action alone in the fill or drain runs faster than one beside another rank's
# and stage medians overstate the bubble (CI measured gpipe at p = 2 0.183 against 0.219 from
# medians, 0.183 replayed action by action).
REPLAY_ROW = "bubble fraction (replayed measured actions)"
COLLECTIVES_HOW = "mean per timed step"


def replayed_bubble(events: analysis.Events, plan: ParallelPlan, n_microbatches: int) -> float | None:
    """Median over the timed steps of the bubble ``simulate_schedule`` gives each step fed with
    that step's measured actions (``analysis.step_actions``; an action a step did not record
    takes its stage's median, ``analysis.stage_times``); None unless every stage was measured."""
    st = analysis.stage_times(events)
    if len(st) != plan.n_stages:
        return None
    medians = [(st[s].get("F", 0.0), st[s].get("B", 0.0) or st[s].get("I", 0.0) + st[s].get("W", 0.0))
               for s in range(plan.n_stages)]
    bubbles = [simulate_schedule(plan.pp_schedule, plan.pp, n_microbatches, plan.virtual_stages,
                                 stage_times=medians, action_times=acts).bubble_fraction
               for acts in analysis.step_actions(events).values()]
    return statistics.median(bubbles) if bubbles else None


@dataclass(frozen=True)
class Row:
    """One quantity, predicted and measured, in ``unit`` ("B", "s", "fraction", "calls")."""

    section: str
    name: str
    predicted: float | None
    measured: float | None
    unit: str
    rank: int | None = None
    how: str = ""  # how the measured number is taken or derived ("" : read as the events carry it)

    @property
    def error(self) -> float | None:
        """Relative error (measured - predicted) / predicted; absolute difference for fractions
        (a bubble of 0.30 against 0.25 is "5 points"); None when either side is missing."""
        if self.predicted is None or self.measured is None:
            return None
        if self.unit == "fraction":
            return self.measured - self.predicted
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.predicted) / self.predicted


@dataclass(frozen=True)
class Comparison:
    run_dir: str
    config: RunConfig
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default=())
    outcome: str = ""  # how the run stands (workbench.rundir.status.run_outcome): "stopped at step 12 (...)"

    def section(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.section == name]

    def row(self, section: str, name: str, rank: int | None = None) -> Row:
        for r in self.rows:
            if r.section == section and r.name == name and (rank is None or r.rank == rank):
                return r
        raise KeyError(f"{section}/{name}" + (f" (rank {rank})" if rank is not None else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "notes": list(self.notes), "outcome": self.outcome,
                "rows": [{"section": r.section, "name": r.name, "rank": r.rank, "predicted": r.predicted,
                          "measured": r.measured, "unit": r.unit, "error": r.error, "how": r.how}
                         for r in self.rows]}

    def format(self) -> str:
        """A plain-text table: section, quantity, predicted, measured, error."""
        lines = [f"predicted vs measured: {self.run_dir}  ({self.config.plan.describe()}, "
                 f"{self.config.world_size} ranks)"]
        if self.outcome:
            lines.append(f"run: {self.outcome}")
        header = f"  {'quantity':<44} {'predicted':>14} {'measured':>14} {'error':>9}"
        current = None
        hows: list[str] = []  # the footnotes: how each derived number is derived, once each
        for r in self.rows:
            if r.section != current:
                current = r.section
                lines += ["", f"{current}" + (f" (rank {r.rank})" if r.rank is not None and current == "memory" else ""),
                          header]
            name = r.name if r.rank is None or current == "memory" else f"{r.name} [rank {r.rank}]"
            if r.how:
                if r.how not in hows:
                    hows.append(r.how)
                name = f"{name} ({hows.index(r.how) + 1})"
            lines.append(f"  {name:<44} {format_value(r.predicted, r.unit):>14} {format_value(r.measured, r.unit):>14} "
                         f"{format_error(r):>9}")
        if hows:
            lines += ["", "how each measured number is taken:"]
            lines += [f"({i}) {how}" for i, how in enumerate(hows, 1)]
        if self.notes:
            lines.append("")
            lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def format_value(x: float | None, unit: str) -> str:
    """One predicted or measured value as :meth:`Comparison.format` and the UI's compare table show
    it: bytes ("B") in B/KiB/MiB/GiB, seconds ("s") in ms, fractions to three places, counts
    with thousands separators; "-" when missing."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)  # "inf", "nan": said as they are, not formatted into an exception
    if unit == "B":
        for div, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(x) >= div:
                return f"{x / div:,.3f} {suffix}"
        return f"{x:,.0f} B"
    if unit == "s":
        return f"{x * 1e3:,.2f} ms"
    if unit == "fraction":
        return f"{x:.3f}"
    return f"{x:,.1f}" if x != int(x) else f"{int(x):,}"


def format_error(r: Row) -> str:
    """A row's :attr:`Row.error` as shown beside it: percent ("+12.5%"), points for fractions
    ("+5.0 pt"), "new" when nothing was predicted but something was measured, "-" when missing."""
    e = r.error
    if e is None:
        return "-"
    if r.unit == "fraction":
        return f"{e * 100:+.1f} pt"
    if e == float("inf"):
        return "new"
    return f"{e * 100:+.1f}%"


def _rank_groups(plan: ParallelPlan, rank: int) -> dict[str, tuple[int, ...]]:
    """This rank's group (sorted ranks) of every dimension the planner may name."""
    out = {}
    for dim in ("tp", "cp", "ep", "pp", "dp_shard_cp", "dp_cp", "dp", "dp_shard", "dp_replicate") + EXPERT_DIMS:
        if dim in EXPERT_DIMS or dim == "dp":
            try:
                groups = group_members(plan, dim)
            except ValueError:
                continue
        else:
            groups = plan.group_ranks(dim)
        for g in groups:
            if rank in g:
                out[dim] = tuple(sorted(g))
    return out


def predicted_collectives(config: RunConfig, rank: int) -> dict[tuple[tuple[int, ...], str], dict[str, Any]]:
    """The planner's bytes and calls per step of ``rank``, keyed like the measurement: (group, op)."""
    plan = config.plan
    groups = _rank_groups(plan, rank)
    out: dict[tuple[tuple[int, ...], str], dict[str, Any]] = {}
    for c in step_collectives(config, plan.rank_coords(rank)["pp"]):
        key = (groups[c.dim], c.op)
        d = out.setdefault(key, {"bytes": 0, "count": 0, "dims": []})
        d["bytes"] += c.total_bytes
        d["count"] += c.count
        if c.dim not in d["dims"]:
            d["dims"].append(c.dim)
    return out


def collective_rows(config: RunConfig, events: list, rank: int) -> list[Row]:
    """Bytes and calls per (group, op) on ``rank``. A call the rank did not make measures 0; a rank
    with no collectives events measured nothing, which is "-", not 0 B at -100%."""
    predicted = predicted_collectives(config, rank)
    measured = analysis.collective_bytes(events, rank)
    none = None if rank not in analysis.ranks_with(events, "collectives") else 0
    rows = []
    for key in sorted(set(predicted) | set(measured), key=lambda k: (k[1], k[0])):
        p, m = predicted.get(key), measured.get(key)
        label = "/".join(p["dims"]) if p else m["dim"]
        name = f"{label} {key[1]}"
        rows.append(Row("collectives per step", name, p["bytes"] if p else 0, m["bytes"] if m else none, "B", rank,
                        how=COLLECTIVES_HOW))
        rows.append(Row("collectives per step", f"{name} calls", p["count"] if p else 0, m["count"] if m else none,
                        "calls", rank, how=COLLECTIVES_HOW))
    return rows


def priced_config(config: RunConfig, cluster: "Cluster | None" = None,
                  framework: "str | FrameworkProfile | None" = None) -> RunConfig:
    """``config`` on ``cluster`` (its GPU, links and calibration, with the run's nodes x GPUs per
    node) and under ``framework``; either None keeps the run's own."""
    if cluster is not None:
        config = replace(config, cluster=replace(cluster, nodes=config.cluster.nodes,
                                                 gpus_per_node=config.cluster.gpus_per_node))
    if framework is not None:
        config = replace(config, train=replace(config.train, framework=framework))
    return config


def step_row_how(name: str, on_pipeline: bool) -> str:
    """How the measured number of a step-time row is taken (the compare table's "how" column)."""
    if name == "compute":
        if on_pipeline:
            return "measured: the pipeline actions' time (F, B, I, W)"
        return "derived: step - data wait - comm - bookkeeping, not below 0"
    if name == "bubble":
        return "mean of window x bubble fraction"
    if name == "data_wait":
        return "mean per step"
    if name == BOOKKEEPING:
        return "mean of the scalar calls' durations"
    if name.startswith("comm_"):
        return "mean of the calls' durations (overlaps counted whole)"
    return ""


def measured_step_time(events: list, rank: int) -> tuple[float, int] | None:
    """(median step time of ``rank`` over the timed steps, how many), or None without steps."""
    times = analysis.step_times(events)
    keep = [s for s in times if s >= analysis.WARMUP_STEPS] or list(times)
    xs = [times[s][rank] for s in keep if rank < len(times[s])]
    return (statistics.median(xs), len(xs)) if xs else None


def bookkeeping_time(events: list, rank: int) -> float | None:
    """Mean seconds per timed step of ``rank``'s single-element calls (None: none recorded)."""
    return analysis.bookkeeping_time(events, rank)


def compare_run(run_dir: str | os.PathLike, cluster: "Cluster | None" = None,
                framework: "str | FrameworkProfile | None" = None) -> Comparison:
    """Predicted vs measured for the run in ``run_dir`` (see the module docstring), priced on
    ``cluster`` and under ``framework`` where given (:func:`priced_config`). A damaged run directory
    is a ConfigError naming the file (:func:`~workbench.rundir.record.load_run`); damaged events are
    skipped, and the notes say what was (:meth:`~workbench.rundir.record.RunRecord.checked_events`),
    ranks without events included."""
    run = load_run(run_dir)
    events, read_notes = run.checked_events()
    config = priced_config(run.config, cluster, framework)
    plan = config.plan
    rows: list[Row] = []
    notes: list[str] = list(read_notes)

    # memory, on the planner's most loaded rank
    bill = estimate_memory(config)
    worst = bill.most_loaded_rank
    measured = analysis.memory(events, worst)
    for name in MEMORY_COMPONENTS:
        rows.append(Row("memory", name, bill.components[name], measured.get(name), "B", worst,
                        how=MEMORY_HOW.get(name, "")))
    if "cuda_peak_allocated" in measured:
        total = sum(bill.components[k] for k in ("parameters", "gradients", "optimizer", "master_weights",
                                                 "activations", "buffers"))
        rows.append(Row("memory", "allocated peak (CUDA)", total, measured["cuda_peak_allocated"], "B", worst,
                        how="allocator's peak, timed steps"))
    if not measured:
        notes.append("no memory events: was instrumentation on?")

    # pipeline bubble
    prediction = predict_step(config)
    if plan.pp > 1:
        m = config.n_microbatches
        planned = simulate_schedule(plan.pp_schedule, plan.pp, m, plan.virtual_stages,
                                    stage_times=prediction.stage_times_s, p2p_time=p2p_time(config))
        # the run's bubble is over all its ranks: with one silent ("rank 1: no events") it is unmeasured
        measured_bubble = (analysis.bubble_fraction(events)
                           if analysis.ranks_with(events, "pipeline") >= set(range(config.world_size)) else None)
        rows.append(Row("pipeline", "bubble fraction", planned.bubble_fraction, measured_bubble, "fraction",
                        how=BUBBLE_HOW))
        replayed = replayed_bubble(events, plan, m) if measured_bubble is not None else None
        if replayed is not None:
            rows.append(Row("pipeline", REPLAY_ROW, replayed, measured_bubble, "fraction", how=BUBBLE_HOW))
        per_rank = analysis.bubble_fractions(events)
        stride = config.world_size // plan.pp
        for r in range(plan.pp):
            rows.append(Row("pipeline", f"bubble of pp rank {r}", planned.per_rank_bubble[r],
                            per_rank.get(r * stride), "fraction", how=BUBBLE_HOW))

    # collectives, one rank per pipeline rank
    stride = config.world_size // plan.pp
    for r in range(plan.pp):
        rows += collective_rows(config, events, r * stride)
    n_book = analysis.bookkeeping_calls(events, 0)
    if n_book:
        notes.append(f"{n_book} single-element calls per step on rank 0 (loss and gradient-norm reductions) "
                     "are measured but not modelled by the planner")

    # step time
    crit = prediction.critical_pp_rank * stride
    book = bookkeeping_time(events, crit)
    # means per step, components included; compute never negative (analysis.step_breakdown)
    measured_steps = analysis.step_breakdown(events, crit, exclude_s=book or 0.0)
    on_pipeline = crit in analysis.ranks_with(events, "pipeline")
    median = measured_step_time(events, crit)
    rows.append(Row("step time", "step time", prediction.step_time_s, median[0] if median else None, "s", crit,
                    how=f"median of {median[1]} timed steps" if median else ""))
    if book is not None and "compute" in measured_steps:
        # the scalar calls are in no comm_<dim> (the planner's collectives leave them out): a row of their own
        measured_steps[BOOKKEEPING] = book
    keys = [k for k in prediction.breakdown if k != "compute"] + ["compute"]
    for k in sorted(set(keys) | {k for k in measured_steps if k != "step_time"}, key=lambda k: (k == "compute", k)):
        rows.append(Row("step time", k, prediction.breakdown.get(k, 0.0), measured_steps.get(k), "s", crit,
                        how=step_row_how(k, on_pipeline) if k in measured_steps else ""))
    rows.append(Row("step time", "mfu", prediction.mfu, analysis.mean_mfu(events), "fraction",
                    how="mean of rank 0's steps"))
    if median:
        notes.append(f"step time measured: median of {median[1]} steps on rank {crit} (the breakdown rows: means)")
    if "compute" in measured_steps and not on_pipeline:
        parts = {k: v for k, v in measured_steps.items() if k not in ("step_time", "compute", BOOKKEEPING)}
        over = analysis.compute_overlap(parts | {"step_time": measured_steps["step_time"]}, book or 0.0)
        if over > 0:
            notes.append(f"compute is shown as 0: the calls timed on rank {crit} take {over * 1e3:.2f} ms per step "
                         "more than the step less its data wait, because asynchronous calls overlap compute (each "
                         "is counted whole, from start to completion); a derived time is never negative")
    if config.cluster.gpu.name == "cpu":
        if config.cluster.calibration is None:
            notes.append("the step-time rows price a CPU run on the uncalibrated local-cpu preset with the profile's "
                         "GPU constants: they test the plumbing. For rows that mean something, compare with a "
                         "calibrated cluster (workbench bench compute + bench comms, workbench calibrate) and a "
                         "profile fitted on CPU runs: compare_run(run, cluster=..., framework=...); "
                         "benchmarks/bench_cpu_loop.py does it end to end")
        else:
            notes.append(f"priced on a calibrated cluster ({config.cluster.calibration.source or 'calibration'}) "
                         f"under profile {config.train.profile.name!r} ({config.train.profile.describe_band()})")
    outcome = run_outcome(events, config.world_size)
    stopped_errors = [e for e in outcome.errors if e.role == "stop"]
    if stopped_errors:
        n = len(stopped_errors)
        notes.append(f"{n} error{'s' if n != 1 else ''} ({_ranks_of(stopped_errors)}: a lost connection to a stopped "
                     f"rank) {'were' if n != 1 else 'was'} raised by a stop: part of the stop, not a failure")
    return Comparison(str(run_dir), config, tuple(rows), tuple(notes), outcome.describe())


def _ranks_of(marks: list) -> str:
    rs = sorted({m.rank for m in marks})
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))
