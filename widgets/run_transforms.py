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
from typing import Any, Iterable, Mapping, Sequence

from workbench import RunConfig, estimate_memory
from workbench.predict.comms import BUS_FACTOR, collective_time, group_shape
from workbench.rundir.compare import Comparison, format_error, format_value

Event = Mapping[str, Any]
CURVES = ("loss", "tokens_per_s", "mfu", "grad_norm")
MARK_KINDS = ("guard", "fault", "restart", "resume", "error", "checkpoint_rejected")
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


def markers(events: Iterable[Event]) -> dict[str, list[Any]]:
    """Guards, faults, restarts, resumes, errors and rejected checkpoints: columns ``step``
    (the curves' x), ``kind``, ``label``, ``rank``. Events every rank writes (restart, resume)
    are kept once, from the lowest rank that wrote them."""
    cols: dict[str, list[Any]] = {"step": [], "kind": [], "label": [], "rank": []}
    seen: set[tuple] = set()
    for e in events:
        kind = e.get("kind")
        if kind not in MARK_KINDS:
            continue
        step = e.get("step")
        if step is None:
            step = (e.get("last_step") or 0) if kind == "fault" else 0
        # every rank writes restarts, resumes and faults of one attempt: mark each once
        key = (kind, step, e.get("attempt"), e.get("guard")) if kind != "error" else (kind, step, e.get("rank"))
        if key in seen:
            continue
        seen.add(key)
        cols["step"].append(int(step) + (1 if kind in ("guard", "fault") else 0))
        cols["kind"].append(kind)
        cols["label"].append(marker_label(e))
        cols["rank"].append(e.get("rank"))
    return cols


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


def status_rows(status: Any) -> list[dict[str, Any]]:
    """A RunStatus as table rows: one per rank with its node's host and state."""
    hosts = {n.node: n.host for n in status.nodes}
    return [{"node": r.node, "host": hosts.get(r.node, ""), "rank": r.rank, "state": r.state,
             "step": "" if r.step is None else r.step + 1, "loss": "" if r.loss is None else f"{r.loss:.4f}",
             "events": r.events, "why": r.why} for r in status.ranks]


# --------------------------------------------------------------------------- the running digest


@dataclass
class RunDigest:
    """Everything the live view shows, kept up to date from batches of new events. ``add``
    returns the *new* curve rows (to stream into the plots); the rest is current state."""

    config: RunConfig | None = None
    events: int = 0
    last_step: int | None = None
    run_end: dict[int, str] = field(default_factory=dict)  # rank -> status
    errors: list[str] = field(default_factory=list)
    comm: CommAccumulator = field(default_factory=CommAccumulator)
    step_times: StepTimes = field(default_factory=StepTimes)
    _memory: list[dict[str, Any]] = field(default_factory=list)
    _pipeline: dict[int, dict[int, Event]] = field(default_factory=lambda: defaultdict(dict))
    _pp_ranks: set[int] = field(default_factory=set)
    _experts: dict[int, tuple[list[list[int]], set[int]]] = field(default_factory=dict)
    _checkpoints: list[Event] = field(default_factory=list)

    def add(self, events: Sequence[Event]) -> dict[str, dict[str, list[Any]]]:
        self.events += len(events)
        self.comm.add(events)
        self.step_times.add(events)
        for e in events:
            kind = e.get("kind")
            if kind == "memory":
                self._memory.append(e)
            elif kind == "pipeline":
                self._pp_ranks.add(e["pp_rank"])
                cur = self._pipeline[e["step"]].get(e["pp_rank"])
                if cur is None or e["rank"] < cur["rank"]:
                    self._pipeline[e["step"]][e["pp_rank"]] = e
            elif kind == "checkpoint":
                self._checkpoints.append(e)
            elif kind == "run_end":
                self.run_end[e["rank"]] = e.get("status", "")
            elif kind == "error":
                self.errors.append(f"rank {e.get('rank')}: {e.get('error', '')}")
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
        return {"curves": step_rows(events), "markers": markers(events), "step_times": self.step_times.take()}

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


def _compact_memory(mem: list[Event]) -> list[Event]:
    last: dict[int, Event] = {}
    peak: dict[int, Event] = {}
    for e in mem:
        last[e["rank"]] = e
        if e["rank"] not in peak or e["activations"] > peak[e["rank"]]["activations"]:
            peak[e["rank"]] = e
    return [peak[r] for r in peak] + [last[r] for r in last]


# --------------------------------------------------------------------------- comparing, bandwidth


def comparison_rows(comparison: Comparison) -> list[dict[str, Any]]:
    """A :class:`workbench.rundir.compare.Comparison` as rows with formatted numbers."""
    # the CLI's formatters (Comparison.format), so the page and the terminal agree
    return [{"section": r.section, "name": r.name, "rank": r.rank, "predicted": format_value(r.predicted, r.unit),
             "measured": format_value(r.measured, r.unit), "error": format_error(r)} for r in comparison.rows]


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
