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
* the step time and its breakdown.

``workbench compare runs/<id>`` prints :meth:`Comparison.format`; the UI reads :attr:`rows` and
shows them with the same formatters (:func:`format_value`, :func:`format_error`).
No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from workbench.predict.comms import EXPERT_DIMS, group_members, p2p_time, step_collectives
from workbench.spec.config import RunConfig
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step
from workbench.spec.plan import ParallelPlan
from workbench.predict.pipeline import simulate_schedule
from workbench.rundir import analysis
from workbench.rundir.record import load_run

MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class Row:
    """One quantity, predicted and measured, in ``unit`` ("B", "s", "fraction", "calls")."""

    section: str
    name: str
    predicted: float | None
    measured: float | None
    unit: str
    rank: int | None = None

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

    def section(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.section == name]

    def row(self, section: str, name: str, rank: int | None = None) -> Row:
        for r in self.rows:
            if r.section == section and r.name == name and (rank is None or r.rank == rank):
                return r
        raise KeyError(f"{section}/{name}" + (f" (rank {rank})" if rank is not None else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "notes": list(self.notes),
                "rows": [{"section": r.section, "name": r.name, "rank": r.rank, "predicted": r.predicted,
                          "measured": r.measured, "unit": r.unit, "error": r.error} for r in self.rows]}

    def format(self) -> str:
        """A plain-text table: section, quantity, predicted, measured, error."""
        lines = [f"predicted vs measured: {self.run_dir}  ({self.config.plan.describe()}, "
                 f"{self.config.world_size} ranks)"]
        header = f"  {'quantity':<44} {'predicted':>14} {'measured':>14} {'error':>9}"
        current = None
        for r in self.rows:
            if r.section != current:
                current = r.section
                lines += ["", f"{current}" + (f" (rank {r.rank})" if r.rank is not None and current == "memory" else ""),
                          header]
            name = r.name if r.rank is None or current == "memory" else f"{r.name} [rank {r.rank}]"
            lines.append(f"  {name:<44} {format_value(r.predicted, r.unit):>14} {format_value(r.measured, r.unit):>14} "
                         f"{format_error(r):>9}")
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
    predicted = predicted_collectives(config, rank)
    measured = analysis.collective_bytes(events, rank)
    rows = []
    for key in sorted(set(predicted) | set(measured), key=lambda k: (k[1], k[0])):
        p, m = predicted.get(key), measured.get(key)
        label = "/".join(p["dims"]) if p else m["dim"]
        name = f"{label} {key[1]}"
        rows.append(Row("collectives per step", name, p["bytes"] if p else 0, m["bytes"] if m else 0, "B", rank))
        rows.append(Row("collectives per step", f"{name} calls", p["count"] if p else 0, m["count"] if m else 0,
                        "calls", rank))
    return rows


def compare_run(run_dir: str | os.PathLike) -> Comparison:
    """Predicted vs measured for the run in ``run_dir`` (see the module docstring)."""
    run = load_run(run_dir)
    config, events = run.config, run.events()
    plan = config.plan
    rows: list[Row] = []
    notes: list[str] = []

    # memory, on the planner's most loaded rank
    bill = estimate_memory(config)
    worst = bill.most_loaded_rank
    measured = analysis.memory(events, worst)
    for name in MEMORY_COMPONENTS:
        rows.append(Row("memory", name, bill.components[name], measured.get(name), "B", worst))
    if "cuda_peak_allocated" in measured:
        total = sum(bill.components[k] for k in ("parameters", "gradients", "optimizer", "master_weights",
                                                 "activations", "buffers"))
        rows.append(Row("memory", "allocated peak (CUDA)", total, measured["cuda_peak_allocated"], "B", worst))
    if not measured:
        notes.append("no memory events: was instrumentation on?")

    # pipeline bubble
    prediction = predict_step(config)
    if plan.pp > 1:
        m = config.n_microbatches
        planned = simulate_schedule(plan.pp_schedule, plan.pp, m, plan.virtual_stages,
                                    stage_times=prediction.stage_times_s, p2p_time=p2p_time(config))
        measured_bubble = analysis.bubble_fraction(events)
        rows.append(Row("pipeline", "bubble fraction", planned.bubble_fraction, measured_bubble, "fraction"))
        st = analysis.stage_times(events)
        if len(st) == plan.n_stages:
            times = [(st[s].get("F", 0.0), st[s].get("B", 0.0) or st[s].get("I", 0.0) + st[s].get("W", 0.0))
                     for s in range(plan.n_stages)]
            replay = simulate_schedule(plan.pp_schedule, plan.pp, m, plan.virtual_stages, stage_times=times)
            rows.append(Row("pipeline", "bubble fraction (measured stage times)", replay.bubble_fraction,
                            measured_bubble, "fraction"))
        per_rank = analysis.bubble_fractions(events)
        stride = config.world_size // plan.pp
        for r in range(plan.pp):
            rows.append(Row("pipeline", f"bubble of pp rank {r}", planned.per_rank_bubble[r],
                            per_rank.get(r * stride), "fraction"))

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
    measured_steps = analysis.step_breakdown(events, crit)
    rows.append(Row("step time", "step time", prediction.step_time_s, measured_steps.get("step_time"), "s", crit))
    keys = [k for k in prediction.breakdown if k != "compute"] + ["compute"]
    for k in sorted(set(keys) | {k for k in measured_steps if k != "step_time"}, key=lambda k: (k == "compute", k)):
        rows.append(Row("step time", k, prediction.breakdown.get(k, 0.0), measured_steps.get(k), "s", crit))
    rows.append(Row("step time", "mfu", prediction.mfu, _mean_mfu(events), "fraction"))
    if config.cluster.gpu.name == "cpu":
        notes.append("step times on CPU test the plumbing, not the planner's compute model (it models GPUs)")
    return Comparison(str(run_dir), config, tuple(rows), tuple(notes))


def _mean_mfu(events: list) -> float | None:
    xs = [e["mfu"] for e in events if e.get("kind") == "step" and e.get("rank") == 0 and e.get("mfu") is not None
          and e["step"] >= analysis.WARMUP_STEPS]
    return sum(xs) / len(xs) if xs else None
