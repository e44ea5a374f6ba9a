"""The `workbench` command: tables, JSON, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.cli import main
from workbench.predict.memory import estimate_memory

REFERENCE = ["memory", "--model", "llama3-70b", "--gpu", "h100-80gb", "--gpus", "64", "--tp", "8", "--pp", "4",
             "--seq", "8192", "--mbs", "1", "--recompute", "selective"]


def test_memory_table_names_the_most_loaded_rank():
    result = CliRunner().invoke(main, REFERENCE)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Most loaded: rank 0 (pipeline rank 0 of 4" in out
    for component in ("parameters", "gradients", "optimizer", "master_weights", "activations", "buffers", "overhead"):
        assert component in out
    assert "fits: headroom" in out


def test_memory_json_equals_the_python_api():
    result = CliRunner().invoke(main, REFERENCE + ["--json"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    cfg = RunConfig(
        ModelSpec.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=8), ParallelPlan(tp=8, pp=4),
        TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron"),
    )
    assert data["bill"]["peak_bytes"] == estimate_memory(cfg).peak_bytes
    assert RunConfig.from_dict(data["config"]) == cfg


def test_hf_config_option(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256}))
    result = CliRunner().invoke(main, ["memory", "--hf-config", str(path), "--gpus", "8", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output)["config"]["model"]["n_layers"] == 32


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True)


@pytest.mark.multiprocess  # the CLI in a subprocess
def test_bad_input_is_one_line_and_exit_2():
    for args, message in [
        (["memory", "--model", "llama3-8b", "--tp", "3"], "error: tp=3 does not divide n_heads=32"),
        (["memory", "--model", "llama3-9b"], "error: model='llama3-9b' is not a preset; presets: llama3-8b"),
        (["memory", "--gpus", "12"], "error: gpus=12 is not a multiple of 8 GPUs per node"),
        (["memory", "--model", "tiny", "--pp", "8"], "error: pp x virtual_stages = 8 x 1 = 8 exceeds n_layers=4"),
        (["memory", "--seq", "-5"], "error: seq_len=-5 must be >= 1"),
    ]:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith(message), proc.stderr
        assert "Traceback" not in proc.stderr


def test_plan_command_prints_ranked_plans_and_baseline():
    result = CliRunner().invoke(main, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                                       "--seq", "4096", "--gbs", "256", "--top", "3"])
    assert result.exit_code == 0, result.output
    assert "baseline: plain data parallel over 16 GPUs needs" in result.output
    assert "#1 " in result.output and "#3 " in result.output and "#4 " not in result.output
    assert "MFU" in result.output and "bubble" in result.output


def test_plan_json_matches_the_advisor():
    from workbench.predict.advisor import advise

    result = CliRunner().invoke(main, ["plan", "--model", "llama3-8b", "--nodes", "2", "--seq", "4096", "--gbs", "256",
                                       "--top", "2", "--json"])
    data = json.loads(result.output)
    advice = advise(ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=2),
                    TrainSettings(seq_len=4096, global_batch_size=256).with_precision("bf16-megatron"), top=2)
    assert [c["plan"] for c in data["candidates"]] == [c.plan.to_dict() for c in advice]
    assert data["baseline"]["fits"] is False


def test_mesh_command_lays_ranks_on_nodes():
    result = CliRunner().invoke(main, ["mesh", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "4",
                                       "--plan", "tp=8,pp=4", "--seq", "8192", "--gbs", "32"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("node 1: r8(pp1,tp0) r9(pp1,tp1)") for line in lines)
    tp_row = next(line for line in lines if line.startswith("tp "))
    assert "intra_node" in tp_row
    pp_row = next(line for line in lines if line.startswith("pp "))
    assert "inter_node" in pp_row


def test_mesh_json_groups_equal_the_plan():
    result = CliRunner().invoke(main, ["mesh", "--model", "llama3-70b", "--nodes", "4", "--plan", "tp=8,pp=2,dp=2",
                                       "--json"])
    data = json.loads(result.output)
    plan = ParallelPlan(tp=8, pp=2, dp_shard=2)
    assert data["groups"]["tp"]["ranks"] == plan.group_ranks("tp")
    assert data["ranks"][13] == {"rank": 13, "node": 1, "gpu": 5, **plan.rank_coords(13)}


@pytest.mark.multiprocess  # the CLI in a subprocess
def test_mesh_warns_about_tp_across_nodes():
    result = CliRunner().invoke(main, ["mesh", "--model", "llama3-8b", "--nodes", "2", "--plan", "tp=8,dp=2",
                                       "--cluster", "dgx-h100"])
    assert "warning" not in result.output
    proc = run_cli("mesh", "--model", "llama3-405b", "--nodes", "2", "--plan", "tp=16")
    assert proc.returncode == 2 and "tp=16 does not divide n_kv_heads=8" in proc.stderr


@pytest.mark.multiprocess  # the CLI in a subprocess
def test_train_refuses_what_the_trainer_cannot_run_before_starting(tmp_path):
    for args, message in [
        (["train", "--model", "deepseek-v3", "--plan", "tp=2"], "error: n_mtp_layers=1: the bundled trainer trains"),
        (["train", "--model", "tiny", "--plan", "tp=3"], "error: tp=3 does not divide n_heads=4"),
        (["train", "--model", "tiny", "--plan", "pp=8"], "error: pp x virtual_stages = 8 x 1 = 8 exceeds n_layers=4"),
    ]:
        proc = run_cli(*args, "--runs", str(tmp_path))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(message), proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no process


def test_serve_passes_runs_to_the_app_and_refuses_a_non_directory(tmp_path, monkeypatch):
    import workbench.cli as cli

    started: list[list[str]] = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: started.append(argv))  # no server starts
    runs = tmp_path / "runs"
    runs.mkdir()
    result = CliRunner().invoke(main, ["serve", "--port", "5999", "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    assert len(started) == 1 and started[0][1:3] == ["-m", "widgets"]
    assert started[0][started[0].index("--runs") + 1] == str(runs)
    # a name whose folder exists is made at the first launch; a file, or a missing folder, is refused
    assert CliRunner().invoke(main, ["serve", "--runs", str(tmp_path / "new")]).exit_code == 0
    not_a_dir = tmp_path / "runs.txt"
    not_a_dir.write_text("")
    for bad, why in ((not_a_dir, "is not a directory"), (tmp_path / "no" / "runs", "does not exist")):
        result = CliRunner().invoke(main, ["serve", "--runs", str(bad)])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: runs={str(bad)!r} {why}"), result.output
    assert len(started) == 2  # the refused ones never reached the server
