"""Measured runs and the planner checked against them (workbench/predict/measurements.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from workbench.cli import main
from workbench.predict.measurements import (Measurement, load_measurements, measurement_from_row,
                                            published_measurements, validate)
from workbench.predict.perf import predict_step
from workbench.predict.stats import percentile, ranks, spearman
from workbench.spec.config import build_run_config
from workbench.spec.errors import ConfigError


def test_published_mpt_rows_reproduce_their_shapes_and_settings():
    ms = published_measurements()
    assert len(ms) == 70
    first = ms[0]  # mpt-70b on 512 H100, seq 2048, micro-batch 8, FULL_SHARD, full recompute
    c = first.config
    assert c.model.n_params() == 64_862_437_376  # the table's NumParams, from the shapes alone
    assert (c.world_size, c.cluster.gpu.name, c.cluster.nodes) == (512, "h100-80gb", 64)
    assert (c.plan.dp_shard, c.plan.zero_stage, c.train.micro_batch_size, c.train.global_batch_size) == (512, 3, 8, 4096)
    assert (c.train.recompute, c.train.param_dtype, c.train.compute_dtype) == ("full", "fp32", "bf16")
    assert first.tokens_per_s_per_gpu == 1007 and "llm-foundry" in first.source
    assert {m.config.plan.zero_stage for m in ms} == {2, 3}


def test_a_shape_that_misses_the_published_count_is_refused():
    row = {"label": "m", "n_layers": "2", "d_model": "64", "n_heads": "4", "vocab_size": "128", "gpu": "h100-80gb",
           "n_gpus": "8", "plan": "dp_shard=8", "seq_len": "128", "tokens_per_s_per_gpu": "1000",
           "params_published": "1"}
    with pytest.raises(ConfigError, match=r"row 3 \(m\): the shape gives .* parameters, the table 1"):
        measurement_from_row(row, 3)


def test_ranks_and_spearman_against_hand_worked_values():
    assert ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5, 1, 3], 90) == pytest.approx(4.6)


def test_validation_statistics_are_those_of_its_rows():
    ms = published_measurements()[:12]
    v = validate(ms)
    errors = [predict_step(m.config).tokens_per_s_per_gpu / m.tokens_per_s_per_gpu - 1 for m in ms]
    assert [r.error for r in v.rows] == pytest.approx(errors)
    assert v.stats["median_abs_error"] == pytest.approx(percentile([abs(e) for e in errors], 50))
    assert v.stats["p90_abs_error"] == pytest.approx(percentile([abs(e) for e in errors], 90))


def test_the_uncalibrated_planner_on_the_published_mpt_table():
    """Item 3(a): the planner uncalibrated on 70 runs it was never tuned to, each priced under the
    profile of its own software (``fsdp-flash1``: the tables predate torch 2.0, so FlashAttention
    v1, at half FA2's documented speed). Aim (issue 12): median |error| <= 15 %; measured 5.0 %,
    p90 19 %, Spearman 0.99. Under the FA2 ``fsdp`` profile the same rows give 17.5 %: the
    attention kernel is the difference, not a fitted constant."""
    s = validate(published_measurements()).stats
    print(f"\nMPT, own profile: median {s['median_abs_error']:.1%}, p90 {s['p90_abs_error']:.1%}, "
          f"Spearman {s['spearman']:.3f}")
    assert s["n"] == 70
    assert s["median_abs_error"] <= 0.15
    assert s["spearman"] >= 0.95
    fa2 = validate(published_measurements("fsdp")).stats
    assert fa2["median_error"] > s["median_error"]  # FA2's constant is optimistic for FA1's kernels


def test_a_step_time_stands_for_the_throughput():
    config = build_run_config("llama3-8b", gpu="h100-80gb", gpus=8, plan="dp_shard=8", seq_len=4096,
                              global_batch_size=64)
    m = Measurement(config, step_time_s=2.0)
    assert m.measured_tokens_per_s_per_gpu == pytest.approx(64 * 4096 / 2.0 / 8)
    with pytest.raises(ConfigError, match="needs tokens_per_s_per_gpu, step_time_s, peak_memory_bytes or mfu"):
        Measurement(config)
    with pytest.raises(ConfigError, match="step_time_s=-1.0 must be a positive number"):
        Measurement(config, step_time_s=-1.0)


def test_cli_validate_reads_a_csv_and_refuses_bad_ones(tmp_path):
    good = tmp_path / "runs.csv"
    good.write_text("label,model,gpu,n_gpus,plan,seq_len,global_batch_size,precision,tokens_per_s_per_gpu\n"
                    "a,llama3-8b,h100-80gb,8,dp_shard=8,4096,64,bf16-zero,9000\n"
                    "b,llama3-8b,h100-80gb,16,dp_shard=16,4096,64,bf16-zero,8000\n")
    runner = CliRunner()
    out = runner.invoke(main, ["validate", "--measured", str(good), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert [r["label"] for r in data["rows"]] == ["a", "b"] and data["stats"]["n"] == 2
    assert data["rows"][0]["measured"] == 9000
    bad = tmp_path / "bad.csv"
    bad.write_text("label,model,gpu,n_gpus,plan,seq_len,tokens_per_s_per_gpu\nx,llama3-8b,h100-80gb,8,dp_shard=8,4096,abc\n")
    out = runner.invoke(main, ["validate", "--measured", str(bad)])
    assert out.exit_code == 2 and out.output.strip() == "error: row 1: tokens_per_s_per_gpu='abc' is not a number"
    out = runner.invoke(main, ["validate", "--measured", "/dev/zero"])
    assert out.exit_code == 2 and "is not a regular file" in out.output
    assert len(load_measurements(good)) == 2


def test_the_memory_bill_on_torchtitans_memory_rows():
    """The bill's peak against torchtitan's logged peak *reserved* memory (max over GPUs; Llama 3.1
    8B, FSDP2 on 8 and 128 H100, bf16, per-op selective checkpointing, seq 8192, local batch 2).
    The bill's peak is reserved memory: what is allocated x (1 + the allocator's fragmentation) +
    the CUDA context (its ``overhead``). torchtitan's selective checkpointing is its per-op policy,
    priced as such (the ``torchtitan`` profile); torch.compile, which two rows add, is not modelled.
    Nothing was fitted to these rows. Aim of issue item 3c: median |error| <= 10 %."""
    from workbench.predict.measurements import published_memory_measurements
    from workbench.predict.memory import estimate_memory

    ms = published_memory_measurements()
    assert len(ms) == 4 and all(m.peak_memory_bytes for m in ms)
    assert {m.framework for m in ms} == {"torchtitan"}
    errors = []
    for m in ms:
        bill = estimate_memory(m.config)
        errors.append(bill.peak_bytes / m.peak_memory_bytes - 1)
        c = {k: f"{v / 2**30:.1f}" for k, v in bill.components.items()}
        print(f"{m.label[:56]:<56} bill {bill.peak_bytes / 2**30:6.1f} GiB  measured "
              f"{m.peak_memory_bytes / 2**30:6.1f} GiB  {errors[-1]:+.1%}  {c}")
    abs_err = sorted(abs(x) for x in errors)
    print(f"median |error| {percentile(abs_err, 50):.1%}, p90 {percentile(abs_err, 90):.1%}")
    assert percentile(abs_err, 50) <= 0.10
    assert max(abs_err) <= 0.15
