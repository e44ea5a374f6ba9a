"""Checkpoints (workbench/trainer/checkpoint.py): complete or invisible, verified on load, resumable
bit for bit, and reshardable across layouts.

* world 1, in this process: the files of a committed checkpoint, its size against the planner's
  ``cost.checkpoint_bytes``, the event phases, retention, and every way a checkpoint can be bad
  (truncated, bit-flipped, no marker, tampered hashes, left as ``.tmp``) with the fallback;
* world 2, one torchrun job: an asynchronous dp_shard=2 run; pp=2 (interleaved, two stages per
  rank) saved, dp_shard=2 resumed;
  then ``workbench train --resume`` (``resume_local``) of a copy holding only the dp_shard=2 step-3
  checkpoint, in fresh processes: bit-identical to the uninterrupted run (deterministic mode);
* world 4, one torchrun job: dp_shard=2 x tp=2 saved, dp_shard=4 resumed.

Resharded runs continue the saved run's losses within relative 1e-4 (another layout reduces in
another order: ~1e-6, not bitwise). The torchrun jobs run through tests/dist.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist import LOSS_SETTINGS, max_rel_diff, run_torchrun
from dist import make_config as _make_config

STEPS = 6
EVERY = 3
RTOL = 1e-4


def make_config(plan_text: str, world: int, **train):
    """The loss-equality settings (tests/dist.py), 6 steps, deterministic, a checkpoint every 3."""
    fields = dict(LOSS_SETTINGS, steps=STEPS, deterministic=True, checkpoint_every=EVERY)
    fields.update(train)
    return _make_config(plan_text, world, "tiny", settings=fields)


def copy_run(src: Path, dst: Path, steps: list[int]) -> Path:
    """A new run directory with ``src``'s config and only the checkpoints of ``steps``."""
    (dst / "checkpoints").mkdir(parents=True)
    (dst / "events").mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    for s in steps:
        shutil.copytree(src / "checkpoints" / f"step-{s}", dst / "checkpoints" / f"step-{s}")
    return dst


def train(config, run_dir: Path, **kw) -> list[float]:
    from workbench.rundir.events import EventWriter
    from workbench.trainer.train import run_training

    with EventWriter(run_dir, 0) as writer:
        return run_training(config, writer, run_dir=run_dir, **kw)


def events(run_dir: Path, kind: str | None = None, rank: int | None = None) -> list[dict]:
    from workbench.rundir import read_events

    return [e for e in read_events(run_dir) if (kind is None or e["kind"] == kind) and (rank is None or e["rank"] == rank)]


# --------------------------------------------------------------------------- world 1


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted 6-step run checkpointing at steps 3 and 6 (synchronously)."""
    from workbench.rundir import create_run_dir

    config = make_config("", 1)
    run_dir = create_run_dir(config, tmp_path_factory.mktemp("ckpt"), "baseline")
    return run_dir, train(config, run_dir), config


def test_settings_are_validated():
    from workbench import ConfigError, TrainSettings

    with pytest.raises(ConfigError, match="checkpoint_keep=0 must be >= 1") as e:
        TrainSettings(checkpoint_keep=0)
    assert e.value.field == "checkpoint_keep"
    with pytest.raises(ConfigError, match="checkpoint_async='yes' must be true or false"):
        TrainSettings(checkpoint_async="yes")
    s = TrainSettings(checkpoint_every=5, checkpoint_async=True, checkpoint_keep=2)
    assert TrainSettings.from_dict(s.to_dict()) == s


def test_committed_checkpoint_files_events_and_size(baseline):
    from workbench.predict.cost import checkpoint_bytes
    from workbench.rundir.checkpoints import list_checkpoints
    from workbench.trainer.checkpoint import verify_checkpoint

    run_dir, _, config = baseline
    assert [s for s, _ in list_checkpoints(run_dir)] == [3, 6]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    path = run_dir / "checkpoints" / "step-3"
    names = {p.name for p in path.iterdir()}
    assert {"COMMITTED", "hashes.json", "meta.json", ".metadata", "__0_0.distcp"} <= names
    assert set(json.loads((path / "hashes.json").read_text())) == names - {"COMMITTED", "hashes.json"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["config"] == config.to_dict()
    assert verify_checkpoint(path) is None
    # Phases in order, for each save.
    ck = events(run_dir, "checkpoint")
    for step in (3, 6):
        assert [e["phase"] for e in ck if e["step"] == step] == ["started", "staged", "written", "committed", "verified"]
    # The measured twin of the planner's checkpoint size: parameters + Adam's two moments, fp32,
    # plus one 4-byte step counter per parameter tensor.
    from workbench.trainer.transformer import build_model

    n_tensors = len(list(build_model(config.model, "meta").parameters()))
    staged = next(e for e in ck if e["phase"] == "staged" and e["step"] == 3)
    assert staged["bytes"] == checkpoint_bytes(config) + 4 * n_tensors
    committed = next(e for e in ck if e["phase"] == "committed" and e["step"] == 3)
    assert committed["bytes"] == sum(p.stat().st_size for p in path.iterdir())
    assert committed["bytes"] >= checkpoint_bytes(config)


def test_resume_is_bit_identical(baseline, tmp_path):
    run_dir, losses, config = baseline
    copy = copy_run(run_dir, tmp_path / "resumed", [3])
    resumed = train(config, copy, resume=True)
    assert resumed == losses[3:]  # bitwise: deterministic mode, same layout
    resume = events(copy, "resume")[0]
    assert resume["step"] == 3 and not resume["resharded"]
    assert any(n.startswith("rng: every rank's generator states restored") for n in resume["notes"])
    assert events(copy, "run_start")[0]["step"] == 3
    assert [e["step"] for e in events(copy, "step")] == [3, 4, 5]


def corrupt_truncate(path: Path) -> None:
    f = path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def corrupt_flip(path: Path) -> None:
    f = path / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_verify_detects_every_kind_of_damage(baseline, tmp_path):
    from workbench.rundir.checkpoints import list_checkpoints
    from workbench.trainer.checkpoint import verify_checkpoint

    run_dir, _, _ = baseline
    cases = {
        "truncated": (corrupt_truncate, "__0_0.distcp is truncated or overwritten"),
        "flipped": (corrupt_flip, "__0_0.distcp is corrupted: its SHA-256 differs"),
        "no marker": (lambda p: (p / "COMMITTED").unlink(), "no COMMITTED marker"),
        "hashes edited": (lambda p: (p / "hashes.json").write_text((p / "hashes.json").read_text() + " "),
                          "hashes.json does not match the hash recorded in COMMITTED"),
        "metadata gone": (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    }
    for name, (damage, expected) in cases.items():
        path = tmp_path / name.replace(" ", "-") / "step-3"
        shutil.copytree(run_dir / "checkpoints" / "step-3", path)
        damage(path)
        reason = verify_checkpoint(path)
        assert reason is not None and expected in reason, (name, reason)
    # A flipped bit keeps the size: only the full check (hashes) sees it.
    assert verify_checkpoint(tmp_path / "flipped" / "step-3", full=False) is None
    # An incomplete write is never listed.
    (tmp_path / "tmp-run" / "checkpoints" / "step-9.tmp").mkdir(parents=True)
    assert list_checkpoints(tmp_path / "tmp-run") == []


def test_corrupted_latest_falls_back_to_previous(baseline, tmp_path, capfd):
    run_dir, losses, config = baseline
    copy = copy_run(run_dir, tmp_path / "fallback", [3, 6])
    corrupt_truncate(copy / "checkpoints" / "step-6")
    (copy / "checkpoints" / "step-9.tmp").mkdir()  # a save that never committed
    resumed = train(config, copy, resume=True, steps=1)
    assert resumed == losses[3:4]
    rejected = events(copy, "checkpoint_rejected")
    assert len(rejected) == 1 and rejected[0]["step"] == 6
    assert "truncated" in rejected[0]["reason"] and rejected[0]["fallback"].endswith("step-3")
    err = capfd.readouterr().err
    line = next(l for l in err.splitlines() if "rejected" in l)
    assert "step-6 rejected: __0_0.distcp is truncated" in line and line.endswith("falling back to step-3")
    assert (copy / "checkpoints" / "step-6.rejected").is_dir()  # kept for inspection, out of the way
    assert not (copy / "checkpoints" / "step-9.tmp").exists()
    phases = [(e["phase"], e["step"]) for e in events(copy, "checkpoint")]
    assert phases[:3] == [("discarded", 9), ("verified", 3), ("loaded", 3)]
    assert events(copy, "resume")[0]["step"] == 3


def test_no_good_checkpoint_starts_from_zero(baseline, tmp_path):
    run_dir, losses, config = baseline
    copy = copy_run(run_dir, tmp_path / "none-good", [3])
    corrupt_flip(copy / "checkpoints" / "step-3")
    assert train(config, copy, resume=True, steps=1) == losses[:1]
    resume = events(copy, "resume")[0]
    assert resume["step"] == 0 and resume["path"] is None
    assert events(copy, "checkpoint_rejected")[0]["fallback"] is None


def test_retention_deletes_only_after_a_newer_commit(tmp_path):
    from workbench.rundir import create_run_dir
    from workbench.rundir.checkpoints import list_checkpoints

    config = make_config("", 1, steps=3, checkpoint_every=1, checkpoint_keep=2)
    run_dir = create_run_dir(config, tmp_path, "keep")
    train(config, run_dir)
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 3]
    seq = [(e["phase"], e["step"]) for e in events(run_dir, "checkpoint") if e["phase"] in ("committed", "deleted")]
    assert seq == [("committed", 1), ("committed", 2), ("committed", 3), ("deleted", 1)]


# --------------------------------------------------------------------------- multi-rank

# name -> (plan, world, train overrides, checkpoint to resume from: (task, step) or None, steps)
TASKS_2 = {
    "A": ("dp_shard=2", 2, {"checkpoint_async": True}, None, STEPS),
    "P": ("pp=2,schedule=interleaved-1f1b,v=2", 2, {}, None, STEPS),  # two stages per rank
    "P->dp": ("dp_shard=2", 2, {}, ("P", EVERY), STEPS - EVERY),
}
TASKS_4 = {
    "T": ("dp_shard=2,tp=2", 4, {}, None, STEPS),
    "T->dp4": ("dp_shard=4", 4, {}, ("T", EVERY), STEPS - EVERY),
}


def worker(spec_path: str) -> None:
    """One rank of a torchrun job: run the tasks of the spec in order; rank 0 writes the losses."""
    import torch.distributed as dist  # made by init_distributed, ended by tests/dist.py

    from workbench import RunConfig
    from workbench.rundir.events import EventWriter
    from workbench.trainer.train import init_distributed, run_training

    rank, _, _, _ = init_distributed()
    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for name, task in spec["tasks"].items():
        run_dir = Path(task["run_dir"])
        if task["source"] and rank == 0:
            src = Path(task["source"])
            shutil.copytree(src, run_dir / "checkpoints" / src.name)
        dist.barrier()
        config = RunConfig.load(str(run_dir / "config.json"))
        with EventWriter(run_dir, rank) as writer:
            results[name] = run_training(config, writer, run_dir=run_dir, resume=bool(task["source"]))
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))


def run_tasks(tasks: dict, world: int, tmp_path: Path) -> dict[str, list[float]]:
    from workbench.rundir import create_run_dir

    spec = {"out": str(tmp_path / f"losses-{world}.json"), "tasks": {}}
    for name, (plan, _, overrides, source, steps) in tasks.items():
        run_dir = create_run_dir(make_config(plan, world, **overrides), tmp_path, name.replace(">", ""))
        src = str(tmp_path / source[0] / "checkpoints" / f"step-{source[1]}") if source else None
        spec["tasks"][name] = {"run_dir": str(run_dir), "source": src, "steps": steps}
    spec_path = tmp_path / f"spec-{world}.json"
    spec_path.write_text(json.dumps(spec))
    run_torchrun("test_checkpoint:worker", world, [str(spec_path)], timeout=300)
    return json.loads(Path(spec["out"]).read_text())


def check_resharded(tmp_path: Path, results: dict, saved: str, resumed: str, world: int) -> float:
    diff = max_rel_diff(results[resumed], results[saved][EVERY:])
    print(f"\n{saved} -> {resumed}: max relative loss difference {diff:.2e}")
    assert diff <= RTOL
    run_dir = tmp_path / resumed.replace(">", "")
    for rank in range(world):
        resume = events(run_dir, "resume", rank)[0]
        assert resume["step"] == EVERY and resume["resharded"], resume
        assert resume["saved_world_size"] == world
        assert any("re-seeded" in n for n in resume["notes"])
        assert any(n.startswith(f"data: resumed at global batch {EVERY}") for n in resume["notes"])
    return diff


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_world_2_async_resume_and_pp_resharding(tmp_path):
    from workbench.launch.local import resume_local

    results = run_tasks(TASKS_2, 2, tmp_path)
    # Asynchronous saves: every phase on every rank, committed by rank 0.
    ck = events(tmp_path / "A", "checkpoint")
    assert {e["mode"] for e in ck} == {"async"}
    for rank in (0, 1):
        phases = [e["phase"] for e in ck if e["rank"] == rank and e["step"] == EVERY]
        assert phases == (["started", "staged", "written", "committed", "verified"] if rank == 0
                          else ["started", "staged", "written"])
    # pp=2 (stages 0, 2 | 1, 3) -> dp_shard=2: stage modules keep the unsplit model's parameter
    # names, so DCP reshards.
    check_resharded(tmp_path, results, "P", "P->dp", 2)
    # `workbench train --resume` in fresh processes, from a run holding only A's step-3 checkpoint.
    copy = copy_run(tmp_path / "A", tmp_path / "A-resumed", [EVERY])
    lines: list[str] = []
    assert resume_local(copy, stream=lines.append) == 0, lines
    resumed = [e["loss"] for e in events(copy, "step", 0)]
    print(f"dp_shard=2 resumed at step {EVERY}: {resumed} vs {results['A'][EVERY:]}")
    assert resumed == results["A"][EVERY:]  # bitwise
    assert f"resume at step {EVERY} from step-{EVERY}" in lines


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_world_4_tp_to_fsdp_resharding(tmp_path):
    results = run_tasks(TASKS_4, 4, tmp_path)
    check_resharded(tmp_path, results, "T", "T->dp4", 4)

