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

    ms = [m for m in published_memory_measurements() if m.config.train.fp8_recipe is None]  # the bf16 rows
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


# ---------------------------------------------------------------------------- float8 (issue 16, item 3)
def _torchtitan_priced() -> list[dict]:
    """Every torchtitan row priced: the row, its prediction, its bill, and the relative errors of
    throughput (tokens/s per GPU), MFU (the same step by the bf16-peak convention, so the same
    error) and peak memory (None where not measured)."""
    from workbench.predict.measurements import published_torchtitan_measurements
    from workbench.predict.memory import estimate_memory
    from workbench.predict.perf import mfu

    out = []
    for m in published_torchtitan_measurements():
        c = m.config
        p, bill = predict_step(c), estimate_memory(c)
        measured_mfu = mfu(c, c.tokens_per_step / (m.tokens_per_s_per_gpu * c.world_size))
        out.append({"m": m, "p": p, "bill": bill, "recipe": c.train.precision, "cp": c.plan.cp,
                    "tps": p.tokens_per_s_per_gpu / m.tokens_per_s_per_gpu - 1, "mfu": p.mfu / measured_mfu - 1,
                    "measured_mfu": measured_mfu,
                    "mem": bill.peak_bytes / m.peak_memory_bytes - 1 if m.peak_memory_bytes else None})
    return out


def _twin(rows: list[dict], r: dict) -> dict | None:
    """The bf16 row of ``r``'s table run as ``r`` was: the same table, plan, batch and checkpointing,
    compiled where the table has both (every float8 row is compiled)."""
    def key(x: dict) -> tuple:
        c = x["m"].config
        return (x["m"].label.split(": ")[0], c.plan, c.train.micro_batch_size, c.train.recompute, c.train.seq_len)
    twins = [x for x in rows if x["recipe"] == "fsdp2-bf16" and key(x) == key(r)]
    twins.sort(key=lambda x: "torch.compile" not in x["m"].label)
    return twins[0] if twins else None


def test_float8_rows_are_priced_as_well_as_the_bf16_rows_of_their_tables():
    """torchtitan's float8 rows (torchao Float8Linear; "yes" is torchtitan's default dynamic
    tensorwise scaling, priced as ``float8-tensorwise``; "rowwise" as ``float8-rowwise``) beside the
    bf16 rows of the same tables, all on the Grand Teton H100 (96 GB HBM2e, 2.4 TB/s; 500 W, which
    the datasheet peaks do not model: every row's throughput is over-predicted) or the H200.
    Nothing is fitted to these rows.

    The bars are what the bf16 rows achieve, computed here from them:

    * throughput: the float8 rows in the bf16 rows' regime (FSDP, or FSDP x TP; no context
      parallelism) are each within the bf16 rows' worst |error| and their median within the bf16
      median;
    * memory: the float8 rows of the bf16 rows' own tables (Tables 1 and 3: the same software,
      plan and checkpointing) are within the bf16 rows' worst |error|;
    * speed-up: each float8 row with a bf16 twin (same table and settings, compiled) is predicted
      faster than its twin, and the predicted speed-up is within 0.10 of the measured one (a tenth
      is under a third of the smallest measured FP8 gain, 16 %).

    Out of the bars, reported (``-s``): the rowwise rows under vanilla TP (their file: "the low
    baseline performance of the vanilla TP float8 rowwise training is being addressed",
    torchtitan#1207: measured slower than bf16); the CP rows of Table 2 (128k-256k tokens, attention
    bound, no bf16 twin: their error is the attention and ring model's, which no FP8 recipe changes,
    the core runs in bf16; Table 2's CP 1 row, at 32k, is in the throughput bars); the H200 rows' memory (torchtitan e7c0cae compiles the loss with
    ``training.compile``, so its fp32 gradients are never materialised: 9dec370 did not; compile is
    not modelled for any precision); the 70B FSDP x TP row's memory (no bf16 twin to compare)."""
    rows = _torchtitan_priced()
    bf16 = [r for r in rows if r["recipe"] == "fsdp2-bf16"]
    fp8 = [r for r in rows if r["recipe"] != "fsdp2-bf16"]
    assert len(bf16) == 6 and len(fp8) == 13
    print()
    for r in rows:
        mem = (f"{r['bill'].peak_bytes / 2**30:5.1f} / {r['m'].peak_memory_bytes / 2**30:5.1f} GiB {r['mem']:+6.1%}"
               if r["mem"] is not None else "")
        fp8_peak = f" ({r['p'].mfu_fp8_peak:.1%} of fp8 peak)" if r["p"].mfu_fp8_peak is not None else ""
        where, _, row = r["m"].label.partition(": ")
        print(f"{where[:44] + ': ' + row[:32]:<78} {r['recipe']:<17} tok/s/GPU {r['p'].tokens_per_s_per_gpu:7,.0f} / "
              f"{r['m'].tokens_per_s_per_gpu:7,.0f} {r['tps']:+6.1%}  MFU {r['p'].mfu:5.1%}{fp8_peak} / "
              f"{r['measured_mfu']:5.1%}  {mem}")

    def summary(name: str, xs: list[float]) -> tuple[float, float]:
        a = sorted(abs(x) for x in xs)
        print(f"{name}: n={len(a)}, median |error| {percentile(a, 50):.1%}, worst {a[-1]:.1%}")
        return percentile(a, 50), a[-1]

    bf16_tps_median, bf16_tps_worst = summary("bf16 throughput", [r["tps"] for r in bf16])
    _, bf16_mem_worst = summary("bf16 memory", [r["mem"] for r in bf16 if r["mem"] is not None])
    rowwise_vanilla_tp = [r for r in fp8 if r["recipe"] == "float8-rowwise"]
    barred = [r for r in fp8 if r["cp"] == 1 and r not in rowwise_vanilla_tp]
    summary("float8 throughput, all", [r["tps"] for r in fp8])
    median, worst = summary("float8 throughput, the bf16 rows' regime", [r["tps"] for r in barred])
    summary("float8 memory, all", [r["mem"] for r in fp8 if r["mem"] is not None])
    same_tables = [r for r in fp8 if r["mem"] is not None and any(f" {t}: " in r["m"].label for t in ("Table 1", "Table 3"))]
    _, mem_worst = summary("float8 memory, Tables 1 and 3", [r["mem"] for r in same_tables])
    assert len(barred) == 8 and len(same_tables) == 2
    assert median <= bf16_tps_median and worst <= bf16_tps_worst
    assert mem_worst <= bf16_mem_worst
    # speed-ups over the bf16 twin
    pairs = [(r, _twin(rows, r)) for r in fp8]
    pairs = [(r, t) for r, t in pairs if t is not None]
    for r, t in pairs:
        predicted = r["p"].tokens_per_s_per_gpu / t["p"].tokens_per_s_per_gpu
        measured = r["m"].tokens_per_s_per_gpu / t["m"].tokens_per_s_per_gpu
        where, _, row = r["m"].label.partition(": ")
        print(f"speed-up {r['recipe']:<17} {where[:44] + ': ' + row[:32]:<78} predicted {predicted:.3f}, measured {measured:.3f}")
        if r in rowwise_vanilla_tp:
            continue
        assert predicted > 1 and abs(predicted - measured) <= 0.10, r["m"].label
    assert sum(r["recipe"] == "float8-tensorwise" for r, _ in pairs) == 4  # Tables 1 and 3, async-TP 70B and 8B
