"""The verdicts of a run's declared acceptance thresholds (:mod:`workbench.spec.acceptance`).

Each threshold of ``config.train.accept`` gets "pass", "fail" or "not measured" (a metric the run
has no measurement of: no timed step, no resume, no prediction of a quantity the events lack).
:func:`evaluate_acceptance` reads the run directory only; a live run is judged on what it has
written so far (a pass then is provisional: ``final`` is False until the run has ended).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from workbench.rundir.compare import Comparison, compare_run
from workbench.rundir.events import Acceptance, EventWriter
from workbench.rundir.record import load_run
from workbench.rundir.status import run_outcome
from workbench.spec.acceptance import METRICS, Threshold, parse_accept

PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"


@dataclass(frozen=True)
class ThresholdResult:
    threshold: Threshold
    measured: float | None
    status: str  # pass | fail | not measured
    how: str = ""

    def describe(self) -> str:
        value = "—" if self.measured is None else f"{self.measured:.4g}"
        return f"{self.status:<12} {str(self.threshold):<32} measured {value}" + (f"  ({self.how})" if self.how else "")

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": str(self.threshold), "metric": self.threshold.metric, "op": self.threshold.op,
                "value": self.threshold.value, "measured": self.measured, "status": self.status, "how": self.how}


def _step_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "step" and e["rank"] == 0]


def resume_loss_diff(events: list[dict[str, Any]]) -> float | None:
    """Max relative loss difference over the steps rank 0 ran more than once (before a stop or a
    fault and again after the resume); None where no step ran twice."""
    by_step: dict[int, list[float]] = {}
    for e in _step_events(events):
        by_step.setdefault(int(e["step"]), []).append(float(e["loss"]))
    diffs = [max(abs(x - losses[0]) / abs(losses[0]) if losses[0] else abs(x) for x in losses)
             for losses in by_step.values() if len(losses) > 1]
    return max(diffs) if diffs else None


def _measure(metric: str, comparison: Comparison, events: list[dict[str, Any]]) -> tuple[float | None, str]:
    config = comparison.config
    if metric == "tokens_per_s_per_gpu":
        try:
            step = comparison.row("step time", "step time").measured
        except KeyError:
            step = None
        if not step:
            return None, "no timed step"
        return config.tokens_per_step / step / config.world_size, "tokens per step / median step time / ranks"
    if metric == "final_loss":
        steps = _step_events(events)
        return (float(steps[-1]["loss"]), f"step {steps[-1]['step']}") if steps else (None, "no step")
    if metric == "step_time_error":
        try:
            row = comparison.row("step time", "step time")
        except KeyError:
            return None, "no step-time row"
        return (abs(row.error), "median step time against the prediction") if row.error is not None else (None, "no timed step")
    if metric == "memory_error":
        rows = [r for r in comparison.section("memory") if r.predicted is not None and r.measured is not None]
        predicted = sum(r.predicted for r in rows)
        if not rows or not predicted:
            return None, "no memory events"
        measured = sum(r.measured for r in rows)
        return abs(measured - predicted) / predicted, f"sum of {', '.join(r.name for r in rows)} on rank {rows[0].rank}"
    if metric == "resume_loss_diff":
        diff = resume_loss_diff(events)
        return (diff, "steps run before and after a resume") if diff is not None else (None, "no step ran twice")
    if metric == "guards_fired":
        fired = {(e.get("step"), e.get("guard")) for e in events if e["kind"] == "guard"}
        return float(len(fired)), "guard events"
    raise ValueError(f"metric {metric!r} is not one of {', '.join(METRICS)}")


def evaluate_acceptance(run_dir: str | os.PathLike, comparison: Comparison | None = None,
                        accept: str | None = None) -> tuple[list[ThresholdResult], bool]:
    """(a verdict per declared threshold, whether the run has ended). ``comparison``: the run's
    :func:`~workbench.rundir.compare.compare_run`, where the caller has it already. ``accept``:
    judge these thresholds instead of the declared ones (what-if, never recorded)."""
    run = load_run(run_dir)
    thresholds = parse_accept(run.config.train.accept if accept is None else accept)
    events, _ = run.checked_events()
    ended = run_outcome(events, run.config.world_size).state in ("finished", "stopped", "failed")
    if not thresholds:
        return [], ended
    comparison = comparison or compare_run(run_dir)
    out = []
    for t in thresholds:
        measured, how = _measure(t.metric, comparison, events)
        status = NOT_MEASURED if measured is None else (PASS if t.holds(measured) else FAIL)
        out.append(ThresholdResult(t, measured, status, how))
    return out, ended


def acceptance_failed(verdicts: list[ThresholdResult]) -> bool:
    """A declared threshold failed (not measured is not a failure: it is reported as such)."""
    return any(v.status == FAIL for v in verdicts)


def format_results(verdicts: list[ThresholdResult], ended: bool = True) -> list[str]:
    if not verdicts:
        return []
    failed = sum(v.status == FAIL for v in verdicts)
    head = (f"acceptance: {len(verdicts) - failed} of {len(verdicts)} thresholds hold" if not failed
            else f"acceptance: FAILED {failed} of {len(verdicts)} declared thresholds")
    if not ended:
        head += " (provisional: the run is still going)"
    return [head] + [f"  {v.describe()}" for v in verdicts]


def recorded_acceptance(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``acceptance`` event of the run's last attempt (after rank 0's last ``run_start``), if any."""
    out = None
    for e in events:
        if e["rank"] != 0:
            continue
        if e["kind"] == "run_start":
            out = None
        elif e["kind"] == "acceptance":
            out = e
    return out


def record_acceptance(run_dir: str | os.PathLike) -> list[ThresholdResult]:
    """Judge an ended run's thresholds and append the verdicts to its events (an ``acceptance``
    event in rank 0's file, once per attempt: every launcher's end path may call this, the
    first writes it); the verdicts (empty where the run declared none)."""
    verdicts, _ = evaluate_acceptance(run_dir)
    events = load_run(run_dir).events()
    if verdicts and recorded_acceptance(events) is None:
        steps = _step_events(events)
        with EventWriter(run_dir, 0) as writer:
            writer.emit(Acceptance(step=int(steps[-1]["step"]) if steps else None,
                                   verdicts=[v.to_dict() for v in verdicts], failed=acceptance_failed(verdicts)))
    return verdicts
