"""Acceptance thresholds, declared before a run: ``TrainSettings.accept``.

A threshold is ``metric op value``: ``tokens_per_s_per_gpu>=2000``, ``step_time_error<=0.25``.
They are part of the run's ``config.json``, so they are written before the first step and a resume
cannot change them (:func:`workbench.launch.preflight.resumed_config` refuses it). At the end of a
run (or on demand for a live one) :func:`workbench.rundir.acceptance.evaluate_acceptance` gives each
one pass, fail or "not measured"; a run that fails one ends with :data:`EXIT_ACCEPTANCE_FAILED`.

=========================  ====  ===========================================================
metric                     op    measured as
=========================  ====  ===========================================================
``tokens_per_s_per_gpu``   >=    median over the timed steps of tokens/s of the job per rank
``final_loss``             <=    the loss of the last step
``step_time_error``        <=    |measured - predicted| / predicted median step time
``memory_error``           <=    |measured - predicted| / predicted peak memory (the worst rank)
``resume_loss_diff``       <=    max relative loss difference of a step run before and after a
                                 resume or restart (the run must continue the same curve)
``guards_fired``           <=    number of guard stops (``guards_fired<=0``: no guard fired)
=========================  ====  ===========================================================
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from workbench.spec.errors import ConfigError

# metric -> (the one comparison it takes, what it measures)
METRICS: dict[str, tuple[str, str]] = {
    "tokens_per_s_per_gpu": (">=", "median tokens/s per GPU over the timed steps"),
    "final_loss": ("<=", "the loss of the last step"),
    "step_time_error": ("<=", "|measured - predicted| / predicted step time"),
    "memory_error": ("<=", "|measured - predicted| / predicted peak memory"),
    "resume_loss_diff": ("<=", "relative loss difference of a step run before and after a resume"),
    "guards_fired": ("<=", "guard stops"),
}
EXIT_ACCEPTANCE_FAILED = 3  # a run that ran to its end but failed a declared threshold
_TERM = re.compile(r"\s*([a-z_]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*")


@dataclass(frozen=True)
class Threshold:
    metric: str
    op: str
    value: float

    def holds(self, measured: float) -> bool:
        return measured >= self.value if self.op == ">=" else measured <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def parse_accept(text: str) -> tuple[Threshold, ...]:
    """``"tokens_per_s_per_gpu>=2000,step_time_error<=0.25"`` -> thresholds, or one ConfigError
    line naming the term and the rule. Each metric at most once, with its own comparison."""
    if not isinstance(text, str):
        raise ConfigError(f"accept={text!r} must be text like 'final_loss<=2.5,guards_fired<=0'",
                          field="accept", value=text)
    out: list[Threshold] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = _TERM.fullmatch(term)
        if not m:
            raise ConfigError(f"accept term {term!r} is not metric>=value or metric<=value "
                              f"(metrics: {', '.join(METRICS)})", field="accept", value=term)
        metric, op, raw = m.groups()
        if metric not in METRICS:
            raise ConfigError(f"accept term {term!r}: {metric!r} is not one of {', '.join(METRICS)}",
                              field="accept", value=term)
        want = METRICS[metric][0]
        if op != want:
            raise ConfigError(f"accept term {term!r}: {metric} takes {want} ({METRICS[metric][1]})",
                              field="accept", value=term)
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"accept term {term!r}: the value must be a finite number >= 0",
                              field="accept", value=term)
        if any(t.metric == metric for t in out):
            raise ConfigError(f"accept names {metric} twice", field="accept", value=text)
        out.append(Threshold(metric, op, value))
    return tuple(out)


def format_accept(thresholds: tuple[Threshold, ...]) -> str:
    """The canonical text of thresholds (what ``config.json`` keeps)."""
    return ",".join(str(t) for t in thresholds)
