"""Every parallel layout trains the same numbers as one process.

The tiny model (or the model a layout names), a fixed seed and the pydoc corpus; per-step losses
over STEPS steps under each layout must equal the single-process run of the same model and
settings within relative tolerance 1e-4 (fp32 on CPU; what differs is only the order of
floating-point reductions). A layout is a plan, or ``"<model>:<plan>"`` with a preset or a name of
VARIANTS (a preset with other training settings: dropout).

To fit the CI budget, one torchrun job per world size (tests/dist.py) runs all of its layouts in
sequence (the process group is made once; every layout builds its own DeviceMesh), and each
single-process reference runs once, in the test process (the session's ``reference_losses``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dist import LOSS_SETTINGS, max_rel_diff, run_torchrun
from dist import make_config as _make_config

STEPS = LOSS_SETTINGS["steps"]  # 10
RTOL = 1e-4

# Layouts of world size 2 and 4 (cp and ep layouts are tested in test_context_parallel.py and
# test_expert_parallel.py; ep with tp, expert tensor parallelism, here).
LAYOUTS_2 = [
    "dp_replicate=2",
    "dp_shard=2",
    "dp_shard=2,zero=2",
    "tp=2,sequence_parallel=1",
    "tp=2,sequence_parallel=0,loss_parallel=1",
    "pp=2,schedule=gpipe",
    "pp=2,schedule=1f1b",
    "pp=2,schedule=interleaved-1f1b,v=2",
    "pp=2,schedule=looped-bfs,v=2",
    "pp=2,schedule=zero-bubble,v=2",
    "pp=2,schedule=zbv,v=2",
    "pp=2,schedule=dualpipev,v=2",
    # latent attention across stages; QK-norm (Qwen3-style, head_dim x heads > d_model) under TP;
    # tied embeddings on two stages; dropout across stages (its masks keyed by global sample index)
    "tiny-mla:pp=2",
    "tiny-qk-norm:tp=2",
    "tiny-tied:pp=2",
    "tiny-dropout:pp=2",
]
LAYOUTS_4 = [
    "dp_shard=4",
    "dp_replicate=2,dp_shard=2",
    "dp_shard=2,tp=2",
    "pp=2,tp=2",
    "pp=2,dp_shard=2",
    "pp=4,schedule=gpipe",
    "pp=4,schedule=1f1b",
    # latent attention under TP + FSDP; expert tensor parallelism with EP; dropout under SP,
    # data parallel and full recomputation (the masks recomputed from their keys)
    "tiny-mla:dp_shard=2,tp=2",
    "tiny-moe-mb4:tp=2,dp_shard=2,ep=2",
    "tiny-dropout:dp_shard=2,tp=2",
]
# A preset trained with other settings, by the name a layout gives it: (preset, TrainSettings fields).
# tiny-moe-mb4: the auxiliary loss is a per-micro-batch statistic, so a MoE layout in micro-batches of
# 4 (as MICRO_BATCH gives TP layouts, for time) compares with a single process in micro-batches of 4.
VARIANTS: dict[str, tuple[str, dict]] = {"tiny-dropout": ("tiny", {"dropout": True}),
                                         "tiny-moe-mb4": ("tiny-moe", {"micro_batch_size": 4})}
# Meshes checked against ParallelPlan.group_ranks without training (every group dimension).
MESH_ONLY_4 = ["cp=2,tp=2", "dp_shard=4,ep=2", "dp_shard=2,cp=2,ep=4", "dp_replicate=2,cp=2", "pp=2,dp_shard=2"]
RECOMPUTE = {"dp_shard=2,zero=2": "full", "tp=2,sequence_parallel=0,loss_parallel=1": "selective",
             "tiny-dropout:dp_shard=2,tp=2": "full"}
# TP's cost on CPU is per micro-batch (DTensor's dispatch and a collective around every sharded
# matmul: 0.6-1.2 s a step of 4 micro-batches, against 0.1-0.2 s for the other layouts), so the
# TP layouts without a pipeline take the global batch of 8 in micro-batches of 4, not 2: the same
# per-step losses (a mean over the same 8 sequences), half the micro-batches. Accumulating over
# several micro-batches is what every other layout checks (and TP with it: pp=2,tp=2).
MICRO_BATCH = {layout: 4 for layout in ("tp=2,sequence_parallel=1", "tp=2,sequence_parallel=0,loss_parallel=1",
                                         "dp_shard=2,tp=2", "tiny-qk-norm:tp=2", "tiny-mla:dp_shard=2,tp=2",
                                         "tiny-dropout:dp_shard=2,tp=2")}


def model_and_plan(layout: str) -> tuple[str, str]:
    """``"<model>:<plan>"`` -> (model, plan); a bare plan is the tiny model's."""
    model, _, plan = layout.rpartition(":")
    return model or "tiny", plan


def preset_and_settings(model: str) -> tuple[str, dict]:
    """A layout's model name -> (preset, TrainSettings fields beyond the loss-equality settings)."""
    return VARIANTS.get(model, (model, {}))


def make_config(layout: str, world: int):
    model, plan_text = model_and_plan(layout)
    preset, settings = preset_and_settings(model)
    train = {"recompute": RECOMPUTE.get(layout, "none"),
             "micro_batch_size": MICRO_BATCH.get(layout, LOSS_SETTINGS["micro_batch_size"]), **settings}
    return _make_config(plan_text, world, preset, **train)


def worker(out_path: str, layouts: list[str]) -> None:
    """One rank of a torchrun job: train each layout, rank 0 writes {layout: losses}."""
    from workbench import ParallelPlan
    from workbench.trainer.mesh import build_meshes, check_mesh
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    results: dict = {}
    if world == 4:
        # check_mesh raises on any rank whose groups differ from the plan's; gather rank 0's.
        groups = {}
        for text in MESH_ONLY_4:
            plan = ParallelPlan.parse(text, dp_shard=1).resolve(world)
            groups[text] = check_mesh(build_meshes(plan, "cpu"), rank)
        results["_mesh_groups_rank0"] = groups
    for text in layouts:
        t0 = time.time()
        results[text] = run_training(make_config(text, world))
        if rank == 0:
            print(f"{text}: {time.time() - t0:.1f}s", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def run_job(world: int, layouts: list[str], tmp_path: Path) -> dict[str, list[float]]:
    out = tmp_path / f"losses-{world}.json"
    run_torchrun("test_trainer_layouts:worker", world, [str(out), layouts], timeout=400)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(reference_losses) -> list[float]:
    return reference_losses("tiny")  # make_config("", 1): no recompute


@pytest.fixture(scope="module")
def references(reference_losses):
    """layout -> the single-process losses of its model and settings."""
    def of(layout: str) -> list[float]:
        preset, settings = preset_and_settings(model_and_plan(layout)[0])
        return reference_losses(preset, **settings)

    return of


def check(results: dict[str, list[float]], references) -> None:
    report = {k: max_rel_diff(v, references(k)) for k, v in results.items()}
    print("\nmax relative loss difference per layout:")
    for k, d in report.items():
        print(f"  {k:40s} {d:.2e}")
    bad = {k: d for k, d in report.items() if not d <= RTOL}
    assert not bad, f"layouts off the single-process losses: {bad}"


def test_reference_loss_falls(reference):
    assert len(reference) == STEPS
    assert reference[-1] < reference[0] - 0.1


def test_dropout_changes_the_losses(reference, references):
    """The dropout layouts compare to a reference that really drops (not to the plain run)."""
    dropped = references("tiny-dropout:pp=2")
    assert max_rel_diff(dropped, reference) > 1e-3
    assert dropped[-1] < dropped[0] - 0.1


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_layouts_world_2(references, tmp_path):
    results = run_job(2, LAYOUTS_2, tmp_path)
    assert set(results) == set(LAYOUTS_2)
    check(results, references)


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_layouts_world_4(references, tmp_path):
    results = run_job(4, LAYOUTS_4, tmp_path)
    groups = results.pop("_mesh_groups_rank0")
    assert set(results) == set(LAYOUTS_4)
    check(results, references)
    from workbench import ParallelPlan

    for text in MESH_ONLY_4:
        plan = ParallelPlan.parse(text, dp_shard=1).resolve(4)
        expected = {d: next(g for g in plan.group_ranks(d) if 0 in g) for d in groups[text]}
        assert groups[text] == expected
        assert "ep" in groups[text] or plan.ep == 1


def test_invalid_config_starts_no_process(tmp_path):
    from workbench import ConfigError
    from workbench.launch.local import config_from_cli

    with pytest.raises(ConfigError, match="tp=3 does not divide n_heads=4"):
        config_from_cli("tiny", "tp=3", steps=5)
    # Nothing was created, so nothing was started.
    assert not (tmp_path / "runs").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_failing_rank_ends_the_job_quickly(tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits in a collective: the job must end within
    seconds (not the process-group timeout), naming the rank and its error, in the events too."""
    from workbench.launch.local import config_from_cli, train_local
    from workbench.rundir import read_events

    config = config_from_cli("tiny", "dp_shard=2", steps=20, seq_len=32)
    lines: list[str] = []
    t0 = time.time()
    code = train_local(config, run_root=tmp_path, run_id="fail", stream=lines.append,
                       env={"WORKBENCH_FAIL_AT": "1:2", "WORKBENCH_PG_TIMEOUT_S": "600"})
    elapsed = time.time() - t0
    assert code != 0
    assert elapsed < 60, elapsed
    errors = [e for e in read_events(tmp_path / "fail") if e["kind"] == "error"]
    assert errors and errors[0]["rank"] == 1
    assert "rank 1: RuntimeError: injected failure at step 2" in errors[0]["error"]
    assert any("rank 1: RuntimeError: injected failure" in line for line in lines)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_local_writes_the_run_directory(tmp_path):
    from workbench.launch.local import config_from_cli, train_local
    from workbench.rundir import load_run
    from workbench.rundir.events import find_gaps

    config = config_from_cli("tiny", "dp_shard=2", steps=3, seq_len=32)
    lines: list[str] = []
    assert train_local(config, run_root=tmp_path, run_id="ok", stream=lines.append) == 0
    run = load_run(tmp_path / "ok")
    assert run.config == config
    assert run.manifest["world_size"] == 2 and run.manifest["mesh"] == {"dp_shard": 2}
    events = run.events()
    assert find_gaps(events) == {}
    for rank in (0, 1):
        # the run's own kinds (instrumentation adds collectives, memory... per step: test_compare.py)
        kinds = [e["kind"] for e in events if e["rank"] == rank and e["kind"] in ("run_start", "step", "run_end")]
        assert kinds == ["run_start", "step", "step", "step", "run_end"], kinds
    steps = run.steps()
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert all(e["loss"] > 0 and e["tokens_per_s"] > 0 and e["grad_norm"] > 0 for e in steps)
    assert sum(line.startswith("step ") for line in lines) == 3

