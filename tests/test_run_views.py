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


# ---------------------------------------------------------------------------- stopped, resumed, finished
# Run directories as a user's Stop leaves them: pp=2 on 2 ranks; the Stop's SIGTERM ends rank 0
# ("interrupted"), and rank 1, whose peer has gone, raises gloo's "Connection reset by peer" 2 s
# later (it waited that long for its own signal) and ends "error". A resume then rejects the
# newest checkpoint, loads the one before and runs to the end. Also used by
# tests/test_browser_runs_views.py, which serves them.
RESET = ("rank 1: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by "
         "peer [127.0.0.1]:40417")
STOP_STEPS, STOP_AT, CKPT_EVERY, REJECTED, RESUME_AT = 12, 7, 2, 6, 4  # steps, stopped after, ckpts, ...
STEP_S, WINDOW_S, BUSY_S, P2P_S = 0.1, 0.09, 0.054, 0.04  # per step; p2p calls overlap the actions
PP2 = config_from_cli("tiny", "pp=2", STOP_STEPS)
DP2 = config_from_cli("tiny", "dp_shard=2", 10)


def _steps(w, first: int, last: int, t0: float, pp: bool = True) -> float:
    """Steps first..last-1 on writer ``w`` from time t0; returns the time after them."""
    r = w.rank
    t = t0
    for s in range(first, last):
        t = t0 + (s - first + 1) * 0.2
        w.emit(kind="step", step=s, loss=5.5 - 0.1 * s, grad_norm=2.0 - 0.05 * s, lr=1e-3, tokens=256,
               tokens_per_s=2000.0 + s, step_time_s=STEP_S, mfu=0.01, t=t)
        if pp:
            a = t - STEP_S + 0.005 + 0.01 * r
            w.emit(kind="pipeline", step=s, pp_rank=r, window=[t - STEP_S, t - STEP_S + WINDOW_S], busy_s=BUSY_S,
                   bubble_fraction=1 - BUSY_S / WINDOW_S, actions=[["F", r, 0, a, a + 0.018], ["B", r, 0, a + 0.03, a + 0.066]],
                   t=t)
            w.emit(kind="collectives", step=s, t=t, calls=[
                {"op": "send_recv", "dim": "pp", "group": [0, 1], "n": 2, "bytes": 65536, "dir": d,
                 "start": t - STEP_S, "end": t - STEP_S + P2P_S} for d in ("send", "send")])
        w.emit(kind="memory", step=s, parameters=1000, gradients=1000, optimizer=2000, activations=500, t=t)
    return t


def _checkpoint(writers, step: int, t: float) -> None:
    path = f"checkpoints/step-{step}"
    for w in writers:
        w.emit(kind="checkpoint", phase="written", step=step, path=path + ".tmp", bytes=1000, duration_s=0.01, t=t)
    writers[0].emit(kind="checkpoint", phase="committed", step=step, path=path, bytes=2500, duration_s=0.002, t=t)
    writers[0].emit(kind="checkpoint", phase="verified", step=step, path=path, bytes=2500, duration_s=0.001, t=t)


def _start(writers, config, step: int, t: float) -> None:
    for w in writers:
        w.emit(kind="run_start", world_size=config.world_size, mesh={"pp": config.plan.pp}, coords={}, device="cpu",
               backend="gloo", n_params=1, n_local_params=1, steps=config.train.steps, step=step, t=t)


def write_stopped_run(root, run_id: str = "stopped", resume: bool = False):
    """The Stop above (and, with ``resume``, the resume to the end); returns the run directory."""
    path = create_run_dir(PP2, root, run_id)
    writers = [EventWriter(path, r) for r in range(2)]
    t = 1_700_000_000.0
    _start(writers, PP2, 0, t)
    for s in range(0, STOP_AT, CKPT_EVERY):  # steps in chunks, a checkpoint after each full chunk
        end = min(s + CKPT_EVERY, STOP_AT)
        for w in writers:
            t_end = _steps(w, s, end, t)
        t = t_end
        if end % CKPT_EVERY == 0:
            _checkpoint(writers, end, t)
    writers[0].emit(kind="run_end", status="interrupted", step=STOP_AT, elapsed_s=3.0, t=t + 0.1)
    writers[1].emit(kind="error", error=RESET, traceback="Traceback ...", t=t + 2.1)
    writers[1].emit(kind="run_end", status="error", step=STOP_AT, elapsed_s=5.0, t=t + 2.1)
    if resume:
        t += 30
        writers[0].emit(kind="fault", cause="interrupted", attempt=0, last_step=STOP_AT - 1, detail="stopped by a signal",
                        t=t)
        writers[1].emit(kind="fault", cause="error", attempt=0, last_step=STOP_AT - 1, detail=RESET, t=t)
        _start(writers, PP2, RESUME_AT, t)
        writers[0].emit(kind="checkpoint_rejected", step=REJECTED, path=f"checkpoints/step-{REJECTED}",
                        reason="hashes.json: __0_0.distcp has another sha256", fallback=f"checkpoints/step-{RESUME_AT}",
                        t=t)
        writers[0].emit(kind="checkpoint", phase="verified", step=RESUME_AT, path=f"checkpoints/step-{RESUME_AT}",
                        bytes=2500, t=t)
        for w in writers:
            w.emit(kind="checkpoint", phase="loaded", step=RESUME_AT, path=f"checkpoints/step-{RESUME_AT}", bytes=1000,
                   duration_s=0.01, t=t)
            w.emit(kind="resume", step=RESUME_AT, path=f"checkpoints/step-{RESUME_AT}", t=t)
        for s in range(RESUME_AT, STOP_STEPS, CKPT_EVERY):
            for w in writers:
                t_end = _steps(w, s, s + CKPT_EVERY, t)
            t = t_end
            _checkpoint(writers, s + CKPT_EVERY, t)
        for w in writers:
            w.emit(kind="run_end", status="ok", step=STOP_STEPS, elapsed_s=9.0, t=t + 0.1)
    for w in writers:
        w.close()
    return path


def write_finished_run(root, run_id: str = "finished", steps: int = 10):
    """A run without a pipeline (dp_shard=2) that finished all its steps."""
    path = create_run_dir(DP2, root, run_id)
    writers = [EventWriter(path, r) for r in range(2)]
    t = 1_700_100_000.0
    _start(writers, DP2, 0, t)
    for w in writers:
        t_end = _steps(w, 0, steps, t, pp=False)
        w.emit(kind="run_end", status="ok", step=steps, elapsed_s=2.0, t=t_end + 0.1)
        w.close()
    return path


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
    t0 = time.perf_counter()
    for i in range(0, len(events), 400):  # the live view's batches
        out = digest.add(events[i:i + 400])
        for k in curves:
            curves[k] += out["curves"][k]
        for k in steps:
            steps[k] += out["step_times"][k]
    marks = digest.marks()["label"]
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


# ---------------------------------------------------------------------------- stops, failures, resets
def _ev(rank: int, seq: int, kind: str, t: float, **fields):
    if kind == "step":
        fields = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 1, "tokens_per_s": 1.0, "step_time_s": 0.1,
                  **fields}
    return {"kind": kind, "rank": rank, "seq": seq, "t": t, **fields}


def test_a_stop_with_a_peers_connection_reset_is_a_stop_not_a_failure(tmp_path):
    from workbench.rundir import read_events
    from workbench.rundir.compare import compare_run
    from workbench.rundir.status import run_outcome

    path = write_stopped_run(tmp_path)
    events = read_events(path)
    out = run_outcome(events, 2)
    assert (out.state, out.step) == ("stopped", STOP_AT)
    assert [(r.rank, r.state) for r in out.ranks] == [(0, "stopped"), (1, "stopped")]
    assert "Connection reset by peer" in out.ranks[1].why and "stopped rank" in out.ranks[1].why
    assert [(e.rank, e.role, e.step) for e in out.errors] == [(1, "stop", STOP_AT)] and out.failures == []
    marks = rt.markers(events, 2)
    assert marks["kind"] == ["stop"] and marks["step"] == [STOP_AT]
    # the live view's digest, fed a few events at a time, keeps only what decides this, and agrees
    digest = rt.RunDigest(config=PP2)
    for i in range(0, len(events), 7):
        digest.add(events[i:i + 7])
    assert digest.outcome() == out and digest.marks() == marks and digest.failures() == []
    assert len(digest.tracker.events) < 20 < len(events)
    # compare says the same, in its header line and its notes
    cmp = compare_run(path)
    assert cmp.outcome.startswith(f"stopped at step {STOP_AT}")
    assert cmp.format().splitlines()[1].startswith("run: stopped at step 7")
    assert any("raised by a stop" in n for n in cmp.notes)
    # the launcher's status table: the driver saw rank 1 fail; the run directory says it stopped
    from workbench.launch.handle import NodeStatus, RankStatus, RunStatus
    status = RunStatus("stopped", "stopped by the user", (NodeStatus(0, "h", "stopped", "", (0, 1)),),
                       (RankStatus(0, 0, "stopped", "interrupted", 6, 4.9, 30), RankStatus(1, 0, "failed", RESET, 6, 4.9, 30)))
    rows = rt.status_rows(status, out)
    assert [r["state"] for r in rows] == ["stopped", "stopped"] and "stopped rank" in rows[1]["why"]
    assert [r["state"] for r in rt.status_rows(status)] == ["stopped", "failed"]  # without the outcome: as the driver saw


def test_failures_stay_failures_around_a_stop():
    from workbench.rundir.status import run_outcome

    # a rank raised for itself; torchrun then stopped the other one, whose peer reset is that failure's echo
    evs = [_ev(0, 0, "run_start", 0.0), _ev(0, 1, "step", 1.0, step=0), _ev(0, 2, "error", 2.5, error=RESET.replace("1", "0", 1)),
           _ev(0, 3, "run_end", 2.5, status="error", step=1),
           _ev(1, 0, "run_start", 0.0), _ev(1, 1, "error", 2.0, error="rank 1: RuntimeError: injected failure at step 1"),
           _ev(1, 2, "run_end", 2.0, status="error", step=1)]
    out = run_outcome(evs, 2)
    assert out.state == "failed" and out.why == "rank 1: RuntimeError: injected failure at step 1"
    assert [e.role for e in out.failures] == ["failure", "failure"]
    # the connection went first (a lost network), and the stop came after it: a failure
    evs = [_ev(1, 0, "run_start", 0.0), _ev(1, 1, "error", 1.0, error=RESET), _ev(1, 2, "run_end", 1.0, status="error"),
           _ev(0, 0, "run_start", 0.0), _ev(0, 1, "run_end", 3.0, status="interrupted", step=1)]
    assert run_outcome(evs, 2).state == "failed"
    # a rank that says it was signalled is stopped, with or without a peer's run_end
    evs = [_ev(0, 0, "run_start", 0.0), _ev(0, 1, "error", 1.0, error="rank 0: SignalException: got signal: 15"),
           _ev(0, 2, "run_end", 1.0, status="error", step=3)]
    assert run_outcome(evs, 1).describe().startswith("stopped at step 3")


def test_an_earlier_attempts_failure_is_a_fault_once_the_run_went_on():
    from workbench.rundir.status import run_outcome

    boom = "rank 0: RuntimeError: injected failure at step 2"
    evs = [_ev(0, 0, "run_start", 0.0), _ev(0, 1, "step", 1.0, step=0), _ev(0, 2, "error", 2.0, error=boom),
           _ev(0, 3, "run_end", 2.0, status="error", step=1)]
    assert rt.markers(evs, 1)["kind"] == ["error"]
    evs += [_ev(0, 4, "fault", 5.0, cause="error", attempt=0, last_step=0, detail=boom),
            _ev(0, 5, "run_start", 5.0, step=0), _ev(0, 6, "step", 6.0, step=0), _ev(0, 7, "step", 7.0, step=1),
            _ev(0, 8, "run_end", 7.5, status="ok", step=2)]
    out = run_outcome(evs, 1)
    assert (out.state, out.attempts, out.failures) == ("finished", 2, [])
    assert [e.role for e in out.errors] == ["earlier"]
    m = rt.markers(evs, 1)
    assert m["kind"] == ["fault"] and m["label"] == [f"fault of attempt 0 (error): {boom}"]
    # the digest, fed in the live view's batches, drops the error once the next attempt starts
    digest = rt.RunDigest()
    digest.add(evs[:4])
    assert digest.failures() == [boom] and digest.marks()["kind"] == ["error"]
    out = digest.add(evs[4:])
    assert digest.failures() == [] and out["markers"]["kind"] == ["fault"]


def test_the_live_view_resets_per_run_and_follows_to_the_last_step(tmp_path):
    import widgets

    stopped, resumed = write_stopped_run(tmp_path), write_stopped_run(tmp_path, "resumed", resume=True)
    write_finished_run(tmp_path)
    state = widgets.PlanState()
    session = widgets.session_of(state)
    session.runs_root = str(tmp_path)
    live = widgets.LiveView(state)
    live.panel()

    session.open(stopped)  # a replay: its events say how it stands
    assert 'data-testid="live-state">stopped<' in live._headline.object
    assert 'data-testid="live-errors">0<' in live._headline.object
    assert live.mark_source.data["kind"] == ["stop"] and live.mark_source.data["step"] == [STOP_AT]
    assert 'data-testid="live-ranks"' in live._ranks.object and "failed" not in live._ranks.object
    assert live.checkpoint_sources["saved"].data["step"] == [2, 4, 6]

    session.open(resumed)  # stopped, resumed, finished: no error left, checkpoints on the step axis
    assert 'data-testid="live-state">finished<' in live._headline.object
    assert 'data-testid="live-step">12 / 12<' in live._headline.object
    assert live.curves.data["step"] == list(range(1, STOP_STEPS + 1))  # the lost steps 5..7 trimmed
    assert live.step_source.data["step"] == list(range(1, STOP_STEPS + 1))  # and retaken after the resume
    assert live.mark_source.data["kind"] == ["stop", "checkpoint_rejected", "resume"]
    assert "error" not in live.mark_source.data["kind"]
    timeline = {k: src.data["step"] for k, src in live.checkpoint_sources.items()}
    assert timeline == {"saved": [2, 4, 6, 8, 10, 12], "committed": [2, 4, 6, 8, 10, 12],
                        "verified": [2, 4, 6, 8, 10, 12], "loaded": [4], "rejected": [6], "failed": []}
    assert live._pipeline_step == STOP_STEPS - 1 and 'data-testid="measured-step">12<' in live._pipe_note.object
    assert (live.pipeline.schedule, live.pipeline.pp) == ("1f1b", 2)

    session.open(tmp_path / "finished")  # no pipeline: nothing of the previous run's is left
    assert live._pipeline_step is None and live._pipe_note.object == "" and live.pipeline.measured == []
    assert "live-no-pipeline" in live._no_pipeline.object and not live.pipeline.panel().visible
    assert all(not src.data["step"] for src in live.checkpoint_sources.values())
    assert live.mark_source.data["step"] == [] and live._marks_pane.object == ""
    assert 'data-testid="live-step">10 / 10<' in live._headline.object


def test_the_measured_pipeline_shows_the_last_step_once_the_run_ends(tmp_path):
    """A launched run: while it runs the Gantt chart refreshes every PIPELINE_REFRESH_S; the poll
    after it ended draws its last step even when no event came with it."""
    import types

    import widgets

    path = write_stopped_run(tmp_path, "live", resume=True)
    events = EventTail(path).read()
    state = widgets.PlanState()
    session = widgets.session_of(state)
    session.run_dir, session.config = str(path), PP2
    live = widgets.LiveView(state)
    live.reset()
    running, finished = types.SimpleNamespace(state="running"), types.SimpleNamespace(state="finished")
    cut = max(i for i, e in enumerate(events) if e["kind"] == "pipeline" and e["step"] == 8)
    live.update(events[:cut + 1], running)
    assert live._pipeline_step == 8
    live.update(events[cut + 1:], running)  # within PIPELINE_REFRESH_S: not redrawn yet
    assert live._pipeline_step == 8
    live.update([], finished)  # the run ended: its last step, at once
    assert live._pipeline_step == STOP_STEPS - 1
    assert 'data-testid="measured-step">12<' in live._pipe_note.object


def test_compare_draws_what_is_selected_and_a_resumed_run_once(tmp_path):
    import widgets

    write_stopped_run(tmp_path)
    write_stopped_run(tmp_path, "resumed", resume=True)
    state = widgets.PlanState()
    widgets.session_of(state).runs_root = str(tmp_path)
    compare = widgets.CompareView(state)
    assert sorted(compare.refresh_runs()) == ["resumed", "stopped"]
    compare.param.update(run_a="stopped", run_b="")  # A alone draws A
    assert compare.sources[0].data["step"] == list(range(1, STOP_AT + 1)) and compare.sources[1].data["step"] == []
    assert "compare-table-a" in compare._tables[0].object and compare._tables[1].object == ""
    assert "run: stopped at step 7" in compare._tables[0].object and "how measured" in compare._tables[0].object
    compare.run_b = "resumed"  # and B beside it: the lost attempt's steps 5..7 are not drawn twice
    assert compare.sources[1].data["step"] == list(range(1, STOP_STEPS + 1))
    assert compare.sources[1].data["y"][4] == pytest.approx(5.5 - 0.1 * 4)
    assert compare.sources[0].data["step"] == list(range(1, STOP_AT + 1))
    compare.run_a = ""  # B alone
    assert compare.sources[0].data["step"] == [] and len(compare.sources[1].data["step"]) == STOP_STEPS
    assert [i.label["value"] for i in compare.figure.legend.items] == ["A: (none)", "B: resumed"]
