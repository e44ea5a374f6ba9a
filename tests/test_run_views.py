"""The run views' data transforms (events -> plot data) and the views fed from a run directory.

A synthetic run (500 steps x 4 ranks, pp=2 x dp_shard=2, with known numbers in every event) is
written with the real EventWriter; every transform is checked against the numbers put in, the
incremental reader against a torn line, the digest's speed on tens of thousands of events, and
the live and compare views against a replayed directory. No processes: the browser test
(tests/test_browser_run.py) launches a real run.
"""

from __future__ import annotations

import math
import time

import pytest

from workbench import ConfigError
from workbench.rundir.benchmarks import CommsResults, CommsRow
from workbench.predict.comms import BUS_FACTOR, collective_time
from workbench.launch.local import config_from_cli
from workbench.rundir import EventWriter, create_run_dir
from workbench.rundir.tail import EventTail

from widgets import run_transforms as rt
from widgets.launch_view import backend_options, build_launch_config

STEPS, WORLD = 500, 4
CONFIG = config_from_cli("tiny", "pp=2,dp_shard=2", STEPS)


def step_time(step: int, rank: int) -> float:
    return 0.1 + 0.01 * rank + (0.05 if step % 7 == 0 and rank == 2 else 0.0)


def write_run(root, steps: int = STEPS, extra: bool = True):
    """A run directory of synthetic events; returns (path, n_events)."""
    path = create_run_dir(CONFIG, root, "synthetic")
    writers = [EventWriter(path, r) for r in range(WORLD)]
    n = 0
    for r, w in enumerate(writers):
        w.emit(kind="run_start", world_size=WORLD, mesh={"pp": 2, "dp_shard": 2}, coords={}, device="cpu",
               backend="gloo", n_params=1, n_local_params=1, steps=steps)
        n += 1
    for s in range(steps):
        t = 1000.0 + s
        for r, w in enumerate(writers):
            pp_rank = r // 2
            w.emit(kind="step", step=s, loss=5.0 - s / 1000, grad_norm=1.0 + s / 100, lr=1e-3, tokens=256,
                   tokens_per_s=1000.0 + s, step_time_s=step_time(s, r), mfu=0.01 * (1 + s % 3),
                   tokens_per_expert=[[s, 2 * s, 3 * s]] if extra else None)
            # F of micro-batch 0 then B; pp rank 1 starts 0.01 s later
            a0 = t + 0.01 * pp_rank
            w.emit(kind="pipeline", step=s, pp_rank=pp_rank, window=[t, t + 0.05], busy_s=0.03, bubble_fraction=0.4,
                   actions=[["F", pp_rank, 0, a0, a0 + 0.01], ["B", pp_rank, 0, a0 + 0.02, a0 + 0.04]])
            w.emit(kind="collectives", step=s, calls=[
                {"op": "all_gather", "dim": "dp_shard", "group": [2 * pp_rank, 2 * pp_rank + 1], "n": 2,
                 "bytes": 1000, "start": t, "end": t + 0.001, "busbw": 500_000.0},
                {"op": "all_gather", "dim": "dp_shard", "group": [2 * pp_rank, 2 * pp_rank + 1], "n": 2,
                 "bytes": 3000, "start": t, "end": t + 0.003, "busbw": 500_000.0},
                {"op": "all_reduce", "dim": "world", "group": [0, 1, 2, 3], "n": 4, "bytes": 4, "start": t,
                 "end": t + 0.001, "busbw": 1.0, "scalar": True}])
            w.emit(kind="memory", step=s, parameters=100 + r, gradients=200, optimizer=400,
                   activations=1000 + (s % 5))
            n += 4
        if extra and s == 3:
            writers[0].emit(kind="guard", step=s, guard="grad_spike", value=9.0, threshold=5.0, message="spike")
            for w in writers:
                w.emit(kind="checkpoint", phase="written", step=s, path="p", bytes=100, duration_s=0.2 + 0.1 * w.rank)
            writers[0].emit(kind="checkpoint", phase="committed", step=s, path="p", bytes=400, duration_s=0.05)
            n += 6
    for w in writers:
        w.close()
    return path, n


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("runs"))


def test_tail_reads_only_new_whole_lines(tmp_path):
    path = create_run_dir(CONFIG, tmp_path, "t")
    tail = EventTail(path)
    assert tail.read() == []
    with EventWriter(path, 0) as w:
        w.emit(kind="step", step=0, loss=1.0)
    f = open(path / "events" / "rank-0.jsonl", "a")
    f.write('{"kind": "step", "rank": 0, "seq": 1, "t": 1.0, "step": 1, "lo')  # torn: mid-write
    f.flush()
    got = tail.read()
    assert [e["step"] for e in got] == [0]
    f.write('ss": 2.0}\n')
    f.close()
    got = tail.read()
    assert [(e["step"], e["loss"]) for e in got] == [(1, 2.0)]
    assert tail.read() == [] and tail.count == 2


def test_digest_matches_the_events_and_is_fast(run_dir):
    path, n = run_dir
    t0 = time.perf_counter()
    events = EventTail(path).read()
    read_s = time.perf_counter() - t0
    assert len(events) == n > 8000
    digest = rt.RunDigest(config=CONFIG)
    curves = {k: [] for k in ("step", "loss", "mfu")}
    steps = {k: [] for k in ("step", "p50", "p95", "max", "slowest")}
    marks = []
    t0 = time.perf_counter()
    for i in range(0, len(events), 400):  # the live view's batches
        out = digest.add(events[i:i + 400])
        for k in curves:
            curves[k] += out["curves"][k]
        for k in steps:
            steps[k] += out["step_times"][k]
        marks += out["markers"]["label"]
    fold_s = time.perf_counter() - t0
    print(f"\n{len(events)} events: read {read_s * 1e3:.0f} ms, folded in {fold_s * 1e3:.0f} ms")
    assert read_s < 2.0 and fold_s < 2.0
    # curves: rank 0's steps, 1-based, in order
    assert curves["step"] == list(range(1, STEPS + 1))
    assert curves["loss"][10] == pytest.approx(5.0 - 10 / 1000)
    assert curves["mfu"][:3] == pytest.approx([0.01, 0.02, 0.03])
    # step-time distribution: every step once, with its slowest rank
    assert steps["step"] == list(range(1, STEPS + 1))
    assert steps["max"][7] == pytest.approx(step_time(7, 2)) and steps["slowest"][7] == 2
    assert steps["slowest"][8] == 3 and steps["p50"][8] == pytest.approx((0.11 + 0.12) / 2)
    assert marks == ["guard grad_spike: spike"]
    # the pipeline of the last step, times from its first window start
    step, actions = digest.pipeline()
    assert step == STEPS - 1 and len(actions) == 4
    f1 = next(a for a in actions if a["rank"] == 1 and a["kind"] == "F")
    assert f1["start"] == pytest.approx(0.01) and f1["end"] == pytest.approx(0.02)
    # memory: latest model states, peak activations, the planner's bill beside them
    mem = digest.memory()
    assert [m["rank"] for m in mem] == [0, 1, 2, 3]
    assert mem[3]["parameters"] == 103 and mem[0]["activations"] == 1004
    assert mem[0]["parameters_predicted"] > 0
    # communication: bookkeeping left out; per step and rank: 2 calls, 4000 B, 4 ms, busbw 500 kB/s
    (row,) = digest.comm_rows()
    assert (row["dim"], row["op"]) == ("dp_shard", "all_gather")
    assert row["calls"] == pytest.approx(2) and row["bytes"] == pytest.approx(4000)
    assert row["time_s"] == pytest.approx(0.004) and row["busbw"] == pytest.approx(500_000)
    assert row["peak"] == CONFIG.cluster.link(row["tier"]).bandwidth_bytes_per_s
    # experts: the last step's counts summed over 4 ranks
    step, load = digest.experts()
    assert step == STEPS - 1 and load == [[4 * (STEPS - 1), 8 * (STEPS - 1), 12 * (STEPS - 1)]]
    cells = rt.heatmap_rects(load)
    assert cells["share"] == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    # checkpoints: per-rank bytes summed, the longest duration
    ck = {r["phase"]: r for r in digest.checkpoints()}
    assert ck["written"]["bytes"] == 400 and ck["written"]["duration_s"] == pytest.approx(0.5)
    assert ck["committed"]["bytes"] == 400 and ck["committed"]["ranks"] == 1


def test_markers_keep_each_restart_once_and_label_it():
    evs = [{"kind": "restart", "rank": r, "attempt": 1, "t": 1.0} for r in range(4)]
    evs += [{"kind": "fault", "rank": r, "cause": "killed", "attempt": 0, "last_step": 9, "t": 1.0} for r in (0, 1)]
    evs += [
            {"kind": "resume", "rank": 0, "step": 10, "path": "/r/checkpoints/step-10", "t": 2.0},
            {"kind": "resume", "rank": 1, "step": 10, "path": "/r/checkpoints/step-10", "t": 2.0}]
    m = rt.markers(evs)
    assert m["kind"] == ["restart", "fault", "resume"]
    assert m["step"] == [0, 10, 10]
    assert m["label"][1] == "fault of attempt 0 (killed)"
    assert m["label"][2] == "resume at step 10 from step-10"


def test_step_times_prefer_the_trainers_step_stats():
    evs = [{"kind": "step_stats", "rank": 0, "step": 4, "step_time_s": [0.1, 0.4, 0.2, 0.3], "slowest_rank": 1}]
    cols = rt.step_time_rows(evs)
    assert cols == {"step": [5], "p50": [0.25], "p95": [0.4], "max": [0.4], "min": [0.1], "slowest": [1]}


def test_bandwidth_series_sets_the_planner_beside_the_measurement():
    rows = tuple(CommsRow("dp_shard", "all_reduce", 4, "intra_node", s, s, 5, 1, t, t, t)
                 for s, t in ((1024, 1e-4), (1 << 20, 2e-3)))
    res = CommsResults(cluster=CONFIG.cluster, plan=CONFIG.plan, world_size=4, backend="gloo", device="cpu",
                       dtype="float32", rows=rows)
    (series,) = rt.bandwidth_series(res)
    assert series["size"] == [1024, 1 << 20]
    assert series["busbw"][1] == pytest.approx((1 << 20) / 2e-3 * 1.5)  # all-reduce bus factor 2(n-1)/n
    t = collective_time("all_reduce", 1 << 20, 4, CONFIG.cluster, "intra_node")
    assert series["predicted_busbw"][1] == pytest.approx((1 << 20) * BUS_FACTOR["all_reduce"](4) / t)


def test_bench_view_reads_comms_json_under_the_runs_root(tmp_path):
    import widgets
    from workbench.rundir.benchmarks import save_results

    rows = tuple(CommsRow(dim, "all_gather", 2, "intra_node", s, s, 5, 1, 1e-3, 1e-3, 1e-3)
                 for dim in ("dp_shard", "pp") for s in (64, 4096))
    res = CommsResults(cluster=CONFIG.cluster, plan=CONFIG.plan, world_size=4, backend="gloo", device="cpu",
                       dtype="float32", rows=rows)
    (tmp_path / "bench-1").mkdir()
    save_results(res, tmp_path / "bench-1" / "comms.json")
    state = widgets.PlanState()
    widgets.session_of(state).runs_root = str(tmp_path)
    view = widgets.BenchView(state)
    assert view.refresh() == ["bench-1/comms.json"]
    view.op = "all_gather"
    view.panel()
    assert [s["dim"] for s in view.series] == ["dp_shard", "pp"]
    assert view.series[0]["busbw"] == pytest.approx([64 / 1e-3 * 0.5, 4096 / 1e-3 * 0.5])  # (n-1)/n = 1/2
    assert 'data-testid="bench-table"' in view._table.object and view._table.object.count("<tr>") == 5
    fig = view._plot.object
    assert fig.x_scale.__class__.__name__ == "LogScale" and len(fig.renderers) == 6  # 3 glyphs per group


def test_launch_fields_are_validated_before_anything_starts():
    config = build_launch_config("tiny", "pp=2", 30, checkpoint_every=10)
    assert (config.plan.pp, config.world_size, config.train.steps, config.train.checkpoint_every) == (2, 2, 30, 10)
    with pytest.raises(ConfigError) as e:
        build_launch_config("tiny", "pp=2,tp=3", 30)
    assert "tp=3" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_launch_config("tiny", "pp=2", 0)
    assert e.value.field == "steps"
    with pytest.raises(ConfigError) as e:
        build_launch_config("not-a-model", "pp=2", 5)
    assert e.value.field == "model"
    with pytest.raises(ConfigError) as e:
        build_launch_config("tiny", "pp=two", 5)
    assert e.value.field in ("plan", "pp") and "two" in str(e.value)
    with pytest.raises(ConfigError) as e:
        backend_options("ssh", " ", "", "")
    assert e.value.field == "hosts"
    with pytest.raises(ConfigError) as e:
        backend_options("gateway", "", "file:///etc", "")
    assert e.value.field == "url"
    assert backend_options("ssh", "a, b", "", "") == {"hosts": ["a", "b"]}


def test_replay_fills_the_live_and_compare_views(tmp_path):
    import widgets

    path, _ = write_run(tmp_path, steps=30, extra=False)
    widgets.extension()
    state = widgets.PlanState()
    session = widgets.session_of(state)
    session.runs_root = str(tmp_path)
    live, compare, launch = widgets.LiveView(state), widgets.CompareView(state), widgets.LaunchView(state)
    assert compare.refresh_runs() == ["synthetic"]
    compare.panel()
    assert compare.sources[1].data["step"] == list(range(1, 31))
    assert "compare-table-b" in compare._tables[1].object
    compare.replay("synthetic")
    assert session.replay and session.run_dir == str(path)
    assert live.curves.data["step"] == list(range(1, 31))
    assert live.curves.data["loss"][-1] == pytest.approx(5.0 - 29 / 1000)
    assert live._pipeline_step == 29 and len(live.pipeline.measured) == 4
    assert (live.pipeline.schedule, live.pipeline.pp) == ("1f1b", 2)  # the run's plan, simulated beside
    assert 'data-testid="live-comm"' in live._comm.object
    assert 'data-testid="run-state">replay<' in launch._status.object
    # new events stream in: only they are read, and the curve grows by their rows
    with EventWriter(path, 0) as w:
        w.emit(kind="step", step=30, loss=1.5, grad_norm=1.0, lr=1e-3, tokens=1, tokens_per_s=1.0, step_time_s=0.1)
    assert len(session.poll()) == 1
    assert live.curves.data["step"][-1] == 31 and live.curves.data["loss"][-1] == 1.5
    assert not math.isnan(live.curves.data["mfu"][0]) and math.isnan(live.curves.data["mfu"][-1])
    assert live._expert_slot.objects == []  # a dense run: no heat map
    # a resume from the checkpoint of step 20: the lost attempt's steps 21..31 leave the curves
    with EventWriter(path, 0) as w:
        w.emit(kind="fault", cause="killed", attempt=0, last_step=30)
        w.emit(kind="resume", step=20, path=str(path / "checkpoints" / "step-20"))
        w.emit(kind="step", step=20, loss=1.25, grad_norm=1.0, lr=1e-3, tokens=1, tokens_per_s=1.0, step_time_s=0.1)
    session.poll()
    assert live.curves.data["step"] == list(range(1, 22)) and live.curves.data["loss"][-1] == 1.25
    assert [m["kind"] for m in live.marks] == ["fault", "resume"]
    assert 'data-testid="run-marks"' in live._marks_pane.object


def test_compare_overlays_two_runs_and_the_heat_map_shows_for_moe(tmp_path):
    import widgets

    write_run(tmp_path / "a", steps=12, extra=True)
    write_run(tmp_path / "b", steps=20, extra=False)
    for d in ("a", "b"):
        (tmp_path / d / "synthetic").rename(tmp_path / f"run-{d}")
    state = widgets.PlanState()
    session = widgets.session_of(state)
    session.runs_root = str(tmp_path)
    live, compare = widgets.LiveView(state), widgets.CompareView(state)
    assert sorted(compare.refresh_runs()) == ["run-a", "run-b"]
    compare.param.update(run_a="run-a", run_b="run-b", metric="grad_norm")
    assert compare.sources[0].data["step"] == list(range(1, 13))
    assert compare.sources[1].data["y"][-1] == pytest.approx(1.0 + 19 / 100)
    assert compare.figure.title.text == "grad_norm"
    compare.replay("run-a")
    assert live._expert_slot.objects and live.experts.data["tokens"] == [44, 88, 132]  # 4 ranks x step 11


def test_each_app_session_has_its_own_runs():
    import widgets

    a, b = widgets.create_app(), widgets.create_app()
    sa, sb = widgets.session_of(a.state), widgets.session_of(b.state)
    assert sa is not sb
    assert a.views["6 · Launch"].session is sa and a.views["7 · Live run"].session is sa
    assert b.views["8 · Compare"].session is sb
