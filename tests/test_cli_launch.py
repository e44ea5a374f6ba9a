"""`workbench launch`: every launch backend from the command line.

Fast: bad input is one line naming the option, exit status 2, and nothing is made or started;
the backend options reach launch() (and the benchmark) as the backends take them; following a run
(node lines, step lines, the final line, the exit status, Ctrl-C and SIGTERM) against a stand-in
RunHandle, with real signals to this process. One real run through local kernels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import workbench.cli as cli
from dist import live_processes
from slurm import slurm_available
from workbench.cli import main
from workbench.launch.follow import StopSignals, follow, verdict
from workbench.launch.handle import NodeStatus, RunStatus
from workbench.launch.outcome import EXIT_CODES
from workbench.rundir.events import find_gaps, read_events



def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["launch", *args], env=env)


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, names", [
    (["--partition", "gpu"], ["--partition is an option of --backend slurm, not local"]),
    (["--backend", "ssh", "--time-limit", "30"], ["--time-limit is an option of --backend slurm, not ssh"]),
    (["--remote-root", "/scratch"], ["--remote-root is an option of --backend ssh, gateway or slurm, not local"]),
    (["--backend", "gateway", "--hosts", "a,b"], ["--hosts is an option of --backend ssh, not gateway"]),
    (["--backend", "slurm", "--time-limit", "1:75"], ["--time-limit", "'1:75'", "below 60"]),
    (["--backend", "slurm", "--sbatch-arg", "-p"], ["--sbatch-arg", "'-p'", "long options only"]),
    (["--backend", "slurm", "--sbatch-arg", "--nodes=3"], ["--sbatch-arg", "'--nodes=3'", "set by the backend"]),
    (["--backend", "slurm", "--partition", "-x"], ["--partition", "'-x'", "is not a Slurm name"]),
    (["--backend", "ssh"], ["--backend ssh needs --hosts"]),
    (["--backend", "ssh", "--hosts", "a,b", "--hosts-file", "hosts.txt"], ["--hosts or --hosts-file, not both"]),
    (["--backend", "gateway"], ["--backend gateway needs --url", "$WORKBENCH_GATEWAY_TOKEN"]),
    (["--backend", "pbs"], ["'--backend'", "'pbs' is not one of", "'slurm'"]),
    (["--token", "secret"], ["No such option", "--token"]),  # a token never goes on a command line
    (["--plan", "tp=3"], ["tp=3 does not divide n_heads=4"]),  # the trainer's checks, through launch()
    (["--plan", "dp_shard=4", "--max-restarts", "-1"], ["max_restarts=-1"]),
    (["--config", "run.json", "--model", "tiny"], ["--model cannot be given with --config"]),
    (["--resume", "runs/x", "--steps", "9"], ["--steps cannot be given with --resume"]),
    (["--resume", "nowhere"], ["resume='nowhere' is not a run directory"]),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_made(tmp_path, args, names):
    runs = tmp_path / "runs"
    result = invoke(*args, "--runs", str(runs)) if "--resume" not in args else invoke(*args)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    for name in names:
        assert name in line, line
    assert not runs.exists()  # no run directory (and so no kernel: a run starts in one)


def test_resume_refuses_a_run_started_without_kernels(tmp_path):
    from workbench.launch.local import config_from_cli

    run_dir = tmp_path / "r1"  # as workbench train leaves it: config.json and events, no launch record
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "config.json").write_text(config_from_cli("tiny", "dp_shard=2", 2).to_json())
    result = invoke("--resume", str(run_dir))
    assert result.exit_code == 2, result.output
    assert f"was not launched through kernels: continue it with workbench train --resume {run_dir}" \
        in one_error_line(result)


def test_help_lists_the_backends_and_the_exit_statuses():
    result = CliRunner().invoke(main, ["launch", "--help"])
    assert result.exit_code == 0
    for backend in ("local", "ssh", "gateway", "slurm"):
        assert f"--backend {backend}" in result.output
    for code, what in EXIT_CODES.items():
        assert f"{code:>3}  {what}" in result.output
    assert "--resume RUN_DIR" in result.output


# ---------------------------------------------------------------------------- options reach launch()
class FakeRun:
    """A stand-in RunHandle: ``batches`` of events, the i-th streamed once status() has been asked
    i + 1 times (so that every state is seen, however the threads are scheduled); ``states``: the
    run's state at each status() call (the last one stays), ``final`` its state once shut down;
    ``on_status(calls)``: a hook per status() call; ``stop_batch``: the events a stop brings (the
    run goes on until it is stopped)."""

    def __init__(self, batches, states, final: str = "finished", why: str = "", on_status=None, stop_batch=()):
        self.path = Path("/runs/r1")
        self.config = SimpleNamespace(world_size=2, train=SimpleNamespace(steps=2, steps_to_run=2, accept=""))
        self.nodes = [SimpleNamespace(index=i, addr=f"127.0.0.{10 + i}") for i in range(2)]
        self.stop_timeout_s = 10.0
        self.batches, self.states, self.final, self.why = list(batches), list(states), final, why
        self.on_status, self.stop_batch = on_status, list(stop_batch)
        self.calls: list[str] = []
        self.stopped = threading.Event()

    def _status(self, state: str) -> RunStatus:
        return RunStatus(state, self.why, tuple(NodeStatus(i, "vm", state) for i in range(len(self.nodes))), ())

    def status(self) -> RunStatus:
        self.calls.append("status")
        if self.on_status is not None:
            self.on_status(self.calls.count("status"))
        return self._status(self.states.pop(0) if len(self.states) > 1 else self.states[0])

    def events(self):
        for i, batch in enumerate(self.batches):
            deadline = time.monotonic() + 10
            while self.calls.count("status") <= i and time.monotonic() < deadline:
                time.sleep(0.01)
            yield batch
        if self.stop_batch:
            assert self.stopped.wait(10)
            yield self.stop_batch

    def stop(self) -> RunStatus:
        self.calls.append("stop")
        self.states, self.final = ["stopped"], "stopped"
        self.stopped.set()
        return self._status("stopped")

    def shutdown(self) -> RunStatus:
        self.calls.append("shutdown")
        return self._status(self.final)


def step(rank: int, i: int, seq: int) -> dict:
    return {"kind": "step", "rank": rank, "seq": seq, "t": 1.0 + i, "step": i, "loss": 5.0 - i / 10,
            "grad_norm": 1.5, "lr": 3e-4, "tokens_per_s": 100.0, "step_time_s": 0.5}


def start(rank: int) -> dict:
    return {"kind": "run_start", "rank": rank, "seq": 0, "t": 0.5, "step": 0}


def end(rank: int, seq: int, status: str = "ok", step_: int = 2) -> dict:
    return {"kind": "run_end", "rank": rank, "seq": seq, "t": 9.0, "status": status, "step": step_}


def finished_run() -> FakeRun:
    batches = [[start(0), start(1)], [step(0, 0, 1), step(1, 0, 1)], [step(0, 1, 2), step(1, 1, 2)],
               [end(0, 3), end(1, 3)]]
    return FakeRun(batches, ["starting", "running"])


def test_backend_options_reach_launch_as_the_backends_take_them(tmp_path, monkeypatch):
    calls: list[tuple] = []

    def fake_launch(config, backend, **kw):
        calls.append((config, backend, kw))
        return finished_run()

    monkeypatch.setattr(cli, "launch_run", fake_launch)
    runs = str(tmp_path / "runs")
    result = invoke("--backend", "slurm", "--plan", "dp_shard=4", "--steps", "2", "--runs", runs,
                    "--partition", "gpu,debug", "--account", "proj", "--time-limit", "1:30:00",
                    "--sbatch-arg", "--qos=high", "--sbatch-arg=--exclusive", "--shared-run-root", "--join-timeout", "30")
    assert result.exit_code == 0, result.output
    config, backend, kw = calls[-1]
    assert backend == "slurm" and config.world_size == 4 and config.train.steps == 2
    assert kw == dict(run_root=runs, run_id=None, max_restarts=0, join_timeout_s=30.0, partition="gpu,debug",
                      account="proj", time_limit="1:30:00", extra_sbatch=("--qos=high", "--exclusive"),
                      shared_run_root=True)

    result = invoke("--backend", "ssh", "--plan", "dp_shard=4", "--hosts", " a@h1:2222, h2 ", "--identity-file", "k",
                    "--remote-root", "/scratch/runs", "--runs", runs)
    assert result.exit_code == 0, result.output
    assert calls[-1][1] == "ssh"
    assert {k: v for k, v in calls[-1][2].items() if k not in ("run_root", "run_id", "max_restarts", "join_timeout_s")} \
        == dict(hosts=["a@h1:2222", "h2"], identity_file="k", remote_root="/scratch/runs")

    # the gateway's token comes from the environment, never from the command line
    result = invoke("--backend", "gateway", "--url", "https://gw:8888", "--runs", runs,
                    env={"WORKBENCH_GATEWAY_TOKEN": "s3cret"})
    assert result.exit_code == 0, result.output
    assert calls[-1][1] == "gateway" and calls[-1][2]["url"] == "https://gw:8888" and calls[-1][2]["token"] == "s3cret"
    assert "s3cret" not in result.output

    # --config: the file's RunConfig with the launch options
    path = tmp_path / "run.json"
    path.write_text(calls[0][0].to_json())
    result = invoke("--config", str(path), "--backend", "local", "--max-restarts", "1", "--runs", runs)
    assert result.exit_code == 0, result.output
    assert calls[-1][0] == calls[0][0] and calls[-1][1] == "local" and calls[-1][2]["max_restarts"] == 1


def test_bench_comms_takes_slurm_options(tmp_path, monkeypatch):
    seen: list[dict] = []

    def fake_benchmark(cluster, plan, run_root, **kw):
        seen.append(kw)
        return SimpleNamespace(path=Path(run_root) / "comms.json")

    monkeypatch.setattr(cli, "run_comms_benchmark", fake_benchmark)
    monkeypatch.setattr(cli, "format_table", lambda results: "table")
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "comms", "--backend", "slurm", "--plan", "dp_shard=4", "--partition", "gpu",
                                  "--time-limit", "20", "--sbatch-arg", "--qos=low", "--runs", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen[-1]["backend"] == "slurm"
    assert seen[-1]["backend_options"] == dict(partition="gpu", time_limit="20", extra_sbatch=("--qos=low",))
    for args, name in ((["--partition", "gpu"], "--partition is an option of --backend slurm, not local"),
                       (["--backend", "slurm", "--sbatch-arg", "-p"], "--sbatch-arg")):
        result = runner.invoke(main, ["bench", "comms", *args, "--runs", str(tmp_path)])
        assert result.exit_code == 2 and name in one_error_line(result), result.output
    assert len(seen) == 1


# ---------------------------------------------------------------------------- following a run
def test_follow_prints_node_changes_steps_and_the_final_line():
    run, lines = finished_run(), []
    code = follow(run, lines.append, 2)
    assert code == 0
    assert lines[0] == "node 0 (127.0.0.10 on vm): starting"
    assert [line for line in lines if line.startswith("node 1")] == \
        ["node 1 (127.0.0.11 on vm): starting", "node 1 (127.0.0.11 on vm): running", "node 1 (127.0.0.11 on vm): finished"]
    steps = [line for line in lines if line.startswith("step")]
    assert len(steps) == 2 and steps[0].startswith("step     1/2  loss 5.0000")  # rank 0 only
    assert lines[-1] == "done: /runs/r1 (2 steps)"
    assert "stop" not in run.calls and run.calls[-1] == "shutdown"
    assert isinstance(signal.getsignal(signal.SIGINT), type(signal.default_int_handler))  # handlers restored


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_and_ends_the_kernels(signum, code):
    def send(calls: int) -> None:
        if calls == 3:  # while the run goes: a real signal to this process, as Ctrl-C or kill sends it
            assert isinstance(signal.getsignal(signum), StopSignals), "follow() must handle the signal"
            os.kill(os.getpid(), signum)

    run = FakeRun([[start(0), start(1)], [step(0, 0, 1), step(1, 0, 1)]], ["running"], on_status=send,
                  stop_batch=[end(0, 2, "interrupted", 1), end(1, 2, "interrupted", 1)])
    lines: list[str] = []
    assert follow(run, lines.append, 50) == code
    name = signal.Signals(signum).name
    assert any(line.startswith(f"{name}: stopping the run") for line in lines), lines
    assert run.calls.count("stop") == 1 and run.calls[-1] == "shutdown"
    assert lines[-1] == f"interrupted at step 1 ({name}; run: /runs/r1); resume with: workbench launch --resume /runs/r1"
    assert not isinstance(signal.getsignal(signum), StopSignals)


def status_of(state: str, why: str = "") -> RunStatus:
    return RunStatus(state, why, (NodeStatus(0, "vm", state, why),), ())


def test_verdicts_of_a_guard_a_failure_and_an_outside_stop():
    guard = {"kind": "guard", "rank": 0, "seq": 2, "t": 3.0, "guard": "nonfinite_loss", "message": "loss is nan"}
    events = [start(0), step(0, 0, 1), guard, end(0, 3, "stopped", 1)]
    assert verdict(status_of("stopped"), events, 1, None, "runs/r") == \
        (3, "stopped by the nonfinite_loss guard: loss is nan (after 1 steps; run: runs/r)")
    assert verdict(status_of("stopped"), events, 1, signal.SIGINT, "runs/r")[0] == 3  # it had ended before
    code, line = verdict(status_of("failed", "rank 0: boom"), [start(0), step(0, 0, 1)], 1, None, "runs/r")
    assert code == 1 and line.startswith("run failed at step 1: rank 0: boom (run: runs/r); resume with:")
    code, line = verdict(status_of("stopped", "stopped by the user"), [start(0), end(0, 1, "interrupted", 0)],
                         1, None, "runs/r")
    assert code == 143 and "stopped from outside; stopped by the user" in line


# ---------------------------------------------------------------------------- a real run
def job_processes(run_dir: Path) -> list[int]:
    """torchrun and trainer processes of this run still alive."""
    return [p.pid for p in live_processes(str(run_dir))]


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(slurm_available() is None, reason="the same command runs for real through Slurm "
                                                      "(tests/test_launch_slurm.py), where Slurm can start")
def test_launch_through_local_kernels_runs_to_the_end(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    no_torch = subprocess.run([sys.executable, "-c", "import sys, workbench.cli, workbench.launch.follow; "
                               "print('torch' in sys.modules)"], capture_output=True, text=True, env=env)
    assert no_torch.stdout.strip() == "False", no_torch.stderr  # the driver never imports torch

    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", "--backend", "local", "--model", "tiny",
                           "--plan", "dp_shard=4", "--steps", "4", "--seq", "32", "--mbs", "1", "--runs", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert lines[0].startswith(f"run {run_dir}  (4 ranks on 2 nodes x 2, local kernels")
    for node, addr in ((0, "127.0.0.10"), (1, "127.0.0.11")):
        assert any(line.startswith(f"node {node} ({addr}") and line.endswith(": running") for line in lines), lines
        assert any(line.startswith(f"node {node} ({addr}") and line.endswith(": finished") for line in lines), lines
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1/4", "2/4", "3/4", "4/4"]
    assert lines[-1] == f"done: {run_dir} (4 steps)"
    assert proc.stderr == ""

    events = read_events(run_dir)
    assert {e["rank"] for e in events} == {0, 1, 2, 3}
    assert find_gaps(events) == {}
    assert all(min(e["seq"] for e in events if e["rank"] == r) == 0 for r in range(4))
    assert sorted(e["rank"] for e in events if e["kind"] == "run_end" and e["status"] == "ok") == [0, 1, 2, 3]
    assert job_processes(run_dir) == []
    launch_record = json.loads((run_dir / "launch" / "launch.json").read_text())
    assert [n["state"] for n in launch_record["nodes"]] == ["finished", "finished"]
    kernel_pids = [n["kernel"]["kernel_pid"] for n in launch_record["nodes"]]
    assert all(pid and not alive(pid) for pid in kernel_pids), kernel_pids  # the kernels were ended
