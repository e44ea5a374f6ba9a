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
    """The run finished on this rank: ``status`` is "ok", "error" or "interrupted"."""

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


EVENT_TYPES: dict[str, type] = {cls.kind: cls for cls in (RunStart, Step, RunEnd, Error)}
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
