"""Faults on the launcher's side of `workbench train`: signals to the command or to torchrun, a
guard stop, resumes that change what they may (and refuse what they may not), bad input, and the
verdict of a handle on a run that has ended.

The multi-process tests run the real CLI in a subprocess on the tiny model (world 1-2, a few steps)
and judge it by what a user and a scheduler see: its exit status, its last line, the processes
left in /proc, and the run directory's events. The others start nothing: bad input must be
refused before any process starts and before a run directory is made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from workbench.cli import main
from workbench.launch import launch, open_run
from workbench.launch.local import config_from_cli
from workbench.launch.outcome import (EXIT_BAD_INPUT, EXIT_DONE, EXIT_FAILED, EXIT_GUARD, EXIT_INTERRUPTED,
                                      EXIT_TERMINATED, judge)
from workbench.rundir.events import Error, EventWriter, RunEnd, RunStart, Step, read_events
from workbench.rundir.record import create_run_dir
from workbench.spec.errors import ConfigError

TINY = ["--model", "tiny", "--seq", "16", "--mbs", "1"]


# ---------------------------------------------------------------------------- helpers


def job_pids(run_dir: Path, but: int | None = None) -> list[int]:
    """Live processes whose command line names the run directory (torchrun and its ranks)."""
    needle = str(run_dir).encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == but:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if needle in cmd:  # a zombie's command line is empty
            out.append(int(name))
    return out


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, list[str]]:
    proc = start_cli(*args, env=env)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.splitlines()


def read_until_steps(proc: subprocess.Popen, n: int, timeout_s: float = 90) -> list[str]:
    """The CLI's lines up to its n-th step line."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if sum(x.startswith("step ") for x in lines) >= n or time.monotonic() > deadline:
            return lines
    raise AssertionError("the CLI ended before its steps:\n" + "\n".join(lines))


def last_run_ends(run_dir: Path) -> dict[int, dict | None]:
    """Each rank's last event if it is a run_end, else None."""
    out: dict[int, dict | None] = {}
    for e in read_events(run_dir):
        out[e["rank"]] = e if e["kind"] == "run_end" else None
    return out


def invoke(*args: str):
    return CliRunner().invoke(main, ["train", *args])


def assert_one_error_line(result, *words: str) -> None:
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and err.splitlines() == [err], err
    assert "Traceback" not in result.output
    for w in words:
        assert w in err, (w, err)


# ---------------------------------------------------------------------------- signals


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, world, code", [(signal.SIGTERM, 2, EXIT_TERMINATED), (signal.SIGINT, 1, EXIT_INTERRUPTED)])
def test_a_signal_to_the_cli_stops_the_whole_job(tmp_path, sig, world, code):
    run_dir = tmp_path / "sig"
    proc = start_cli(*TINY, "--plan", f"dp_shard={world}", "--steps", "500", "--runs", str(tmp_path), "--run-id", "sig")
    try:
        head = read_until_steps(proc, 2)
        assert len(job_pids(run_dir, but=proc.pid)) == 1 + world  # torchrun and its ranks
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=40)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    lines = head + out.splitlines()
    assert proc.returncode == code, lines
    assert elapsed < 20, elapsed
    wait_for(lambda: job_pids(run_dir) == [], 5, "no torchrun or rank left")
    assert "Traceback" not in out and "SignalException" not in out
    last = lines[-1]
    assert last.startswith("interrupted at step ") and sig.name in last, last
    ends = last_run_ends(run_dir)
    assert sorted(ends) == list(range(world)) and all(e and e["status"] == "interrupted" for e in ends.values()), ends
    assert int(last.split()[3]) == ends[0]["step"] >= 2  # the line says where the run directory says


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sigkill_of_torchrun_fails_the_job_and_takes_the_ranks(tmp_path):
    import psutil

    run_dir = tmp_path / "kill"
    proc = start_cli(*TINY, "--plan", "dp_shard=2", "--steps", "500", "--runs", str(tmp_path), "--run-id", "kill")
    try:
        head = read_until_steps(proc, 2)
        torchrun = [c for c in psutil.Process(proc.pid).children() if "torch.distributed.run" in " ".join(c.cmdline())]
        assert len(torchrun) == 1
        torchrun[0].kill()
        out, _ = proc.communicate(timeout=40)
    finally:
        proc.kill()
    lines = head + out.splitlines()
    assert proc.returncode == EXIT_FAILED, lines
    assert lines[-1].startswith("job failed: torchrun was killed by SIGKILL"), lines[-1]
    wait_for(lambda: job_pids(run_dir) == [], 20, "no rank left (they die with their torchrun)")
    assert not any(e is not None and e["status"] == "ok" for e in last_run_ends(run_dir).values())


# ---------------------------------------------------------------------------- guard, resume


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_guard_stop_exits_3_with_the_guards_line(tmp_path):
    code, lines = run_cli(*TINY, "--steps", "20", "--runs", str(tmp_path), "--run-id", "nan",
                          env={"WORKBENCH_INJECT": "nan:2"})
    assert code == EXIT_GUARD, lines
    assert lines[-1].startswith("stopped by the nonfinite guard: loss=nan is not finite at step 2"), lines[-1]
    assert [e["status"] for e in last_run_ends(tmp_path / "nan").values()] == ["stopped"]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_resume_extends_steps_and_refuses_what_cannot_change(tmp_path):
    run_dir = tmp_path / "ext"
    code, lines = run_cli(*TINY, "--steps", "4", "--checkpoint-every", "2", "--runs", str(tmp_path), "--run-id", "ext")
    assert code == EXIT_DONE and lines[-1] == f"done: {run_dir}", lines
    config_before = (run_dir / "config.json").read_text()

    refused = invoke("--resume", str(run_dir), "--steps", "6", "--plan", "dp_shard=2")
    assert_one_error_line(refused, "--plan", "--resume")
    assert (run_dir / "config.json").read_text() == config_before  # refused before anything changed

    code, lines = run_cli("--resume", str(run_dir), "--steps", "6")
    assert code == EXIT_DONE and lines[-1] == f"done: {run_dir}", lines
    assert "resume at step 4 from step-4" in lines
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["5/6", "6/6"]
    steps = [e["step"] for e in read_events(run_dir) if e["kind"] == "step"]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 6
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [r["changed"] for r in manifest["resumes"]] == [{"steps": [4, 6]}]


# ---------------------------------------------------------------------------- bad input: nothing starts


@pytest.mark.parametrize("args, words", [
    (["--seq", "0"], ["seq_len=0"]),
    (["--mbs", "0"], ["micro_batch_size=0"]),
    (["--lr", "0"], ["lr=0"]),
    (["--checkpoint-keep", "0"], ["checkpoint_keep=0"]),
    (["--max-restarts", "-1"], ["max_restarts=-1"]),
    (["--dataset", "text", "--data-path", "no-such-file.txt"], ["data_path='no-such-file.txt' does not exist"]),
    (["--dataset", "bin", "--data-path", "."], ["data_path='.' is a directory"]),
])
def test_bad_options_are_one_line_and_make_no_run_directory(tmp_path, args, words):
    runs = tmp_path / "runs"
    assert_one_error_line(invoke(*TINY, "--runs", str(runs), *args), *words)
    assert not runs.exists()


def finished_run(root: Path, run_id: str = "done", status: str = "ok", error: str | None = None) -> Path:
    """A run directory as a 1-rank job leaves it, written by the trainer's own event writer."""
    config = config_from_cli("tiny", "", 2, seq_len=16, micro_batch_size=1)
    run_dir = create_run_dir(config, root, run_id)
    with EventWriter(run_dir, 0) as w:
        w.emit(RunStart(world_size=1, mesh={}, coords={}, device="cpu", backend="none",
                        n_params=config.model.n_params(), n_local_params=config.model.n_params(), steps=2))
        w.emit(Step(step=0, loss=5.0, grad_norm=1.0, lr=1e-4, tokens=16, tokens_per_s=100.0, step_time_s=0.1))
        if error:
            w.emit(Error(error=error))
        w.emit(RunEnd(status=status, step=1))
    return run_dir


def test_resume_refuses_in_one_line(tmp_path):
    run_dir = finished_run(tmp_path)
    assert_one_error_line(invoke("--resume", ""), "resume=''")
    assert_one_error_line(invoke("--resume", str(tmp_path / "nope")), "not a run directory")
    assert_one_error_line(invoke("--resume", str(run_dir), "--seq", "32", "--model", "tiny-moe"), "--model", "--seq")
    assert_one_error_line(invoke("--resume", str(run_dir), "--steps", "0", "--max-restarts", "-1"), "max_restarts=-1")
    # A config.json edited to another model than the run started with.
    data = json.loads((run_dir / "config.json").read_text())
    data["model"]["n_layers"] += 2
    (run_dir / "config.json").write_text(json.dumps(data))
    assert_one_error_line(invoke("--resume", str(run_dir), "--steps", "9"), "model", "parameters")
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 2  # not rewritten
    assert list(tmp_path.iterdir()) == [run_dir]


def test_resume_refuses_a_model_its_checkpoint_was_not_saved_for(tmp_path):
    run_dir = finished_run(tmp_path)
    (run_dir / "events" / "rank-0.jsonl").unlink()  # no run_start to compare: the checkpoint decides
    other = config_from_cli("tiny-moe", "", 2, seq_len=16, micro_batch_size=1)
    step = run_dir / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 1, "config": other.to_dict()}))  # as the trainer writes it
    assert_one_error_line(invoke("--resume", str(run_dir)), "model 'tiny'", "step-1", "'tiny-moe'")
    # the checkpoint's step bounds a resume's steps from below
    step.rename(run_dir / "checkpoints" / "step-3")
    (run_dir / "checkpoints" / "step-3" / "meta.json").write_text(
        json.dumps({"step": 3, "config": json.loads((run_dir / "config.json").read_text())}))
    assert_one_error_line(invoke("--resume", str(run_dir), "--steps", "2"), "steps=2 is below step 3")


def test_a_taken_run_id_is_one_line(tmp_path):
    run_dir = finished_run(tmp_path, "taken")
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert_one_error_line(invoke(*TINY, "--runs", str(tmp_path), "--run-id", "taken"), "run_id='taken'", "exists")
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_config_file_with_other_options_is_refused(tmp_path):
    run_dir = finished_run(tmp_path)
    assert_one_error_line(invoke("--config", str(run_dir / "config.json"), "--steps", "9"), "--steps", "--config")
    assert_one_error_line(invoke("--config", str(tmp_path / "none.json")), "does not exist")


# ---------------------------------------------------------------------------- the API


def test_launch_and_open_run_refuse_bad_arguments_with_config_error(tmp_path):
    config = config_from_cli("tiny", "", 2, seq_len=16, micro_batch_size=1)
    runs = tmp_path / "runs"
    for call, words in [
        (lambda: launch(config, backend="local", bogus=1, run_root=runs), "no option bogus"),
        (lambda: launch(config, backend="gateway", run_root=runs), "needs url="),
        (lambda: launch({"model": "tiny"}, run_root=runs), "is not a RunConfig"),
        (lambda: launch(config, max_restarts=-1, run_root=runs), "max_restarts=-1"),
        (lambda: launch(config_from_cli("tiny", "", 2, dataset="text", data_path=str(tmp_path / "x.txt")),
                        run_root=runs), "does not exist"),
        (lambda: open_run(tmp_path / "nope"), "not a run directory"),
        (lambda: open_run(""), "not a run directory"),
    ]:
        with pytest.raises(ConfigError, match=words):
            call()
    assert not runs.exists()
    damaged = tmp_path / "damaged"
    (damaged / "events").mkdir(parents=True)
    (damaged / "config.json").write_text('{"model": ')
    with pytest.raises(ConfigError, match="config.json"):
        open_run(damaged)
    (damaged / "config.json").write_text(config.to_json())
    (damaged / "launch").mkdir()
    (damaged / "launch" / "launch.json").write_text("[]")
    with pytest.raises(ConfigError, match="launch.json is damaged"):
        open_run(damaged)


def test_stop_on_an_ended_run_reports_how_it_ended(tmp_path):
    for status, error, state in [("ok", None, "finished"), ("error", "rank 0: RuntimeError: boom", "failed")]:
        run_dir = finished_run(tmp_path, status, status, error)
        before = (run_dir / "events" / "rank-0.jsonl").read_bytes()
        run = open_run(run_dir)
        stopped = run.stop()
        assert stopped.state == state, stopped
        assert "stopped by the user" not in str(stopped)
        if error:
            assert "boom" in stopped.why
        assert (run_dir / "events" / "rank-0.jsonl").read_bytes() == before  # nothing appended
        run.close()


# ---------------------------------------------------------------------------- the verdict


def ev(rank: int, kind: str, **fields) -> dict:
    return {"rank": rank, "kind": kind, **fields}


@pytest.mark.parametrize("events, code, signalled, outcome, exit_code, words", [
    ([ev(0, "run_start"), ev(0, "step", step=0), ev(0, "run_end", status="ok", step=1)], 0, None,
     "done", EXIT_DONE, "done: "),
    # a failed attempt that torchrun restarted is not the outcome: the last attempt is
    ([ev(0, "run_start"), ev(0, "error", error="rank 0: boom"), ev(0, "run_end", status="error"),
      ev(0, "run_start", step=0), ev(0, "run_end", status="ok", step=3)], 0, None, "done", EXIT_DONE, "done: "),
    ([ev(0, "run_start"), ev(0, "step", step=4)], -9, None, "failed", EXIT_FAILED, "killed by SIGKILL"),
    ([ev(0, "run_start"), ev(0, "run_end", status="ok", step=2)], -9, None, "failed", EXIT_FAILED, "killed by SIGKILL"),
    ([ev(0, "run_start"), ev(0, "run_end", status="interrupted", step=2)], -9, None, "failed", EXIT_FAILED, "SIGKILL"),
    ([ev(0, "run_start"), ev(0, "step", step=2), ev(0, "run_end", status="interrupted", step=3)], 1, signal.SIGINT,
     "interrupted", EXIT_INTERRUPTED, "interrupted at step 3 (SIGINT)"),
    ([ev(0, "run_start"), ev(0, "guard", guard="grad_spike", message="grad_norm=9 > 5 x median", step=1),
      ev(0, "run_end", status="stopped", step=2)], 0, None, "stopped", EXIT_GUARD, "grad_spike guard: grad_norm=9"),
    ([ev(0, "run_start"), ev(0, "run_end", status="ok", step=2), ev(1, "run_start"),
      ev(1, "error", error="rank 1: RuntimeError: x"), ev(1, "run_end", status="error")], 1, None,
     "failed", EXIT_FAILED, "job failed: rank 1: RuntimeError: x"),
])
def test_the_verdict_is_the_run_directorys(events, code, signalled, outcome, exit_code, words):
    world = 1 + max(e["rank"] for e in events)
    verdict = judge(events, world, code, "runs/x", signalled)
    assert (verdict.outcome, verdict.exit_code) == (outcome, exit_code), verdict
    assert words in verdict.line, verdict.line
