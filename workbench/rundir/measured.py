"""A run directory of the bundled trainer read back as a :class:`~workbench.predict.measurements.Measurement`.

So that ``workbench calibrate --measured runs/<id>`` and ``workbench validate --measured`` take
the workbench's own runs beside CSV rows: the config the run recorded, its median step time over
the steps after warm-up (the slowest rank of each step: the step ends when it does), and its peak
memory where the run measured one on CUDA (reserved bytes, as torchtitan logs them).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from workbench.spec.errors import require
from workbench.predict.measurements import Measurement, load_measurements, priced_under
from workbench.rundir.analysis import WARMUP_STEPS, memory, step_times
from workbench.rundir.record import load_run

MIN_TIMED_STEPS = 3  # a median of fewer steps is one noisy step


def measurement_from_run(path: str | os.PathLike) -> Measurement:
    """The run at ``path`` as a measurement (raises :class:`ConfigError` when it measured too little)."""
    path = Path(path)
    require(os.path.lexists(path / "config.json"), f"measured={str(path)!r} is not a run directory (no config.json)",
            field="measured", value=str(path))
    run = load_run(path)  # a damaged file: one ConfigError naming it
    events, _ = run.checked_events()  # the run's own ranks; bad lines skipped
    steps = {s: max(t) for s, t in step_times(events).items() if s >= WARMUP_STEPS and t}
    require(len(steps) >= MIN_TIMED_STEPS,
            f"run {path.name} has {len(steps)} timed steps after warm-up; a measurement needs >= {MIN_TIMED_STEPS}",
            field="measured", value=str(path))
    peaks = [memory(events, r).get("cuda_peak_reserved") for r in sorted({e["rank"] for e in events})]
    peak = max((p for p in peaks if p), default=None)
    return Measurement(run.config, step_time_s=statistics.median(steps.values()), peak_memory_bytes=peak,
                       label=f"run {path.name} ({run.config.plan.describe()})", framework=run.config.train.profile.name,
                       source=str(path))


def load_measured(paths: "list[str | os.PathLike]", framework=None) -> list[Measurement]:
    """Measurements from CSV files and run directories, in the order given."""
    out: list[Measurement] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            m = measurement_from_run(p)
            if framework is not None:
                m = priced_under(m, framework)
            out.append(m)
        else:  # a CSV of runs (load_measurements refuses what is not a regular file, in one line)
            out.extend(load_measurements(p, framework))
    return out
