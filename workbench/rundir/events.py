"""The event schema of a run: one module, one place (DESIGN.md, "the run directory").

Every event is one JSON object on one line of ``events/rank-<r>.jsonl`` and carries

* ``kind``: what happened (one of :data:`KINDS`; later issues add kinds here);
* ``rank``: the global rank that wrote it;
* ``seq``: a per-rank counter from 0 without gaps, so a reader can tell a lost line;
* ``t``: wall-clock seconds (``time.time()``);
* ``step``: the optimizer step, where it applies.

Each kind is a frozen dataclass listing its own fields; :class:`EventWriter` adds the four common
ones. Readers return plain dicts and tolerate fields they do not know (a newer writer) and a torn
last line (a writer still writing, or killed mid-line).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

COMMON_FIELDS = ("kind", "rank", "seq", "t")


@dataclass(frozen=True)
class RunStart:
    """The trainer is up on this rank: what it runs and where."""

    kind = "run_start"
    world_size: int
    mesh: dict[str, int]  # mesh dimension -> degree (degree-1 dims dropped)
    coords: dict[str, int]  # this rank's mesh coordinates (ParallelPlan.rank_coords)
    device: str
    backend: str
    n_params: int  # parameters of the whole model
    n_local_params: int  # elements this rank stores (its shards and stages)
    steps: int
    step: int = 0  # first step to run (> 0 after a resume)


@dataclass(frozen=True)
class Step:
    """One optimizer step. ``loss`` is the global mean cross-entropy (all micro-batches and
    data-parallel ranks), the same number on every rank; ``grad_norm`` the global L2 norm before
    clipping."""

    kind = "step"
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens of the global batch
    tokens_per_s: float
    step_time_s: float
    data_wait_s: float = 0.0
    aux_loss: float | None = None  # MoE load-balancing loss (mean over MoE layers), unscaled
    tokens_per_expert: list[list[int]] | None = None  # per local MoE layer, this rank's tokens
    mfu: float | None = None


@dataclass(frozen=True)
class RunEnd:
    """The run finished on this rank: ``status`` is "ok", "stopped" (a guard fired; the ``guard``
    event says which and why), "error" or "interrupted". ``step``: the next step to run (= steps
    completed since the start of the run, resumes included)."""

    kind = "run_end"
    status: str
    step: int = 0  # last completed step
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Error:
    """A rank raised: which rank, the exception as one line, and the traceback."""

    kind = "error"
    error: str
    traceback: str = ""
    step: int | None = None


# ---------------------------------------------------------------------------- instrumentation
# Kinds written by the trainer's measurements (workbench/trainer/instrument.py and its meters). Calls and actions are batched: one event per
# rank per step holds a list, so a step with hundreds of collectives writes one line, not hundreds
# (each line is flushed: per-call lines would cost more than the calls on a small model).


@dataclass(frozen=True)
class Collectives:
    """Every collective this rank issued in one step. Each call is a dict:

    ``op`` (all_reduce | all_gather | reduce_scatter | all_to_all | send_recv | broadcast),
    ``dim`` (the plan's group dimension whose ranks equal the call's group; "world" or "other"
    when none does), ``group`` (sorted global ranks), ``n`` (group size), ``bytes`` (S by the
    nccl-tests convention of :mod:`workbench.predict.comms`), ``wire_bytes`` (S x bus factor: what this
    rank sends with a ring/pairwise algorithm), ``start``/``end`` (wall-clock seconds; ``end`` is
    when the call completed or, for asynchronous calls, when completion was observed), ``algbw`` and
    ``busbw`` (bytes/s, nccl-tests), ``dir`` ("send"/"recv" for point-to-point), ``api``
    ("c10d" or "functional": DTensor), ``scalar`` (a single-element bookkeeping call: loss, norm).
    ``phase`` is "compute" for calls made inside forward/backward, "step" for the rest."""

    kind = "collectives"
    step: int
    calls: list[dict[str, Any]]


@dataclass(frozen=True)
class PipelineStep:
    """This pipeline rank's actions in one step: ``actions`` are ``[kind, stage, microbatch, start,
    end]`` with kind F (forward), B (full backward), I (input-gradient backward), W (weight-gradient
    backward); ``p2p`` are ``[dir, bytes, start, end]`` pipeline sends/receives. Times are wall-clock
    seconds (on CUDA, device time from CUDA events, anchored to the wall clock at the step start).
    ``bubble_fraction = 1 - busy / window`` with ``window`` the span of ``schedule.step()``; the
    rest of the window is ``wait_s`` (blocked on a neighbour) and the schedule's own work between
    actions (posting transfers, the loss, Python)."""

    kind = "pipeline"
    step: int
    pp_rank: int
    window: list[float]  # [start, end] of schedule.step()
    busy_s: float
    bubble_fraction: float
    actions: list[list[Any]]
    p2p: list[list[Any]] = field(default_factory=list)
    timing: str = "wall"  # "wall" (CPU) or "cuda_events"
    wait_s: float = 0.0  # blocked waiting on pipeline sends/receives (host time)
    # The process's CPU seconds inside the window (CPU runs; None on CUDA). On a core of its own a
    # rank is on the CPU for all of the window it is not blocked: cpu_s ~ window - wait_s. Much
    # less means another process had its core, and that step's timings measure the machine's
    # load, not the schedule (workbench.rundir.analysis drops such steps).
    cpu_s: float | None = None


@dataclass(frozen=True)
class Memory:
    """Measured bytes of this rank, per component of the planner's bill (workbench.predict.memory):
    ``parameters``, ``gradients``, ``optimizer`` from the real tensors' local shards (no padding);
    ``activations``: peak bytes saved for backward (saved-tensor hooks; storages counted once,
    parameters excluded) during the step; the CUDA allocator's peaks on GPU (None on CPU)."""

    kind = "memory"
    step: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    activations_per_microbatch: int = 0  # saved by the first micro-batch's forward alone
    cuda_peak_allocated: int | None = None
    cuda_peak_reserved: int | None = None


@dataclass(frozen=True)
class StepStats:
    """Per-rank step times of one step (written by rank 0), so that stragglers show."""

    kind = "step_stats"
    step: int
    step_time_s: list[float]  # indexed by rank
    slowest_rank: int
    p50_s: float
    p95_s: float
    max_s: float
    min_s: float


@dataclass(frozen=True)
class Guard:
    """A guard of TrainSettings fired: the run stops after this step (with a final checkpoint
    when checkpointing is available). ``guard`` is "nonfinite", "grad_spike" or "min_tokens_per_s"."""

    kind = "guard"
    step: int
    guard: str
    value: float
    threshold: float
    message: str


EVENT_TYPES: dict[str, type] = {
    cls.kind: cls for cls in (RunStart, Step, RunEnd, Error, Collectives, PipelineStep, Memory, StepStats, Guard)
}
KINDS = tuple(EVENT_TYPES)


def events_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "events"


def rank_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return events_dir(run_dir) / f"rank-{rank}.jsonl"


class EventWriter:
    """Appends one JSON line per event to ``events/rank-<rank>.jsonl``, flushed at once.

    ``seq`` continues from the lines already in the file (a restarted rank keeps counting). A
    write that fails raises: events are never dropped silently."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.rank = rank
        self.path = rank_file(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = sum(1 for _ in read_rank_events(run_dir, rank)) if self.path.exists() else 0
        self._file = open(self.path, "a", encoding="utf-8")

    def emit(self, event: Any = None, /, **fields: Any) -> dict[str, Any]:
        """Write ``event`` (a dataclass of this module) or ``kind=..., **fields``; return the record."""
        if event is not None:
            body = asdict(event)
            body["kind"] = type(event).kind
        else:
            body = dict(fields)
            if "kind" not in body:
                raise ValueError("an event needs a kind")
        record = {"kind": body.pop("kind"), "rank": self.rank, "seq": self.seq, "t": time.time()}
        record.update(body)
        line = json.dumps(record, default=_jsonable)
        self._file.write(line + "\n")
        self._file.flush()
        self.seq += 1
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _jsonable(x: Any) -> Any:
    """numpy/torch scalars and tensors as plain Python (no torch import needed here)."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def read_rank_events(run_dir: str | os.PathLike, rank: int, since: int | None = None) -> Iterator[dict[str, Any]]:
    """Events of one rank with ``seq >= since`` (all when None). A torn or unparsable last line
    is skipped (it is still being written); unknown fields are kept as they are."""
    path = rank_file(run_dir, rank)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # torn last line: the writer has not finished it
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if since is None or record.get("seq", 0) >= since:
                yield record


def ranks_of(run_dir: str | os.PathLike) -> list[int]:
    """Ranks that have an events file."""
    d = events_dir(run_dir)
    if not d.exists():
        return []
    out = []
    for p in d.glob("rank-*.jsonl"):
        try:
            out.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out)


def read_events(run_dir: str | os.PathLike, since: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    """Events of every rank, ordered by time. ``since[rank]`` is the next seq wanted from that
    rank (a tailer passes back ``next_seq(events)``)."""
    out: list[dict[str, Any]] = []
    for r in ranks_of(run_dir):
        out.extend(read_rank_events(run_dir, r, (since or {}).get(r)))
    out.sort(key=lambda e: (e.get("t", 0.0), e.get("rank", 0), e.get("seq", 0)))
    return out


def next_seq(events: list[Mapping[str, Any]], since: Mapping[int, int] | None = None) -> dict[int, int]:
    """The ``since`` mapping to pass next time, after having read ``events``."""
    out = dict(since or {})
    for e in events:
        r = e.get("rank")
        if r is not None:
            out[r] = max(out.get(r, 0), int(e.get("seq", -1)) + 1)
    return out


def find_gaps(events: list[Mapping[str, Any]]) -> dict[int, list[int]]:
    """Missing seq numbers per rank (should always be empty)."""
    seen: dict[int, set[int]] = {}
    for e in events:
        seen.setdefault(e["rank"], set()).add(e["seq"])
    return {r: sorted(set(range(min(s), max(s) + 1)) - s) for r, s in seen.items() if len(s) != max(s) - min(s) + 1}


# --------------------------------------------------------------------------- checkpoints, faults, restarts
# (issue 5: workbench/trainer/checkpoint.py writes these)

CHECKPOINT_PHASES = ("started", "staged", "written", "committed", "verified", "loaded", "deleted", "discarded")


@dataclass(frozen=True)
class Checkpoint:
    """One phase of a checkpoint's life. Saving: ``started`` -> ``staged`` (the state dict is
    built; async: copied to CPU, training may go on) -> ``written`` (this rank's files are on disk)
    -> ``committed`` (rank 0: hashes and the commit marker written, directory renamed into place)
    -> ``verified`` (rank 0: the committed files checked). Loading: ``verified`` (every hash
    checked) -> ``loaded``. Retention: ``deleted``; an incomplete ``step-<n>.tmp``: ``discarded``.
    ``bytes``: this rank's state for staged/written/loaded, the whole checkpoint on disk for
    committed/verified/deleted."""

    kind = "checkpoint"
    phase: str
    step: int
    path: str
    bytes: int = 0
    duration_s: float = 0.0
    mode: str = "sync"  # "sync" or "async"


@dataclass(frozen=True)
class CheckpointRejected:
    """A checkpoint failed its integrity check on load: why (one line), and what was used instead."""

    kind = "checkpoint_rejected"
    step: int
    path: str
    reason: str
    fallback: str | None = None  # the checkpoint loaded instead (None: none left, start from 0)


@dataclass(frozen=True)
class Fault:
    """This rank's previous attempt ended abnormally, found when the job starts again.

    ``cause``: "killed" (no run_end and no error: SIGKILL, the OOM killer, a lost node),
    "error" (it raised; ``detail`` is the error), "interrupted" (stopped by a signal or the launcher)."""

    kind = "fault"
    cause: str
    attempt: int  # the attempt that failed (0: the first launch)
    last_step: int | None  # last step it logged (None: none)
    detail: str = ""


@dataclass(frozen=True)
class Restart:
    """torchrun restarted the job (``--max-restarts``): this is attempt ``attempt`` (1, 2, ...)."""

    kind = "restart"
    attempt: int
    max_restarts: int | None = None


@dataclass(frozen=True)
class Resume:
    """Training continues at ``step`` from the checkpoint ``path`` (None: none was good, start at
    0). ``resharded``: saved under another layout or world size; ``notes`` say, one line per piece of
    state, what was restored, resharded or re-derived."""

    kind = "resume"
    step: int
    path: str | None
    saved_plan: str | None = None
    saved_world_size: int | None = None
    resharded: bool = False
    notes: list[str] = field(default_factory=list)


EVENT_TYPES.update({cls.kind: cls for cls in (Checkpoint, CheckpointRejected, Fault, Restart, Resume)})
KINDS = tuple(EVENT_TYPES)
