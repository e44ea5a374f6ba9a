"""The app's exports of the current plan, fed to the real CLI: the lines parse, and the RunConfig
they build equals the plan's (``workbench memory``) or the launch config (``workbench train``);
the JSON round-trips. No process starts: ``train``'s torchrun is replaced by a recorder."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

import workbench.cli as cli
from workbench import ModelSpec, RunConfig
from widgets.launch_view import launch_config
from widgets.plan_export import (DEGREE_FLAGS, TRAIN_FLAGS, TRAIN_SWITCHES, config_json, memory_line, train_line)
from widgets.state import PlanState

PLANS = {
    "tiny pp=2 on local-cpu (the app's default)": dict(pp=2),
    "tiny dp_shard=2 on two local-cpu nodes, zero1, gbs 16": dict(nodes=2, dp_shard=-1, zero_stage=1,
                                                                 global_batch_size=16, micro_batch_size=2),
    "tiny tp=2 pp=2 interleaved on two local-cpu nodes, seq 64": dict(
        nodes=2, tp=2, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, seq_len=64),
    "llama3-70b on 2 DGX H100, tp=8 pp=2, bf16, selective recompute, torchtitan": dict(
        model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100", nodes=2, tp=8, pp=2, precision="bf16-megatron",
        recompute="selective", seq_len=8192, framework="torchtitan"),
    "tiny-moe ep=2": dict(model=ModelSpec.preset("tiny-moe"), ep=2),
}


def plan_config(values: dict) -> RunConfig:
    state = PlanState(**values)
    assert state.config is not None, state.error
    return state.config


def invoke(argv: tuple[str, ...]) -> object:
    assert argv[0] == "workbench"
    return CliRunner().invoke(cli.main, list(argv[1:]), catch_exceptions=False)


def test_the_flags_spelled_in_the_export_are_the_clis():
    memory = {o for p in cli.main.commands["memory"].params for o in p.opts + p.secondary_opts}
    train = {o for p in cli.main.commands["train"].params for o in p.opts + p.secondary_opts}
    assert set(DEGREE_FLAGS.values()) | {"--no-sp", "--loss-parallel", "--seq", "--mbs", "--gbs", "--recompute",
                                         "--precision", "--attention", "--optimizer", "--framework",
                                         "--model", "--cluster", "--nodes", "--dropout"} <= memory
    assert set(TRAIN_FLAGS.values()) | set(TRAIN_SWITCHES.values()) | {"--model", "--plan", "--steps", "--runs",
                                                                      "--config"} <= train


@pytest.mark.parametrize("name", list(PLANS))
def test_the_memory_line_rebuilds_the_plan_in_the_cli(name):
    config = plan_config(PLANS[name])
    line = memory_line(config)
    assert line, line.why
    result = invoke(line.argv + ("--json",))
    assert result.exit_code == 0, result.output
    assert RunConfig.from_dict(json.loads(result.output)["config"]) == config


def _recorded_train(monkeypatch, argv: tuple[str, ...]) -> RunConfig:
    seen: list[RunConfig] = []
    monkeypatch.setattr(cli, "train_local", lambda config, **kw: seen.append(config) or 0)
    result = invoke(argv)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("name", list(PLANS))
def test_the_train_line_runs_the_launch_config_in_the_cli(name, monkeypatch, tmp_path):
    launched = launch_config(plan_config(PLANS[name]), steps=40, checkpoint_every=5)
    line = train_line(launched, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    by_file = "DGX" in name  # train's options run on local-cpu in fp32 only: the JSON says the rest
    assert (line.argv[2] == "--config") is by_file and bool(line.why) is by_file, line
    if by_file:
        (tmp_path / "plan.json").write_text(config_json(launched))
    assert _recorded_train(monkeypatch, line.argv) == launched


def test_the_default_plan_trains_from_plain_options(monkeypatch, tmp_path):
    launched = launch_config(plan_config(dict(pp=2)), steps=400, checkpoint_every=5)
    line = train_line(launched, str(tmp_path))
    assert line.text == f"workbench train --model tiny --plan pp=2 --steps 400 --seq 256 --mbs 1 " \
                        f"--checkpoint-every 5 --runs {tmp_path}"
    assert _recorded_train(monkeypatch, line.argv) == launched


def test_what_the_options_cannot_say_goes_through_the_json():
    bf16 = launch_config(plan_config(dict(pp=2, precision="bf16")), steps=10)
    line = train_line(bf16)
    assert line.text == "workbench train --config plan.json" and "precision='bf16'" in line.why
    edited = plan_config(dict(model=replace(ModelSpec.preset("tiny"), n_layers=6)))
    assert not memory_line(edited) and "edited model" in memory_line(edited).why


@pytest.mark.parametrize("name", list(PLANS))
def test_the_json_round_trips(name):
    launched = launch_config(plan_config(PLANS[name]), steps=40)
    assert RunConfig.from_json(config_json(launched)) == launched


# ---------------------------------------------------------------------------- what the Launch tab refuses, and offers
def test_a_plan_this_machine_cannot_train_is_refused_in_one_line_per_reason():
    from widgets.launch_view import CPU_MAX_PARAMS, blockers

    assert blockers(plan_config(dict(pp=2))) == []
    big = plan_config(dict(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100"))
    found = blockers(big, gpus=0)
    assert [b.field for b in found] == ["cluster", "peak memory"]
    assert found[0].line().startswith("cluster='dgx-h100': 1 × 8 h100-80gb = 8 GPUs, and this machine has no GPU")
    assert all("\n" not in b.line() for b in found)
    assert [b.field for b in blockers(big, gpus=8)] == ["peak memory"]  # GPUs enough; the bill still does not fit
    assert [b.field for b in blockers(big, backend="ssh", gpus=0)] == ["peak memory"]  # the GPUs are elsewhere
    on_cpu = blockers(plan_config(dict(model=ModelSpec.preset("llama3-8b"))))
    assert on_cpu[0].field == "model" and ModelSpec.preset("llama3-8b").n_params() > CPU_MAX_PARAMS
    assert blockers(plan_config(dict(model=ModelSpec.preset("tiny-moe"), tp=2))) == []  # experts split by TP
    mtp = blockers(plan_config(dict(model=replace(ModelSpec.preset("tiny-mla"), n_mtp_layers=1))))
    assert [b.field for b in mtp] == ["plan"] and "multi-token prediction" in mtp[0].rule  # the trainer's own limits


def test_offers_are_plans_that_run_and_apply_only_when_asked():
    from widgets.launch_view import blockers, offers

    state = PlanState(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100")
    before = state.config
    made = offers(state, gpus=0)
    assert [o.label for o in made] == ["the same plan (dp_shard=8 zero3) on the tiny model on local-cpu (8 ranks)",
                                       "the tiny model, pp=2 on one local-cpu node (2 ranks)"]
    assert state.config == before  # offering changes nothing
    for offer in made:
        trial = PlanState(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100")
        trial.apply(**offer.changes)
        assert trial.config is not None and blockers(trial.config, gpus=0) == []
        assert trial.precision == "fp32"  # the precision follows the cluster to the CPUs
    assert offers(PlanState(pp=2)) == []


def test_the_plan_comparison_reads_the_predictions():
    from workbench import estimate_memory, predict_step
    from widgets.plan_compare_view import PlanCompareView
    from widgets.transforms import format_bytes, format_seconds

    state = PlanState(pp=2)
    view = PlanCompareView(state)
    assert view.rows() == [] and view.pin()
    a = state.config
    state.apply(pp=1, tp=2)
    b = state.config
    rows = {r.key: r for r in view.rows()}
    for cfg, col in ((a, "a"), (b, "b")):
        step = predict_step(cfg)
        assert getattr(rows["step"], col) == format_seconds(step.step_time_s)
        assert getattr(rows["mfu"], col) == f"{step.mfu:.1%}"
        assert getattr(rows["peak"], col) == format_bytes(estimate_memory(cfg).fits().peak_bytes)
    assert (rows["plan"].a, rows["plan"].b, rows["plan"].diff) == ("pp=2 1f1b", "tp=2", "changed")
    assert rows["model"].diff == "same" and not rows["model"].changed
    assert rows["traffic-tp"].diff == "only in B" and rows["traffic-pp"].diff == "only in A"
    assert 'data-testid="cmp-step-diff"' in view._table.object
    view.back_to_a()
    assert state.config == a
