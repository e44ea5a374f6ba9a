"""A table of hostile inputs to the CLI and the Python API.

Every row must get exactly one line naming what is wrong: exit code 2 and ``error: ...`` on stderr
(nothing on stdout) from the CLI, :class:`ConfigError` (a ValueError) from the API, never a
traceback, another exception type, a hang or a silent acceptance. The files are the ones a
hostile or careless user hands over: truncated, binary, deeply nested, a directory, a device, a
FIFO, beyond the size cap, NaN and infinity, wrong types, unknown keys, unicode digits.

The time limit is a hang guard (a read of /dev/zero grew to 18 GB in 50 s before the size cap),
not a speed assertion: every row takes milliseconds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.cli import main
from workbench.predict.advisor import advise
from workbench.predict.comms import traffic_by_dim
from workbench.predict.cost import estimate_cost
from workbench.predict.fit import cross_validate, fit_framework
from workbench.predict.measurements import Measurement, load_measurements
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step
from workbench.rundir.benchmarks import load_results
from workbench.rundir.record import check_run_id, create_run_dir
from workbench.spec.config import build_cluster, build_model, build_plan, build_run_config
from workbench.spec.errors import ConfigError
from workbench.spec.files import CONFIG_MAX_BYTES
from workbench.spec.framework import FrameworkProfile, resolve_framework

HANG_GUARD_S = 20.0

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
         "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 256}


def _tiny_config() -> RunConfig:
    return RunConfig(ModelSpec.preset("tiny"), Cluster.preset("local-cpu"), ParallelPlan(dp_shard=2),
                     TrainSettings(seq_len=64, micro_batch_size=2, steps=3))


# ---------------------------------------------------------------------------- hostile files
# name -> how to make it under a folder (returns its path)
def _write(text: str | bytes):
    def make(d: Path, name: str) -> str:
        p = d / f"{name}.json"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)
    return make


def _sparse(d: Path, name: str) -> str:
    p = d / f"{name}.json"
    with open(p, "wb") as f:
        f.truncate(CONFIG_MAX_BYTES + 1)  # a sparse file: beyond the cap without writing it
    return str(p)


def _folder(d: Path, name: str) -> str:
    p = d / f"{name}.json"
    p.mkdir()
    return str(p)


def _fifo(d: Path, name: str) -> str:
    p = d / f"{name}.json"
    os.mkfifo(p)  # opening it would block until a writer comes: it must not be opened
    return str(p)


def _under_a_file(d: Path, name: str) -> str:
    (d / f"{name}-file").write_text("{}")
    return str(d / f"{name}-file" / "config.json")  # ENOTDIR


HOSTILE_FILES = {
    "missing": lambda d, n: str(d / "no-such-file.json"),
    "dev-zero": lambda d, n: "/dev/zero",
    "dev-null": lambda d, n: "/dev/null",
    "fifo": _fifo,
    "directory": _folder,
    "under-a-file": _under_a_file,
    "beyond-the-cap": _sparse,
    "empty": _write(""),
    "truncated": _write('{"model_type": "llama", "hidden_size": 64, "interm'),
    "binary": _write(bytes(range(256)) * 4),
    "utf16": _write(json.dumps(LLAMA).encode("utf-16")),
    "deeply-nested": _write("[" * 100_000 + "]" * 100_000),
    "deeply-nested-object": _write('{"a":' * 50_000 + "1" + "}" * 50_000),
    "list": _write("[1, 2, 3]"),
    "null": _write("null"),
    "nan": _write('{"model_type": "llama", "hidden_size": NaN}'),
    "infinity": _write('{"hidden_size": Infinity, "model_type": "llama"}'),
    "huge-exponent": _write('{"model_type": "llama", "rope_theta": 1e999}'),
}

# every option or argument that reads a user's file, as the argv around it
FILE_OPTIONS = {
    "memory --hf-config": lambda p: ["memory", "--hf-config", p],
    "memory --cluster": lambda p: ["memory", "--cluster", p],
    "memory --framework": lambda p: ["memory", "--model", "tiny", "--seq", "64", "--framework", p],
    "plan --cluster": lambda p: ["plan", "--model", "tiny", "--seq", "64", "--cluster", p],
    "mesh --hf-config": lambda p: ["mesh", "--plan", "tp=2", "--hf-config", p],
    "bench compute --hf-config": lambda p: ["bench", "compute", "--hf-config", p],
    "train --config": lambda p: ["train", "--config", p],
    "calibrate RESULTS": lambda p: ["calibrate", p, "-o", os.devnull],
    "calibrate --measured": lambda p: ["calibrate", "--measured", p, "-o", os.devnull],
    "validate --measured": lambda p: ["validate", "--measured", p],
}
# a run directory is read by compare: tests/test_damaged_runs.py holds its table
FILE_CASES = [(o, f) for o in FILE_OPTIONS for f in HOSTILE_FILES
              # click checks calibrate's RESULTS exist itself (one line all the same)
              if not (o.startswith("calibrate") and f in ("deeply-nested-object",))]


# ---------------------------------------------------------------------------- hostile option values
OPTION_CASES = [
    # memory: every number is validated, 0 included
    ["memory", "--seq", "0"], ["memory", "--seq", "-1"], ["memory", "--seq", "x"],
    ["memory", "--seq", "99999999999999999999999"], ["memory", "--mbs", "0"], ["memory", "--gbs", "-1"],
    ["memory", "--tp", "0"], ["memory", "--tp", "3"], ["memory", "--pp", "0"], ["memory", "--cp", "-2"],
    ["memory", "--ep", "2"], ["memory", "--zero", "4"], ["memory", "--zero", "-1"],
    ["memory", "--schedule", "nope"], ["memory", "--virtual-stages", "0"], ["memory", "--recompute", "some"],
    ["memory", "--attention", "sdpa"], ["memory", "--precision", "fp64"], ["memory", "--optimizer", "lion"],
    ["memory", "--framework", "nope"], ["memory", "--nodes", "0"], ["memory", "--nodes", "-1"],
    ["memory", "--gpus", "0"], ["memory", "--gpus", "12"], ["memory", "--gpu", "tpu-v5"],
    ["memory", "--gpu", "h100-80gb", "--cluster", "dgx-h100"], ["memory", "--model", "nope"],
    ["memory", "--model", ""], ["memory", "--model", "$(id)"], ["memory", "--model", "a\nb\x1b[31m"],
    ["memory", "--cluster", "nope"], ["memory", "--model", "gpt3-175b", "--seq", "4096"],  # past its position table
    ["memory", "--bogus"], ["memory", "--tp"],
    # --plan text
    ["memory", "--plan", "tp=\uff18"], ["memory", "--plan", "tp=\u0663"], ["memory", "--plan", "tp"],
    ["memory", "--plan", "tp=2,tp=4"], ["memory", "--plan", "foo=1"], ["memory", "--plan", "tp=1e3"],
    ["memory", "--plan", "sequence_parallel=maybe"], ["memory", "--plan", "tp=99999999999999999999"],
    ["memory", "--plan", "tp=1_0"], ["memory", "--plan", "tp=2.0"], ["memory", "--plan", "schedule=zb"],
    ["memory", "--plan", "stage_layers=1"],
    # plan and mesh
    ["plan", "--top", "0"], ["plan", "--top", "-1"], ["plan", "--nodes", "0"], ["plan", "--cluster", "x"],
    ["mesh", "--plan", "tp=2", "--max-nodes", "-1"], ["mesh", "--plan", "tp=2", "--max-nodes", "0"],
    ["mesh"], ["mesh", "--plan", "tp=3"],
    # serve: refused before the app starts
    ["serve", "--port", "70000"], ["serve", "--port", "0"], ["serve", "--port", "-5"], ["serve", "--port", "x"],
    # bench
    ["bench", "comms", "--backend", "gateway"], ["bench", "comms", "--backend", "ssh"],
    ["bench", "comms", "--nodes", "0"], ["bench", "comms", "--max-bytes", "0"],
    ["bench", "comms", "--backend", "warp"], ["bench", "compute", "--tokens", "0"],
    ["bench", "compute", "--tokens", "-3"], ["bench", "compute", "--tp", "0"], ["bench", "compute", "--tp", "3"],
    # calibrate, validate, compare
    ["calibrate", "-o", os.devnull], ["calibrate"], ["calibrate", "--measured", "x.csv", "-o", "/no/such/dir/p.json"],
    ["calibrate", "--measured", "x.csv", "-o", "/tmp"], ["bench", "compute", "--model", "tiny", "-o", "/no/such/dir/c.json"], ["validate", "--framework", "nope"],
    ["compare", "/no/such/run"], ["compare", "/dev/null"], ["compare", "/"],
    ["nope"],
]


def _check_cli(args: list[str]) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(main, args)
    took = time.monotonic() - started
    assert took < HANG_GUARD_S, f"{args} took {took:.1f} s"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args} raised {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code == 2, f"{args}: exit {result.exit_code}, output {result.output!r}"
    err = result.stderr
    assert result.stdout == "", f"{args} printed on stdout: {result.stdout!r}"
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, f"{args}: {err!r}"
    assert "Traceback" not in err


@pytest.mark.parametrize("option,kind", FILE_CASES, ids=[f"{o}:{f}" for o, f in FILE_CASES])
def test_a_hostile_file_gets_one_line(tmp_path, option, kind):
    path = HOSTILE_FILES[kind](tmp_path, kind)
    _check_cli(FILE_OPTIONS[option](path))


@pytest.mark.parametrize("args", OPTION_CASES, ids=[" ".join(a)[:60] for a in OPTION_CASES])
def test_a_hostile_option_gets_one_line(args):
    _check_cli(args)


def test_train_options_are_checked_before_a_run_directory_exists(tmp_path):
    runs = tmp_path / "runs"
    for args in (["--steps", "-1"], ["--seq", "0"], ["--mbs", "0"], ["--lr", "0"], ["--lr", "nan"],
                 ["--lr", "inf"], ["--lr", "-1"], ["--checkpoint-keep", "0"], ["--checkpoint-every", "-1"],
                 ["--max-restarts", "-1"], ["--dataset", "nope"], ["--dataset", "text"],
                 ["--dataset", "text", "--data-path", str(tmp_path / "missing.txt")],
                 ["--run-id", "../../x"], ["--run-id", "/abs/x"], ["--run-id", ""], ["--run-id", "-x"],
                 ["--run-id", "a/b"], ["--run-id", ".."], ["--resume", ""], ["--resume", str(tmp_path / "nope")],
                 ["--plan", "tp=3"], ["--model", "nope"], ["--seed", "-1"], ["--seq", "0x10"]):
        _check_cli(["train", "--runs", str(runs), *args])
        assert not runs.exists() or not any(runs.iterdir()), f"{args} left a run directory"


def test_hostile_run_configs_get_one_line(tmp_path):
    good = _tiny_config().to_dict()
    variants = {
        "lr-nan": '{"train": {"lr": NaN}}',
        "unknown-top": {"colour": 1},
        "unknown-train": {"train": {"lrr": 0.1}},
        "steps-string": {"train": {"steps": "10"}},
        "steps-float": {"train": {"steps": 1.5}},
        "deterministic-no": {"train": {"deterministic": "no"}},
        "zero-true": {"plan": {"zero_stage": True}},
        "betas": {"train": {"betas": [2, -1]}},
        "betas-short": {"train": {"betas": [0.9]}},
        "min-lr-ratio": {"train": {"min_lr_ratio": 5}},
        "weight-decay-neg": {"train": {"weight_decay": -0.1}},
        "model-list": {"model": [1, 2]},
        "gpu-string-hbm": {"cluster": {"gpu": {"hbm_bytes": "80GB"}}},
        "nodes-zero": {"cluster": {"nodes": 0}},
        "framework-int": {"train": {"framework": 7}},
        "stage-layers": {"plan": {"stage_layers": "abc"}},
        "seq-over-table": {"model": {"position": "learned"}, "train": {"seq_len": 4096}},
    }
    for name, change in variants.items():
        if isinstance(change, str):
            text = json.dumps(good)[:-1] + ', "x": 0}'  # keep it JSON, then put NaN in its place
            text = text.replace('"lr": 0.0003', '"lr": NaN')
        else:
            data = json.loads(json.dumps(good))
            for key, value in change.items():
                if isinstance(value, dict) and isinstance(data.get(key), dict):
                    for k, v in value.items():
                        if isinstance(v, dict) and isinstance(data[key].get(k), dict):
                            data[key][k].update(v)
                        else:
                            data[key][k] = v
                else:
                    data[key] = value
            text = json.dumps(data)
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        _check_cli(["train", "--runs", str(tmp_path / "runs"), "--config", str(path)])
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- the API
def _model(**kw):
    return lambda: ModelSpec(**{"n_layers": 2, "d_model": 64, "n_heads": 4, **kw})


def _train(**kw):
    return lambda: TrainSettings(**kw)


def _hf(**kw):
    return lambda: ModelSpec.from_hf_config({**LLAMA, **kw})


API_CASES = {
    # ModelSpec
    "model n_layers=True": _model(n_layers=True), "model n_layers=0": _model(n_layers=0),
    "model n_layers=2.0": _model(n_layers=2.0), "model n_layers='2'": _model(n_layers="2"),
    "model d_model=-64": _model(d_model=-64), "model huge": _model(n_layers=10 ** 30),
    "model rope_theta=nan": _model(rope_theta=math.nan), "model rope_theta=inf": _model(rope_theta=math.inf),
    "model tie='no'": _model(tie_embeddings="no"), "model activation=relu": _model(activation="relu"),
    "model name=5": _model(name=5), "model n_experts=-1": _model(n_experts=-1),
    "model top_k>n_experts": _model(n_experts=2, top_k=3), "model heads 3": _model(n_heads=3),
    "model max_seq_len=0": _model(max_seq_len=0), "model vocab 10**12": _model(vocab_size=10 ** 12),
    "ModelSpec.from_dict list": lambda: ModelSpec.from_dict([1]),
    "ModelSpec.from_dict unknown": lambda: ModelSpec.from_dict({"n_layers": 2, "d_model": 8, "n_heads": 2, "x": 1}),
    "ModelSpec.from_dict missing": lambda: ModelSpec.from_dict({"n_layers": 2}),
    "ModelSpec.from_json junk": lambda: ModelSpec.from_json("{nope"),
    "ModelSpec.preset list": lambda: ModelSpec.preset(["tiny"]),
    # Hugging Face configs
    "hf model_type list": _hf(model_type=["llama"]), "hf model_type gpt2": _hf(model_type="gpt2"),
    "hf layers string": _hf(num_hidden_layers="32"), "hf layers float": _hf(num_hidden_layers=2.5),
    "hf tie 'no'": _hf(tie_word_embeddings="no"), "hf rope_theta string": _hf(rope_theta="x"),
    "hf rope_theta huge int": _hf(rope_theta=10 ** 400), "hf max_pos float": _hf(max_position_embeddings=1.5),
    "hf hidden_act 5": _hf(hidden_act=5), "hf name list": _hf(_name_or_path=["x"]),
    "hf missing hidden_size": lambda: ModelSpec.from_hf_config({k: v for k, v in LLAMA.items() if k != "hidden_size"}),
    "hf mlp_only_layers str": _hf(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, mlp_only_layers="x"),
    "hf unicode digits": _hf(num_hidden_layers="\u4e09\u5341\u4e8c"),
    "hf config 5": lambda: ModelSpec.from_hf_config(5),
    "hf config list": lambda: build_model(hf_config=[1]),
    # TrainSettings
    "train lr=inf": _train(lr=math.inf), "train lr=nan": _train(lr=math.nan), "train lr=0": _train(lr=0),
    "train weight_decay=nan": _train(weight_decay=math.nan), "train betas=(2,-1)": _train(betas=(2, -1)),
    "train betas='ab'": _train(betas="ab"), "train min_lr_ratio=5": _train(min_lr_ratio=5),
    "train deterministic='no'": _train(deterministic="no"), "train steps=-1": _train(steps=-1),
    "train steps=1.5": _train(steps=1.5), "train seq_len=True": _train(seq_len=True),
    "train dataset=x": _train(dataset="x"), "train checkpoint_keep=0": _train(checkpoint_keep=0),
    "train seed=-1": _train(seed=-1), "train framework=123": _train(framework=123),
    "train framework=nope": _train(framework="nope"), "train fragmentation=1.5": _train(allocator_fragmentation=1.5),
    "train guard_grad_spike=0.5": _train(guard_grad_spike=0.5), "train capacity=0.5": _train(moe_capacity_factor=0.5),
    "train grad_clip=-1": _train(grad_clip=-1), "train instrument=1": _train(instrument=1),
    "train data_path=5": _train(dataset="text", data_path=5), "train dataset text no path": _train(dataset="text"),
    "train recompute=None": _train(recompute=None), "train precision": lambda: TrainSettings().with_precision("x"),
    "TrainSettings.from_dict unknown": lambda: TrainSettings.from_dict({"lrr": 1}),
    "TrainSettings.from_dict str": lambda: TrainSettings.from_dict("lr=1"),
    # ParallelPlan
    "plan zero=True": lambda: ParallelPlan(zero_stage=True), "plan zero=1.0": lambda: ParallelPlan(zero_stage=1.0),
    "plan tp=0": lambda: ParallelPlan(tp=0), "plan tp='2'": lambda: ParallelPlan(tp="2"),
    "plan schedule=1": lambda: ParallelPlan(pp_schedule=1), "plan sp='yes'": lambda: ParallelPlan(sequence_parallel="yes"),
    "plan stage_layers='ab'": lambda: ParallelPlan(stage_layers="ab"),
    "plan dp_shard=-2": lambda: ParallelPlan(dp_shard=-2),
    "plan.parse 123": lambda: ParallelPlan.parse(123), "plan.parse arabic": lambda: ParallelPlan.parse("tp=\u0663"),
    "plan.parse empty item": lambda: ParallelPlan.parse("tp=2,,pp=x"),
    "plan.from_dict unknown": lambda: ParallelPlan.from_dict({"tpp": 2}),
    "build_plan 5": lambda: build_plan(5),
    # Cluster
    "cluster json list": lambda: Cluster.from_json("[]"), "cluster json {}": lambda: Cluster.from_json("{}"),
    "cluster json nan": lambda: Cluster.from_json('{"nodes": NaN}'),
    "cluster gpu types": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(),
                                                    "gpu": {"name": "x", "hbm_bytes": "80", "bf16_flops": 1}}),
    "cluster nodes 0": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(), "nodes": 0}),
    "cluster calibration junk": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(),
                                                           "calibration": {"links": [1]}}),
    "cluster calibration tier": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(), "calibration": {
        "links": {"moon": {"all_reduce": {"bandwidth_bytes_per_s": 1, "latency_s": 0}}}}}),
    "cluster calibration flops nan": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(),
                                                                "calibration": {"flops_per_s": {"bf16": math.nan}}}),
    "cluster unknown": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(), "x": 1}),
    "cluster link neg": lambda: Cluster.from_dict({**Cluster.preset("dgx-h100").to_dict(),
                                                   "inter_node": {"name": "ib", "bandwidth_bytes_per_s": -1, "latency_s": 0}}),
    "Cluster.preset 5": lambda: Cluster.preset(5),
    "build_cluster 5": lambda: build_cluster(5), "build_cluster nodes=0": lambda: build_cluster("dgx-h100", nodes=0),
    "build_cluster gpus=-8": lambda: build_cluster("dgx-h100", gpus=-8),
    # RunConfig
    "RunConfig.from_dict list": lambda: RunConfig.from_dict([]),
    "RunConfig.from_dict missing": lambda: RunConfig.from_dict({"model": {}}),
    "RunConfig.from_json junk": lambda: RunConfig.from_json("nope"),
    "RunConfig model str": lambda: RunConfig("tiny", Cluster.preset("local-cpu"), ParallelPlan(), TrainSettings()),
    "RunConfig seq>table": lambda: RunConfig(replace(ModelSpec.preset("tiny"), position="learned"),
                                             Cluster.preset("local-cpu"), ParallelPlan(), TrainSettings(seq_len=512)),
    "build_run_config plan=5": lambda: build_run_config("tiny", plan=5),
    "build_run_config train unknown": lambda: build_run_config("tiny", colour=1),
    "build_run_config seq=0": lambda: build_run_config("tiny", seq_len=0),
    # FrameworkProfile
    "framework 5": lambda: resolve_framework(5), "framework name 1": lambda: resolve_framework({"name": 1}),
    "framework list": lambda: FrameworkProfile.from_dict([1]),
    "framework efficiency nan": lambda: resolve_framework({"name": "x", "efficiency": {"matmul": math.nan}}),
    "framework efficiency list": lambda: resolve_framework({"name": "x", "efficiency": [1]}),
    "framework memory bool": lambda: resolve_framework({"name": "x", "memory": {"foreach_optimizer": "yes"}}),
    "framework exposed str": lambda: resolve_framework({"name": "x", "in_stage_comm_exposed": "all"}),
    "framework exposed tier": lambda: resolve_framework({"name": "x", "in_stage_comm_exposed": {"moon": 1}}),
    "framework band missing": lambda: resolve_framework({"name": "x", "band": {"step_error": 0.1}}),
    "framework unknown": lambda: resolve_framework({"name": "x", "speed": 2}),
    "framework fitted str": lambda: resolve_framework({"name": "x", "fitted": 5}),
    # the planner's entry points
    "estimate_memory str": lambda: estimate_memory("tiny"), "estimate_memory None": lambda: estimate_memory(None),
    "estimate_memory policy": lambda: estimate_memory(_tiny_config(), selective_policy="most"),
    "predict_step 1": lambda: predict_step(1), "traffic_by_dim {}": lambda: traffic_by_dim({}),
    "advise str": lambda: advise("llama3-8b", Cluster.preset("dgx-h100"), TrainSettings()),
    "advise top=0": lambda: advise(ModelSpec.preset("tiny"), Cluster.preset("local-cpu"), TrainSettings(seq_len=64), top=0),
    "advise top=True": lambda: advise(ModelSpec.preset("tiny"), Cluster.preset("local-cpu"), TrainSettings(seq_len=64), top=True),
    "estimate_cost nan": lambda: estimate_cost(_tiny_config(), tokens=math.nan),
    "estimate_cost rate 0": lambda: estimate_cost(_tiny_config(), tokens=1e9, write_bytes_per_s_per_node=0),
    "Measurement none": lambda: Measurement(_tiny_config()),
    "Measurement nan": lambda: Measurement(_tiny_config(), step_time_s=math.nan),
    "Measurement bool": lambda: Measurement(_tiny_config(), step_time_s=True),
    "Measurement config str": lambda: Measurement("tiny", step_time_s=1.0),
    "fit_framework str": lambda: fit_framework("runs.csv"), "fit_framework ints": lambda: fit_framework([1, 2]),
    "fit_framework params str": lambda: fit_framework([Measurement(_tiny_config(), step_time_s=1.0)] * 2, params="matmul"),
    "cross_validate k=1": lambda: cross_validate([Measurement(_tiny_config(), step_time_s=1.0)] * 3, k=1),
    # run directories
    "run id ..": lambda: check_run_id(".."), "run id ../x": lambda: check_run_id("../x"),
    "run id abs": lambda: check_run_id("/etc"), "run id empty": lambda: check_run_id(""),
    "run id option": lambda: check_run_id("-rf"), "run id nul": lambda: check_run_id("a\x00b"),
    "run id newline": lambda: check_run_id("a\nb"), "run id int": lambda: check_run_id(5),
}


@pytest.mark.parametrize("name", list(API_CASES))
def test_a_hostile_api_call_raises_one_config_error(name):
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        API_CASES[name]()
    assert time.monotonic() - started < HANG_GUARD_S
    message = str(info.value)
    assert message and "\n" not in message and message.isprintable(), repr(message)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kind", [k for k in HOSTILE_FILES if k not in ("nan", "infinity", "huge-exponent")])
def test_hostile_files_through_the_api(tmp_path, kind):
    path = HOSTILE_FILES[kind](tmp_path, kind)
    for read in (ModelSpec.from_hf_config, RunConfig.load, resolve_framework, load_measurements, load_results,
                 lambda p: build_cluster(p if p.endswith(".json") else p + ".json")):
        with pytest.raises(ConfigError) as info:
            read(path)
        assert "\n" not in str(info.value)


def test_create_run_dir_refuses_escapes_and_existing_runs(tmp_path):
    config = _tiny_config()
    for bad in ("../x", "/abs", "a/b", "..", ""):
        with pytest.raises(ConfigError, match="is not a run name"):
            create_run_dir(config, tmp_path / "runs", bad)
    assert not (tmp_path / "x").exists() and not Path("/abs").exists()
    create_run_dir(config, tmp_path / "runs", "r1")
    with pytest.raises(ConfigError, match="already exists"):
        create_run_dir(config, tmp_path / "runs", "r1")
    # a Hugging Face model's name holds a slash: the generated id has it replaced
    named = replace(config, model=replace(config.model, name="meta-llama/../Llama"))
    path = create_run_dir(named, tmp_path / "runs")
    assert path.parent == tmp_path / "runs" and "/" not in path.name and ".." not in path.name


@pytest.mark.multiprocess  # the real command in a subprocess: nothing reads a device or blocks on a FIFO
def test_the_command_reads_no_device_and_opens_no_fifo(tmp_path):
    fifo = _fifo(tmp_path, "fifo")
    for args in (["memory", "--hf-config", "/dev/zero"], ["memory", "--hf-config", fifo],
                 ["train", "--config", "/dev/urandom"], ["validate", "--measured", "/dev/zero"]):
        out = subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stdout == "" and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr


def test_the_table_is_large():
    """The issue asks for at least 150 hostile inputs across the CLI and the API."""
    assert len(FILE_CASES) + len(OPTION_CASES) + len(API_CASES) >= 150
