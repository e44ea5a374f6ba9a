"""The run directory: the contract between the trainer, the launcher and the UI. No torch here.

Reading order: :mod:`.events` (the event schema, writer and reader), :mod:`.record` (create and
load a run directory: :class:`RunRecord`), :mod:`.tail` (incremental event tailer, run listing),
:mod:`.checkpoints` (commit markers, hashes, verify and list, without torch), :mod:`.benchmarks`
(the files the cluster benchmarks leave), :mod:`.status` (how a run stands: finished, stopped,
failed, running; errors a stop raised are part of the stop), :mod:`.analysis` (measured bubbles,
stragglers), :mod:`.compare` (predicted next to measured).
"""

from workbench.rundir.events import EVENT_TYPES, KINDS, EventWriter, read_events, read_rank_events
from workbench.rundir.record import RunRecord, create_run_dir, load_run

__all__ = ["EVENT_TYPES", "KINDS", "EventWriter", "RunRecord", "create_run_dir", "load_run", "read_events", "read_rank_events"]
