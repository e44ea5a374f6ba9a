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
import math
import os
import re
import reprlib
import sys
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Mapping

from workbench.spec.files import open_regular  # noqa: F401  (the one reader of user and run files; re-exported)

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
    write that fails raises: events are never dropped silently.

    The file may be removed or replaced while the run goes on (a clean-up script, a copy put
    back): the writer would keep appending to the unlinked file, and every later event of this
    rank would be lost without a word. So before each write it compares the open file with the
    path (one ``os.stat``: the device and inode numbers it opened) and, when they differ, opens
    the path anew (appending to a replacement, creating it when gone), warns on stderr, and marks
    the first record of the new file with a ``reopened`` field saying what happened. ``seq`` runs
    on, so readers see the gap."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.rank = rank
        self.path = rank_file(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # max + 1, not a line count: after a reopened file the lines no longer number the events
        last = max((int(e.get("seq", -1)) for e in read_rank_events(run_dir, rank)), default=-1) \
            if self.path.exists() else -1
        self.seq = last + 1
        self._file = open(self.path, "a", encoding="utf-8")
        self._identity = self._opened_identity()

    def _opened_identity(self) -> tuple[int, int]:
        st = os.fstat(self._file.fileno())
        return st.st_dev, st.st_ino

    def _path_changed(self) -> str | None:
        """None while the path is still the file this writer opened, else what happened to it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "removed"
        return None if (st.st_dev, st.st_ino) == self._identity else "replaced by another file"

    def _reopen(self, what: str) -> str:
        """Open the path again after ``what`` happened to it; return the note for the next record."""
        self._file.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+", encoding="utf-8")
        # a replacement without a final newline would tear our first line
        if self._file.tell() > 0:
            self._file.seek(self._file.tell() - 1)
            if self._file.read(1) != "\n":
                self._file.write("\n")
        self._identity = self._opened_identity()
        note = (f"{self.path.name} was {what} while the run wrote it; this writer's events before seq "
                f"{self.seq} went to the old file")
        # one write: ranks share the log, and print() writes its newline apart
        sys.stderr.write(f"[workbench] warning: events file {self.path} was {what}; writing to a new one "
                         f"from seq {self.seq}\n")
        sys.stderr.flush()
        return note

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
        what = self._path_changed()
        if what is not None:
            record["reopened"] = self._reopen(what)
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


# ---------------------------------------------------------------------------- reading
# A run directory is data from elsewhere: another host's copy, a writer killed mid-line, a disk that
# filled up, a hand edit. Every reader (load_run, the tailer, analysis, compare, the UI) takes its
# events through parse_line, which checks each line against the schema above, once, here: a line
# that holds no well-typed event is skipped and counted (in a ReadReport), never raised, so a bad
# line costs one event, not the view. JSON only: nothing from a run directory is unpickled.

MAX_LINE_BYTES = 16 * 2**20  # a longer line is read past in chunks, never held whole in memory
MAX_GAPS_LISTED = 10_000  # per rank: a forged seq of 10**12 must not make find_gaps list them all
RANK_FILE = re.compile(r"rank-(0|[1-9][0-9]{0,8})\.jsonl")  # canonical names only: rank-01 is not rank 1
# The floats that may be NaN or infinite: what a diverging run measures (the "nonfinite" guard fires
# on them). Every other float of the schema is finite, and every integer is a count or index >= 0.
NONFINITE_FIELDS = frozenset({"loss", "grad_norm", "aux_loss", "value"})
_INT_LIMIT = 2**63  # 64-bit, as the writer's numbers are: larger ones overflow float arithmetic
_REAL_LIMIT = 1e300

Check = Callable[[Any], bool]


def _anything(x: Any) -> bool:
    return True


# The predicates take the exact JSON types first (a run's whole history goes through them on every
# read), then the in-memory ones an event built by hand may hold (tuples, numpy floats).
def _is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))  # True is no count


def _is_count(x: Any) -> bool:
    return _is_int(x) and 0 <= x < _INT_LIMIT


def _is_real(x: Any) -> bool:
    if type(x) is float:
        return math.isfinite(x)
    return (_is_int(x) and -_REAL_LIMIT < x < _REAL_LIMIT) or (isinstance(x, float) and math.isfinite(x))


def _is_number(x: Any) -> bool:  # NaN and infinities allowed
    return isinstance(x, float) or (_is_int(x) and -_INT_LIMIT < x < _INT_LIMIT)


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def _is_list(x: Any) -> bool:  # JSON gives lists; events built in memory may hold tuples
    return type(x) is list or isinstance(x, (list, tuple))


def _nullable(check: Check) -> Check:
    return lambda x: x is None or check(x)


def _list_of(item: Check) -> Check:
    def check(x: Any) -> bool:
        if not _is_list(x):
            return False
        for v in x:
            if not item(v):
                return False
        return True
    return check


def _tuple_of(*items: Check) -> Check:
    def check(x: Any) -> bool:
        if not _is_list(x) or len(x) != len(items):
            return False
        for c, v in zip(items, x):
            if not c(v):
                return False
        return True
    return check


def _object_of(required: dict[str, Check], optional: dict[str, Check]) -> Check:
    def check(x: Any) -> bool:
        if not isinstance(x, Mapping):
            return False
        for k, c in required.items():
            if k not in x or not c(x[k]):
                return False
        for k, c in optional.items():
            if k in x and not c(x[k]):
                return False
        return True
    return check


def _check_of(hint: Any, name: str) -> Check:
    """The predicate of one dataclass annotation (int: a count >= 0; float: finite unless ``name``
    is in NONFINITE_FIELDS); a type this reader does not know (a newer writer's) accepts anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        alternatives = [_check_of(a, name) for a in args if a is not type(None)]
        nullable = type(None) in args
        return lambda x: (nullable and x is None) or any(c(x) for c in alternatives)
    if hint is int:
        return _is_count
    if hint is float:
        return _is_number if name in NONFINITE_FIELDS else _is_real
    if hint is str:
        return _is_str
    if hint is bool:
        return _is_bool
    if origin is list or hint is list:
        return _list_of(_check_of(args[0], name) if args else _anything)
    if origin is dict or hint is dict:
        value = _check_of(args[1], name) if len(args) == 2 else _anything
        return lambda x: isinstance(x, Mapping) and all(value(v) for v in x.values())
    return _anything


def _rule_of(annotation: Any, name: str) -> str:
    """The rule of an annotation, in words, for the report of a skipped line."""
    words = {"int": "an integer >= 0", "str": "a string", "bool": "true or false",
             "float": "a number" if name in NONFINITE_FIELDS else "a finite number"}
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|")]
    core = " | ".join(p for p in parts if p != "None")
    if core in words:
        rule = words[core]
    else:
        rule = f"of type {core}" + (" (integers >= 0, finite numbers)" if "int" in core or "float" in core else "")
    return rule + (" or null" if "None" in parts else "")


# The fields the dataclasses type as Any, by what the trainer writes and the analyses read.
_CALL = _object_of(
    {"op": _is_str, "dim": _is_str, "group": _list_of(_is_count), "bytes": _is_count, "start": _is_real,
     "end": _nullable(_is_real)},
    {"n": _is_count, "wire_bytes": _nullable(_is_real), "algbw": _nullable(_is_real), "busbw": _nullable(_is_real),
     "scalar": _is_bool, "dir": _nullable(_is_str), "api": _nullable(_is_str), "phase": _nullable(_is_str)})
NESTED_FIELDS: dict[tuple[str, str], tuple[Check, str]] = {
    ("collectives", "calls"): (_list_of(_CALL), "a list of calls {op, dim, group: [rank], bytes, start, end}"),
    ("pipeline", "actions"): (_list_of(_tuple_of(_is_str, _is_count, _is_count, _is_real, _is_real)),
                              "a list of [kind, stage, microbatch, start, end]"),
    ("pipeline", "p2p"): (_list_of(_tuple_of(_nullable(_is_str), _is_count, _is_real, _nullable(_is_real))),
                          "a list of [dir, bytes, start, end]"),
    ("pipeline", "window"): (_tuple_of(_is_real, _is_real), "[start, end] in seconds"),
}
# The common fields (kind, rank and seq are required; t and step are where they apply).
_COMMON: dict[str, tuple[Check, str]] = {
    "kind": (lambda x: isinstance(x, str) and x != "", "a non-empty string"),
    "rank": (_is_count, "an integer >= 0"),
    "seq": (_is_count, "an integer >= 0"),
    "t": (_is_real, "a finite number"),
    "step": (_nullable(_is_count), "an integer >= 0"),
}
_SCHEMAS: dict[tuple[str, Any], dict[str, tuple[Check, str]]] = {}


def _schema(kind: str) -> dict[str, tuple[Check, str]]:
    """name -> (check, rule) of every field an event of ``kind`` may carry, built once per kind from
    its dataclass; an unknown kind (a newer writer's) has the common fields only."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return _COMMON  # not cached: a file of a million made-up kinds must not grow a cache
    schema = _SCHEMAS.get((kind, cls))
    if schema is None:
        schema = dict(_COMMON)
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation this Python cannot evaluate: typed as Any
            hints = {}
        for name, annotation in getattr(cls, "__annotations__", {}).items():
            rule = NESTED_FIELDS.get((kind, name))
            if rule is None:
                rule = (_check_of(hints.get(name, Any), name), _rule_of(annotation, name))
            schema[name] = rule
        _SCHEMAS[(kind, cls)] = schema
    return schema


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 40, 40, 4, 4, 2


def _json_type(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(x), type(x).__name__)


def fields_problem(record: Any) -> str | None:
    """Why the fields ``record`` carries do not fit the schema of its kind (None: they do). Fields
    it lacks and fields the schema does not name (a newer writer's) are no problem here."""
    if not isinstance(record, Mapping):
        return f"{_json_type(record)}, not an object"
    kind = record.get("kind")
    if not _COMMON["kind"][0](kind):
        return f"kind={_SHORT.repr(kind)} is not a non-empty string"
    schema = _schema(kind)
    for name, value in record.items():
        rule = schema.get(name)
        if rule is not None and not rule[0](value):
            return f"{kind} event's {name}={_SHORT.repr(value)} is not {rule[1]}"
    return None


def event_problem(record: Any, rank: int | None = None) -> str | None:
    """Why ``record`` is not a valid event (None: it is one): an object with ``kind``, ``rank`` and
    ``seq``, every field as the schema types it, of ``rank`` when the file says whose it is."""
    if not isinstance(record, dict):
        return f"{_json_type(record)}, not an object"
    missing = [k for k in ("kind", "rank", "seq") if k not in record]
    if missing:
        return f"no {', '.join(missing)}"
    problem = fields_problem(record)
    if problem is None and rank is not None and record["rank"] != rank:
        problem = f"rank={record['rank']} in the events file of rank {rank}"
    return problem


def parse_line(line: bytes | str | None, rank: int | None = None) -> tuple[dict[str, Any] | None, str]:
    """(the event one line holds, "") or (None, why it holds none). ``None`` stands for a line over
    :data:`MAX_LINE_BYTES` (see :func:`complete_lines`)."""
    if line is None:
        return None, f"longer than {MAX_LINE_BYTES} bytes"
    try:  # UTF-8, as the writer writes: json.loads would guess UTF-16/32 from a junk line's first bytes
        record = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits, nesting too deep
        return None, f"not JSON ({type(e).__name__})"
    problem = event_problem(record, rank)
    return (None, problem) if problem else (record, "")


def parse_event(line: bytes | str | None, rank: int | None = None) -> dict[str, Any] | None:
    """The well-typed event one line holds, or None (see :func:`parse_line` for why)."""
    return parse_line(line, rank)[0]


def os_reason(e: OSError) -> str:
    return e.strerror or str(e)


def complete_lines(f: IO[bytes]) -> Iterator[tuple[bytes | None, int]]:
    """(line, offset after it) of every complete line from ``f``'s position; None in place of a line
    longer than :data:`MAX_LINE_BYTES`, which is read past in chunks, never held. Stops before a
    torn last line: its writer has not finished it (a tailer comes back to it)."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if line.endswith(b"\n"):
            yield line, f.tell()
        elif len(line) <= MAX_LINE_BYTES:
            return  # the end, or a torn last line
        else:
            while not (chunk := f.readline(1 << 20)).endswith(b"\n"):
                if not chunk:
                    return  # an overlong torn line
            yield None, f.tell()


def _printable(name: str) -> str:
    return name if name.isprintable() else ascii(name)


@dataclass
class ReadReport:
    """What a read left out, per events file (named relative to the run directory): lines holding no
    valid event (how many, the first one and why) and files it could not read. The readers fill one
    when given it; :meth:`notes` says it in one line per file."""

    skipped: dict[str, int] = field(default_factory=dict)
    first_problem: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)

    def skip(self, name: str, why: str) -> None:
        self.skipped[name] = self.skipped.get(name, 0) + 1
        self.first_problem.setdefault(name, why)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def notes(self) -> list[str]:
        out = [f"{name}: {why}" for name, why in sorted(self.unreadable.items())]
        for name, n in sorted(self.skipped.items()):
            out.append(f"{name}: {n} line{'s' if n != 1 else ''} skipped, no valid event "
                       f"(first: {self.first_problem[name]})")
        return out


def rank_files(run_dir: str | os.PathLike, report: ReadReport | None = None) -> dict[int, Path]:
    """rank -> its events file, for every ``events/rank-<r>.jsonl`` that is a regular file, by
    rank. Anything else named ``rank-*`` is left out, and named in ``report``."""
    d = events_dir(run_dir)
    try:
        entries = sorted(os.scandir(d), key=lambda entry: entry.name)
    except FileNotFoundError:
        return {}
    except OSError as e:
        if report is not None:
            report.unreadable["events"] = f"cannot be listed ({os_reason(e)})"
        return {}
    out: dict[int, Path] = {}
    for entry in entries:
        match = RANK_FILE.fullmatch(entry.name)
        name = f"events/{_printable(entry.name)}"
        if match is None:
            if entry.name.startswith("rank-") and report is not None:
                report.unreadable[name] = "not an events file name (rank-<n>.jsonl), ignored"
            continue
        try:
            regular = entry.is_file()  # follows a symlink, as the reader will
        except OSError:
            regular = False
        if regular:
            out[int(match.group(1))] = Path(entry.path)
        elif report is not None:
            report.unreadable[name] = "not a regular file, ignored"
    return out


def read_rank_events(run_dir: str | os.PathLike, rank: int, since: int | None = None,
                     report: ReadReport | None = None) -> Iterator[dict[str, Any]]:
    """Valid events of one rank with ``seq >= since`` (all when None). A torn last line is left for
    later (it is still being written); a line that holds no valid event (:func:`parse_line`) is
    skipped and counted in ``report``; unknown fields are kept as they are."""
    path = rank_file(run_dir, rank)
    name = f"events/{path.name}"
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    except OSError as e:
        if report is not None:
            report.unreadable[name] = f"{os_reason(e)}, ignored"
        return
    with f:
        number = 0
        try:
            for line, _ in complete_lines(f):
                number += 1
                event, why = parse_line(line, rank)
                if event is None:
                    if report is not None:
                        report.skip(name, f"line {number}: {why}")
                elif since is None or event["seq"] >= since:
                    yield event
        except OSError as e:  # an I/O error mid-file: what was read stands
            if report is not None:
                report.unreadable[name] = f"read stopped at line {number + 1}: {os_reason(e)}"


def ranks_of(run_dir: str | os.PathLike) -> list[int]:
    """Ranks that have an events file."""
    return sorted(rank_files(run_dir))


def event_order(e: Mapping[str, Any]) -> tuple[Any, ...]:
    """The order events are shown in: by time, then rank and seq."""
    return (e.get("t", 0.0), e.get("rank", 0), e.get("seq", 0))


def read_events(run_dir: str | os.PathLike, since: Mapping[int, int] | None = None,
                report: ReadReport | None = None) -> list[dict[str, Any]]:
    """Valid events of every rank, ordered by time. ``since[rank]`` is the next seq wanted from
    that rank (a tailer passes back ``next_seq(events)``); ``report`` learns what was skipped."""
    out: list[dict[str, Any]] = []
    for r in rank_files(run_dir, report):
        out.extend(read_rank_events(run_dir, r, (since or {}).get(r), report))
    out.sort(key=event_order)
    return out


def next_seq(events: list[Mapping[str, Any]], since: Mapping[int, int] | None = None) -> dict[int, int]:
    """The ``since`` mapping to pass next time, after having read ``events``."""
    out = dict(since or {})
    for e in events:
        r, s = e.get("rank"), e.get("seq")
        if _is_count(r) and _is_count(s):
            out[r] = max(out.get(r, 0), s + 1)
    return out


def find_gaps(events: list[Mapping[str, Any]]) -> dict[int, list[int]]:
    """Missing seq numbers per rank (should always be empty); at most :data:`MAX_GAPS_LISTED` per
    rank, so that a forged seq far ahead costs no memory."""
    seen: dict[int, set[int]] = {}
    for e in events:
        r, s = e.get("rank"), e.get("seq")
        if _is_count(r) and _is_count(s):
            seen.setdefault(r, set()).add(s)
    out: dict[int, list[int]] = {}
    for r, s in seen.items():
        ordered, missing = sorted(s), []
        for a, b in zip(ordered, ordered[1:]):
            missing.extend(range(a + 1, min(b, a + 1 + MAX_GAPS_LISTED - len(missing))))
            if len(missing) >= MAX_GAPS_LISTED:
                break
        if missing:
            out[r] = missing
    return out


# --------------------------------------------------------------------------- checkpoints, faults, restarts
# (issue 5: workbench/trainer/checkpoint.py writes these)

CHECKPOINT_PHASES = ("started", "staged", "written", "committed", "verified", "loaded", "deleted", "discarded",
                     "failed")


@dataclass(frozen=True)
class Checkpoint:
    """One phase of a checkpoint's life. Saving: ``started`` -> ``staged`` (the state dict is
    built; async: copied to CPU, training may go on) -> ``written`` (this rank's files are on disk)
    -> ``committed`` (rank 0: hashes and the commit marker written, directory renamed into place)
    -> ``verified`` (rank 0: the committed files checked). Loading: ``verified`` (every hash
    checked) -> ``loaded``. Retention: ``deleted``; an incomplete ``step-<n>.tmp``: ``discarded``.
    A save that could not be written: ``failed``, with ``reason`` (the path and the cause, one
    line) and ``final`` (the run's last save: the run then ends with an error; an earlier one is
    skipped and training goes on). ``bytes``: this rank's state for staged/written/loaded, the
    whole checkpoint on disk for committed/verified/deleted."""

    kind = "checkpoint"
    phase: str
    step: int
    path: str
    bytes: int = 0
    duration_s: float = 0.0
    mode: str = "sync"  # "sync" or "async"
    reason: str = ""
    final: bool = False


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


@dataclass(frozen=True)
class Acceptance:
    """The declared acceptance thresholds judged when the run ended (issue 17:
    workbench/rundir/acceptance.py writes it, in rank 0's file, after the job): one dict per
    threshold (``threshold``, ``measured``, ``status`` pass / fail / not measured, ``how``) and
    whether any failed."""

    kind = "acceptance"
    step: int | None  # the last step the run logged
    verdicts: list[dict] = field(default_factory=list)
    failed: bool = False


EVENT_TYPES.update({cls.kind: cls for cls in (Checkpoint, CheckpointRejected, Fault, Restart, Resume, Acceptance)})
KINDS = tuple(EVENT_TYPES)
