"""The naive baseline, measured: ``workbench train --baseline`` and the Launch tab's button.

The baseline of a job is :func:`workbench.predict.advisor.naive_baseline`: the same model, data and
global batch as plain data parallelism over the same devices. It runs the first
:data:`BASELINE_STEPS` steps of the job's own learning-rate schedule (``stop_after``), so that its
loss over those steps is the plan's (up to the order of reductions) and its throughput and memory
stand beside the plan's in ``workbench compare PLAN BASELINE``. Where it cannot run (it does not
fit, by the bill, or the batch does not split over the ranks) the reason is one ConfigError line.
"""

from __future__ import annotations

from dataclasses import replace

from workbench.predict.advisor import naive_baseline
from workbench.spec.config import RunConfig
from workbench.spec.errors import ConfigError

BASELINE_STEPS = 20
# The bundled trainer runs on what the cluster has; the bill decides, with no headroom beyond the
# allocator's own share (the baseline is a measurement, not a plan to keep).
BASELINE_HEADROOM = 0.0


def baseline_config(config: RunConfig, steps: int = BASELINE_STEPS) -> RunConfig:
    """The naive baseline of ``config``: plain data parallel over its ranks, the same model, data,
    seed and global batch (in the plan's micro-batches where they divide each rank's share, else
    the largest that do), the first ``steps`` steps of its schedule, no acceptance thresholds of
    its own (they were declared for the plan)."""
    gbs, world = config.train.global_batch_size, config.world_size
    if gbs % world:
        raise ConfigError(f"the naive baseline of {config.plan.describe()} cannot run: the global batch of {gbs} "
                          f"sequences does not split over {world} data-parallel ranks", field="baseline",
                          value=config.plan.describe())
    # the plan's micro-batch where it divides each rank's share, else the largest that does
    mbs = max(d for d in range(1, min(config.train.micro_batch_size, gbs // world) + 1) if (gbs // world) % d == 0)
    train = replace(config.train, micro_batch_size=mbs)
    base = naive_baseline(config.model, config.cluster, train, BASELINE_HEADROOM)
    if base.config is None or not base.fits:
        raise ConfigError(f"the naive baseline of {config.plan.describe()} cannot run: {base.reason}",
                          field="baseline", value=config.plan.describe())
    train = replace(base.config.train, stop_after=min(steps, config.train.steps), accept="")
    return replace(base.config, train=train)
