"""Framework profiles (workbench.spec.framework): what each changes in the bill and the step time,
their JSON, and bad input as one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from workbench import Cluster, ConfigError, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.cli import main
from workbench.predict.memory import activation_bytes_per_layer, estimate_memory
from workbench.predict.perf import predict_step
from workbench.spec.framework import FRAMEWORKS, Efficiency, FrameworkProfile, resolve_framework


def config(framework="bundled", plan=None, nodes=1, gpus_per_node=8, **train):
    settings = dict(seq_len=4096, micro_batch_size=1, global_batch_size=64, framework=framework)
    settings.update(train)
    return RunConfig(ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=nodes, gpus_per_node=gpus_per_node),
                     plan or ParallelPlan(tp=8, sequence_parallel=True),
                     TrainSettings(**settings).with_precision("bf16-megatron"))


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_profiles_round_trip_through_json(name, tmp_path):
    profile = FRAMEWORKS[name]
    assert FrameworkProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    path = profile.save(tmp_path / f"{name}.json")
    assert FrameworkProfile.load(path) == profile


def test_a_fitted_profile_travels_inside_the_run_config():
    fitted = replace(FRAMEWORKS["fsdp"], name="my-cluster",
                     efficiency=replace(FRAMEWORKS["fsdp"].efficiency, matmul=0.61, overhead_s_per_microbatch=0.01))
    cfg = config(fitted, plan=ParallelPlan(dp_shard=8))
    back = RunConfig.from_json(cfg.to_json())
    assert back.train.profile == fitted
    assert predict_step(back).step_time_s == predict_step(cfg).step_time_s
    # a built-in profile is saved by name
    assert json.loads(config("megatron").to_json())["train"]["framework"] == "megatron"


def test_megatron_keeps_sequence_parallel_inputs_sharded():
    """Korthikanti section 4.2.2: Megatron saves the 1/t shard of the QKV and MLP inputs and
    gathers again in backward; torch DTensor SP (the bundled trainer) saves the gathered input:
    2 e s b h (1 - 1/t) more per layer, nothing else differs for a plain TP + SP plan."""
    bundled, megatron = config("bundled"), config("megatron")
    m, t = bundled.model, 8
    extra_per_layer = 2 * 2 * 4096 * m.d_model * (1 - 1 / t) + 2 * 2 * 4096 * m.head_dim  # + RoPE cache per layer
    per_layer = [activation_bytes_per_layer(c.model, c.train, c.plan, conventions=c.train.profile.memory)
                 for c in (bundled, megatron)]
    assert per_layer[0] - per_layer[1] == pytest.approx(extra_per_layer, rel=1e-12)
    # the whole bill: at least that per layer (Megatron also shards the loss over the vocabulary)
    act = [estimate_memory(c).components["activations"] for c in (bundled, megatron)]
    assert act[0] - act[1] >= m.n_layers * extra_per_layer * (1 - 1e-9)


def test_megatron_overlaps_tp_communication_within_a_node_only():
    intra = [predict_step(config(f)) for f in ("bundled", "megatron")]
    assert intra[1].breakdown["comm_tp"] == pytest.approx(intra[0].breakdown["comm_tp"] * 0.5, rel=1e-9)
    assert intra[1].step_time_s < intra[0].step_time_s
    # tp=8 over two nodes of 4 GPUs: nothing hides the inter-node TP transfers
    plan = ParallelPlan(tp=8, dp_shard=1, sequence_parallel=True)
    cross = [predict_step(config(f, plan=plan, nodes=2, gpus_per_node=4)) for f in ("bundled", "megatron")]
    assert cross[1].breakdown["comm_tp"] == pytest.approx(cross[0].breakdown["comm_tp"], rel=1e-9)


def test_fragmentation_is_the_profile_s_unless_the_job_sets_it():
    profile = replace(FRAMEWORKS["bundled"], name="frag", memory=replace(FRAMEWORKS["bundled"].memory,
                                                                         allocator_fragmentation=0.2))
    assert config(profile).train.fragmentation == 0.2
    assert config(profile, allocator_fragmentation=0.01).train.fragmentation == 0.01
    low, high = (estimate_memory(config(p)).components["overhead"] for p in ("bundled", profile))
    assert high > low


@pytest.mark.parametrize("data, field", [
    ({"name": "x", "efficiency": {"matmul": 1.5}}, "efficiency.matmul"),
    ({"name": "x", "efficiency": {"matmul": "fast"}}, "efficiency.matmul"),
    ({"name": "x", "efficiency": {"launch_overhead_s_per_layer": -1}}, "efficiency.launch_overhead_s_per_layer"),
    ({"name": "x", "memory": {"allocator_fragmentation": 1.0}}, "memory.allocator_fragmentation"),
    ({"name": "x", "in_stage_comm_exposed": {"intra_node": 2}}, "framework.in_stage_comm_exposed"),
    ({"name": "x", "in_stage_comm_exposed": {"moon": 0.5}}, "framework.in_stage_comm_exposed"),
    ({"name": "x", "turbo": True}, "framework"),
    ({"efficiency": {}}, "framework.name"),
    ({"name": ""}, "framework.name"),
    ([1, 2], "framework"),
])
def test_bad_profiles_are_one_config_error(data, field):
    with pytest.raises(ConfigError) as err:
        FrameworkProfile.from_dict(data)
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_bad_framework_names_and_files(tmp_path):
    with pytest.raises(ConfigError, match="framework='nope' is not one of bundled, megatron, fsdp"):
        TrainSettings(framework="nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        resolve_framework(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_framework(str(tmp_path / "missing.json"))
    runner = CliRunner()
    for arg in ("nope", str(bad)):
        result = runner.invoke(main, ["memory", "--framework", arg])
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output


def test_cli_names_the_profile_and_its_band():
    runner = CliRunner()
    out = runner.invoke(main, ["memory", "--tp", "2", "--framework", "megatron"])
    assert out.exit_code == 0, out.output
    assert "framework megatron: predictions uncalibrated, megatron profile" in out.output
    out = runner.invoke(main, ["mesh", "--plan", "tp=8", "--framework", "fsdp"])
    assert out.exit_code == 0, out.output
    assert "uncalibrated, fsdp profile" in out.output


def test_efficiency_defaults_are_the_bundled_profile_s():
    assert FRAMEWORKS["bundled"].efficiency == Efficiency()
