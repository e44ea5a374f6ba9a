"""Faults on the trainer's side, each checked the way it happens, from the run directory:

* a tampered checkpoint (its RNG file, or DCP's ``.metadata``, swapped for a pickle that runs code,
  its hashes updated to match) is rejected in one line and its code never runs;
* a checkpoint that cannot be written is one line per rank and no ``.tmp``; training goes on, and
  a failed *final* checkpoint ends the run with an error at the last step (world 1 in-process: a
  DCP write failure; world 2 under torchrun: a full disk injected on one rank; world 1 as a
  process: ``checkpoints`` is a file);
* an events file removed or replaced mid-run is noticed and recreated, ``seq`` running on;
* run_end names the last completed step when a rank fails mid-run;
* SIGKILL of torchrun ends every rank (the parent-death signal), each with run_end "interrupted";
* a guard's message names the guard.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist import make_config, torchrun_env

SETTINGS = dict(seq_len=32, micro_batch_size=2, global_batch_size=4, warmup_steps=1, lr=3e-3, seed=1)


def config(world: int = 1, plan: str = "", **train):
    return make_config(plan, world, "tiny", settings=dict(SETTINGS, **train))


def events(run_dir: Path, kind: str | None = None, rank: int | None = None) -> list[dict]:
    from workbench.rundir import read_events

    return [e for e in read_events(run_dir) if (kind is None or e["kind"] == kind) and (rank is None or e["rank"] == rank)]


def train_in_process(cfg, run_dir: Path, **kw):
    from workbench.rundir.events import EventWriter
    from workbench.trainer.train import run_training

    with EventWriter(run_dir, 0) as writer:
        return run_training(cfg, writer, run_dir=run_dir, **kw)


def workbench_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "[workbench]" in line]


# --------------------------------------------------------------------------- tampered checkpoints


class Payload:
    """What an attacker would plant: unpickling it writes ``marker`` (full pickle runs exec)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def rehash(path: Path, name: str) -> None:
    """Update ``hashes.json`` and the COMMITTED marker for a replaced file, as an attacker who can
    write the run directory would: only the content's own loader can then refuse it."""
    hashes = json.loads((path / "hashes.json").read_text())
    data = (path / name).read_bytes()
    hashes[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    text = json.dumps(hashes, indent=1, sort_keys=True)
    (path / "hashes.json").write_text(text)
    marker = json.loads((path / "COMMITTED").read_text())
    marker["hashes_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (path / "COMMITTED").write_text(json.dumps(marker))


def test_rng_states_are_plain_tensors_and_round_trip(tmp_path):
    import random

    import numpy as np
    import torch

    from workbench.trainer.checkpoint import load_rng, restore_rng, save_rng

    random.gauss(0, 1)  # a cached gauss_next is part of Python's state
    file = save_rng(tmp_path, 3)
    assert file.name == "rng-3.pt"
    raw = torch.load(file, weights_only=True)  # loads with the narrow loader: tensors and numbers only
    assert raw["python_state"].dtype == torch.int64 and raw["python_state"].numel() == 625
    expected = (torch.rand(3), random.random(), random.gauss(0, 1), float(np.random.rand()))
    torch.rand(5), random.random(), np.random.rand(4)  # move every generator on
    restore_rng(load_rng(file))
    again = (torch.rand(3), random.random(), random.gauss(0, 1), float(np.random.rand()))
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_a_tampered_checkpoint_is_rejected_and_its_code_never_runs(tmp_path, capfd):
    import torch

    from workbench.rundir import create_run_dir

    cfg = config(steps=2, checkpoint_every=1)
    run_dir = create_run_dir(cfg, tmp_path, "tampered")
    losses = train_in_process(cfg, run_dir)
    ckpts = run_dir / "checkpoints"
    # step-2: its RNG file a torch.save of the payload; step-1: DCP's .metadata a raw pickle of it
    marker = tmp_path / "payload-ran"
    torch.save(Payload(marker), ckpts / "step-2" / "rng-0.pt")
    rehash(ckpts / "step-2", "rng-0.pt")
    (ckpts / "step-1" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rehash(ckpts / "step-1", ".metadata")
    # The payloads are live: the full loaders would run them.
    probe = tmp_path / "probe"
    torch.load(ckpts / "step-2" / "rng-0.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(Payload(probe)))
    assert probe.exists()
    capfd.readouterr()

    resumed = train_in_process(cfg, run_dir, resume=True, steps=1)
    assert not marker.exists()
    assert resumed == losses[:1]  # nothing good left: from step 0
    rejected = {e["step"]: e["reason"] for e in events(run_dir, "checkpoint_rejected")}
    assert set(rejected) == {1, 2}
    assert rejected[2] == "rng-0.pt is not plain generator state (loaded with weights_only=True): " \
                          "UnpicklingError: it names exec, which is not plain data"
    assert rejected[1].startswith(".metadata does not load: UnsafeCheckpointFile: names builtins.exec")
    err = [line for line in workbench_lines(capfd.readouterr().err) if "rejected" in line]
    assert len(err) == 2 and all("\n" not in r for r in rejected.values())
    assert {p.name for p in ckpts.iterdir()} >= {"step-1.rejected", "step-2.rejected"}


# --------------------------------------------------------------------------- checkpoints that cannot be written


def test_a_failed_write_is_one_line_leaves_no_tmp_and_training_goes_on(tmp_path, capfd):
    """A real DCP write failure: ``__0_0.distcp`` of step 2's directory is in the way (a directory)."""
    from workbench.rundir import create_run_dir
    from workbench.rundir.checkpoints import list_checkpoints

    cfg = config(steps=3, checkpoint_every=1)
    run_dir = create_run_dir(cfg, tmp_path, "blocked")
    (run_dir / "checkpoints" / "step-2.tmp" / "__0_0.distcp").mkdir(parents=True)
    losses = train_in_process(cfg, run_dir)
    assert len(losses) == 3 and losses.final_step == 3
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 3]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    failed = [e for e in events(run_dir, "checkpoint") if e["phase"] == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and failed[0]["final"] is False
    assert "step-2.tmp" in failed[0]["reason"] and "IsADirectoryError" in failed[0]["reason"]
    lines = workbench_lines(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert "checkpoint step-2 not saved" in lines[0] and lines[0].endswith("removed step-2.tmp, training continues")


def run_trainer(run_dir: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """One rank of world 1 as its own process, as torchrun would start it (no torchrun)."""
    return subprocess.run([sys.executable, "-m", "workbench.trainer", str(run_dir / "config.json")],
                          env=torchrun_env(env), capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_final_checkpoint_ends_the_run_with_an_error(tmp_path):
    """``checkpoints`` is a regular file (root ignores permissions; a file is in the way for everyone)."""
    from workbench.rundir import create_run_dir

    run_dir = create_run_dir(config(steps=2, checkpoint_every=1), tmp_path, "no-room")
    (run_dir / "checkpoints").write_text("not a directory")
    proc = run_trainer(run_dir, {})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = workbench_lines(proc.stderr)
    assert len(lines) == 2, proc.stderr[-3000:]
    assert "checkpoint step-1 not saved" in lines[0] and "NotADirectoryError" in lines[0] and "training continues" in lines[0]
    assert "CheckpointWriteError: the final checkpoint step-2 was not saved" in lines[1]
    assert str(run_dir / "checkpoints" / "step-2.tmp") in lines[1]
    end = events(run_dir, "run_end")
    assert [(e["status"], e["step"]) for e in end] == [("error", 2)]  # the last step, not 0
    failed = [(e["step"], e["final"]) for e in events(run_dir, "checkpoint") if e["phase"] == "failed"]
    assert failed == [(1, False), (2, True)]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_error_mid_run_ends_at_the_last_completed_step(tmp_path):
    from workbench.rundir import create_run_dir

    run_dir = create_run_dir(config(steps=6), tmp_path, "fails")
    proc = run_trainer(run_dir, {"WORKBENCH_FAIL_AT": "0:3"})
    assert proc.returncode == 1
    assert [e["step"] for e in events(run_dir, "step")] == [0, 1, 2]
    end = events(run_dir, "run_end")
    assert [(e["status"], e["step"]) for e in end] == [("error", 3)]  # steps 0-2 done: next to run is 3
    assert workbench_lines(proc.stderr) == ["[workbench] rank 0: RuntimeError: injected failure at step 3"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_survive_a_full_disk_on_one(tmp_path):
    """dp_shard=2 under torchrun; rank 1's write of step 2 hits ENOSPC (faults.py): both ranks say so
    in one line, step-2.tmp is gone, step 4 is committed and the run ends ok."""
    from workbench.launch.local import torchrun_command
    from workbench.rundir import create_run_dir
    from workbench.rundir.checkpoints import list_checkpoints

    run_dir = create_run_dir(config(2, "dp_shard=2", steps=4, checkpoint_every=2), tmp_path, "enospc")
    log = run_dir / "torchrun.log"
    with open(log, "w") as out:
        code = subprocess.run(torchrun_command(run_dir / "config.json", 2), stdout=out, stderr=subprocess.STDOUT,
                              env=torchrun_env({"WORKBENCH_CHECKPOINT_FAIL_AT": "1:2"}), timeout=200).returncode
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "Traceback" not in text
    lines = workbench_lines(text)
    assert len(lines) == 2, lines  # one per rank
    mine = next(line for line in lines if "rank 1:" in line)
    assert "No space left on device" in mine and "rng-1.pt" in mine
    other = next(line for line in lines if "rank 0:" in line)
    assert "rank 1 could not write its files" in other
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert [s for s, _ in list_checkpoints(run_dir)] == [4]
    for rank in (0, 1):
        failed = [e for e in events(run_dir, "checkpoint", rank) if e["phase"] == "failed"]
        assert [e["step"] for e in failed] == [2]
        assert [(e["status"], e["step"]) for e in events(run_dir, "run_end", rank)] == [("ok", 4)]


# --------------------------------------------------------------------------- the events file


def test_a_removed_or_replaced_events_file_is_recreated_with_seq_running_on(tmp_path, capfd):
    from workbench.rundir.events import EventWriter, rank_file, read_rank_events

    path = rank_file(tmp_path, 0)
    with EventWriter(tmp_path, 0) as w:
        w.emit(kind="note", n=0)
        w.emit(kind="note", n=1)
        path.unlink()  # removed
        w.emit(kind="note", n=2)
        w.emit(kind="note", n=3)
        path.with_name("other").write_text('{"kind": "note", "rank": 0, "seq": 99, "n": -1}')  # no final newline
        os.replace(path.with_name("other"), path)  # replaced by another file
        w.emit(kind="note", n=4)
        w.emit(kind="note", n=5)
        (tmp_path / "events" / path.name).unlink()
        (tmp_path / "events").rmdir()  # the whole folder gone
        w.emit(kind="note", n=6)
    got = [(e["seq"], e.get("n"), "reopened" in e) for e in read_rank_events(tmp_path, 0)]
    assert got == [(6, 6, True)]
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning: events file" in line]
    assert len(warnings) == 3
    assert "was removed; writing to a new one from seq 2" in warnings[0]
    assert "was replaced by another file; writing to a new one from seq 4" in warnings[1]


def test_the_events_writer_reopens_into_a_replacement_and_a_restart_counts_on(tmp_path):
    from workbench.rundir.events import EventWriter, find_gaps, rank_file, read_rank_events

    path = rank_file(tmp_path, 0)
    with EventWriter(tmp_path, 0) as w:
        w.emit(kind="note", n=0)
        path.unlink()
        w.emit(kind="note", n=1)
        path.with_name("other").write_text('{"kind": "note", "rank": 0, "seq": 0, "n": -1}')
        os.replace(path.with_name("other"), path)
        w.emit(kind="note", n=2)
    got = [(e["seq"], e.get("n"), e.get("reopened", "")) for e in read_rank_events(tmp_path, 0)]
    assert [(s, n) for s, n, _ in got] == [(0, -1), (2, 2)]  # the replacement's line kept, ours after it
    assert "rank-0.jsonl was replaced by another file" in got[1][2] and "before seq 2" in got[1][2]
    assert find_gaps([e for e in read_rank_events(tmp_path, 0)]) == {0: [1]}  # the lost event shows
    with EventWriter(tmp_path, 0) as again:  # a restarted rank: after the highest seq, not the line count
        assert again.emit(kind="note")["seq"] == 3


def test_the_events_file_check_costs_one_stat_per_emit(tmp_path, monkeypatch):
    from workbench.rundir import events as events_module

    calls = []
    real_stat = os.stat

    def counting_stat(*a, **kw):
        calls.append(a[0] if a else None)
        return real_stat(*a, **kw)

    with events_module.EventWriter(tmp_path, 0) as w:
        monkeypatch.setattr(events_module.os, "stat", counting_stat)
        for i in range(200):
            w.emit(kind="note", n=i)
        monkeypatch.undo()
    assert len(calls) <= 200


# --------------------------------------------------------------------------- torchrun killed


def pids_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(int(entry))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_torchrun_ends_every_rank_as_interrupted(tmp_path):
    from workbench.launch.local import torchrun_command
    from workbench.rundir import create_run_dir

    run_dir = create_run_dir(config(2, "dp_shard=2", steps=100_000), tmp_path, "orphans")
    name = str((run_dir / "config.json").resolve())
    with open(run_dir / "torchrun.log", "w") as log:
        proc = subprocess.Popen(torchrun_command(run_dir / "config.json", 2), stdout=log, stderr=subprocess.STDOUT,
                                env=torchrun_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while {e["rank"] for e in events(run_dir, "step")} != {0, 1}:
            assert proc.poll() is None and time.monotonic() < deadline, (run_dir / "torchrun.log").read_text()[-3000:]
            time.sleep(0.2)
        ranks = [p for p in pids_naming(name) if p != proc.pid]
        assert len(ranks) >= 2, ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while pids_naming(name) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        left = pids_naming(name)
        assert not left, f"ranks still running 15 s after torchrun's SIGKILL: {left}"
    finally:
        for pid in pids_naming(name):
            os.kill(pid, signal.SIGKILL)
    for rank in (0, 1):
        mine = events(run_dir, rank=rank)
        last_step = max(e["step"] for e in mine if e["kind"] == "step")
        assert mine[-1]["kind"] == "run_end", mine[-3:]
        assert mine[-1]["status"] == "interrupted"
        assert mine[-1]["step"] in (last_step + 1, last_step + 2)  # the next step to run (a step may end meanwhile)
        assert not [e for e in mine if e["kind"] == "error"]


# --------------------------------------------------------------------------- guards


def test_a_guard_message_names_the_guard_and_the_reason():
    import math

    from workbench.trainer.guards import check_guards

    cfg = config(guard_grad_spike=3.0, guard_min_tokens_per_s=100.0)
    cases = [({"loss": math.nan, "grad_norm": 1.0}, 1e3, [], "guard_nonfinite"),
             ({"loss": 2.0, "grad_norm": 9.0}, 1e3, [1.0] * 5, "guard_grad_spike=3.0"),
             ({"loss": 2.0, "grad_norm": 1.0}, 50.0, [], "guard_min_tokens_per_s=100.0")]
    for metrics, tokens_per_s, history, setting in cases:
        g = check_guards(cfg, 5, metrics, tokens_per_s, history)
        assert setting in g.message and "at step 5" in g.message and "\n" not in g.message, g.message
