"""Telemetry: the event schema (``events``) and the run directory (``rundir``). No torch here."""

from .events import EVENT_TYPES, KINDS, EventWriter, read_events, read_rank_events
from .rundir import Run, create_run_dir, load_run

__all__ = ["EVENT_TYPES", "KINDS", "EventWriter", "Run", "create_run_dir", "load_run", "read_events", "read_rank_events"]
