"""What the planner predicts for a RunConfig, with no torch and no UI.

Reading order: :mod:`.memory` (the bill), :mod:`.comms` (every collective of a step, nccl-tests
conventions), :mod:`.pipeline` (schedules simulated into timelines), :mod:`.perf` (step time,
the one :func:`~.perf.mfu`), :mod:`.advisor` (the plan search), :mod:`.cost` (a run's cost once
failures are counted), :mod:`.references` (published runs the predictions are tested against).
"""
