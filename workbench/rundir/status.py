"""How a run stands, read from its events: per attempt and rank, finished, stopped, failed or
running, and every error classified. One place, so that the live view, the compare table and
``workbench compare`` say the same thing about a run.

Why a classification: a stop (the user's Stop button, Ctrl-C, a scheduler's SIGTERM) reaches the
ranks of a job one after another. A rank whose peer has already exited can see the peer's socket
close (gloo: "Connection reset by peer") before its own signal arrives; the trainer waits
``STOP_GRACE_S`` for that signal (``workbench/trainer/train.py``), and when the signal comes later
still, the rank writes an ``error`` event and ``run_end`` "error". That error is the stop's echo,
not a failure. Here an error is part of a stop when, in the same attempt,

1. it says a peer went away (:data:`PEER_LOST`) or that the rank itself was signalled
   (:data:`SIGNALLED`);
2. the attempt was stopped: some rank ended ``run_end`` "interrupted", or said it was signalled;
3. a peer-lost error came after that stop began (its ``t`` not more than :data:`STOP_SKEW_S`
   before the first stopped rank's ``run_end``: a real network failure comes first and the stop
   follows it, torchrun stopping the survivors);
4. no rank of the attempt raised anything else (then the peers' lost connections echo that
   failure, and they stay errors).

Attempts. A resumed or restarted run appends to the same files: each rank's events split into
attempts at its ``run_start`` (with the ``fault`` and ``restart`` events written just before it,
which describe the attempt before). Attempt ``k`` of every rank is the job's ``k``-th start. The
run's state is its last attempt's; errors of earlier attempts are history ("earlier": the resume
or restart after them recovered), and never count as the run's errors once it went on.

A rank without ``run_end`` in the last attempt is running (the events alone cannot tell it from a
rank killed with SIGKILL; the launcher's verdict, :mod:`workbench.launch.outcome`, can).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

Event = Mapping[str, Any]

# How a peer's exit reads in a collective's error (gloo's TCP transport, NCCL, torch's DistError
# family): the trainer's own list (workbench/trainer/train.py) and the exception names.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator",
             "DistBackendError", "DistNetworkError", "DistStoreError")
# How a rank says it was stopped by a signal.
SIGNALLED = ("SIGTERM", "SIGINT", "KeyboardInterrupt", "SignalException", "got signal: 15", "got signal: 2")
STOP_SKEW_S = 0.5  # clocks of two hosts (NTP) and the order two ranks write in
CONTROL_KINDS = frozenset({"run_start", "run_end", "error", "guard", "fault", "restart", "resume"})
OPENS_ATTEMPT = ("fault", "restart", "run_start")
RUN_STATES = ("starting", "running", "finished", "stopped", "failed")


def peer_lost(text: str) -> bool:
    return any(m in text for m in PEER_LOST)


def signalled(text: str) -> bool:
    return any(m in text for m in SIGNALLED)


@dataclass(frozen=True)
class ErrorMark:
    """One ``error`` event, classified: ``role`` is "failure" (the run's error), "stop" (raised by a
    stop: see the module docstring) or "earlier" (an attempt before a resume or restart).
    ``step``: steps the rank had completed (the curves' x)."""

    rank: int
    attempt: int
    step: int
    text: str
    t: float
    role: str


@dataclass(frozen=True)
class StopMark:
    """An attempt ended by a stop: at ``step`` (rank 0's steps completed), from time ``t``."""

    attempt: int
    step: int
    t: float
    ranks: tuple[int, ...]  # the ranks that ended "interrupted" or were signalled
    echoes: tuple[int, ...] = ()  # ranks whose error was the stop's echo


@dataclass(frozen=True)
class RankOutcome:
    """One rank in the last attempt: ``state`` of :data:`RUN_STATES` (not "starting"), ``why`` in
    words, ``step`` its steps completed."""

    rank: int
    state: str
    why: str = ""
    step: int = 0


@dataclass(frozen=True)
class RunOutcome:
    """The run as its events say: ``state`` of :data:`RUN_STATES`, ``why`` in words, ``step`` (rank
    0's steps completed), ``attempts`` (starts seen), per rank of the last attempt, every error
    classified and every stopped attempt."""

    state: str
    why: str = ""
    step: int = 0
    attempts: int = 0
    ranks: tuple[RankOutcome, ...] = ()
    errors: tuple[ErrorMark, ...] = ()
    stops: tuple[StopMark, ...] = ()

    @property
    def failures(self) -> list[ErrorMark]:
        """The run's errors: those of its last attempt that no stop explains."""
        return [e for e in self.errors if e.role == "failure"]

    def describe(self) -> str:
        """One line: "stopped at step 12 (...)"."""
        return f"{self.state} at step {self.step}" + (f" ({self.why})" if self.why else "")


@dataclass
class _Attempt:
    """One rank's events of one attempt, digested."""

    rank: int
    index: int
    events: list[Event] = field(default_factory=list)
    started: bool = False
    step: int = 0
    end: Event | None = None
    errors: list[tuple[Event, int]] = field(default_factory=list)  # (event, steps completed then)
    guard: Event | None = None


def _per_rank(events: Iterable[Event]) -> dict[int, list[Event]]:
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        r = e.get("rank")
        if isinstance(r, int) and not isinstance(r, bool):
            by_rank[r].append(e)
    for evs in by_rank.values():
        evs.sort(key=lambda e: _int(e.get("seq")))  # a hand-built list may lack seq: its order stands
    return by_rank


def _split(rank: int, events: list[Event]) -> list[_Attempt]:
    """A rank's events (seq order) split into attempts; see the module docstring."""
    out = [_Attempt(rank, 0)]
    for e in events:
        kind = e.get("kind")
        cur = out[-1]
        if kind in OPENS_ATTEMPT and cur.started:
            cur = _Attempt(rank, len(out))
            out.append(cur)
        cur.events.append(e)
        if kind == "run_start":
            cur.started = True
            cur.step = max(cur.step, _int(e.get("step")))
        elif kind == "step":
            cur.step = max(cur.step, _int(e.get("step")) + 1)  # written once the step is done
        elif kind == "error":
            cur.errors.append((e, _int(e.get("step")) if e.get("step") is not None else cur.step))
        elif kind == "guard":
            cur.guard = e
        elif kind == "run_end":
            cur.end = e
            cur.step = max(cur.step, _int(e.get("step")))
    return [a for a in out if a.events]


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else 0


def _t(e: Event) -> float:
    t = e.get("t", 0.0)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def _stop_of(index: int, attempts: list[_Attempt]) -> StopMark | None:
    """The stop that ended attempt ``index`` (None: it was not stopped, or something failed in it)."""
    texts = [(a, str(e.get("error", ""))) for a in attempts for e, _ in a.errors]
    if any(not peer_lost(s) and not signalled(s) for _, s in texts):
        return None  # a rank raised something else: the rest is that failure's echo
    stopped = [a for a in attempts if a.end is not None and a.end.get("status") == "interrupted"]
    stopped += [a for a in attempts if all(a is not b for b in stopped)
                and any(signalled(str(e.get("error", ""))) for e, _ in a.errors)]
    if not stopped:
        return None
    t0 = min(_t(a.end) if a.end is not None and a.end.get("status") == "interrupted"
             else min(_t(e) for e, _ in a.errors) for a in stopped)
    for a in attempts:
        for e, _ in a.errors:
            text = str(e.get("error", ""))
            if not signalled(text) and _t(e) < t0 - STOP_SKEW_S:
                return None  # the connection went before any stop: a failure the stop followed
    echoes = tuple(sorted({a.rank for a, s in texts if not signalled(s)} - {a.rank for a in stopped}))
    first = min(attempts, key=lambda a: a.rank)
    return StopMark(index, first.step, t0, tuple(sorted(a.rank for a in stopped)), echoes)


def _rank_state(a: _Attempt, stop: StopMark | None) -> RankOutcome:
    end = a.end
    status = end.get("status") if end is not None else None
    error = str(a.errors[0][0].get("error", "error")) if a.errors else ""
    if stop is not None and (status in ("interrupted", "error") or a.errors):
        if a.rank in stop.echoes:
            return RankOutcome(a.rank, "stopped", "stopped with the job: its connection to a stopped rank "
                                                  f"closed ({_short(error)})", a.step)
        if status == "interrupted" or a.rank in stop.ranks:
            return RankOutcome(a.rank, "stopped", "stopped by a signal (Stop, Ctrl-C or a scheduler)", a.step)
    if status == "ok":
        return RankOutcome(a.rank, "finished", "", a.step)
    if status == "stopped":
        g = a.guard or {}
        why = f"stopped by the {g['guard']} guard: {g.get('message', '')}" if g.get("guard") else "stopped by a guard"
        return RankOutcome(a.rank, "stopped", why.rstrip(": "), a.step)
    if status == "interrupted" and not a.errors:
        return RankOutcome(a.rank, "stopped", "stopped by a signal (Stop, Ctrl-C or a scheduler)", a.step)
    if a.errors:
        return RankOutcome(a.rank, "failed", error, a.step)
    if end is not None:
        return RankOutcome(a.rank, "failed", f"run_end status {status!r}", a.step)
    return RankOutcome(a.rank, "running" if a.started else "starting", "", a.step)


def _short(text: str) -> str:
    """The part of an error line that says a peer went (gloo's lines carry a source path and an
    address first)."""
    for m in PEER_LOST + SIGNALLED:
        if m in text:
            return m
    return text[:80]


def run_outcome(events: Iterable[Event], world_size: int | None = None) -> RunOutcome:
    """How the run whose ``events`` these are stands (see the module docstring). ``world_size``:
    the ranks the run has (default: those with events)."""
    per_rank = {r: _split(r, evs) for r, evs in _per_rank(events).items()}
    if world_size is not None:
        per_rank = {r: a for r, a in per_rank.items() if r < world_size}
    n_attempts = max((len(a) for a in per_rank.values()), default=0)
    if n_attempts == 0:
        return RunOutcome("starting")
    errors: list[ErrorMark] = []
    stops: list[StopMark] = []
    last_stop: StopMark | None = None
    for k in range(n_attempts):
        attempts = [a[k] for a in per_rank.values() if k < len(a)]
        stop = _stop_of(k, attempts)
        if stop is not None:
            stops.append(stop)
        if k == n_attempts - 1:
            last_stop = stop
        for a in attempts:
            for e, step in a.errors:
                role = "stop" if stop is not None else ("earlier" if k < n_attempts - 1 else "failure")
                errors.append(ErrorMark(a.rank, k, step, str(e.get("error", "")), _t(e), role))
    last = [a[-1] for a in per_rank.values() if len(a) == n_attempts]
    ranks = tuple(sorted((_rank_state(a, last_stop) for a in last), key=lambda r: r.rank))
    if world_size is not None:  # a rank of the run with no event in this attempt has not started
        have = {r.rank for r in ranks}
        ranks = tuple(sorted(ranks + tuple(RankOutcome(r, "starting") for r in range(world_size) if r not in have),
                             key=lambda r: r.rank))
    step = ranks[0].step if ranks else 0
    failed = [r for r in ranks if r.state == "failed"]
    if failed:
        first = min((e for e in errors if e.role == "failure"), key=lambda e: e.t, default=None)
        why = first.text if first is not None else f"rank {failed[0].rank}: {failed[0].why}"
        state = "failed"
    elif ranks and all(r.state in ("finished", "stopped") for r in ranks):
        stopped = [r for r in ranks if r.state == "stopped"]
        if not stopped:
            state, why = "finished", ""
        elif last_stop is None:  # a guard
            state, why = "stopped", stopped[0].why
        else:
            state, why = "stopped", "by a signal: the Stop button, Ctrl-C or a scheduler"
            if last_stop.echoes:
                why += f"; {_ranks(last_stop.echoes)} then lost the connection to a stopped rank (part of the stop)"
    elif any(r.state in ("running", "finished", "stopped") for r in ranks):
        state, why = "running", ""
    else:
        state, why = "starting", ""
    return RunOutcome(state, why, step, n_attempts, ranks, tuple(errors), tuple(stops))


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class OutcomeTracker:
    """:func:`run_outcome` kept current from batches of new events, for a live view: it keeps the
    few events that decide the outcome (:data:`CONTROL_KINDS`) and each rank's latest step, so
    a run of any length costs the same per batch. :meth:`add` says whether one of those arrived."""

    def __init__(self, world_size: int | None = None):
        self.world_size = world_size
        self._control: list[Event] = []
        self._last_step: dict[int, Event] = {}
        self._outcome: RunOutcome | None = RunOutcome("starting")

    def add(self, events: Iterable[Event]) -> bool:
        """Fold ``events`` in; True when one of :data:`CONTROL_KINDS` came (marks may change)."""
        changed = False
        for e in events:
            kind = e.get("kind")
            if kind in CONTROL_KINDS:
                self._control.append(e)
                changed = True
                self._outcome = None
            elif kind == "step" and isinstance(e.get("rank"), int):
                self._last_step[e["rank"]] = e
                self._outcome = None  # the steps completed moved
        return changed

    @property
    def events(self) -> list[Event]:
        """The events the outcome is derived from."""
        return self._control + list(self._last_step.values())

    def outcome(self) -> RunOutcome:
        if self._outcome is None:
            self._outcome = run_outcome(self.events, self.world_size)
        return self._outcome
