"""Damaged run directories: every reader tolerates a bad line (skips it, counts it) or reports a bad
file in one line (a ConfigError naming it; exit code 2 in the CLI), never a traceback or a hang.

One real run (the bundled trainer, pp=2 on 2 gloo ranks, 4 steps) is made once; each case damages a
copy of it in one way and runs ``workbench compare`` (in-process through click's CliRunner; two
cases also as a real subprocess), the API (load_run, read_events, compare_run), the live tailer and
``measurement_from_run`` on it. Each case states what it expects: the exit code and a fragment of
the one line or of the notes that name what was wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from workbench.cli import main
from workbench.rundir.compare import compare_run
from workbench.rundir.events import MAX_LINE_BYTES, ReadReport, read_events
from workbench.rundir.measured import measurement_from_run
from workbench.rundir.record import MAX_JSON_BYTES, load_run
from workbench.rundir.tail import EventTail
from workbench.spec.errors import ConfigError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 4  # 3 timed steps after the warm-up: enough for measurement_from_run


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A real run directory of the bundled trainer: pp=2, 2 ranks, every kind of measurement."""
    root = tmp_path_factory.mktemp("runs")
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "train", "--model", "tiny", "--plan", "pp=2",
                           "--steps", str(STEPS), "--runs", str(root), "--run-id", "ref"],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = root / "ref"
    assert sorted(p.name for p in (path / "events").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    return path


# ---------------------------------------------------------------------------- ways to damage a copy
def rank_path(d: Path, rank: int) -> Path:
    return d / "events" / f"rank-{rank}.jsonl"


def insert_line(rank: int, line: bytes, at: int = 2) -> Callable[[Path], None]:
    """Put ``line`` (a newline added) before line ``at`` (0-based) of the rank's file."""
    def damage(d: Path) -> None:
        lines = rank_path(d, rank).read_bytes().splitlines(keepends=True)
        rank_path(d, rank).write_bytes(b"".join(lines[:at] + [line + b"\n"] + lines[at:]))
    return damage


def edit_event(rank: int, kind: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite the rank's first event of ``kind`` after ``change`` (JSON, NaN/Infinity allowed)."""
    def damage(d: Path) -> None:
        lines = rank_path(d, rank).read_text().splitlines(keepends=True)
        i = next(i for i, ln in enumerate(lines) if json.loads(ln)["kind"] == kind)
        event = json.loads(lines[i])
        change(event)
        lines[i] = json.dumps(event) + "\n"
        rank_path(d, rank).write_text("".join(lines))
    return damage


def set_field(name: str, value) -> Callable[[dict], None]:
    return lambda e: e.__setitem__(name, value)


def drop_field(name: str) -> Callable[[dict], None]:
    return lambda e: e.pop(name)


def first_call_bytes_as_string(e: dict) -> None:
    e["calls"][0]["bytes"] = str(e["calls"][0]["bytes"])


def truncate_last_line(d: Path) -> None:
    data = rank_path(d, 0).read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    rank_path(d, 0).write_bytes(data[:last + (len(data) - last) // 2])


def replace_with(name: str, content: bytes) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        target = d / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        target.write_bytes(content)
    return damage


def make_dir(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        target = d / name
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        target.mkdir()
        (target / "inside").write_text("{}")
    return damage


def make_fifo(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        (d / name).unlink(missing_ok=True)
        os.mkfifo(d / name)  # opening it to read would block until a writer came: it must not be opened
    return damage


def link_to_device(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        (d / name).unlink(missing_ok=True)
        os.symlink("/dev/zero", d / name)  # endless: reading it all would never end
    return damage


def make_huge(name: str, size: int) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        with open(d / name, "ab") as f:
            f.truncate(size)  # sparse: cheap to make, expensive to read whole
    return damage


def remove(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        target = d / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return damage


def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = json.loads((d / "config.json").read_text())
        change(data)
        (d / "config.json").write_text(json.dumps(data))
    return damage


def odd_rank_names(d: Path) -> None:
    (rank_path(d, 1)).rename(d / "events" / "rank-x.jsonl")
    shutil.copy(rank_path(d, 0), d / "events" / "rank--1.jsonl")
    shutil.copy(rank_path(d, 0), d / "events" / "rank-01.jsonl")


def foreign_rank(d: Path) -> None:
    lines = [json.loads(ln) for ln in rank_path(d, 1).read_text().splitlines()]
    rank_path(d, 7).write_text("".join(json.dumps(dict(e, rank=7)) + "\n" for e in lines))


def huge_line_then_valid(d: Path) -> None:
    """A 17 MiB line in the middle: skipped without stopping the lines after it."""
    lines = rank_path(d, 0).read_bytes().splitlines(keepends=True)
    pad = b'{"kind": "step", "rank": 0, "seq": 999, "pad": "' + b"x" * (MAX_LINE_BYTES + 2**20) + b'"}\n'
    rank_path(d, 0).write_bytes(b"".join(lines[:3] + [pad] + lines[3:]))


def events_dir_is_empty(d: Path) -> None:
    shutil.rmtree(d / "events")
    (d / "events").mkdir()


def seq_beyond_float(e: dict) -> None:
    e["seq"] = 10**30  # an integer no float holds: a gap listing to it would never end


# (id, damage, expected exit code, fragments expected in the output: stdout for 0, the line for 2)
EVENT_CASES = [
    ("events-file-is-a-directory", make_dir("events/rank-1.jsonl"), 0,
     ["events/rank-1.jsonl: not a regular file", "rank 1: no events"]),
    ("events-file-is-a-fifo", make_fifo("events/rank-1.jsonl"), 0, ["rank 1: no events"]),
    ("events-file-links-to-a-device", link_to_device("events/rank-1.jsonl"), 0, ["rank 1: no events"]),
    ("binary-junk-line", insert_line(0, b"\x00\xff\xfe\x80junk\x9c"), 0, ["line 3: not UTF-8 text"]),
    ("binary-junk-file", replace_with("events/rank-1.jsonl", bytes(range(256)) * 64), 0, ["rank 1: no events"]),
    ("truncated-last-line", truncate_last_line, 0, ["predicted vs measured"]),
    ("line-is-a-list", insert_line(0, b"[1, 2, 3]"), 0, ["line 3: a list, not an object"]),
    ("line-is-a-number", insert_line(0, b"42"), 0, ["line 3: a number, not an object"]),
    ("line-is-null", insert_line(0, b"null"), 0, ["line 3: null, not an object"]),
    ("line-is-a-string", insert_line(0, b'"step"'), 0, ["a string, not an object"]),
    ("blank-line", insert_line(0, b"   "), 0, ["line 3: not JSON"]),
    ("deep-nesting", insert_line(0, b"[" * 200_000), 0, ["line 3: not JSON"]),
    ("integer-of-5000-digits", insert_line(0, b'{"kind": "step", "rank": 0, "seq": ' + b"9" * 5000 + b"}"), 0,
     ["line 3: not JSON"]),
    ("no-kind", edit_event(0, "memory", drop_field("kind")), 0, ["no kind"]),
    ("no-rank", edit_event(0, "step", drop_field("rank")), 0, ["no rank"]),
    ("no-seq", edit_event(1, "pipeline", drop_field("seq")), 0, ["no seq"]),
    ("seq-a-string", edit_event(0, "step", set_field("seq", "3")), 0, ["seq='3' is not an integer >= 0"]),
    ("seq-a-boolean", edit_event(0, "step", set_field("seq", True)), 0, ["seq=True is not an integer >= 0"]),
    ("seq-beyond-float", edit_event(0, "step", seq_beyond_float), 0, ["is not an integer >= 0"]),
    ("rank-negative", edit_event(0, "run_start", set_field("rank", -1)), 0, ["rank=-1 is not an integer >= 0"]),
    ("rank-of-another-file", edit_event(0, "memory", set_field("rank", 1)), 0,
     ["rank=1 in the events file of rank 0"]),
    ("step-a-list", edit_event(0, "memory", set_field("step", [1])), 0, ["step=[1] is not an integer >= 0"]),
    ("call-bytes-a-string", edit_event(0, "collectives", first_call_bytes_as_string), 0, ["calls="]),
    ("actions-malformed", edit_event(1, "pipeline", set_field("actions", [["F", 0]])), 0, ["actions="]),
    ("loss-the-string-nan", edit_event(0, "step", set_field("loss", "nan")), 0, ["loss='nan' is not a number"]),
    ("loss-null", edit_event(0, "step", set_field("loss", None)), 0, ["loss=None is not a number"]),
    ("step-time-infinite", edit_event(0, "step", set_field("step_time_s", float("inf"))), 0,
     ["step_time_s=inf is not a finite number"]),
    ("t-nan", edit_event(1, "memory", set_field("t", float("nan"))), 0, ["t=nan is not a finite number"]),
    ("memory-bytes-negative", edit_event(0, "memory", set_field("parameters", -5)), 0, ["parameters=-5"]),
    ("huge-line", huge_line_then_valid, 0, [f"line 4: longer than {MAX_LINE_BYTES} bytes"]),
    ("empty-events-dir", events_dir_is_empty, 0, ["ranks 0-1: no events"]),
    ("no-events-dir", remove("events"), 0, ["ranks 0-1: no events"]),
    ("events-is-a-file", replace_with("events", b"{}\n"), 0, ["events: cannot be listed", "ranks 0-1: no events"]),
    ("odd-rank-file-names", odd_rank_names, 0,
     ["events/rank-x.jsonl: not an events file name", "events/rank--1.jsonl", "rank 1: no events"]),
    ("rank-the-run-does-not-have", foreign_rank, 0, ["rank 7: events ignored, the run has 2 ranks"]),
]
# Damage that is no damage: tolerated without a note.
TOLERATED_CASES = [
    ("loss-infinite", edit_event(0, "step", set_field("loss", float("inf"))), 0, []),  # a diverged run measures it
    ("unknown-kind-and-fields", insert_line(0, b'{"kind": "future", "rank": 0, "seq": 2, "t": 1.0, "new": {"a": [1]}}'),
     0, []),
    ("unknown-field-on-a-known-kind", edit_event(0, "step", set_field("future_field", {"x": "y"})), 0, []),
    ("no-manifest", remove("manifest.json"), 0, []),
    ("duplicated-line", insert_line(0, b'{"kind": "run_end", "rank": 0, "seq": 0, "t": 1.0, "status": "ok"}'), 0, []),
]
FILE_CASES = [
    ("config-not-json", replace_with("config.json", b'{"model": '), 2, ["config.json is not valid JSON"]),
    ("config-binary", replace_with("config.json", b"\x80\x81\xfe\xff" * 100), 2, ["config.json is not UTF-8 text"]),
    ("config-a-list", replace_with("config.json", b"[]"), 2, ["config.json must hold a JSON object, not a list"]),
    ("config-a-number", replace_with("config.json", b"3.5"), 2, ["config.json must hold a JSON object, not a number"]),
    ("config-a-directory", make_dir("config.json"), 2,
     ["config.json cannot be read: not a regular file (a directory)"]),
    ("config-a-device", link_to_device("config.json"), 2,
     ["config.json cannot be read: not a regular file (a device)"]),
    ("config-a-fifo", make_fifo("config.json"), 2, ["config.json cannot be read: not a regular file (a FIFO)"]),
    ("config-huge", make_huge("config.json", MAX_JSON_BYTES + 1), 2, [f"config.json is larger than {MAX_JSON_BYTES}"]),
    ("config-deep", replace_with("config.json", b"[" * 100_000), 2, ["config.json is not valid JSON"]),
    ("config-field-of-wrong-type", edit_config(lambda c: c["plan"].__setitem__("pp", "2")), 2,
     ["config.json: pp='2' must be an integer"]),
    ("config-section-a-list", edit_config(lambda c: c.__setitem__("model", [1])), 2, ["config.json: model"]),
    ("config-missing", remove("config.json"), 2, ["is not a run directory (no config.json)"]),
    ("manifest-not-json", replace_with("manifest.json", b"{'python': 3}"), 2, ["manifest.json is not valid JSON"]),
    ("manifest-a-number", replace_with("manifest.json", b"7"), 2, ["manifest.json must hold a JSON object"]),
    ("manifest-a-directory", make_dir("manifest.json"), 2, ["manifest.json cannot be read: not a regular file"]),
    ("manifest-huge", make_huge("manifest.json", MAX_JSON_BYTES + 10), 2, ["manifest.json is larger than"]),
    ("prediction-not-json", replace_with("prediction.json", b'{"step_time_s": 1.0,'), 2,
     ["prediction.json is not valid JSON"]),
    ("prediction-null", replace_with("prediction.json", b"null"), 2,
     ["prediction.json must hold a JSON object, not null"]),
    ("prediction-a-fifo", make_fifo("prediction.json"), 2, ["prediction.json cannot be read: not a regular file"]),
]
CASES = EVENT_CASES + TOLERATED_CASES + FILE_CASES


@pytest.fixture
def damaged(reference, tmp_path, request) -> Path:
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    request.param(d)
    return d


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "Error:" not in text.replace("error:", ""), text[-3000:]


@pytest.mark.parametrize(("damaged", "code", "expect"), [pytest.param(f, c, x, id=i) for i, f, c, x in CASES],
                         indirect=["damaged"])
def test_compare_reports_damage_in_one_line_or_notes_it(damaged, code, expect):
    result = CliRunner().invoke(main, ["compare", str(damaged)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    no_traceback(result.stdout + result.stderr)
    assert result.exit_code == code, result.stdout[-2000:] + result.stderr
    if code == 2:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert result.stdout == ""
        text = lines[0]
    else:
        assert result.stderr == "" and result.stdout.startswith("predicted vs measured")
        text = result.stdout
        # a rank without events measured nothing: "-", never 0 B at -100%
        assert "-100.0%" not in text
    for fragment in expect:
        assert fragment in text, (fragment, text[-3000:])


@pytest.mark.parametrize(("damaged", "code", "expect"), [pytest.param(f, c, x, id=i) for i, f, c, x in CASES],
                         indirect=["damaged"])
def test_every_reader_returns_or_raises_config_error(damaged, code, expect):
    """The API under the CLI agrees with it: the same ConfigError, or values, never another exception."""
    try:
        run = load_run(damaged)
    except ConfigError as e:
        assert code == 2 and "\n" not in str(e)
        with pytest.raises(ConfigError):
            compare_run(damaged)
    else:
        events, notes = run.checked_events()
        assert all(e["rank"] < run.config.world_size for e in events)
        comparison = compare_run(damaged)
        assert comparison.format().startswith("predicted vs measured")
        json.dumps(comparison.to_dict())
        for fragment in expect:
            assert any(fragment in n for n in notes) or code == 0 and fragment in comparison.format(), fragment
    report = ReadReport()
    events = read_events(damaged, report=report)  # the events dir alone: never raises
    assert all(isinstance(e["seq"], int) and isinstance(e["rank"], int) for e in events)
    assert all("\n" not in n for n in report.notes())
    tail = EventTail(damaged)
    assert sorted((e["rank"], e["seq"]) for e in tail.read()) == sorted((e["rank"], e["seq"]) for e in events)
    assert tail.read() == [] and tail.skipped == report.n_skipped
    try:
        m = measurement_from_run(damaged)
        assert m.step_time_s > 0
    except ConfigError as e:
        assert "\n" not in str(e)


def test_bad_lines_cost_one_event_each(reference, tmp_path):
    """Skipped lines are counted and the rest of the file is read: the count of valid events drops by
    exactly the damaged ones."""
    clean = read_events(reference)
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    for line in (b"[1]", b"\xff\xfe", b'{"kind": "step", "rank": 0, "seq": "x"}'):
        insert_line(0, line)(d)
    edit_event(1, "step", set_field("loss", "nan"))(d)
    report = ReadReport()
    events = read_events(d, report=report)
    assert len(events) == len(clean) - 1
    assert report.skipped == {"events/rank-0.jsonl": 3, "events/rank-1.jsonl": 1}


@pytest.mark.parametrize(("damage", "code", "fragment"), [
    (make_dir("config.json"), 2, "config.json cannot be read: not a regular file (a directory)"),
    (huge_line_then_valid, 0, f"line 4: longer than {MAX_LINE_BYTES} bytes"),
], ids=["config-a-directory", "huge-line"])
def test_the_real_command_line(reference, tmp_path, damage, code, fragment):
    """``python -m workbench.cli compare`` in a process of its own: exit code, one line, no traceback."""
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    damage(d)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(d)], capture_output=True, text=True,
                          timeout=120)
    no_traceback(proc.stdout + proc.stderr)
    assert proc.returncode == code, proc.stderr
    if code == 2:
        assert proc.stderr.splitlines() == [proc.stderr.strip()] and fragment in proc.stderr
    else:
        assert fragment in proc.stdout


@pytest.mark.parametrize("command", ["calibrate", "validate"])
def test_measured_runs_are_read_the_same_way(reference, tmp_path, command):
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    replace_with("config.json", b"[]")(d)
    out = ["-o", str(tmp_path / "fitted.json")] if command == "calibrate" else []
    result = CliRunner().invoke(main, [command, "--measured", str(d), *out])
    assert result.exit_code == 2 and "config.json must hold a JSON object" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_no_reader_of_a_run_directory_can_unpickle():
    """A run directory is data from elsewhere: the rundir modules import no unpickler and call no
    ``torch.load``/``numpy.load``; JSON is all they parse."""
    import ast

    import workbench.rundir

    unpicklers = {"pickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
    for path in sorted(Path(workbench.rundir.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & unpicklers, (path.name, imported & unpicklers)
        loads = [node.value.id for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "load"
                 and isinstance(node.value, ast.Name) and node.value.id in {"torch", "np", "numpy"}]
        assert not loads, (path.name, loads)
