"""Experiment records in the app (issue 17): declared acceptance thresholds in the Launch tab, their
verdicts under an ended run's status, the naive baseline's button, and two runs' lineage
differences, summaries and verdicts in 8 · Compare.

Widget-level, no browser and no process: run directories are written with the real EventWriter,
and ``launch`` is replaced by a recorder (tests/test_browser_run.py launches the real plan and its
baseline in Chromium).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.launch.baseline import BASELINE_STEPS
from workbench.launch.handle import RunStatus
from workbench.launch.local import config_from_cli
from workbench.rundir import EventWriter, create_run_dir, load_run
from workbench.rundir.acceptance import ThresholdResult
from workbench.rundir.compare import format_value
from workbench.rundir.runs_compare import compare_runs
from workbench.spec.acceptance import Threshold

from widgets import launch_view
from widgets import run_transforms as rt
from widgets.compare_view import CompareView, records_html, verdict_table
from widgets.launch_view import LaunchView
from widgets.markup import escape
from widgets.state import PlanState

STEPS, STEP_S = 10, 0.1
PLAN_ACCEPT = "final_loss<=0.01,guards_fired<=0"  # the loss stays near 5: one fails, one holds


def write_run(root: Path, run_id: str, plan: str = "pp=2", accept: str = "", baseline_of: dict | None = None,
              steps: int = STEPS, step_s: float = STEP_S, framework: str | None = None) -> Path:
    """A finished run of ``plan`` (tiny model, 2 ranks): ``steps`` steps of ``step_s`` seconds,
    losses 5.5 - 0.1 s on every plan (the same data and batch), memory events, run_end ok."""
    config = config_from_cli("tiny", plan, steps)
    train = replace(config.train, accept=accept, **({"framework": framework} if framework else {}))
    config = config.replace(train=train)
    path = create_run_dir(config, root, run_id, manifest_extra={"baseline_of": baseline_of} if baseline_of else None)
    t = 1_700_000_000.0
    for r in range(config.world_size):
        with EventWriter(path, r) as w:
            w.emit(kind="run_start", world_size=config.world_size, mesh={}, coords={}, device="cpu", backend="gloo",
                   n_params=1, n_local_params=1, steps=steps, t=t)
            for s in range(steps):
                w.emit(kind="step", step=s, loss=5.5 - 0.1 * s, grad_norm=1.0, lr=1e-3, tokens=256,
                       tokens_per_s=2000.0, step_time_s=step_s, mfu=0.01, t=t + (s + 1) * step_s)
                w.emit(kind="memory", step=s, parameters=1000, gradients=1000, optimizer=2000,
                       activations=500 + 100 * r, t=t + (s + 1) * step_s)
            w.emit(kind="run_end", status="ok", step=steps, elapsed_s=steps * step_s, t=t + (steps + 1) * step_s)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A plan (pp=2, two thresholds declared) and its naive baseline (dp_shard=2, twice as fast)."""
    root = tmp_path_factory.mktemp("records")
    plan = write_run(root, "plan", accept=PLAN_ACCEPT)
    base = write_run(root, "base", plan="dp_shard=2", baseline_of={"plan": "pp=2 1f1b", "run_id": "plan"},
                     step_s=STEP_S / 2)
    return root, plan, base


# ---------------------------------------------------------------------------- the transforms
def test_acceptance_rows_say_status_threshold_measured_and_how():
    verdicts = [ThresholdResult(Threshold("final_loss", "<=", 0.01), 4.6123456, "fail", "step 9"),
                ThresholdResult(Threshold("guards_fired", "<=", 0.0), 0.0, "pass", "guard events"),
                ThresholdResult(Threshold("resume_loss_diff", "<=", 1e-6), None, "not measured", "no step ran twice")]
    assert rt.acceptance_rows(verdicts) == [
        {"status": "fail", "threshold": "final_loss<=0.01", "measured": "4.612", "how": "step 9"},
        {"status": "pass", "threshold": "guards_fired<=0", "measured": "0", "how": "guard events"},
        {"status": "not measured", "threshold": "resume_loss_diff<=1e-06", "measured": "-", "how": "no step ran twice"}]
    html = verdict_table(verdicts, "t")
    assert 'data-testid="t-head">acceptance: FAILED 1 of 3 declared thresholds<' in html
    assert html.count("<tr>") == 4 and 'data-testid="t"' in html
    assert verdict_table([], "t") == ""
    hostile = [ThresholdResult(Threshold("guards_fired", "<=", 0.0), 1.0, "fail", "<img src=x onerror=alert(1)>")]
    assert "<img" not in verdict_table(hostile, "t") and escape("<img src=x") in verdict_table(hostile, "t")


def test_summary_rows_set_the_plan_beside_its_baseline(pair):
    _, plan, base = pair
    comp = compare_runs(plan, base)
    rows = {r[0]: r[1:] for r in rt.summary_rows(comp)}
    assert rows["plan"][0] == "pp=2 1f1b" and rows["plan"][1].startswith("dp_shard=2")
    assert "(naive baseline of " in rows["plan"][1] and "pp=2 1f1b" in rows["plan"][1]
    assert rows["ranks"] == ["2", "2"] and rows["steps"] == [str(STEPS), str(STEPS)]
    assert rows["step time (median)"] == ["100.00 ms", "50.00 ms"]
    tokens = [load_run(p).config.tokens_per_step / t / 2 for p, t in ((plan, STEP_S), (base, STEP_S / 2))]
    assert [comp.a.tokens_per_s_per_gpu, comp.b.tokens_per_s_per_gpu] == pytest.approx(tokens)
    assert rows["tokens/s per GPU"] == [format_value(t, "") for t in tokens]
    assert rows["memory, most loaded rank"] == ["4.492 KiB", "4.492 KiB"]  # 4000 B of states + 600 B of rank 1: 4600 B
    assert rows["final loss"] == ["4.6000", "4.6000"]
    assert rows[f"loss: max relative difference over the {STEPS} steps both ran"] == ["0.00e+00", ""]
    assert [r.status for r in comp.a.acceptance] == ["fail", "pass"] and comp.b.acceptance == []


def test_lineage_lines_name_each_difference_or_say_the_inputs_are_the_same(pair, tmp_path):
    root, plan, base = pair
    assert rt.lineage_lines(compare_runs(plan, base)) == [rt.SAME_LINEAGE]
    other = write_run(tmp_path, "megatron", framework="megatron")
    lines = rt.lineage_lines(compare_runs(plan, other))
    assert lines[0] == "prediction.framework: bundled -> megatron"
    assert lines[1].startswith("prediction.framework_sha256: ") and len(lines) == 2
    (other / "lineage.json").unlink()
    assert rt.lineage_lines(compare_runs(plan, other)) == [
        "B has no lineage.json (a run from before lineages): its inputs are unknown"]


# ---------------------------------------------------------------------------- 8 · Compare
def test_compare_shows_lineage_summary_and_verdicts_above_the_tables(pair):
    root, plan, base = pair
    state = PlanState()
    view = CompareView(state)
    view.session.runs_root = str(root)
    view.refresh_runs()
    view.param.update(run_a="plan", run_b="base")
    html = view._records.object
    assert f'data-testid="compare-lineage">Lineage: {rt.SAME_LINEAGE}.<' in html
    assert 'data-testid="compare-summary"' in html and "A: plan" in html and "B: base" in html
    assert escape("(naive baseline of ") in html and "tokens/s per GPU" in html
    assert 'data-testid="compare-acceptance-a"' in html and 'data-testid="compare-acceptance-b"' not in html
    layout = view.panel().objects
    assert layout.index(view._records) < layout.index(next(o for o in layout if view._tables[0] in
                                                          getattr(o, "objects", ())))
    view.run_b = ""  # one run picked: no records
    assert view._records.object == ""


def test_compare_records_are_escaped_and_a_broken_run_is_one_line(pair, tmp_path):
    root, plan, _ = pair
    other = write_run(tmp_path, "other")
    lineage = json.loads((other / "lineage.json").read_text())
    lineage["data"]["path"] = "<img src=x onerror=alert(1)>"
    (other / "lineage.json").write_text(json.dumps(lineage))
    html = records_html(plan, other)
    assert 'data-testid="compare-lineage"' in html and 'data-testid="compare-lineage-line"' in html
    assert "<img" not in html and escape("data.path: null -> <img src=x") in html
    (other / "config.json").write_text("{")
    line = records_html(plan, other)
    assert 'data-testid="compare-records-error"' in line and line.count("<div") == 1


# ---------------------------------------------------------------------------- 6 · Launch
class FakeRun:
    """What the view reads of a RunHandle: its directory, config, id and status."""

    def __init__(self, path: Path, state: str = "finished"):
        self.path, self.config, self.run_id, self.state = path, load_run(path).config, path.name, state

    def status(self) -> RunStatus:
        return RunStatus(self.state, "", (), ())

    def shutdown(self) -> None:
        pass


@pytest.fixture
def view(tmp_path, monkeypatch):
    """A Launch tab on the default (trainable) plan whose ``launch`` records its calls and returns
    ``view.next_run`` (or raises when it is None)."""
    calls: list[tuple] = []

    def recorded(config, backend, **options):
        calls.append((config, backend, options))
        if v.next_run is None:
            raise RuntimeError("recorded, not launched")
        return v.next_run

    monkeypatch.setattr(launch_view, "launch", recorded)
    v = LaunchView(PlanState())
    v.session.runs_root = str(tmp_path)
    v.calls, v.next_run = calls, None
    v.panel()
    return v


def accept_box(v: LaunchView):
    return next(box for box in v._fields if box[0].name == "Acceptance thresholds")


def test_a_bad_threshold_is_one_escaped_line_under_its_box_and_nothing_launches(view, tmp_path):
    box = accept_box(view)
    assert box[0].placeholder == launch_view.ACCEPT_EXAMPLE
    view.accept = "speed>=1,<b>x</b>"
    asyncio.run(view._on_start())
    under = box[1]
    assert under.visible and 'data-testid="error-accept"' in under.object
    assert escape("accept term 'speed>=1': 'speed' is not one of tokens_per_s_per_gpu") in under.object
    assert "\n" not in under.object and escape("ConfigError: accept term") in view._message.object
    assert view.calls == [] and not any(tmp_path.iterdir())
    view.accept = "final_loss<=x"
    asyncio.run(view._on_start())
    assert "is not metric&gt;=value or metric&lt;=value" in under.object and view.calls == []


def test_declared_thresholds_reach_the_launched_config(view):
    view.accept = " final_loss <= 2.5 , guards_fired<=0 "
    asyncio.run(view._on_start())
    [(config, backend, _)] = view.calls
    assert backend == "local" and config.train.accept == "final_loss<=2.5,guards_fired<=0"
    assert escape('"accept": "final_loss<=2.5,guards_fired<=0"') in view._export.object  # what Start runs
    assert not accept_box(view)[1].visible


def test_the_baseline_button_launches_the_baseline_of_the_launched_plan(view, tmp_path):
    assert view._baseline.disabled  # nothing launched yet
    view.accept = PLAN_ACCEPT
    view.next_run = FakeRun(write_run(tmp_path, "plan", accept=PLAN_ACCEPT, steps=40))
    asyncio.run(view._on_start())
    assert not view._baseline.disabled  # the plan ended (finished): its baseline may run
    # the plan's verdicts under its status, once it ended
    status = view._status.object
    assert 'data-testid="run-acceptance"' in status and "acceptance: FAILED 1 of 2 declared thresholds" in status
    assert "final_loss&lt;=0.01" in status and ">fail<" in status and ">pass<" in status

    view.next_run = FakeRun(write_run(tmp_path, "base", plan="dp_shard=2"))
    asyncio.run(view._on_baseline())
    _, (config, backend, options) = view.calls
    planned = view._planned.config  # the launched run's config (the recorder's run, pp=2 over 40 steps)
    assert backend == "local" and (config.plan.dp_shard, config.plan.tp, config.plan.pp, config.world_size) == (2, 1, 1, 2)
    assert config.train.stop_after == BASELINE_STEPS and config.train.steps == planned.train.steps == 40
    assert config.train.accept == "" and config.train.global_batch_size == planned.train.global_batch_size
    assert options.pop("run_root") == str(tmp_path)
    assert options == launch_view.baseline_record({"plan": "pp=2 1f1b", "run_id": "plan"})
    assert escape(f"the naive baseline of plan (pp=2 1f1b), {config.plan.describe()} for the first 20 of its 40 "
                  "steps") in view._message.object
    assert view.session.run is view.next_run and "run-acceptance" not in view._status.object  # none declared


def test_a_baseline_that_cannot_run_says_why_and_starts_nothing(view, tmp_path):
    big = SimpleNamespace(config=config_from_cli("llama3-8b", "tp=2", 2), run_id="big")
    view._planned, view._planned_on = big, ("local", {})
    asyncio.run(view._on_baseline())
    line = view._message.object
    assert 'data-testid="baseline-error"' in line and line.count("<div") == 1
    assert ">No baseline: the naive baseline of tp=2 cannot run: " in line
    assert view.calls == [] and not any(tmp_path.iterdir())


def test_verdicts_show_once_the_run_has_ended(view, tmp_path):
    run = FakeRun(write_run(tmp_path, "plan", accept=PLAN_ACCEPT), state="running")
    view.session.attach(run)
    assert "run-acceptance" not in view._status.object  # still going: not judged
    run.state = "finished"
    view.session.poll()
    assert 'data-testid="run-acceptance"' in view._status.object
    # a replayed run (no live status) is judged once a poll brings no new events
    view.session.open(tmp_path / "plan")
    view.session.poll()
    assert 'data-testid="run-state">replay<' in view._status.object
    assert 'data-testid="run-acceptance"' in view._status.object
