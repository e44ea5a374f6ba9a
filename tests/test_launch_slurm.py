"""Runs through a real Slurm (tests/slurm.py: munged, slurmctld and two slurmd, nodes n1 and n2 on
this machine): a 2-node x 2-rank tiny run allocated with salloc, one kernel per node started with
srun and reached only through that step's stdio; stop, a job cancelled from outside, resume with
a new allocation, and the same from the shell. Every check reads Slurm's own queue, the real
processes and the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dist import live_processes
from slurm import slurm_available, start_slurm
from workbench.spec.errors import ConfigError
from workbench.launch import launch
from workbench.launch.local import config_from_cli
from workbench.rundir.events import find_gaps, read_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600),
              pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available()))]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # the backend's salloc/srun/squeue find the cluster
    try:
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


def tiny_config(steps: int, **overrides):
    """tiny model, dp_shard=4 on local-cpu: 2 nodes x 2 ranks."""
    return config_from_cli("tiny", "dp_shard=4", steps, seq_len=32, micro_batch_size=1, **overrides)


def job_processes(*marks: str) -> list[psutil.Process]:
    """Live processes of a run (torchrun, trainer ranks, kernels, srun steps) by a path in their
    command line."""
    return live_processes(*marks, programs=None)


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if predicate():
            return time.time() - t0
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def first_step(run) -> bool:
    return any(e["kind"] == "step" for e in run.history())


def test_a_run_through_slurm_stops_resumes_on_a_new_allocation_and_finishes(slurm, tmp_path):
    config = tiny_config(18, checkpoint_every=3, checkpoint_keep=2)
    t0 = time.time()
    # The nodes keep their own run directory (no shared file system): the driver's copy is made of
    # the events streamed over the kernels, and the resume reads the nodes' checkpoints.
    run = launch(config, "slurm", run_root=tmp_path / "runs", remote_root=str(tmp_path / "nodes"),
                 shared_run_root=False, join_timeout_s=120)
    try:
        manifest = json.loads((run.path / "manifest.json").read_text())
        (first,) = manifest["allocations"]
        assert first["scheduler"] == "slurm" and first["nodes"] == ["n1", "n2"] and first["nodelist"] == "n[1-2]"
        job = first["job_id"]
        assert slurm.jobs() == [f"{job} RUNNING wb-{run.path.name}"]
        # Rank placement follows the planner's: node i holds ranks 2i, 2i+1 at its own address.
        assert [n.addr for n in run.nodes] == ["127.0.0.10", "127.0.0.11"]
        for f in (run.path / "launch").glob("kernel-node*.json"):
            assert f.stat().st_mode & 0o777 == 0o600
        wait_until(lambda: first_step(run), 180, "the first step")
        to_first_step = time.time() - t0
        print(f"launch to the first step: {to_first_step:.1f} s (of which in the queue: {first['granted_after_s']:.2f} s)")
        # The kernels listen on the nodes' loopback only: nothing of theirs on another address.
        for node in run.nodes:
            kernel = psutil.Process(node.channel.description["remote_kernel_pid"])
            listening = [c.laddr for c in kernel.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        wait_until(lambda: any(e["kind"] == "checkpoint" and e.get("phase") == "committed" and e["step"] >= 3
                               for e in run.history()), 180, "a committed checkpoint")

        # Stop mid-run: the ranks end, the allocation is given back, nothing is left.
        t_stop = time.time()
        status = run.stop(timeout_s=10)
        stopped_s = time.time() - t_stop
        print(f"stop() returned after {stopped_s:.1f} s with the queue empty: {slurm.jobs() == []}")
        wait_until(lambda: slurm.jobs() == [], 30, "an empty queue")
        assert status.state == "stopped", status
        before = {e["step"]: e["loss"] for e in run.history() if e["kind"] == "step" and e["rank"] == 0}
        assert max(before) < config.train.steps - 1
        assert job_processes(str(run.path), run.path.name) == []
        assert not list((run.path / "launch").glob("kernel-node*.json"))  # no key left behind
        stopped_at = max(before)

        # Resume: a new allocation, from the latest good checkpoint; the loss continues.
        run.resume()
        allocations = json.loads((run.path / "manifest.json").read_text())["allocations"]
        assert len(allocations) == 2 and allocations[1]["job_id"] != job
        status = run.wait(timeout_s=300)
        assert status.state == "finished", status
        events = read_events(run.path)
        assert find_gaps(events) == {}
        resumes = [e for e in events if e["kind"] == "resume" and e["rank"] == 0]
        assert resumes and 3 <= resumes[-1]["step"] <= stopped_at + 1
        after = [e for e in events if e["kind"] == "step" and e["rank"] == 0 and e["seq"] > resumes[-1]["seq"]]
        assert after[0]["step"] == resumes[-1]["step"]
        for e in after:  # same data, same state: the same losses as before the stop
            if e["step"] in before:
                assert e["loss"] == pytest.approx(before[e["step"]], rel=1e-4)
        # The finished run gave its allocation back by itself.
        wait_until(lambda: slurm.jobs() == [], 30, "an empty queue after the last step")
    finally:
        run.shutdown()
    assert slurm.jobs() == []
    assert job_processes(str(run.path), run.path.name) == []


def test_a_job_cancelled_from_outside_is_reported_with_slurms_reason(slurm, tmp_path):
    run = launch(tiny_config(200), "slurm", run_root=tmp_path / "runs", remote_root=str(tmp_path / "nodes"))
    try:
        # At once: the kernels are up and torchrun is starting (what Slurm ends is the same at any step).
        job = run.backend.job_id
        subprocess.run(["scancel", job], check=True, env=slurm.env)
        status = run.wait(timeout_s=120)
        assert status.state == "failed", status
        assert f"Slurm ended job {job}: CANCELLED" in status.why, status
        wait_until(lambda: slurm.jobs() == [], 30, "an empty queue")
        # The kernels went with the job's steps; torchrun follows its kernel (its death signal)
        # and stops its ranks, which takes it a moment.
        gone = wait_until(lambda: job_processes(str(run.path), run.path.name) == [], 60, "no process of the run")
        print(f"scancel to no process left: {gone:.1f} s")
    finally:
        run.shutdown()


def test_a_request_slurm_refuses_is_one_line_and_leaves_nothing_queued(slurm, tmp_path):
    with pytest.raises(ConfigError, match="(?i)Slurm refused the allocation: .*invalid partition"):
        launch(tiny_config(2), "slurm", run_root=tmp_path, partition="nosuchpartition")
    with pytest.raises(ConfigError, match="time_limit='1:75'"):
        launch(tiny_config(2), "slurm", run_root=tmp_path, time_limit="1:75")
    assert slurm.jobs() == []


def test_workbench_launch_through_slurm_from_the_shell(slurm, tmp_path):
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", "--backend", "slurm", "--model", "tiny",
                           "--plan", "dp_shard=4", "--steps", "4", "--seq", "32", "--mbs", "1", "--runs", str(runs),
                           "--remote-root", str(tmp_path / "nodes"), "--time-limit", "10"],
                          capture_output=True, text=True, timeout=400, env=slurm.env)
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0, done.stderr
    (run_dir,) = runs.iterdir()
    events = read_events(run_dir)
    assert find_gaps(events) == {} and {e["rank"] for e in events} == {0, 1, 2, 3}
    assert sum(e["kind"] == "run_end" and e["status"] == "ok" for e in events) == 4
    (alloc,) = json.loads((run_dir / "manifest.json").read_text())["allocations"]
    assert alloc["time_limit"] == "10"
    assert slurm.jobs() == []


DRIVER = """
import sys, time
from workbench.launch import launch
from workbench.launch.local import config_from_cli
run = launch(config_from_cli("tiny", "dp_shard=4", 500, seq_len=32, micro_batch_size=1), "slurm",
             run_root=sys.argv[1], remote_root=sys.argv[2])
print(run.path, flush=True)  # the kernels are up and torchrun is starting on both nodes
time.sleep(600)
"""


def test_the_drivers_death_leaves_nothing_queued_or_running(slurm, tmp_path):
    """SIGKILL to the driver once the run is launched: the allocation's lifeline (salloc's HOLD) and every srun
    step's stdin close with it, so Slurm gives the nodes back and the kernels, torchrun and the
    ranks follow."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "runs"), str(tmp_path / "nodes")],
                              stdout=subprocess.PIPE, text=True, env=slurm.env)
    try:
        run_dir = driver.stdout.readline().strip()
        assert run_dir and len(slurm.jobs()) == 1
    finally:
        driver.kill()
        driver.wait()
    t0 = time.time()
    wait_until(lambda: slurm.jobs() == [], 60, "an empty queue after the driver's death")
    wait_until(lambda: job_processes(run_dir, Path(run_dir).name) == [], 60, "no process of the run")
    print(f"driver killed to nothing left: {time.time() - t0:.1f} s")
