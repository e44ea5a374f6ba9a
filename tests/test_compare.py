"""Predicted vs measured (workbench.rundir.compare) on real runs: torchrun, gloo, CPU, tiny models.

Two torchrun jobs (world 2 and world 4) each run several layouts in sequence, every layout into
its own run directory with the instrumented trainer; the assertions then read the run
directories through :func:`workbench.rundir.compare.compare_run`:

* parameter, gradient and optimizer bytes equal the memory bill exactly, activations within 10%;
* bytes and calls of every collective per (group, op) per step equal ``comms.step_collectives``
  on every rank (pp=2 x dp_shard=2, cp=2 x tp=2);
* the pipeline bubble within 5 points of the schedule simulation, for GPipe, 1F1B and interleaved
  1F1B at p = 2 (asserted) and 4 (run and reported; 4 ranks oversubscribe the 2 CI cores).

Bubble runs use a wider model (:func:`bubble_model`) so that a stage's compute, not gloo's
latency or Python, dominates an action; each timed step is checked against the schedule
simulation fed with that step's measured actions (the planner's schedule model on its own; its
compute model targets GPUs). Not stages' median times: on CI's 2 vCPUs an action alone in the
fill or drain ran faster than one beside the other rank's, and the medians overstated GPipe's
bubble by 3.6 points and understated interleaved 1F1B's by 5.7.
The torchrun jobs run through tests/dist.py, each once, when a test first needs its world size.
"""

from __future__ import annotations

import os

import time
from pathlib import Path

import pytest

from dist import make_config as _make_config
from dist import run_torchrun

# The torchrun tests are marked multiprocess one by one: the derived-time tests at the end read
# run directories written here, and start nothing.

STEPS = 3
# The bubble, measured and replayed, is a median over the measured steps (after WARMUP_STEPS = 1):
# 10 of them, so that half the steps must be off to move it. Each step is replayed with its own
# actions, so a step the machine stretched is stretched in both (on a loaded CI machine the
# replay of single steps was within 2 points of the measured bubble in 14 of 16).
BUBBLE_STEPS = 11
COMPARE_4 = ["pp=2,dp_shard=2", "cp=2,tp=2"]
BUBBLES = {2: ["pp=2,schedule=gpipe", "pp=2,schedule=1f1b", "pp=2,schedule=interleaved-1f1b,v=2"],
           4: ["pp=4,schedule=gpipe", "pp=4,schedule=1f1b", "pp=4,schedule=interleaved-1f1b,v=2"]}
BUBBLE_POINTS = 0.05


def bubble_model():
    from workbench import ModelSpec

    return ModelSpec(n_layers=8, d_model=192, n_heads=4, n_kv_heads=4, d_ff=512, vocab_size=256, name="bubble")


def make_config(text: str, world: int):
    from workbench import ParallelPlan

    pp = ParallelPlan.parse(text, dp_shard=1).pp
    if text in COMPARE_4:
        # m = 2 micro-batches per rank (4 for the pipeline): gradient accumulation counts too
        train = dict(seq_len=32, micro_batch_size=2, global_batch_size=4 * pp, steps=STEPS, warmup_steps=1, seed=1)
        return _make_config(text, world, "tiny", settings=train)
    m = 2 * pp  # a multiple of p: every schedule takes it
    # more steps: the bubble is the median over the steps after the first (a shared CPU is noisy)
    train = dict(seq_len=64, micro_batch_size=1, global_batch_size=m, steps=BUBBLE_STEPS, warmup_steps=1, seed=1)
    return _make_config(text, world, bubble_model(), settings=train)


def run_id(text: str) -> str:
    return text.replace(",", "_").replace("=", "")


def worker(root: str, layouts: list[str]) -> None:
    import torch.distributed as dist  # made by init_distributed, ended by tests/dist.py

    from workbench.rundir import EventWriter, create_run_dir
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    for text in layouts:
        config = make_config(text, world)
        if rank == 0:
            create_run_dir(config, root, run_id(text))
        dist.barrier()
        t0, cpu0 = time.time(), time.process_time()
        with EventWriter(Path(root) / run_id(text), rank) as writer:
            run_training(config, writer)
        wall, cpu = time.time() - t0, time.process_time() - cpu0
        # A rank's CPU time over its wall time: 1 less its idle share on a core of its own; far
        # less when other processes took its core (then measured bubbles mean little).
        shares: list = [None] * world
        dist.all_gather_object(shares, round(cpu / wall, 2))
        if rank == 0:
            print(f"{text}: {wall:.1f}s, cpu/wall per rank {shares}", flush=True)


# The pp=4 bubbles are reported, never asserted, on 2 shared cores (see _OVERSUBSCRIBED below): their
# three runs (about a minute of CI) are opt-in, WORKBENCH_LONG_TESTS=1, as test_recovery's long case.
LONG = bool(os.environ.get("WORKBENCH_LONG_TESTS"))
JOBS = {2: BUBBLES[2], 4: COMPARE_4 + (BUBBLES[4] if LONG else [])}  # world size -> its layouts, in one torchrun job


def run_job(world: int, layouts: list[str], root: Path) -> None:
    # World 2: a rank per core of the 2 CI cores, at timing priority, so that other jobs on the
    # machine take a core only while a rank waits (with a CPU hog beside it, pp=2 gpipe measured
    # 0.194 against 0.247 simulated at normal priority). Pinning ranks to cores did not help.
    proc = run_torchrun("test_compare:worker", world, [str(root), layouts], timeout=400, timing=True)
    print(proc.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: the run root holding that world size's layouts, its job run once, when
    first asked for (so that selecting only pp=2 cases starts only the world-2 job)."""
    root = tmp_path_factory.mktemp("runs")
    done: set[int] = set()

    def get(world: int) -> Path:
        if world not in done:
            run_job(world, JOBS[world], root)
            done.add(world)
        return root

    return get


def world_of(text: str) -> int:
    return next(w for w, layouts in JOBS.items() if text in layouts)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("text", COMPARE_4)
def test_memory_and_collectives_match_the_planner(runs, text):
    from workbench.rundir.compare import compare_run, predicted_collectives
    from workbench.rundir import analysis, load_run

    root = runs(world_of(text))
    cmp = compare_run(root / run_id(text))
    print("\n" + cmp.format())
    for name in ("parameters", "gradients", "optimizer"):
        row = cmp.row("memory", name)
        assert row.measured == row.predicted, row
    act = cmp.row("memory", "activations")
    assert abs(act.error) <= 0.10, act
    # every rank, not only the table's: bytes and calls per (group, op), and every step alike
    run = load_run(root / run_id(text))
    events = run.events()
    for rank in range(run.config.world_size):
        predicted = predicted_collectives(run.config, rank)
        measured = analysis.collective_bytes(events, rank)
        assert set(measured) == set(predicted), (rank, set(measured) ^ set(predicted))
        for key, p in predicted.items():
            assert (measured[key]["bytes"], measured[key]["count"]) == (p["bytes"], p["count"]), (rank, key)
        per_step = analysis.collective_bytes_by_step(events, rank)
        later = [per_step[s] for s in sorted(per_step) if s >= analysis.WARMUP_STEPS]
        assert later and all(x == later[0] for x in later)


# pp=4 on this CI's 2 CPU cores: 4 ranks time-share 2 cores (with other jobs), so a rank's
# "idle" time is partly time the OS gave to a peer, and gloo's blocking sends and receives stretch
# with it. Measured 2-16 points above the simulation over four runs (GPipe 0.43-0.49 vs
# 0.35-0.46, 1F1B 0.38-0.49 vs 0.34-0.36, interleaved 0.42-0.49 vs 0.26-0.31): reported, not
# asserted. p = 2 (one
# core per rank) is asserted; a GPU run (benchmarks/gpu_check.py) is the place to assert p = 4.
_OVERSUBSCRIBED = pytest.mark.xfail(reason="4 ranks on 2 shared CPU cores: measured idle includes CPU time-sharing",
                                    strict=False)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("text", BUBBLES[2] + [pytest.param(t, marks=[_OVERSUBSCRIBED, pytest.mark.skipif(
    not LONG, reason="long: set WORKBENCH_LONG_TESTS=1")]) for t in BUBBLES[4]])
def test_bubble_fraction_matches_the_schedule(runs, text):
    from workbench.rundir.compare import REPLAY_ROW, compare_run

    cmp = compare_run(runs(world_of(text)) / run_id(text))
    replay = cmp.row("pipeline", REPLAY_ROW)
    print(f"\n{text}: measured {replay.measured:.3f}, simulated {replay.predicted:.3f}, "
          f"planner {cmp.row('pipeline', 'bubble fraction').predicted:.3f}")
    assert abs(replay.error) <= BUBBLE_POINTS, replay



# ---------------------------------------------------------------------------- derived times
# Run directories written from events (no processes): the numbers are known, so the derivation is.

def _overlapping_dp_run(root):
    """dp_shard=2 whose prefetching all-gathers (asynchronous, counted whole) take 150 ms of a
    100 ms step: the residual "step less what is named" would be -50 ms."""
    from workbench.launch.local import config_from_cli
    from workbench.rundir import EventWriter, create_run_dir

    config = config_from_cli("tiny", "dp_shard=2", 6)
    path = create_run_dir(config, root, "overlap")
    for r in range(2):
        with EventWriter(path, r) as w:
            for s in range(6):
                t = 100.0 + s
                w.emit(kind="step", step=s, loss=5.0, grad_norm=1.0, lr=1e-3, tokens=256, tokens_per_s=1.0,
                       step_time_s=0.1, data_wait_s=0.002, t=t)
                w.emit(kind="collectives", step=s, t=t, calls=[
                    {"op": "all_gather", "dim": "dp_shard", "group": [0, 1], "n": 2, "bytes": 4096, "start": t - 0.1,
                     "end": t - 0.1 + 0.075} for _ in range(2)])
    return path


def test_derived_times_are_never_negative_and_say_how(tmp_path):
    from test_run_views import BUSY_S, P2P_S, STEP_S, WINDOW_S, write_stopped_run

    from workbench.rundir.compare import compare_run, format_value

    # pp=2: the residual double-counts the pipeline's sends (they run during the actions and the waits)
    cmp = compare_run(write_stopped_run(tmp_path, resume=True))
    bubble, comm = cmp.row("step time", "bubble"), cmp.row("step time", "comm_pp")
    assert bubble.measured == pytest.approx(WINDOW_S - BUSY_S) and comm.measured == pytest.approx(2 * P2P_S)
    assert STEP_S - bubble.measured - comm.measured < 0  # what the residual would have said
    compute = cmp.row("step time", "compute")
    assert compute.measured == pytest.approx(BUSY_S) and "pipeline actions" in compute.how
    # no pipeline, calls overlapping compute: the residual, floored at 0, and a note says by how much
    cmp = compare_run(_overlapping_dp_run(tmp_path))
    compute = cmp.row("step time", "compute")
    assert compute.measured == 0.0 and compute.how.startswith("derived:")
    assert any("compute is shown as 0" in n and "52.00 ms" in n for n in cmp.notes), cmp.notes  # 150 + 2 - 100
    for c in (cmp, compare_run(tmp_path / "stopped")):
        for r in c.section("step time"):
            assert r.measured is None or r.measured >= 0, r
        text = c.format()
        assert "derived: step - data wait" in text or "pipeline actions" in text
        assert "(1) " in text  # the footnotes that say how
        assert not any(format_value(r.measured, r.unit).startswith("-") and r.measured is not None
                       for r in c.rows if r.unit == "s")
