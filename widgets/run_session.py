"""One browser session's runs: the run it launched (or opened to replay) and the events read from it.

The launch, live-run and compare views of one session share a :class:`RunSession` (found from
the session's PlanState by :func:`session_of`). Each session launches and stops only its own
runs: a RunHandle lives here and nowhere global, so two sessions never see each other's runs
unless one deliberately opens the other's run directory.

``poll()`` is the one refresh: it reads the events appended since the last poll (an
:class:`~workbench.rundir.tail.EventTail` over the run directory) and the run's status, and
hands both to every listener. The served app calls it from a periodic callback (every 0.5 s);
tests and notebooks may call it directly.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable

import panel as pn
import param

from workbench import RunConfig
from workbench.rundir import load_run

from workbench.rundir.tail import EventTail

from widgets.state import PlanState

POLL_MS = 500
DEFAULT_RUNS_ROOT = "runs"

Listener = Callable[[list, Any], None]  # (new events, RunStatus or None)


def default_runs_root() -> str:
    """Where the app keeps run directories: ``$WORKBENCH_RUNS`` or ``runs`` in the working directory."""
    return os.environ.get("WORKBENCH_RUNS", DEFAULT_RUNS_ROOT)


class RunSession(param.Parameterized):
    """The current run of one session: launched here (``run`` is its handle) or opened from disk."""

    runs_root = param.String(default=DEFAULT_RUNS_ROOT)
    run_dir = param.String(default="", doc="The run directory shown now ('' before any)")
    config = param.ClassSelector(class_=RunConfig, allow_None=True, default=None)
    replay = param.Boolean(default=False, doc="True: a run directory opened from disk, not launched here")

    def __init__(self, **params: Any):
        params.setdefault("runs_root", default_runs_root())
        super().__init__(**params)
        self.run: Any = None  # workbench.launch.handle.RunHandle of the launched run
        self.runs: list[Any] = []  # every run this session launched (shut down with the session)
        self._tail: EventTail | None = None
        self._listeners: list[Listener] = []
        self._resets: list[Callable[[], None]] = []
        self._callback: Any = None

    # ---- listeners
    def on_events(self, listener: Listener) -> None:
        """``listener(new_events, status)`` after each poll."""
        self._listeners.append(listener)

    def on_reset(self, fn: Callable[[], None]) -> None:
        """``fn()`` when another run is shown (clear the plots)."""
        self._resets.append(fn)

    # ---- which run
    def attach(self, run: Any) -> None:
        """Show a run launched from this session (a RunHandle)."""
        self.run = run
        if run not in self.runs:
            self.runs.append(run)
        self._show(Path(run.path), run.config, replay=False)

    def open(self, run_dir: str | os.PathLike) -> None:
        """Replay a run directory (finished or still running elsewhere) in the same views; no
        control over its processes is taken."""
        path = Path(run_dir)
        if not path.is_absolute() and not path.exists():
            path = Path(self.runs_root) / path
        config = load_run(path).config  # raises when it is no run directory
        self.run = None
        self._show(path, config, replay=True)

    def _show(self, path: Path, config: RunConfig, replay: bool) -> None:
        self._tail = EventTail(path)
        self.param.update(run_dir=str(path), config=config, replay=replay)
        for fn in self._resets:  # after the update: views reset to the new run's config
            fn()
        self.poll()
        self.start_polling()

    # ---- refresh
    def status(self) -> Any:
        return self.run.status() if self.run is not None else None

    def poll(self) -> list:
        """Read new events and the status; tell every listener. Returns the new events."""
        if self._tail is None:
            return []
        new = self._tail.read()
        status = self.status()
        for fn in self._listeners:
            fn(new, status)
        return new

    def start_polling(self, period_ms: int = POLL_MS) -> None:
        """Poll every ``period_ms`` in the served app (a no-op outside a server session)."""
        if self._callback is not None or pn.state.curdoc is None:
            return
        try:
            self._callback = pn.state.add_periodic_callback(self.poll, period=period_ms)
        except Exception:  # noqa: BLE001 - no event loop (plain Python): callers poll() themselves
            self._callback = None

    def stop_polling(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    def shutdown(self) -> None:
        """End every run this session launched (the session is closing)."""
        self.stop_polling()
        for run in self.runs:
            try:
                run.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


_SESSIONS: "weakref.WeakKeyDictionary[PlanState, RunSession]" = weakref.WeakKeyDictionary()


def session_of(state: PlanState) -> RunSession:
    """The RunSession of a PlanState (one per app session), made on first use."""
    s = _SESSIONS.get(state)
    if s is None:
        s = _SESSIONS[state] = RunSession()
    return s
