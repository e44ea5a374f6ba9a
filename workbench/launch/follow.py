"""Follow a launched run from a terminal (``workbench launch``): print what happens, end it cleanly.

:func:`start_and_follow` starts a run (a launch or a resume) and :func:`follow` watches it to its
end: one line per node whenever its state changes (``node 0 (127.0.0.10): running``), rank 0's
step lines and every error, checkpoint and fault
(:func:`~workbench.launch.local.format_event`), then one final line. The return value is the
exit status of :mod:`~workbench.launch.outcome` (0 done, 1 failed, 3 stopped by a guard, 130 / 143
interrupted by SIGINT / SIGTERM).

SIGINT (Ctrl-C) and SIGTERM stop the run (:meth:`RunHandle.stop`: SIGTERM to every node's
torchrun and ranks, SIGKILL after the run's stop timeout). The kernels are always ended
(:meth:`RunHandle.shutdown`), however the run ends, so nothing is left running. A signal that
comes while the run is still starting (kernels, an allocation in a Slurm queue) stops it as soon
as it has started; a second one interrupts the start itself.

No torch here: this runs in the driver.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from workbench.launch.local import format_event
from workbench.launch.outcome import (EXIT_DONE, EXIT_FAILED, EXIT_GUARD, EXIT_INTERRUPTED, EXIT_TERMINATED,
                                      judge_acceptance, rank_ends)

POLL_S = 0.2  # how often node states and signals are looked at between events
DRAIN_S = 10.0  # how long the last events may take to come in once a stopped run has ended

Stream = Callable[[str], None]


class StopSignals:
    """SIGINT and SIGTERM while a run is followed: noted (``signum``, ``count``), not raised.

    A handler, not KeyboardInterrupt, so that a signal cannot land in the middle of a call to a
    kernel and leave the run half stopped; SIGTERM (a scheduler's, ``kill``'s) must stop the run as
    Ctrl-C does instead of killing only this process. Handlers can only be set on the main thread:
    elsewhere the signals keep their handlers and nothing is noted."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._raise_again = False
        self._old: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        if self._raise_again and self.count > 1:
            raise KeyboardInterrupt  # the user insists: stop waiting for the start

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    @contextmanager
    def second_interrupts(self) -> Iterator[None]:
        """Within: a second signal raises KeyboardInterrupt (a start that waits long, as in a queue)."""
        self._raise_again = True
        try:
            yield
        finally:
            self._raise_again = False


class _EventFeed:
    """``run.events()`` pumped by a thread into a queue: events() blocks until its next batch, and
    the main thread must keep watching node states and signals meanwhile."""

    def __init__(self, run: Any) -> None:
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self.over = False  # every event is in and the run has ended
        threading.Thread(target=self._pump, args=(run,), name="workbench-follow", daemon=True).start()

    def _pump(self, run: Any) -> None:
        try:
            for batch in run.events():
                self._queue.put(batch)
        finally:
            self._queue.put(None)

    def take(self, timeout_s: float) -> list[dict[str, Any]]:
        """The events that arrive within ``timeout_s`` (every batch already waiting, at once)."""
        out: list[dict[str, Any]] = []
        try:
            item = self._queue.get(timeout=timeout_s)
            while True:
                if item is None:
                    self.over = True
                    return out
                out += item
                item = self._queue.get_nowait()
        except queue.Empty:
            return out


class _Printer:
    """The lines of a followed run: node state changes and formatted events."""

    def __init__(self, run: Any, stream: Stream, total_steps: int, skip: int) -> None:
        self.run, self.stream, self.total_steps = run, stream, total_steps
        self.skip = skip  # events of the history from before this follow (a resumed run's earlier attempts)
        self.seen = 0
        self.events: list[dict[str, Any]] = []  # this follow's events, for the verdict
        self.node_states: dict[int, str] = {}

    def print_events(self, batch: list[dict[str, Any]]) -> None:
        for event in batch:
            self.seen += 1
            if self.seen <= self.skip:
                continue
            self.events.append(event)
            line = format_event(event, self.total_steps)
            if line is not None:
                self.stream(line)

    def print_node_changes(self, status: Any) -> None:
        for node in status.nodes:
            if self.node_states.get(node.node) != node.state:
                self.node_states[node.node] = node.state
                self.stream(node_line(node, self._address(node.node)))

    def _address(self, index: int) -> str:
        """The node's rendezvous address (its status names the host, the same for every local node)."""
        nodes = getattr(self.run, "nodes", None) or []
        return next((str(n.addr) for n in nodes if getattr(n, "index", None) == index), "")


def node_line(node: Any, address: str = "") -> str:
    """``node 0 (127.0.0.10): running``, with the host when it is not the address, and why."""
    host = node.host or ""
    where = address or host
    if host and address and host != address:
        where = f"{address} on {host}"
    return f"node {node.node} ({where}): {node.state}" + (f" - {node.why}" if node.why else "")


def verdict(status: Any, events: list[dict[str, Any]], world_size: int, signum: int | None,
            run_dir: str | Path) -> tuple[int, str]:
    """The exit status and the final line of a run that has ended: ``status`` its final
    RunStatus, ``events`` those of this follow, ``signum`` the stop signal received (None: none)."""
    ends = rank_ends(events, world_size)
    step = ends[0].step if ends else 0
    resume = f"resume with: workbench launch --resume {run_dir}"
    if status.state == "finished":
        return EXIT_DONE, f"done: {run_dir} ({step} steps)"
    natural = bool(ends) and all(e.status in ("ok", "stopped") for e in ends)
    guarded = [e for e in ends if e.status == "stopped"]
    if status.state == "stopped" and natural and guarded:  # a guard ended it, whatever came after
        g = next((e.guard for e in guarded if e.guard), None) or {}
        what = f"the {g['guard']} guard" if g.get("guard") else "a guard"
        why = f": {g['message']}" if g.get("message") else ""
        return EXIT_GUARD, f"stopped by {what}{why} (after {step} steps; run: {run_dir})"
    if signum is not None:
        code = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED
        return code, f"interrupted at step {step} ({signal.Signals(signum).name}; run: {run_dir}); {resume}"
    if status.state == "stopped":  # stopped from outside: another driver, or a signal to the ranks
        why = f"; {status.why}" if status.why else ""
        return EXIT_TERMINATED, f"interrupted at step {step} (stopped from outside{why}; run: {run_dir}); {resume}"
    why = status.why or f"the run ended {status.state}"
    return EXIT_FAILED, f"run failed at step {step}: {why} (run: {run_dir}); {resume}"


def follow(run: Any, stream: Stream, total_steps: int, signals: StopSignals | None = None, skip: int = 0) -> int:
    """Print ``run``'s progress until it ends, stop it on SIGINT/SIGTERM, end its kernels, print
    the final line and return the exit status. ``skip``: events of the run's history not to print
    (a resumed run's earlier attempts). ``signals``: the caller's, when it already watches them
    (a signal noted during the start stops the run at once)."""
    if signals is None:
        with StopSignals() as own:
            return follow(run, stream, total_steps, own, skip)
    printer = _Printer(run, stream, total_steps, skip)
    try:
        feed = _EventFeed(run)
        while not feed.over and signals.signum is None:
            printer.print_events(feed.take(POLL_S))
            printer.print_node_changes(run.status())
        if signals.signum is not None and not feed.over:
            stream(f"{signal.Signals(signals.signum).name}: stopping the run (SIGTERM to every node's torchrun and "
                   f"its ranks, SIGKILL after {getattr(run, 'stop_timeout_s', 10.0):g} s)")
            run.stop()
            _drain(feed, printer, DRAIN_S)
    finally:
        status = run.shutdown()  # nothing is left running, however this ended
    printer.print_node_changes(status)
    code, line = verdict(status, printer.events, run.config.world_size, signals.signum, run.path)
    stream(line)
    code, report = judge_acceptance(code, run.path, run.config.train.accept)
    for line in report:
        stream(line)
    return code


def _drain(feed: _EventFeed, printer: _Printer, timeout_s: float) -> None:
    """The events still on their way once the run has been stopped (bounded: a node that cannot
    be reached any more would otherwise keep the stream open)."""
    deadline = time.monotonic() + timeout_s
    while not feed.over and time.monotonic() < deadline:
        printer.print_events(feed.take(POLL_S))


def start_and_follow(start: Callable[[], Any], stream: Stream, total_steps: int,
                     announce: Callable[[Any], str] | None = None, skip: int = 0) -> int:
    """Start a run with ``start()`` (``launch(...)``, or ``run.resume`` of a reopened run: it
    returns the RunHandle) under the stop signals, print ``announce(run)``, then :func:`follow` it
    (``skip``: as there). A signal during the start stops the run as soon as it exists; a second
    one interrupts the start (KeyboardInterrupt)."""
    with StopSignals() as signals:
        with signals.second_interrupts():
            run = start()
        if announce is not None:
            stream(announce(run))
        return follow(run, stream, total_steps, signals, skip)


__all__ = ["StopSignals", "follow", "node_line", "start_and_follow", "verdict"]
