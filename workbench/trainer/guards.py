"""Guards of ``TrainSettings``: stop a run cleanly when a step goes wrong.

* ``guard_nonfinite``: the loss or the gradient norm is NaN or infinite;
* ``guard_grad_spike = k``: the gradient norm exceeds k x the running median of the previous
  :data:`SPIKE_WINDOW` steps (judged once :data:`SPIKE_HISTORY` steps are known);
* ``guard_min_tokens_per_s``: the job's throughput (its slowest rank's) falls below a floor, after
  :data:`GUARD_WARMUP_STEPS` steps.

Plain Python on values every rank already shares (the global loss and norm, the slowest rank's
throughput), so all ranks reach the same verdict without a collective. A fired guard is one
``guard`` event: ``guard`` (its short name) and ``message``, one line naming the value, the
threshold, the step and the TrainSettings field that set it; the run then ends with run_end
"stopped" (which the launcher reports as a failure). Not torch's anomaly mode
(``torch.autograd.set_detect_anomaly``): it checks every backward op's output, which slows every
step, and raises where the run should stop cleanly with a checkpoint; torch has no gradient-spike or
throughput guard.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from workbench.spec.config import RunConfig
from workbench.rundir.events import Guard

GUARD_WARMUP_STEPS = 2  # throughput guard: the first steps include one-off setup work
SPIKE_HISTORY = 5  # grad-spike guard: previous steps needed before it judges
SPIKE_WINDOW = 20


def check_guards(config: RunConfig, step: int, metrics: dict[str, Any], tokens_per_s: float,
                 history: list[float]) -> Guard | None:
    """The first guard of ``config.train`` that this step trips, or None. ``history``: the
    gradient norms of the previous steps."""
    t = config.train
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if getattr(t, "guard_nonfinite", False) and not (math.isfinite(loss) and math.isfinite(norm)):
        what = "loss" if not math.isfinite(loss) else "grad_norm"
        value = loss if what == "loss" else norm
        return Guard(step=step, guard="nonfinite", value=value, threshold=0.0,
                     message=f"{what}={value} is not finite at step {step} (guard_nonfinite)")
    k = getattr(t, "guard_grad_spike", 0.0)
    if k and len(history) >= SPIKE_HISTORY:
        median = statistics.median(history[-SPIKE_WINDOW:])
        if norm > k * median:
            return Guard(step=step, guard="grad_spike", value=norm, threshold=k * median,
                         message=f"grad_norm={norm:.4g} > {k} x running median {median:.4g} at step {step} "
                                 f"(guard_grad_spike={k})")
    floor = getattr(t, "guard_min_tokens_per_s", 0.0)
    if floor and step >= GUARD_WARMUP_STEPS and tokens_per_s < floor:
        return Guard(step=step, guard="min_tokens_per_s", value=tokens_per_s, threshold=floor,
                     message=f"tokens/s={tokens_per_s:.1f} < floor {floor} at step {step} "
                             f"(guard_min_tokens_per_s={floor})")
    return None
