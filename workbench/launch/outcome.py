"""How a local job ended, read from its run directory: one final line and one exit status.

The run directory is the source of truth (DESIGN.md). Each rank's events end with a ``run_end``
whose ``status`` is "ok", "stopped" (a guard fired; a ``guard`` event says which and why), "error"
or "interrupted", and whose ``step`` counts the steps completed; a rank without one was killed.
:func:`judge` joins those with torchrun's exit status and with the signal the launcher itself
received, so that what ``workbench train`` prints last and exits with is what the run directory
says, never a second opinion of the launcher's.

Only the events of this invocation count (a resumed run appends to the same files), and of each
rank only its last attempt (the events after its last ``run_start``: under ``--max-restarts`` an
attempt that failed and was restarted is not the outcome).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from workbench.rundir.acceptance import acceptance_failed, format_results, record_acceptance

# The exit statuses of `workbench train` (also in its --help and in the README). 2 is the CLI's
# status for bad input (ConfigError), 130 and 143 the shells' 128 + signal number.
EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_GUARD = 3
EXIT_ACCEPTANCE = 4
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

EXIT_CODES: dict[int, str] = {
    EXIT_DONE: "done: every rank finished its steps",
    EXIT_FAILED: "failed: a rank raised, was killed, or torchrun failed",
    EXIT_BAD_INPUT: "bad input: one line names the option, nothing was started",
    EXIT_GUARD: "stopped by a guard (non-finite loss, gradient spike, throughput floor)",
    EXIT_ACCEPTANCE: "ran to its end but failed a declared acceptance threshold (--accept)",
    EXIT_INTERRUPTED: "interrupted by SIGINT (Ctrl-C)",
    EXIT_TERMINATED: "terminated by SIGTERM (the job's ranks were stopped)",
}


@dataclass(frozen=True)
class RankEnd:
    """How one rank's last attempt ended: ``status`` of its ``run_end``, None when it has none
    (killed); ``step``: steps completed; ``error``: its ``error`` event's line; ``guard``: the
    ``guard`` event that stopped it."""

    rank: int
    status: str | None
    step: int
    error: str | None = None
    guard: dict[str, Any] | None = None
    started: bool = False  # it wrote any event in this invocation


@dataclass(frozen=True)
class Verdict:
    """The outcome of a job: ``outcome`` is "done", "stopped", "interrupted" or "failed";
    ``line`` the final line to print; ``show_log``: no rank said why it failed, so the tail of
    torchrun's log is the only clue."""

    outcome: str
    exit_code: int
    line: str
    step: int
    show_log: bool = False


def rank_ends(events: Iterable[dict[str, Any]], world_size: int) -> list[RankEnd]:
    """Each rank's end in ``events`` (one invocation's, in seq order per rank), judged by its last
    attempt: the events after its last ``run_start``."""
    per_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world_size)}
    for e in events:
        r = e.get("rank")
        if isinstance(r, int) and r in per_rank:
            if e.get("kind") == "run_start":
                per_rank[r] = []  # a new attempt: what came before is not its outcome
            per_rank[r].append(e)
    return [_rank_end(r, evs) for r, evs in sorted(per_rank.items())]


def _rank_end(rank: int, events: list[dict[str, Any]]) -> RankEnd:
    step, status, error, guard = 0, None, None, None
    for e in events:
        kind = e.get("kind")
        if kind == "run_start":
            step = max(step, int(e.get("step") or 0))
        elif kind == "step":
            step = max(step, int(e.get("step", -1)) + 1)  # a step event is written once the step is done
        elif kind == "error" and error is None:
            error = str(e.get("error", "error"))
        elif kind == "guard":
            guard = e
        elif kind == "run_end":
            status = str(e.get("status"))
            step = max(step, int(e.get("step") or 0))
    return RankEnd(rank, status, step, error, guard, started=bool(events))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ranks(ends: list[RankEnd]) -> str:
    return ("rank " if len(ends) == 1 else "ranks ") + ", ".join(str(e.rank) for e in ends)


def judge(events: Iterable[dict[str, Any]], world_size: int, torchrun_code: int | None, run_dir: str | Path,
          signalled: int | None = None) -> Verdict:
    """The verdict on a job from its events of this invocation, torchrun's exit status (negative:
    killed by that signal) and the stop signal the launcher received (None: none)."""
    ends = rank_ends(events, world_size)
    step = ends[0].step if ends else 0
    log = Path(run_dir) / "torchrun.log"
    natural = bool(ends) and all(e.status in ("ok", "stopped") for e in ends)
    if natural and (torchrun_code == 0 or signalled is not None):  # a signal after the end changed nothing
        guards = [e for e in ends if e.status == "stopped"]
        if guards:
            g = next((e.guard for e in guards if e.guard), None) or {}
            what = f"the {g['guard']} guard" if g.get("guard") else "a guard"
            why = f": {g['message']}" if g.get("message") else ""
            return Verdict("stopped", EXIT_GUARD, f"stopped by {what}{why} (after {step} steps; run: {run_dir})", step)
        return Verdict("done", EXIT_DONE, f"done: {run_dir}", step)
    if signalled is not None:
        code = EXIT_INTERRUPTED if signalled == signal.SIGINT else EXIT_TERMINATED
        killed = [e for e in ends if e.status is None and e.started]
        note = f"; {_ranks(killed)} needed SIGKILL" if killed else ""
        return Verdict("interrupted", code, f"interrupted at step {step} ({_signal_name(signalled)}{note}); "
                                            f"resume with: workbench train --resume {run_dir}", step)
    errors = [e for e in ends if e.error]
    missing = [e for e in ends if e.status is None]
    causes = []
    if torchrun_code is not None and torchrun_code < 0:
        causes.append(f"torchrun was killed by {_signal_name(-torchrun_code)}")
    if errors:
        causes.append(errors[0].error)
    if missing:
        causes.append(f"{_ranks(missing)} left no run_end (killed)")
    if causes:
        return Verdict("failed", EXIT_FAILED, f"job failed: {'; '.join(causes)}; log: {log}", step,
                       show_log=not errors)
    if any(e.status == "interrupted" for e in ends):  # torchrun or the ranks were signalled from outside
        return Verdict("interrupted", EXIT_TERMINATED, f"interrupted at step {step} (the ranks were stopped by a "
                                                       f"signal); resume with: workbench train --resume {run_dir}", step)
    why = ", ".join(f"rank {e.rank} ended {e.status!r}" for e in ends if e.status not in ("ok", "stopped"))
    return Verdict("failed", EXIT_FAILED, f"job failed: torchrun exited with status {torchrun_code}"
                                          f"{' (' + why + ')' if why else ' after every rank had ended'}; log: {log}",
                   step, show_log=True)


def judge_acceptance(exit_code: int, run_dir: str | Path, accept: str) -> tuple[int, list[str]]:
    """A run that ran to its end (done, or stopped by a guard) is judged on its declared acceptance
    thresholds (:func:`workbench.rundir.acceptance.record_acceptance` writes the ``acceptance``
    event): (EXIT_ACCEPTANCE where a done run failed one, else ``exit_code``; the report lines,
    the last naming what failed). A guard stop keeps its status: the guard is the first cause.
    ``accept``: the run's declared thresholds (its config's; none: nothing to judge or write)."""
    if not accept or exit_code not in (EXIT_DONE, EXIT_GUARD):
        return exit_code, []
    results = record_acceptance(run_dir)
    lines = format_results(results)
    if exit_code == EXIT_DONE and acceptance_failed(results):
        failed = ", ".join(str(r.threshold) for r in results if r.status == "fail")
        return EXIT_ACCEPTANCE, lines + [f"failed the declared threshold(s) {failed}: exit status {EXIT_ACCEPTANCE}"]
    return exit_code, lines
