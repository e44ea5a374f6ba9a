"""Events -> plot data for the run views (launch, live run, compare runs, bandwidth). No UI imports.

These only shape data; reading run directories is :mod:`workbench.rundir.tail`'s (the
incremental tailer :class:`~workbench.rundir.tail.EventTail`, the run listing). The live view
calls these on each batch of *new* events (the tailer reads only the bytes appended since the
last call), so every function here is linear in the batch it is given, and the few that need
the whole history (:class:`RunDigest`) keep a running summary instead of re-reading it. Units
are those of the events (bytes, seconds, bytes/s).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from workbench import RunConfig, estimate_memory
from workbench.predict.comms import BUS_FACTOR, collective_time, group_shape
from workbench.rundir.acceptance import ThresholdResult
from workbench.rundir.compare import Comparison, format_error, format_value
from workbench.rundir.events import event_order
from workbench.rundir.runs_compare import RunsComparison, RunSummary
from workbench.rundir.status import OutcomeTracker, RunOutcome, run_outcome

Event = Mapping[str, Any]
CURVES = ("loss", "tokens_per_s", "mfu", "grad_norm")
# What is marked on the curves. "error": a failure of the run's last attempt; "stop": where an
# attempt was stopped by a signal (the errors that stop raised are part of it, not errors);
# "fault": how an earlier attempt ended, before a restart or resume (workbench.rundir.status).
MARK_KINDS = ("guard", "stop", "fault", "restart", "resume", "error", "checkpoint_rejected")
EVENT_MARKS = ("guard", "fault", "restart", "resume", "checkpoint_rejected")  # marked as they are
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer", "activations")


# --------------------------------------------------------------------------- curves


def step_rows(events: Iterable[Event], rank: int = 0) -> dict[str, list[Any]]:
    """Columns for the curves from ``rank``'s step events (loss and grad norm are global, the
    same on every rank): ``step`` (1-based: the step just completed), ``loss``, ``tokens_per_s``,
    ``mfu`` (NaN when not measured), ``grad_norm``, ``step_time_s``."""
    cols: dict[str, list[Any]] = {k: [] for k in ("step", *CURVES, "step_time_s")}
    for e in events:
        if e.get("kind") != "step" or e.get("rank") != rank:
            continue
        cols["step"].append(int(e["step"]) + 1)
        for k in ("loss", "tokens_per_s", "grad_norm", "step_time_s"):
            cols[k].append(float(e[k]))
        cols["mfu"].append(float("nan") if e.get("mfu") is None else float(e["mfu"]))
    return cols


def run_step_rows(events: Iterable[Event], rank: int = 0) -> dict[str, list[Any]]:
    """:func:`step_rows` of the run as it stands: at each resume (to the checkpoint after ``k``
    steps) the rows past step ``k`` that the lost attempt ran are dropped, so that a resumed run's
    curve runs once through its steps, as the live view draws it."""
    cols: dict[str, list[Any]] = {k: [] for k in ("step", *CURVES, "step_time_s")}
    part: list[Event] = []

    def flush() -> None:
        for k, v in step_rows(part, rank).items():
            cols[k].extend(v)
        part.clear()

    for e in events:
        if e.get("kind") == "resume" and e.get("rank") == rank and isinstance(e.get("step"), int):
            flush()
            keep = [i for i, s in enumerate(cols["step"]) if s <= e["step"]]
            for k in cols:
                cols[k] = [cols[k][i] for i in keep]
        part.append(e)
    flush()
    return cols


def marker_label(e: Event) -> str:
    """One line for an event marked on the curves."""
    kind = e["kind"]
    if kind == "guard":
        return f"guard {e['guard']}: {e.get('message', '')}".strip()
    if kind == "fault":
        detail = f": {e['detail']}" if e.get("detail") else ""
        return f"fault of attempt {e.get('attempt')} ({e.get('cause')}){detail}"
    if kind == "restart":
        return f"restart: attempt {e.get('attempt')}"
    if kind == "resume":
        return f"resume at step {e.get('step')} from {Path(str(e.get('path'))).name if e.get('path') else 'scratch'}"
    if kind == "checkpoint_rejected":
        return f"checkpoint rejected: {e.get('reason', '')}"
    return f"error on rank {e.get('rank')}: {e.get('error', '')}"


def stop_label(step: int, echoes: Sequence[int]) -> str:
    """The mark of a stopped attempt, naming the ranks whose lost connection was part of it."""
    text = f"stopped at step {step} by a signal (Stop, Ctrl-C or a scheduler)"
    if echoes:
        who = ", ".join(str(r) for r in echoes)
        text += f"; rank{'s' if len(echoes) > 1 else ''} {who} then lost the connection: part of the stop"
    return text


def markers(events: Iterable[Event], world_size: int | None = None,
            outcome: RunOutcome | None = None) -> dict[str, list[Any]]:
    """Every mark of the run so far, from its whole history (a later event can change what an
    earlier one was: a stop explains a peer's error, a resume makes an attempt's failure a fault
    of the past): columns ``step`` (the curves' x), ``kind`` (:data:`MARK_KINDS`), ``label``,
    ``rank``, in time order. Errors are classified by :func:`workbench.rundir.status.run_outcome`
    (``outcome``, when the caller has it): only the last attempt's failures are errors; each stop is
    one "stop" mark; the faults a resume writes for a stopped attempt are that stop, not faults.
    Events every rank writes (restart, resume, fault) are kept once, from the lowest rank."""
    events = [e for e in events if isinstance(e, Mapping)]
    if outcome is None:
        outcome = run_outcome(events, world_size)
    stopped = {s.attempt for s in outcome.stops}
    found: list[tuple[float, int, str, str, Any]] = []  # (t, step, kind, label, rank)
    for s in outcome.stops:
        found.append((s.t, s.step, "stop", stop_label(s.step, s.echoes), s.ranks[0] if s.ranks else None))
    faults = {(e.get("rank"), e.get("attempt")) for e in events if e.get("kind") == "fault"}
    for m in outcome.errors:
        if m.role == "failure":
            found.append((m.t, m.step, "error", f"error on rank {m.rank}: {m.text}", m.rank))
        elif m.role == "earlier" and (m.rank, m.attempt) not in faults:  # its fault event says it otherwise
            found.append((m.t, m.step, "fault", f"error on rank {m.rank} in attempt {m.attempt} (recovered by the "
                                                f"next attempt): {m.text}", m.rank))
    seen: set[tuple] = set()
    for e in sorted(events, key=event_order):
        kind = e.get("kind")
        if kind not in EVENT_MARKS:
            continue
        if kind == "fault" and e.get("attempt") in stopped and e.get("cause") in ("interrupted", "error"):
            continue  # the stop's own mark says it
        step = e.get("step")
        if step is None:
            step = (e.get("last_step") or 0) if kind == "fault" else 0
        # every rank writes restarts, resumes and faults of one attempt: mark each once
        key = (kind, step, e.get("attempt"), e.get("guard"))
        if key in seen:
            continue
        seen.add(key)
        t = e.get("t", 0.0)
        found.append((t if isinstance(t, (int, float)) else 0.0, int(step) + (1 if kind in ("guard", "fault") else 0),
                      kind, marker_label(e), e.get("rank")))
    found.sort(key=lambda f: f[0])  # stable: events of one time keep their order
    return {"step": [f[1] for f in found], "kind": [f[2] for f in found], "label": [f[3] for f in found],
            "rank": [f[4] for f in found]}


# --------------------------------------------------------------------------- pipeline


def pipeline_actions(events: Iterable[Event], step: int | None = None) -> tuple[int | None, list[dict[str, Any]]]:
    """Measured actions of one step (default: the last step every pipeline rank reported), as the
    records :meth:`widgets.PipelineView.show_measured` draws: ``rank`` is the pipeline rank, times
    in seconds from the step's first window start. Of the data-parallel replicas of a pipeline
    rank, the lowest global rank is drawn."""
    by_step: dict[int, dict[int, Event]] = defaultdict(dict)
    pp_ranks: set[int] = set()
    for e in events:
        if e.get("kind") != "pipeline":
            continue
        pp_ranks.add(e["pp_rank"])
        cur = by_step[e["step"]].get(e["pp_rank"])
        if cur is None or e["rank"] < cur["rank"]:
            by_step[e["step"]][e["pp_rank"]] = e
    complete = [s for s, d in by_step.items() if len(d) == len(pp_ranks)]
    if step is None:
        if not complete:
            return None, []
        step = max(complete)
    chosen = by_step.get(step, {})
    if not chosen:
        return step, []
    t0 = min(e["window"][0] for e in chosen.values())
    out = []
    for pp_rank, e in sorted(chosen.items()):
        for kind, stage, mb, start, end in e["actions"]:
            out.append({"rank": pp_rank, "stage": int(stage), "microbatch": int(mb), "kind": str(kind),
                        "start": start - t0, "end": end - t0})
    return step, out


# --------------------------------------------------------------------------- memory


def memory_rows(events: Iterable[Event], config: RunConfig | None) -> list[dict[str, Any]]:
    """Per rank, each component measured (the latest memory event; activations: the largest
    peak seen) and predicted (the planner's bill for that rank's pipeline stage)."""
    latest: dict[int, dict[str, int]] = {}
    for e in events:
        if e.get("kind") != "memory":
            continue
        d = latest.setdefault(e["rank"], {"activations": 0})
        for k in ("parameters", "gradients", "optimizer"):
            d[k] = int(e[k])
        d["activations"] = max(d["activations"], int(e["activations"]))
        d["step"] = int(e["step"])
    predicted = {}
    if config is not None:
        try:
            predicted = {r.rank: r.components for r in estimate_memory(config).per_rank}
        except Exception:  # noqa: BLE001 - a config the planner rejects still shows its measurements
            predicted = {}
    rows = []
    for rank in sorted(latest):
        row: dict[str, Any] = {"rank": rank, "step": latest[rank]["step"]}
        for k in MEMORY_COMPONENTS:
            row[k] = latest[rank][k]
            row[f"{k}_predicted"] = predicted.get(rank, {}).get(k)
        row["total"] = sum(latest[rank][k] for k in MEMORY_COMPONENTS)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- communication


def link_peak(config: RunConfig, dim: str) -> tuple[str, float | None]:
    """The slowest link tier ``dim``'s groups cross and that link's bandwidth (bytes/s, per GPU
    each way): the ceiling of the group's bus bandwidth. (None, None) for an unknown dim."""
    try:
        _, tier, _ = group_shape(config.plan, dim, config.cluster)
        return tier, config.cluster.link(tier).bandwidth_bytes_per_s
    except Exception:  # noqa: BLE001 - "world", "other": no single plan dimension
        return "", None


class CommAccumulator:
    """Running totals per (dim, op) over the collectives of one rank (default: every rank,
    averaged per rank): calls, bytes (S), seconds, and bytes-weighted bus bandwidth, per step.
    Single-element bookkeeping calls and receive halves of point-to-point are left out, as in
    :func:`workbench.rundir.analysis.collective_bytes`."""

    def __init__(self, rank: int | None = None):
        self.rank = rank
        self._tot: dict[tuple[str, str], dict[str, float]] = {}
        self._steps: set[tuple[int, int]] = set()

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            if e.get("kind") != "collectives" or (self.rank is not None and e.get("rank") != self.rank):
                continue
            self._steps.add((e["rank"], e["step"]))
            for c in e["calls"]:
                if c.get("scalar") or c.get("dir") == "recv":
                    continue
                d = self._tot.setdefault((c["dim"], c["op"]),
                                         {"calls": 0, "bytes": 0.0, "time_s": 0.0, "bus_bytes": 0.0})
                dt = (c["end"] - c["start"]) if c.get("end") is not None else 0.0
                d["calls"] += 1
                d["bytes"] += c["bytes"]
                d["time_s"] += dt
                # busbw x t = S x bus factor: sum it and t, divide at the end (a time-weighted mean)
                d["bus_bytes"] += c.get("busbw", 0.0) * dt

    def rows(self, config: RunConfig | None = None) -> list[dict[str, Any]]:
        """Per (dim, op): ``calls``, ``bytes``, ``time_s`` per step and rank, ``busbw`` (bytes/s) and
        the link's peak (``peak``, ``tier``) when the dim is a plan dimension of ``config``."""
        n = max(1, len(self._steps))
        out = []
        for (dim, op), d in sorted(self._tot.items()):
            tier, peak = link_peak(config, dim) if config is not None else ("", None)
            out.append({"dim": dim, "op": op, "calls": d["calls"] / n, "bytes": d["bytes"] / n,
                        "time_s": d["time_s"] / n, "busbw": d["bus_bytes"] / d["time_s"] if d["time_s"] > 0 else 0.0,
                        "tier": tier, "peak": peak})
        return out


# --------------------------------------------------------------------------- experts, checkpoints, step times


def add_expert_counts(acc: dict[int, tuple[list[list[int]], set[int]]], events: Iterable[Event]) -> None:
    """Fold step events' ``tokens_per_expert`` into ``acc[step] = (layer x expert sums, ranks)``."""
    for e in events:
        tpe = e.get("tokens_per_expert") if e.get("kind") == "step" else None
        if not tpe:
            continue
        matrix, ranks = acc.setdefault(e["step"], ([[0] * len(layer) for layer in tpe], set()))
        ranks.add(e.get("rank"))
        for i, layer in enumerate(tpe):
            if i >= len(matrix):
                matrix.append([0] * len(layer))
            for j, n in enumerate(layer):
                if j < len(matrix[i]):
                    matrix[i][j] += int(n)


def latest_expert_load(acc: Mapping[int, tuple[list[list[int]], set[int]]]) -> tuple[int | None, list[list[int]]]:
    """The latest step that every reporting rank has counted (a step still arriving waits)."""
    if not acc:
        return None, []
    full = max(len(r) for _, r in acc.values())
    step = max(s for s, (_, r) in acc.items() if len(r) == full)
    return step, acc[step][0]


def expert_load(events: Iterable[Event]) -> tuple[int | None, list[list[int]]]:
    """Tokens per expert of the latest step with MoE counts, summed over ranks: (step, matrix of
    local MoE layer x expert). (None, []) for a dense model."""
    acc: dict[int, tuple[list[list[int]], set[int]]] = {}
    add_expert_counts(acc, events)
    return latest_expert_load(acc)


def heatmap_rects(matrix: Sequence[Sequence[float]]) -> dict[str, list[Any]]:
    """Cells of a layer x expert matrix: columns ``expert``, ``layer``, ``tokens``, ``share`` (of
    the layer's tokens; 1/E is perfect balance)."""
    cols: dict[str, list[Any]] = {"expert": [], "layer": [], "tokens": [], "share": []}
    for i, row in enumerate(matrix):
        total = sum(row) or 1
        for j, n in enumerate(row):
            cols["expert"].append(j)
            cols["layer"].append(i)
            cols["tokens"].append(n)
            cols["share"].append(n / total)
    return cols


def checkpoint_rows(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Checkpoint phases as a timeline, one row per (step, phase): bytes summed over ranks for
    per-rank phases (staged, written, loaded), the longest duration, and when it happened
    (the earliest ``t``)."""
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for e in events:
        if e.get("kind") != "checkpoint":
            continue
        key = (int(e["step"]), e["phase"])
        r = rows.setdefault(key, {"step": key[0], "phase": key[1], "bytes": 0, "duration_s": 0.0, "t": e["t"],
                                  "ranks": 0, "mode": e.get("mode", "sync")})
        per_rank = key[1] in ("staged", "written", "loaded")
        r["bytes"] = r["bytes"] + int(e.get("bytes", 0)) if per_rank else max(r["bytes"], int(e.get("bytes", 0)))
        r["duration_s"] = max(r["duration_s"], float(e.get("duration_s", 0.0)))
        r["t"] = min(r["t"], e["t"])
        r["ranks"] += 1
    return sorted(rows.values(), key=lambda r: (r["t"], r["step"]))


# The checkpoint timeline's kinds, in lane order, and the phases (or event kinds) each is drawn from:
# "saved" when every rank's files are written, then committed (rank 0: hashes, marker, rename),
# verified (checked after the commit, or before a load), loaded (on a resume), rejected (failed
# its check on load) and failed (could not be written).
TIMELINE_KINDS: dict[str, str] = {"saved": "written", "committed": "committed", "verified": "verified",
                                  "loaded": "loaded", "rejected": "checkpoint_rejected", "failed": "failed"}


def checkpoint_timeline(events: Iterable[Event]) -> dict[str, dict[str, list[Any]]]:
    """Checkpoints on the curves' step axis: per kind of :data:`TIMELINE_KINDS`, columns ``step``
    (the checkpoint's step: the state after that many steps, the curves' x), ``lane`` (the kind,
    the timeline's row) and ``label`` (one line: bytes, duration, why for a rejection), one point
    per checkpoint and kind (a verify after the save and another before a load are one point)."""
    out: dict[str, dict[str, list[Any]]] = {k: {"step": [], "lane": [], "label": []} for k in TIMELINE_KINDS}
    phase_kind = {v: k for k, v in TIMELINE_KINDS.items()}
    for r in checkpoint_rows(events):
        kind = phase_kind.get(r["phase"])
        if kind is None or kind == "rejected":
            continue
        what = [f"{r['bytes']:,} B"] if r["bytes"] else []
        if r["duration_s"]:
            what.append(f"{r['duration_s']:.3f} s")
        if kind == "saved":
            what.append(f"{r['ranks']} rank{'s' if r['ranks'] != 1 else ''}")
        _add_point(out[kind], r["step"], kind, f"step-{r['step']} {kind}" + (f" ({', '.join(what)})" if what else ""))
    seen: set[int] = set()
    for e in events:
        if e.get("kind") == "checkpoint_rejected" and isinstance(e.get("step"), int) and e["step"] not in seen:
            seen.add(e["step"])
            then = f"; loaded {Path(str(e['fallback'])).name} instead" if e.get("fallback") else ""
            _add_point(out["rejected"], e["step"], "rejected", f"step-{e['step']} rejected: {e.get('reason', '')}{then}")
    return out


def _add_point(cols: dict[str, list[Any]], step: int, lane: str, label: str) -> None:
    if step in cols["step"]:
        return
    cols["step"].append(int(step))
    cols["lane"].append(lane)
    cols["label"].append(label)


def step_time_rows(events: Iterable[Event]) -> dict[str, list[Any]]:
    """Per step, the distribution of per-rank step times: columns ``step`` (1-based), ``p50``,
    ``p95``, ``max``, ``min``, ``slowest`` (rank). From rank 0's ``step_stats`` when the trainer
    writes them; else from every rank's step events, for the steps all ranks have reported
    (see :class:`StepTimes` for the incremental form)."""
    acc = StepTimes()
    acc.add(events)
    return acc.take()


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, as :func:`workbench.rundir.analysis.stragglers` takes it."""
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class StepTimes:
    """Incremental :func:`step_time_rows`: ``add`` new events, ``take`` the rows completed since."""

    def __init__(self, world_size: int | None = None):
        self.world_size = world_size
        self._pending: dict[int, dict[int, float]] = defaultdict(dict)
        self._ready: list[tuple[int, list[float], int | None]] = []
        self._done: set[int] = set()
        self._stats = False

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            kind = e.get("kind")
            if kind == "step_stats" and e["step"] not in self._done:
                self._stats = True
                self._done.add(e["step"])
                self._pending.pop(e["step"], None)
                self._ready.append((e["step"], list(e["step_time_s"]), e.get("slowest_rank")))
            elif kind == "run_start" and self.world_size is None:
                self.world_size = e.get("world_size")
            elif kind == "step" and not self._stats and e["step"] not in self._done:
                d = self._pending[e["step"]]
                d[e["rank"]] = float(e["step_time_s"])
                if self.world_size and len(d) >= self.world_size:
                    self._done.add(e["step"])
                    del self._pending[e["step"]]
                    ts = [d[r] for r in sorted(d)]
                    self._ready.append((e["step"], ts, sorted(d)[max(range(len(ts)), key=ts.__getitem__)]))
        if self.world_size is None:  # no run_start seen: take what is there
            for s in sorted(self._pending):
                d = self._pending.pop(s)
                ts = [d[r] for r in sorted(d)]
                self._done.add(s)
                self._ready.append((s, ts, sorted(d)[max(range(len(ts)), key=ts.__getitem__)]))

    def forget_from(self, step: int) -> None:
        """A resume runs steps ``step``, ``step + 1``, ... (0-based) again: take them anew."""
        self._done = {s for s in self._done if s < step}
        self._ready = [r for r in self._ready if r[0] < step]
        for s in [s for s in self._pending if s >= step]:
            del self._pending[s]

    def take(self) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = {k: [] for k in ("step", "p50", "p95", "max", "min", "slowest")}
        for step, ts, slowest in sorted(self._ready):
            xs = sorted(ts)
            cols["step"].append(step + 1)
            cols["p50"].append(statistics.median(xs))
            cols["p95"].append(_percentile(xs, 0.95))
            cols["max"].append(xs[-1])
            cols["min"].append(xs[0])
            cols["slowest"].append(slowest if slowest is not None else max(range(len(ts)), key=ts.__getitem__))
        self._ready = []
        return cols


# --------------------------------------------------------------------------- status


def status_rows(status: Any, outcome: RunOutcome | None = None) -> list[dict[str, Any]]:
    """A RunStatus as table rows: one per rank with its node's host and state. With the run
    directory's ``outcome`` (:func:`workbench.rundir.status.run_outcome`), a rank the driver saw
    fail but whose error was part of a stop reads "stopped", with the outcome's why."""
    hosts = {n.node: n.host for n in status.nodes}
    judged = {r.rank: r for r in outcome.ranks} if outcome is not None else {}
    rows = []
    for r in status.ranks:
        state, why = r.state, r.why
        o = judged.get(r.rank)
        if o is not None and state == "failed" and o.state == "stopped":
            state, why = o.state, o.why
        rows.append({"node": r.node, "host": hosts.get(r.node, ""), "rank": r.rank, "state": state,
                     "step": "" if r.step is None else r.step + 1, "loss": "" if r.loss is None else f"{r.loss:.4f}",
                     "events": r.events, "why": why})
    return rows


def outcome_rows(outcome: RunOutcome) -> list[list[Any]]:
    """The run directory's own status table: rank, state, steps completed, why."""
    return [[r.rank, r.state, r.step, r.why] for r in outcome.ranks]


# --------------------------------------------------------------------------- the running digest


@dataclass
class RunDigest:
    """Everything the live view shows, kept up to date from batches of new events. ``add``
    returns the *new* curve and step-time rows (to stream into the plots), the steps a resume went
    back to, and the marks when they changed (they are derived from the whole history: a later
    event can change what an earlier one was); the rest is current state."""

    config: RunConfig | None = None
    events: int = 0
    last_step: int | None = None
    run_end: dict[int, str] = field(default_factory=dict)  # rank -> status
    errors: list[str] = field(default_factory=list)  # every error line as written (see failures())
    comm: CommAccumulator = field(default_factory=CommAccumulator)
    step_times: StepTimes = field(default_factory=StepTimes)
    tracker: OutcomeTracker = field(default_factory=OutcomeTracker)
    _memory: list[dict[str, Any]] = field(default_factory=list)
    _pipeline: dict[int, dict[int, Event]] = field(default_factory=lambda: defaultdict(dict))
    _pp_ranks: set[int] = field(default_factory=set)
    _experts: dict[int, tuple[list[list[int]], set[int]]] = field(default_factory=dict)
    _checkpoints: list[Event] = field(default_factory=list)
    _marks: dict[str, list[Any]] | None = None

    def add(self, events: Sequence[Event]) -> dict[str, Any]:
        """Fold a batch in. A batch holding a resume should begin with it (the live view splits
        its batches there): the rows it returns are then all of the resumed attempt."""
        self.events += len(events)
        self.comm.add(events)
        for e in events:
            if e.get("kind") == "resume" and isinstance(e.get("step"), int):
                self.step_times.forget_from(e["step"])
        self.step_times.add(events)
        resumed: list[int] = []
        for e in events:
            kind = e.get("kind")
            if kind == "memory":
                self._memory.append(e)
            elif kind == "pipeline":
                self._pp_ranks.add(e["pp_rank"])
                cur = self._pipeline[e["step"]].get(e["pp_rank"])
                if cur is None or e["rank"] < cur["rank"]:
                    self._pipeline[e["step"]][e["pp_rank"]] = e
            elif kind in ("checkpoint", "checkpoint_rejected"):
                self._checkpoints.append(e)
            elif kind == "run_end":
                self.run_end[e["rank"]] = e.get("status", "")
            elif kind == "error":
                self.errors.append(f"rank {e.get('rank')}: {e.get('error', '')}")
            elif kind == "resume" and isinstance(e.get("step"), int):
                resumed.append(e["step"])
            elif kind == "step" and e.get("rank") == 0:
                self.last_step = int(e["step"]) + 1
        if len(self._memory) > 4 * 64:  # keep the latest per rank and each rank's peak activations
            self._memory = _compact_memory(self._memory)
        add_expert_counts(self._experts, events)
        if len(self._experts) > 8:  # keep the latest steps only
            for s in sorted(self._experts)[:-4]:
                del self._experts[s]
        if len(self._pipeline) > 8:  # keep the latest steps only
            for s in sorted(self._pipeline)[:-4]:
                del self._pipeline[s]
        changed = self.tracker.add(events) or any(e.get("kind") == "checkpoint_rejected" for e in events)
        if changed:
            self._marks = None
        return {"curves": step_rows(events), "step_times": self.step_times.take(), "resumed": resumed,
                "markers": self.marks() if changed else None}

    def outcome(self) -> RunOutcome:
        """How the run stands (:func:`workbench.rundir.status.run_outcome`), from what was read."""
        if self.config is not None and self.tracker.world_size is None:
            self.tracker.world_size = self.config.world_size
        return self.tracker.outcome()

    def failures(self) -> list[str]:
        """The run's errors: its last attempt's, less those a stop raised."""
        return [f"rank {m.rank}: {m.text}" if not m.text.startswith(f"rank {m.rank}:") else m.text
                for m in self.outcome().failures]

    def marks(self) -> dict[str, list[Any]]:
        """Every mark on the curves now (:func:`markers`)."""
        if self._marks is None:
            rejected = [e for e in self._checkpoints if e.get("kind") == "checkpoint_rejected"]
            self._marks = markers(self.tracker.events + rejected, outcome=self.outcome())
        return self._marks

    def pipeline(self) -> tuple[int | None, list[dict[str, Any]]]:
        events = [e for d in self._pipeline.values() for e in d.values()]
        return pipeline_actions(events)

    def memory(self) -> list[dict[str, Any]]:
        return memory_rows(self._memory, self.config)

    def comm_rows(self) -> list[dict[str, Any]]:
        return self.comm.rows(self.config)

    def experts(self) -> tuple[int | None, list[list[int]]]:
        return latest_expert_load(self._experts)

    def checkpoints(self) -> list[dict[str, Any]]:
        return checkpoint_rows(self._checkpoints)

    def checkpoint_timeline(self) -> dict[str, dict[str, list[Any]]]:
        return checkpoint_timeline(self._checkpoints)


def _compact_memory(mem: list[Event]) -> list[Event]:
    last: dict[int, Event] = {}
    peak: dict[int, Event] = {}
    for e in mem:
        last[e["rank"]] = e
        if e["rank"] not in peak or e["activations"] > peak[e["rank"]]["activations"]:
            peak[e["rank"]] = e
    return [peak[r] for r in peak] + [last[r] for r in last]


# --------------------------------------------------------------------------- comparing, bandwidth

SAME_LINEAGE = "same data, model, code, packages, cluster and profile"


def comparison_rows(comparison: Comparison) -> list[dict[str, Any]]:
    """A :class:`workbench.rundir.compare.Comparison` as rows with formatted numbers."""
    # the CLI's formatters (Comparison.format), so the page and the terminal agree
    return [{"section": r.section, "name": r.name, "rank": r.rank, "predicted": format_value(r.predicted, r.unit),
             "measured": format_value(r.measured, r.unit), "error": format_error(r), "how": r.how}
            for r in comparison.rows]


def acceptance_rows(verdicts: Sequence[ThresholdResult]) -> list[dict[str, str]]:
    """:class:`~workbench.rundir.acceptance.ThresholdResult` verdicts as rows: status ("pass",
    "fail", "not measured"), the threshold as declared, the measured value (4 significant
    digits, "-" when not measured) and how it was measured."""
    return [{"status": v.status, "threshold": str(v.threshold),
             "measured": "-" if v.measured is None else f"{v.measured:.4g}", "how": v.how} for v in verdicts]


def lineage_lines(comparison: RunsComparison) -> list[str]:
    """What differs between the inputs of two runs (:class:`~workbench.rundir.runs_compare.RunsComparison`),
    one line per differing lineage leaf ("data.sha256: 3f2a... -> 9c1b..."), then its notes (a run
    without a lineage); :data:`SAME_LINEAGE` alone when the two have the same inputs."""
    lines = [d.describe() for d in comparison.lineage] + list(comparison.notes)
    return lines or [SAME_LINEAGE]


def summary_rows(comparison: RunsComparison) -> list[list[str]]:
    """Two runs' summaries side by side, as rows ``[quantity, A, B]`` formatted as the
    predicted-vs-measured tables format them (:func:`workbench.rundir.compare.format_value`); the
    last row is the largest relative loss difference over the steps both ran (|A - B| / B), in A's
    column."""
    a, b = comparison.a, comparison.b

    def both(fn: Callable[[RunSummary], str]) -> tuple[str, str]:
        return fn(a), fn(b)

    def loss(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    rows = [["plan", *both(lambda s: s.label)],
            ["ranks", *both(lambda s: str(s.world_size))],
            ["steps", *both(lambda s: str(s.steps))],
            ["step time (median)", *both(lambda s: format_value(s.step_time_s, "s"))],
            ["tokens/s per GPU", *both(lambda s: format_value(s.tokens_per_s_per_gpu, ""))],
            ["memory, most loaded rank", *both(lambda s: format_value(s.memory_bytes, "B"))],
            ["final loss", *both(lambda s: loss(s.final_loss))]]
    diff = comparison.loss_diff
    common = len(comparison.common_steps)
    rows.append([f"loss: max relative difference over the {common} step{'s' if common != 1 else ''} both ran",
                 "-" if diff is None else f"{diff:.2e}", ""])
    return rows


def bandwidth_series(results: Any) -> list[dict[str, Any]]:
    """Per (dim, op) of a comms benchmark: measured ``size``/``busbw`` columns and the planner's
    predicted busbw for the same group (``collective_time`` of each size on the results' cluster,
    tier and group size; busbw = S x factor(n) / t)."""
    out = []
    keys = sorted({(r.dim, r.op) for r in results.rows})
    for dim, op in keys:
        rows = results.series(dim, op)
        if not rows:
            continue
        n, tier = rows[0].group_size, rows[0].tier
        sizes = [r.size_bytes for r in rows]
        predicted = []
        for s in sizes:
            try:
                t = collective_time(op, s, n, results.cluster, tier)
                predicted.append(s * BUS_FACTOR[op](n) / t if t > 0 else float("nan"))
            except Exception:  # noqa: BLE001 - an op the planner does not model
                predicted.append(float("nan"))
        out.append({"dim": dim, "op": op, "n": n, "tier": tier, "size": sizes, "busbw": [r.busbw for r in rows],
                    "predicted_busbw": predicted})
    return out
