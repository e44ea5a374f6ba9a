"""Runs through local Jupyter kernels: two kernels as two nodes x two CPU ranks (gloo, loopback).

One story end to end (launch, live events from all four ranks, a driver that disconnects and
reattaches, stop mid-run, no process left, resume from the checkpoint, the loss continues), then
the faults: a rank that crashes, a kernel that dies, a node that never joins. Every check reads
real processes and the real run directory.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from dist import live_processes
from workbench.spec.errors import ConfigError
from workbench.launch import handle, launch, open_run
from workbench.launch.kernels import LocalBackend
from workbench.launch.local import config_from_cli
from workbench.rundir.events import find_gaps, read_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def tiny_config(steps: int, **overrides):
    """tiny model, dp_shard=4: Cluster local-cpu with 2 nodes x 2 ranks."""
    return config_from_cli("tiny", "dp_shard=4", steps, seq_len=32, micro_batch_size=1, **overrides)


def job_processes(run_dir: Path) -> list[psutil.Process]:
    """torchrun and trainer processes of this run still alive (any parent)."""
    return live_processes(str(run_dir))


def kernel_children(run) -> list[psutil.Process]:
    out = []
    for node in run.nodes:
        pid = (node.channel.description.get("kernel_pid") if node.channel else None)
        if pid and psutil.pid_exists(pid):
            out += [c for c in psutil.Process(pid).children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    return out


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def collect(run, until, timeout_s: float = 120.0) -> list[dict]:
    """Events from ``run.events()`` until ``until(all events so far)`` holds."""
    got: list[dict] = []
    deadline = time.time() + timeout_s
    for batch in run.events(timeout_s=timeout_s):
        got += batch
        if until(got) or time.time() > deadline:
            break
    return got


def losses_by_step(events, rank: int = 0) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["kind"] == "step" and e["rank"] == rank}


def test_launch_rejects_bad_input_before_starting_anything(tmp_path):
    with pytest.raises(ConfigError, match="backend='slurmx' is not one of"):
        launch(tiny_config(2), backend="slurmx", run_root=tmp_path)
    with pytest.raises(ConfigError, match="transport="):
        launch(tiny_config(2), transport="udp", run_root=tmp_path)
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_two_kernels_stream_stop_reattach_resume(tmp_path):
    config = tiny_config(60, checkpoint_every=3, checkpoint_keep=2)
    run = launch(config, "local", run_root=tmp_path, join_timeout_s=90)
    path = run.path
    try:
        # Connection files hold the kernels' keys: 0600, in a 0700 directory.
        for f in (path / "launch").glob("kernel-node*.json"):
            assert f.stat().st_mode & 0o777 == 0o600
        assert (path / "launch").stat().st_mode & 0o777 == 0o700

        # Live: events from all four ranks, each rank's seq from 0 without a gap.
        first = collect(run, lambda ev: all(any(e["kind"] == "step" and e["rank"] == r and e["step"] >= 1 for e in ev)
                                            for r in range(4)))
        assert {e["rank"] for e in first} == {0, 1, 2, 3}
        assert find_gaps(first) == {}
        assert all(min(e["seq"] for e in first if e["rank"] == r) == 0 for r in range(4))
        status = run.status()
        assert [n.state for n in status.nodes] == ["running", "running"]
        assert [r.node for r in status.ranks] == [0, 0, 1, 1]  # node i holds ranks 2i, 2i+1
        assert all(r.state == "running" for r in status.ranks)
        # The events came over Jupyter comm messages (not the printed fallback).
        for node in run.nodes:
            assert node.channel.call("import sys as _s\n"
                                     "_wb_out = _s.modules['workbench_agent'].AGENT._outbox._comm is not None")

        # The driver disconnects; a new handle on the run directory continues without a loss or a repeat.
        run.close()
        run = open_run(path)
        wait_until(lambda: any(e["kind"] == "checkpoint" and e.get("phase") == "committed" and e["step"] >= 3
                               for e in run.history()), 120, "a committed checkpoint")
        seen = [e for batch in run.events(timeout_s=0.1) for e in batch]
        assert find_gaps(seen) == {}
        keys = [(e["rank"], e["seq"]) for e in seen]
        assert len(keys) == len(set(keys)) and len(seen) > len(first)

        # Stop mid-run: every node stopped, no torchrun or trainer process left, none below the kernels.
        before = losses_by_step(run.history())
        status = run.stop(timeout_s=10)
        assert status.state == "stopped", status
        assert [n.state for n in status.nodes] == ["stopped", "stopped"]
        assert max(before) < config.train.steps - 1  # it really was mid-run
        assert job_processes(path) == []
        assert kernel_children(run) == []
        stopped_at = max(losses_by_step(read_events(path)))

        # Resume: a fresh rendezvous, from the latest good checkpoint; the loss continues.
        run.resume()
        resumed = collect(run, lambda ev: any(e["kind"] == "step" and e["rank"] == 0 and e["step"] > stopped_at
                                              for e in ev[len(seen):]), timeout_s=150)
        starts = [e for e in resumed if e["kind"] == "resume" and e["rank"] == 0]
        assert starts and starts[-1]["path"], "the trainer resumed from a checkpoint"
        resume_step = starts[-1]["step"]
        assert 3 <= resume_step <= stopped_at + 1
        after = [e for e in resumed if e["kind"] == "step" and e["rank"] == 0 and e["seq"] > starts[-1]["seq"]]
        assert after[0]["step"] == resume_step  # no step repeated from scratch, none skipped
        for e in after:  # same data, same state: the same losses as before the stop
            if e["step"] in before:
                assert e["loss"] == pytest.approx(before[e["step"]], rel=1e-4)
        assert find_gaps(read_events(path)) == {}
        run.stop(timeout_s=10)
        assert job_processes(path) == []
    finally:
        run.shutdown()
    assert job_processes(path) == []
    # The kernels are gone; the run directory still says how the run ended.
    again = open_run(path)
    assert again.status().state == "stopped" and [n.state for n in again.status().nodes] == ["stopped"] * 2
    assert find_gaps(again.history()) == {} and len(again.history()) == len(read_events(path))
    again.close()


def test_a_rank_that_crashes_fails_the_run_and_stops_the_rest(tmp_path):
    run = launch(tiny_config(30), "local", run_root=tmp_path, env={"WORKBENCH_FAIL_AT": "2:0"})
    try:
        status = run.wait(timeout_s=150)
        assert status.state == "failed", status
        assert "rank 2" in status.why and "injected failure at step 0" in status.why
        rank2 = status.ranks[2]
        assert rank2.state == "failed" and "injected failure" in rank2.why
        # Node 1's torchrun saw its worker fail, or the driver stopped it first; either way it ended.
        assert {n.state for n in status.nodes} <= {"stopped", "failed"}
        wait_until(lambda: job_processes(run.path) == [], 15, "the job's processes to go")
    finally:
        run.shutdown()


def test_a_kernel_that_dies_is_reported_and_leaves_no_orphans(tmp_path):
    run = launch(tiny_config(200), "local", run_root=tmp_path)
    try:
        wait_until(lambda: [n.state for n in run.status().nodes] == ["running"] * 2, 120, "the workers")
        victim = run.nodes[1].channel.description["kernel_pid"]
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        wait_until(lambda: run.status().state == "failed" and run.status().nodes[0].state in ("stopped", "failed"),
                   30, "the failure to be reported")
        status = run.status()
        assert time.time() - t0 < 15
        assert status.nodes[1].state == "failed" and "kernel died" in status.nodes[1].why
        assert "node 1" in status.why
        # Node 1's torchrun had the kernel as parent (death signal), its workers had torchrun.
        wait_until(lambda: job_processes(run.path) == [], 20, "no orphan processes")
    finally:
        run.shutdown()


class TorchrunNeverStarted:
    """A node's kernel channel that never passes the driver's start on to the node's agent (and
    says it went through): the node's kernel runs, its torchrun does not, so it never joins."""

    def __init__(self, channel):
        self._channel = channel

    def __getattr__(self, name):
        return getattr(self._channel, name)

    def call(self, code: str, timeout_s: float = 60.0):
        if ".AGENT.start(" in code:
            return {"ok": True}
        return self._channel.call(code, timeout_s)


class Node1NeverStarts(LocalBackend):
    """Local kernels, of which node 1's never starts its torchrun."""

    def start(self, run_dir, node):
        channel = super().start(run_dir, node)
        return TorchrunNeverStarted(channel) if node == 1 else channel


def test_a_node_that_never_joins_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(handle, "make_backend", lambda name, config, **options: Node1NeverStarts(**options))
    run = launch(tiny_config(5), "local", run_root=tmp_path, join_timeout_s=4)
    try:
        status = run.wait(timeout_s=60)
        assert status.state == "failed", status
        assert status.nodes[1].state == "failed"
        assert "did not join the rendezvous within 4 s" in status.nodes[1].why
        assert status.nodes[0].state == "stopped" and "node 1" in status.nodes[0].why, status
        assert job_processes(run.path) == []
    finally:
        run.shutdown()


DRIVER = """
import sys, time
from workbench.launch import launch
from workbench.launch.local import config_from_cli
run = launch(config_from_cli("tiny", "dp_shard=4", 500, seq_len=32, micro_batch_size=1), run_root=sys.argv[1])
while [n.state for n in run.status().nodes] != ["running"] * 2:
    time.sleep(0.2)
print(run.path, flush=True)
time.sleep(600)
"""


def test_a_driver_that_dies_takes_its_kernels_and_job_along(tmp_path):
    """SIGKILL the driver process mid-run: its kernels exit (they watch its pid), their torchruns
    get their death signal, the workers theirs: nothing is left."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = Path(proc.stdout.readline().strip())
        wait_until(lambda: len(job_processes(path)) == 2 + 4, 30, "two torchruns, four ranks")
        kernels = [p for p in psutil.Process(proc.pid).children() if "ipykernel" in " ".join(p.cmdline())]
        assert len(kernels) == 2
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: job_processes(path) == [] and not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE
                                                              for k in kernels), 30, "no orphan processes")
