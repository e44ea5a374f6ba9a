"""The event contract and the run directory (no processes, no torch needed)."""

from __future__ import annotations

import json

import pytest

from workbench.rundir import EventWriter, create_run_dir, load_run, read_events, read_rank_events
from workbench.rundir.events import KINDS, Error, RunEnd, RunStart, Step, find_gaps, next_seq, rank_file
from workbench.spec.errors import ConfigError


def test_writer_adds_common_fields_and_counts_seq(tmp_path):
    with EventWriter(tmp_path, rank=1) as w:
        w.emit(RunStart(world_size=2, mesh={"dp_shard": 2}, coords={"dp_shard": 1}, device="cpu", backend="gloo",
                        n_params=10, n_local_params=5, steps=2))
        w.emit(Step(step=0, loss=5.5, grad_norm=1.0, lr=1e-3, tokens=64, tokens_per_s=100.0, step_time_s=0.64))
        w.emit(kind="custom_kind", step=0, extra=[1, 2])  # later issues add kinds
        w.emit(RunEnd(status="ok", step=1))
    events = list(read_rank_events(tmp_path, 1))
    assert [e["kind"] for e in events] == ["run_start", "step", "custom_kind", "run_end"]
    assert [e["seq"] for e in events] == [0, 1, 2, 3]
    assert all(e["rank"] == 1 and isinstance(e["t"], float) for e in events)
    assert events[1]["loss"] == 5.5 and events[1]["step"] == 0
    assert set(KINDS) >= {"run_start", "step", "run_end", "error"}
    # A reopened writer continues the sequence.
    with EventWriter(tmp_path, rank=1) as w:
        assert w.emit(Error(error="rank 1: RuntimeError: x"))["seq"] == 4


def test_readers_tolerate_unknown_fields_and_a_torn_line(tmp_path):
    with EventWriter(tmp_path, rank=0) as w:
        w.emit(kind="step", step=0, loss=1.0)
    path = rank_file(tmp_path, 0)
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "step", "rank": 0, "seq": 1, "t": 1.0, "step": 1, "future_field": {"a": 1}}) + "\n")
        f.write('{"kind": "step", "rank": 0, "se')  # torn: still being written
    events = list(read_rank_events(tmp_path, 0))
    assert [e["seq"] for e in events] == [0, 1] and events[1]["future_field"] == {"a": 1}


def test_read_events_since_and_gaps(tmp_path):
    for rank in (0, 1):
        with EventWriter(tmp_path, rank) as w:
            for s in range(3):
                w.emit(kind="step", step=s, loss=float(s))
    events = read_events(tmp_path)
    assert len(events) == 6 and find_gaps(events) == {}
    since = next_seq(events)
    assert since == {0: 3, 1: 3}
    assert read_events(tmp_path, since) == []
    with EventWriter(tmp_path, 1) as w:
        w.emit(kind="step", step=3, loss=3.0)
    new = read_events(tmp_path, since)
    assert [(e["rank"], e["seq"]) for e in new] == [(1, 3)]
    assert find_gaps([e for e in events if e["seq"] != 1]) == {0: [1], 1: [1]}


def test_writer_never_drops_silently(tmp_path):
    w = EventWriter(tmp_path, 0)
    with pytest.raises(TypeError):
        w.emit(kind="step", bad=object())
    w.close()
    with pytest.raises(ValueError):
        w.emit(kind="step")  # closed file


def test_run_directory_round_trip(tmp_path):
    from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings

    config = RunConfig(ModelSpec.preset("tiny"), Cluster.preset("local-cpu", nodes=2),
                       ParallelPlan.parse("dp_shard=2,tp=2"), TrainSettings(seq_len=32, micro_batch_size=2))
    path = create_run_dir(config, root=tmp_path, run_id="r1")
    assert (path / "events").is_dir()
    run = load_run(path)
    assert run.config == config
    m = run.manifest
    assert m["world_size"] == 4 and m["mesh"] == {"dp_shard": 2, "tp": 2}
    for key in ("python", "torch", "workbench", "git_revision", "hostname", "devices", "start_time"):
        assert key in m
    with pytest.raises(ConfigError, match="already exists"):  # a run directory is never shared
        create_run_dir(config, root=tmp_path, run_id="r1")


def test_preempted_steps_do_not_count_in_the_measured_bubble():
    """Two ranks, 4 timed steps. In steps 1 and 3 rank 1 was preempted (on a CPU for 40 % of its
    unblocked window): its actions stretched and rank 0's idle grew. The bubble is the median over
    the clean steps 0 and 2 only (0.1 each), and with no step clean over all of them."""
    from workbench.rundir import analysis

    def step(s, idle0, share1):
        w = [10.0 * s, 10.0 * s + 1.0]
        return [
            {"kind": "pipeline", "rank": 0, "step": s + analysis.WARMUP_STEPS, "window": w, "wait_s": idle0,
             "cpu_s": 1.0 - idle0},
            {"kind": "pipeline", "rank": 1, "step": s + analysis.WARMUP_STEPS, "window": w, "wait_s": 0.0,
             "cpu_s": share1},
        ]

    events = step(0, 0.2, 1.0) + step(1, 0.6, 0.4) + step(2, 0.2, 0.95) + step(3, 0.6, 0.4)
    assert analysis.uncontended([e for e in events if e["step"] == analysis.WARMUP_STEPS])
    assert not analysis.uncontended([e for e in events if e["step"] == analysis.WARMUP_STEPS + 1])
    assert analysis.bubble_fraction(events) == pytest.approx(0.1)
    contended = step(1, 0.6, 0.4) + step(3, 0.6, 0.4)
    assert analysis.bubble_fraction(contended) == pytest.approx(0.3)
    cuda = [dict(e, cpu_s=None) for e in events]  # not measured: every step counts
    assert analysis.bubble_fraction(cuda) == pytest.approx(0.2)
