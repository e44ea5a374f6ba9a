"""FP8 precision recipes (workbench/spec/float8.py) in the planner: bytes, traffic, time, MFU."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from workbench.cli import main
from workbench.predict.comms import step_collectives
from workbench.predict.memory import estimate_memory, fp8_saved_input_bytes, model_state_bytes
from workbench.predict.perf import _fp8_cast_bytes, _layer_gemms, mfu, predict_step
from workbench.spec.cluster import Cluster
from workbench.spec.config import PRECISIONS, RunConfig, TrainSettings, build_run_config
from workbench.spec.model import ModelSpec
from workbench.spec.errors import ConfigError
from workbench.spec.float8 import FLOAT8_RECIPES

FP8 = tuple(FLOAT8_RECIPES)
TORCHTITAN_8B = dict(gpu="h100-80gb", seq_len=8192, micro_batch_size=2, recompute="selective", framework="torchtitan")


def config(precision: str, plan: str = "dp_shard=8", gpus: int = 8, model: str = "llama3-8b", **kw) -> RunConfig:
    return build_run_config(model, gpus=gpus, plan=plan, precision=precision, **{**TORCHTITAN_8B, **kw})


def test_each_recipe_is_a_named_precision_that_round_trips():
    for name in FP8:
        train = TrainSettings().with_precision(name)
        assert train.precision == name and train.fp8_recipe == name and train.fp8 is FLOAT8_RECIPES[name]
        assert TrainSettings.from_dict(train.to_dict()) == train
        base = PRECISIONS[FLOAT8_RECIPES[name].base_precision]
        assert {k: getattr(train, k) for k in base if k != "fp8_recipe"} == {k: v for k, v in base.items()
                                                                              if k != "fp8_recipe"}
    assert TrainSettings().with_precision("float8-tensorwise").with_precision("fsdp2-bf16").fp8_recipe is None
    assert TrainSettings().precision == "fsdp2-bf16"  # the defaults are still a named recipe
    with pytest.raises(ConfigError, match="fp8_recipe='float9' is not one of 'float8-tensorwise', 'float8-rowwise', 'te-fp8'"):
        TrainSettings(fp8_recipe="float9")
    with pytest.raises(ConfigError, match="needs a bf16 or fp16 compute_dtype"):
        TrainSettings(compute_dtype="fp32", fp8_recipe="te-fp8")


def test_model_state_bytes_per_parameter_by_hand():
    """The FP8 recipes store their base recipe's dtypes: torchao's (FSDP2 over fp32) 4 + 4 + 2 x 4
    = 16 bytes a parameter with Adam; TE's (Megatron's) 2 + 4 + 2 x 4 + 4 = 18."""
    by_hand = {"float8-tensorwise": (4, 4, 8, 0), "float8-rowwise": (4, 4, 8, 0), "te-fp8": (2, 4, 8, 4)}
    for name, (p, g, o, w) in by_hand.items():
        states = model_state_bytes(1, TrainSettings().with_precision(name), zero_stage=0, shard_degree=1)
        assert states == {"parameters": p, "gradients": g, "optimizer": o, "master_weights": w}


def test_te_caches_fp8_weights_and_amax_histories_by_hand():
    """TE keeps an FP8 weight and its transpose (1 + 1 bytes) per local Linear parameter and, per
    FP8 tensor (5 a GEMM), 1024 fp32 amaxes plus scale and inverse scale. Llama 3 8B, one block:
    wq, wk, wv, wo = 2 x 4096^2 + 2 x 4096 x 1024 and w1, w2, w3 = 3 x 4096 x 14336 parameters, in
    4 GEMMs (QKV fused, wo, w1 with w3, w2). Full recomputation keeps the activations equal; the
    block rebuilt in backward saves its Linears' inputs in FP8 too, s b (h + d_ff) bytes fewer."""
    per_block = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert per_block == 218_103_808
    cache = 32 * (2 * per_block + 4 * 5 * (1024 + 2) * 4)
    kw = dict(plan="dp_shard=8,zero=1", recompute="full", framework="megatron")
    te, bf16 = estimate_memory(config("te-fp8", **kw)).components, estimate_memory(config("bf16-megatron", **kw)).components
    assert te["activations"] == bf16["activations"]
    assert te["buffers"] - bf16["buffers"] == pytest.approx(cache - 2 * 8192 * (4096 + 14336), abs=2)


def test_what_each_recipe_saves_for_backward():
    """torchao saves the bf16 inputs (activations as the bf16 run's); TE saves its Linears' inputs in
    FP8: per block the attention and MLP inputs (s b h each) and the down-projection input (s b d_ff)
    drop a byte an element, and with flash attention (nothing recomputed) TE keeps an FP8 copy of
    the attention output (s b h) beside the kernel's bf16 one."""
    for name in ("float8-tensorwise", "float8-rowwise"):
        for rc in ("none", "selective", "full"):
            assert (estimate_memory(config(name, recompute=rc)).components["activations"]
                    == estimate_memory(config("fsdp2-bf16", recompute=rc)).components["activations"])
    c = config("te-fp8", recompute="none", micro_batch_size=1, framework="megatron")
    sb = 8192
    assert fp8_saved_input_bytes(c.model, c.train, c.plan) == -sb * (4096 + 4096 + 14336) + sb * 4096
    assert fp8_saved_input_bytes(c.model, c.train, c.plan, recompute="full") == 0
    te = estimate_memory(c).components["activations"]
    bf16 = estimate_memory(config("bf16-megatron", recompute="none", micro_batch_size=1, framework="megatron"))
    assert te - bf16.components["activations"] == pytest.approx(32 * -sb * (4096 + 14336), abs=1)


def test_fp8_all_gather_halves_the_fsdp_all_gather_volume():
    """torchao tensorwise with FSDP float8 all-gather: a block's Linear weights travel at 1 byte
    instead of 2 (its two RMSNorm weights, 4096 each, stay bf16); the root unit (embeddings, output
    head) is not converted; rowwise and TE gather in bf16; reduce-scatters are unchanged."""
    def gathers(precision: str) -> dict[str, int]:
        return {c.purpose: c.size_bytes for c in step_collectives(config(precision)) if c.op == "all_gather"}

    def scatters(precision: str) -> list[int]:
        return [c.size_bytes for c in step_collectives(config(precision)) if c.op == "reduce_scatter"]

    bf16, fp8 = gathers("fsdp2-bf16"), gathers("float8-tensorwise")
    block = bf16["FSDP all-gather of dense block weights"]
    assert block == 2 * (218_103_808 + 2 * 4096)
    assert fp8["FSDP all-gather of dense block weights (Linear weights in fp8)"] == 218_103_808 + 2 * 2 * 4096
    assert fp8["FSDP all-gather of dense block weights (Linear weights in fp8)"] / block == pytest.approx(0.5, abs=1e-4)
    root = "FSDP all-gather of root (embedding, output) weights (exposed)"
    assert fp8[root] == bf16[root]
    assert gathers("float8-rowwise") == bf16
    assert scatters("float8-tensorwise") == scatters("fsdp2-bf16")
    wire = {p: sum(c.wire_bytes * c.count for c in step_collectives(config(p)) if c.op == "all_gather")
            for p in ("fsdp2-bf16", "float8-tensorwise")}
    assert wire["float8-tensorwise"] < 0.55 * wire["fsdp2-bf16"]
    # the weights' scales: one small all-reduce after the optimizer step (precompute_float8_dynamic_scale_for_fsdp)
    (amax,) = [c for c in step_collectives(config("float8-tensorwise")) if "amax" in c.purpose]
    assert (amax.op, amax.phase, amax.count, amax.size_bytes) == ("all_reduce", "step", 1, 4 * 7 * 32)


def test_sequence_parallel_all_gathers_move_fp8_where_the_recipe_casts_before_them():
    kw = dict(plan="dp_shard=8,tp=8", gpus=64)
    def sp(precision: str) -> dict[tuple[str, str], int]:
        return {(c.op, c.phase): c.size_bytes for c in step_collectives(config(precision, **kw))
                if c.dim == "tp" and "around attention and MLP" in c.purpose}

    bf16 = sp("fsdp2-bf16")
    for name, halved in (("float8-tensorwise", True), ("float8-rowwise", False), ("te-fp8", True)):
        got = sp(name)
        for (op, phase), size in bf16.items():
            assert got[(op, phase)] == (size // 2 if halved and op == "all_gather" else size), (name, op, phase)


def test_a_gpu_without_fp8_refuses_an_fp8_recipe_in_one_line():
    for name in FP8:
        with pytest.raises(ConfigError) as err:
            build_run_config("llama3-8b", gpu="a100-80gb", gpus=8, plan="dp_shard=8", precision=name)
        assert err.value.field == "fp8_recipe" and err.value.value == name
        assert str(err.value) == (f"fp8_recipe={name!r} runs the block GEMMs on FP8 tensor cores, which "
                                  "gpu=a100-80gb does not have (fp8_flops=0); choose a bf16 recipe, or a GPU with "
                                  "FP8 (H100, H200, L40S)")
    with pytest.raises(ConfigError, match="gpu=cpu does not have"):
        build_run_config("tiny", cluster="local-cpu", gpus=2, plan="dp_shard=2", precision="float8-rowwise")
    out = CliRunner().invoke(main, ["memory", "--model", "llama3-8b", "--gpu", "a100-80gb", "--gpus", "8",
                                    "--precision", "te-fp8"])
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == ["error: fp8_recipe='te-fp8' runs the block GEMMs on FP8 tensor cores, "
                                               "which gpu=a100-80gb does not have (fp8_flops=0); choose a bf16 "
                                               "recipe, or a GPU with FP8 (H100, H200, L40S)"]


def test_every_gpu_preset_has_its_datasheet_fp8_peak():
    """Dense FP8 peaks (half the sparse datasheet figure): H100 and H200 SXM 1978.9 TFLOP/s, L40S
    733; none on A100 and the CPU. H200: the H100's compute, 141 GB of HBM3e at 4.8 TB/s."""
    peaks = {n: Cluster.preset(n).gpu for n in Cluster.presets()}
    assert {n: g.fp8_flops for n, g in peaks.items()} == {
        "dgx-h100": 1978.9e12, "dgx-h200": 1978.9e12, "dgx-a100": 0.0, "pcie-l40s": 733e12, "local-cpu": 0.0}
    h200 = peaks["dgx-h200"]
    assert (h200.bf16_flops, h200.hbm_bytes, h200.hbm_bandwidth_bytes_per_s) == (989.4e12, 141 * 10**9, 4.8e12)


def test_mfu_stays_against_the_bf16_peak_and_the_fp8_figure_sits_beside_it():
    c = config("float8-tensorwise")
    p = predict_step(c)
    assert p.mfu == mfu(c, p.step_time_s)  # bf16's peak, as torchtitan and Megatron report it
    assert p.mfu_fp8_peak == mfu(c, p.step_time_s, peak="fp8")
    assert p.mfu == pytest.approx(2 * p.mfu_fp8_peak, rel=1e-4)  # H100: 1978.9 / 989.4 TFLOP/s
    assert p.to_dict()["mfu_fp8_peak"] == p.mfu_fp8_peak
    assert predict_step(config("fsdp2-bf16")).mfu_fp8_peak is None  # no FP8 recipe: no second figure
    a100 = build_run_config("llama3-8b", gpu="a100-80gb", gpus=8, plan="dp_shard=8")
    with pytest.raises(ConfigError, match="gpu=a100-80gb has no fp8 tensor cores"):
        mfu(a100, 1.0, peak="fp8")


def test_which_gemms_run_at_the_fp8_rate():
    """torchao converts the attention and MLP nn.Linears (and shared experts), not the router, not
    the routed experts (GroupedExperts) and not the output head; TE converts the experts too."""
    dense = _layer_gemms(config("float8-tensorwise"), 1024, False)
    assert all(fp8 for *_, fp8 in dense) and len(dense) == 4
    moe_cfg = dict(model="tiny-moe", gpu="h100-80gb", gpus=8, plan="dp_shard=8", seq_len=256, framework="bundled")
    for name, experts in (("float8-tensorwise", False), ("te-fp8", True)):
        c = build_run_config(precision=name, **moe_cfg)
        gemms = _layer_gemms(c, 256, True)
        n = c.model.n_experts
        router = [g for g in gemms if g[2] == n]
        assert [g[3] for g in router] == [False]
        assert [g[3] for g in gemms[len(c.model.attention_gemms(1)) + 1:][:2 * n]] == [experts] * (2 * n)
    assert not any(fp8 for *_, fp8 in _layer_gemms(config("fsdp2-bf16"), 1024, False))
    # the output head and the attention core stay bf16: an FP8 step is not twice as fast
    bf16, fp8 = predict_step(config("fsdp2-bf16")), predict_step(config("float8-tensorwise"))
    assert 1.1 < bf16.step_time_s / fp8.step_time_s < 1.5


def test_cast_traffic_by_hand():
    """torchao's roofline bytes per element, per converted GEMM (M, K, N): tensorwise input 6 in
    forward, weight 5 + 3, output gradient 6 in backward; without FSDP the weight is cast whole.
    With FSDP float8 all-gather the shard is cast before each gather and the gathered FP8 weight
    transposed (2) in backward. TE casts a cached weight once a step (4 over m micro-batches)."""
    for plan, gathered in (("dp_shard=8,zero=1", False), ("dp_shard=8", True)):
        c = config("float8-tensorwise", plan=plan)
        gemms = _layer_gemms(c, 16384, False)
        w_f, w_b = (5 / 8, 5 / 8 + 2) if gathered else (5, 3)
        fwd = sum(6 * m * k + w_f * k * n for m, k, n, _ in gemms)
        bwd = sum(6 * m * n + w_b * k * n for m, k, n, _ in gemms)
        assert _fp8_cast_bytes(c, 16384, False) == pytest.approx((fwd, bwd))
    c = config("te-fp8", plan="dp_shard=8,zero=1", framework="megatron", global_batch_size=64)
    assert c.n_microbatches == 4
    gemms = _layer_gemms(c, 16384, False)
    assert _fp8_cast_bytes(c, 16384, False) == pytest.approx(
        (sum(4 * m * k + 4 / 4 * k * n for m, k, n, _ in gemms), sum(4 * m * n for m, k, n, _ in gemms)))
    assert _fp8_cast_bytes(config("fsdp2-bf16"), 16384, False) == (0.0, 0.0)


def test_torchaos_own_benchmark_rowwise_between_bf16_and_tensorwise():
    """torchao's end-to-end benchmark (torchao/float8/README.md before #3791): Llama 3 8B on 8 H100,
    FSDP2, batch 1, seq 8192, per-op SAC, compile: bf16 6150 tokens/s, tensorwise with float8
    all-gather 7689.5 (+25.0 %), rowwise 6768 (+10.1 %). The planner orders them so and predicts
    each gain within 10 points, from the kernel factor (pytorch#147971) and the casts (torchao's
    roofline), neither fitted to these numbers. Meta's H100s (torchao's roofline: 2.4 TB/s): the
    Grand Teton cluster beside the published tables."""
    from workbench.predict.measurements import DATA

    def tps(name: str) -> float:
        c = build_run_config("llama3-8b", cluster=str(DATA / "grand-teton-h100.json"), gpus=8, plan="dp_shard=8",
                             precision=name, seq_len=8192, micro_batch_size=1, global_batch_size=8,
                             recompute="selective", framework="torchtitan")
        return predict_step(c).tokens_per_s_per_gpu

    base, tensorwise, rowwise = tps("fsdp2-bf16"), tps("float8-tensorwise"), tps("float8-rowwise")
    assert base < rowwise < tensorwise
    assert abs(tensorwise / base - 7689.5 / 6150) <= 0.10
    assert abs(rowwise / base - 6768 / 6150) <= 0.10


def test_plan_prints_the_fp8_peak_mfu_beside_the_mfu():
    out = CliRunner().invoke(main, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                                    "--seq", "4096", "--gbs", "16", "--precision", "float8-tensorwise",
                                    "--framework", "torchtitan", "--top", "1"])
    assert out.exit_code == 0, out.output
    best = next(line for line in out.output.splitlines() if line.startswith("#1 "))
    assert "MFU" in best and "of the FP8 peak)" in best
    plain = CliRunner().invoke(main, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                                      "--seq", "4096", "--gbs", "16", "--precision", "fsdp2-bf16", "--top", "1"])
    assert plain.exit_code == 0 and "FP8 peak" not in plain.output


@pytest.mark.parametrize("name", ["te-fp8", "float8-tensorwise"])
def test_the_advisors_step_floor_stays_under_fp8_predictions(name):
    """The advisor prunes with a compute-only lower bound; FP8 GEMMs make steps faster than the bf16
    rate allows, so the bound takes the block GEMMs at the FP8 rate (tests/test_advisor.py checks
    the bf16 searches the same way)."""
    from workbench.predict import advisor

    model = ModelSpec.preset("mixtral-8x7b" if name == "te-fp8" else "llama3-8b")
    train = TrainSettings(seq_len=4096, global_batch_size=64,
                          framework="megatron" if name == "te-fp8" else "torchtitan").with_precision(name)
    candidates = advisor._search(advisor._Search(model, Cluster.preset("dgx-h100", nodes=2), train, prune=False), 3)
    assert candidates
    for c in candidates:
        screened = predict_step(c.config, memory=c.memory, simulate=False).step_time_s
        for recompute in advisor.RECOMPUTE_ORDER[: advisor.RECOMPUTE_ORDER.index(c.train.recompute) + 1]:
            for bubble in (False, True):
                assert advisor._step_floor(c.config, recompute, bubble) <= screened, (c.summary(), recompute, bubble)
