"""The memory bill against the ZeRO paper, Korthikanti et al. 2022, and its own consistency."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from workbench import Cluster, ConfigError, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.spec.framework import FRAMEWORKS
from workbench.predict.memory import (
    COMPONENTS,
    activation_bytes_per_layer,
    estimate_memory,
    in_flight_microbatches,
    model_state_bytes,
)

GB = 1e9
STATES = ("parameters", "gradients", "optimizer", "master_weights")


def config(model="llama3-8b", nodes=1, cluster="dgx-h100", train=None, **plan):
    m = model if isinstance(model, ModelSpec) else ModelSpec.preset(model)
    t = train or TrainSettings(seq_len=4096).with_precision("bf16-zero")
    return RunConfig(m, Cluster.preset(cluster, nodes=nodes), ParallelPlan(**plan), t)


def states(bill_components):
    return sum(bill_components[k] for k in STATES)


# ---------------------------------------------------------------------------- ZeRO, Figure 1
@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure_1(stage, expected_gb):
    """7.5B parameters, 64-way data parallel, mixed-precision Adam (2 + 2 + K bytes, K = 12)."""
    train = TrainSettings().with_precision("bf16-zero")
    got = sum(model_state_bytes(7.5e9, train, stage, 64).values())
    assert round(got / GB, 1) == expected_gb


def test_zero_exact_formulas():
    train = TrainSettings().with_precision("bf16-zero")
    psi, nd = 7.5e9, 64
    assert sum(model_state_bytes(psi, train, 1, nd).values()) == 4 * psi + 12 * psi / nd
    assert sum(model_state_bytes(psi, train, 2, nd).values()) == 2 * psi + 14 * psi / nd
    assert sum(model_state_bytes(psi, train, 3, nd).values()) == 16 * psi / nd


def test_zero_through_a_whole_config():
    """A whole RunConfig on 64 GPUs: model states per GPU follow Figure 1's formulas for its N."""
    cfg = config("llama3-8b", nodes=8, dp_shard=64, zero_stage=1)
    n = cfg.model.n_params()
    got = states(estimate_memory(cfg).components)
    assert got == pytest.approx(4 * n + 12 * n / 64, abs=8)


@pytest.mark.parametrize(
    "precision,bytes_per_param",
    [("bf16-megatron", 18), ("bf16-zero", 16), ("fp32", 16), ("fsdp2-bf16", 16), ("bf16", 8)],
)
def test_precision_recipes(precision, bytes_per_param):
    train = TrainSettings().with_precision(precision)
    assert sum(model_state_bytes(1000, train, 0, 1).values()) == bytes_per_param * 1000


def test_sgd_has_one_state():
    train = replace(TrainSettings().with_precision("fp32"), optimizer="sgd")
    assert model_state_bytes(1000, train, 0, 1)["optimizer"] == 4000


# ---------------------------------------------------------------------------- Korthikanti et al.
S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B shapes (paper, Table 3)
GPT = ModelSpec(n_layers=1, d_model=H, n_heads=A, d_ff=4 * H, vocab_size=51200, activation="gelu", norm="layernorm")
PAPER = TrainSettings(seq_len=S, micro_batch_size=B, attention="eager", dropout=True).with_precision("bf16-zero")


def per_layer(t=1, sp=False, recompute="none"):
    plan = ParallelPlan(tp=t, dp_shard=1, sequence_parallel=sp)
    return activation_bytes_per_layer(GPT, replace(PAPER, recompute=recompute), plan)


def test_korthikanti_no_parallelism():
    assert per_layer() == S * B * H * (34 + 5 * A * S / H)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel(t):
    assert per_layer(t) == pytest.approx(S * B * H * (10 + 24 / t + 5 * A * S / (H * t)), rel=1e-12)


@pytest.mark.parametrize("t", [2, 8])
def test_korthikanti_sequence_parallel(t):
    assert per_layer(t, sp=True) == pytest.approx(S * B * H / t * (34 + 5 * A * S / H), rel=1e-12)


@pytest.mark.parametrize("t", [2, 8])
def test_korthikanti_selective_recompute(t):
    assert per_layer(t, sp=True, recompute="selective") == pytest.approx(34 * S * B * H / t, rel=1e-12)


def test_korthikanti_full_recompute():
    assert per_layer(recompute="full") == 2 * S * B * H


def test_flash_attention_keeps_no_scores():
    eager = per_layer()
    plan = ParallelPlan(dp_shard=1)
    flash = activation_bytes_per_layer(GPT, replace(PAPER, attention="flash"), plan)
    # flash drops the 5as^2b score terms and keeps a 4-byte log-sum-exp per query and head
    assert eager - flash == 5 * A * S * S * B - 4 * A * S * B


# Table 3 of Korthikanti et al.: (L, h, a, p, b) with t = 8, s = 2048, v = 51200; the global batch
# is b on one pipeline (22B) or one micro-batch per GPU (175B: 64, 530B: 280, 1T: 512).
TABLE3 = {"22B": (48, 6144, 64, 1, 4), "175B": (96, 12288, 96, 8, 1), "530B": (105, 20480, 128, 35, 1),
          "1T": (128, 25600, 160, 64, 1)}


def table3_config(name, framework):
    L, h, a, p, b = TABLE3[name]
    model = ModelSpec(n_layers=L, d_model=h, n_heads=a, d_ff=4 * h, vocab_size=51200, activation="gelu",
                      norm="layernorm", linear_bias=True, tie_embeddings=True, position="learned", max_seq_len=S)
    train = TrainSettings(seq_len=S, micro_batch_size=b, global_batch_size=b if p == 1 else 8 * p, framework=framework,
                          attention="eager", dropout=True, recompute="selective").with_precision("bf16-megatron")
    # Megatron's cross-entropy is always vocabulary-parallel: loss_parallel
    plan = ParallelPlan(tp=8, pp=p, dp_shard=1, sequence_parallel=True, loss_parallel=True)
    return RunConfig(model, Cluster.preset("dgx-a100", nodes=p), plan, train)


@pytest.mark.parametrize("name", list(TABLE3))
def test_korthikanti_figure_1_first_stage(name):
    """Figure 1's "present work" activations (sequence parallelism + selective recomputation, the
    models of Table 3) under the megatron profile: the first pipeline stage holds p micro-batches
    (1F1B) of L/p layers, 34 sbh/t each (section 4.2.3), plus the dropout mask after the embeddings
    of each, sbhp/t, and with p = 1 the output layer, 4sbh/t (1 + v/h) (section 4.3):
    sbhL/t (34 + p/L + [p = 1] 4/L (1 + v/h))."""
    L, h, a, p, b = TABLE3[name]
    t, v = 8, 51200
    paper = S * b * h * L / t * (34 + p / L + (4 / L * (1 + v / h) if p == 1 else 0))
    megatron = estimate_memory(table3_config(name, "megatron")).per_stage[0]
    assert megatron.in_flight == (p,) and megatron.components["activations"] == pytest.approx(paper, rel=0.03)
    # torch's DTensor SP keeps the gathered QKV and MLP inputs: + 2 e sbh (1 - 1/t) per layer, ~80 % more
    bundled = estimate_memory(table3_config(name, "bundled")).per_stage[0].components["activations"]
    assert bundled > 1.7 * megatron.components["activations"]


def test_torchtitan_op_policy_keeps_every_other_matmul():
    """torchtitan's per-op selective checkpointing of a Llama block keeps its input, the outputs of
    matmuls 1, 3, 5, 7 (wq, wv, w1, w2) and SDPA's output and log-sum-exp: a third of Korthikanti's."""
    model = ModelSpec.preset("llama3-8b")
    train = TrainSettings(seq_len=8192, micro_batch_size=2, recompute="selective")
    plan = ParallelPlan(dp_shard=8)
    sb, h = 2 * 8192, 4096
    kept = 2 * sb * (h + model.q_dim + model.kv_dim + model.d_ff + h + model.q_dim) + 4 * sb * model.n_heads
    op = activation_bytes_per_layer(model, train, plan, selective_policy="op")
    assert op == kept
    assert op < 0.4 * activation_bytes_per_layer(model, train, plan)


def test_loss_buffers_follow_the_framework():
    """The cross-entropy's backward: torch's F.cross_entropy on fp32 logits allocates the fp32
    gradients of the log-probabilities and of the logits (8 bytes a logit) on top of the saved
    fp32 log-probabilities; Megatron's vocabulary-parallel loss works in place and casts (2)."""
    model = ModelSpec.preset("llama3-8b")
    # SGD: no foreach-Adam temporary at the optimizer step, whose moment would hide the loss's
    train = TrainSettings(seq_len=4096, recompute="full", optimizer="sgd").with_precision("bf16-megatron")
    logits = 4096 * model.vocab_size
    torch_bill = estimate_memory(config(model, tp=8, dp_shard=1, train=train))
    megatron_bill = estimate_memory(config(model, tp=8, dp_shard=1, train=replace(train, framework="megatron")))
    assert torch_bill.components["buffers"] >= 8 * logits  # torch without loss_parallel: every logit
    sharded = estimate_memory(config(model, tp=8, dp_shard=1, loss_parallel=True, train=train))
    assert sharded.components["buffers"] < torch_bill.components["buffers"] / 4
    # Megatron: vocab-parallel always, 4 bytes saved (Korthikanti's 4sbv/t) and 2 transient
    assert megatron_bill.components["buffers"] < 3 * logits / 8 + 2 * 2**30


def test_fsdp_gradient_accumulation_follows_the_framework():
    """Accumulating over micro-batches under FSDP2's no-sync (the bundled trainer's
    set_requires_gradient_sync(i == m - 1), and torch.distributed.pipelining on every micro-batch)
    keeps every unit's gradients unsharded in the reduce dtype; torchtitan (``fsdp``) reduce-
    scatters every micro-batch and holds one unit's."""
    model = ModelSpec.preset("llama3-8b")
    train = TrainSettings(seq_len=2048, global_batch_size=32, recompute="full").with_precision("fsdp2-bf16")
    bundled = estimate_memory(config(model, dp_shard=8, train=train))
    fsdp = estimate_memory(config(model, dp_shard=8, train=replace(train, framework="fsdp")))
    assert bundled.components["activations"] == fsdp.components["activations"]
    unsharded = 4 * model.n_params() * (1 - 1 / 8)  # fp32 gradients, less the sharded ones
    # ... in place of the per-unit ones: a block's fp32 reduce-scatter input, and the output
    # projection's bf16 gradient waiting for the root unit's reduce-scatter
    per_unit = 4 * model.layer_params(0).total + 2 * model.vocab_size * model.d_model
    extra = bundled.components["buffers"] - fsdp.components["buffers"]
    assert extra == pytest.approx(unsharded - per_unit, rel=0.01)
    # one micro-batch per step: no accumulation, the same buffers (but for bundled's RoPE cache)
    single = replace(train, global_batch_size=8)
    assert (estimate_memory(config(model, dp_shard=8, train=single)).components["buffers"]
            == pytest.approx(estimate_memory(config(model, dp_shard=8, train=replace(single, framework="fsdp")))
                             .components["buffers"], rel=1e-3))


# ---------------------------------------------------------------------------- pipeline schedules
def test_in_flight_microbatches_closed_forms():
    p, m = 4, 8
    gpipe = ParallelPlan(pp=p, dp_shard=1, pp_schedule="gpipe")
    one = ParallelPlan(pp=p, dp_shard=1, pp_schedule="1f1b")
    inter = ParallelPlan(pp=p, dp_shard=1, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert [in_flight_microbatches(gpipe, m, r) for r in range(p)] == [(8,)] * 4
    assert [in_flight_microbatches(one, m, r) for r in range(p)] == [(4,), (3,), (2,), (1,)]
    # Megatron: (p - r - 1) * 2 + (v - 1) * p + 1 chunks on rank r: 11 on rank 0, 5 on rank 3
    assert sum(in_flight_microbatches(inter, m, 0)) == 11
    assert sum(in_flight_microbatches(inter, m, 3)) == 5


def test_first_stage_holds_most_activations_last_holds_logits():
    cfg = config("llama3-8b", nodes=1, pp=4, tp=2, train=TrainSettings(seq_len=4096, global_batch_size=8))
    bill = estimate_memory(cfg)
    acts = [r.components["activations"] for r in bill.per_stage]
    assert acts[0] > acts[1] > acts[2]
    # the last stage holds 1 micro-batch but also the fp32 log-probabilities over the vocabulary
    assert bill.per_stage[-1].components["buffers"] > bill.per_stage[1].components["buffers"]
    # ... and a torch pipeline that returns its outputs (schedule.step(return_outputs=True), torch's
    # default; the bundled trainer passes False) keeps every micro-batch's logits (8 x 4096 x
    # 128256 in bf16, PipelineStage.output_chunks) until the step ends: without loss_parallel the
    # last stage, not the first, is then the most loaded
    logits = 4096 * 128256 * 2
    assert bill.per_stage[-1].components["buffers"] < 8 * logits
    keeps = replace(FRAMEWORKS["bundled"], name="keeps-outputs",
                    memory=replace(FRAMEWORKS["bundled"].memory, pipeline_keeps_outputs=True))
    kept = estimate_memory(config("llama3-8b", nodes=1, pp=4, tp=2,
                                  train=TrainSettings(seq_len=4096, global_batch_size=8, framework=keeps)))
    assert kept.per_stage[-1].components["buffers"] >= 8 * logits + bill.per_stage[-1].components["buffers"] * 0.5
    assert kept.most_loaded_rank == 6
    sharded = estimate_memory(config("llama3-8b", nodes=1, pp=4, tp=2, loss_parallel=True,
                                     train=TrainSettings(seq_len=4096, global_batch_size=8)))
    # loss_parallel splits the logits over the 2 TP ranks: the last stage's buffers about halve
    assert sharded.per_stage[-1].components["buffers"] < 0.55 * bill.per_stage[-1].components["buffers"]


def test_gpipe_holds_every_microbatch():
    train = TrainSettings(seq_len=1024, global_batch_size=16)
    one = estimate_memory(config("llama3-8b", pp=4, tp=2, train=train))
    gpipe = estimate_memory(config("llama3-8b", pp=4, tp=2, pp_schedule="gpipe", train=train))
    # 16 micro-batches per DP rank (dp = 1): GPipe holds all 16 on stage 0, 1F1B holds 4
    a1 = one.per_stage[0].components["activations"]
    ag = gpipe.per_stage[0].components["activations"]
    assert ag == pytest.approx(a1 * 16 / 4, rel=1e-6)


# ---------------------------------------------------------------------------- consistency
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_doubling_dp_shard_halves_sharded_states(zero):
    a = estimate_memory(config("llama3-8b", nodes=1, dp_shard=8, zero_stage=zero)).components
    b = estimate_memory(config("llama3-8b", nodes=2, dp_shard=16, zero_stage=zero)).components
    sharded = {1: ("optimizer", "master_weights"), 2: ("optimizer", "master_weights", "gradients"),
               3: STATES}[zero]
    for k in sharded:
        assert b[k] == pytest.approx(a[k] / 2, abs=1)
    for k in set(STATES) - set(sharded):
        assert b[k] == a[k]


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_pipeline_stages_hold_the_whole_model(pp):
    model = ModelSpec.preset("llama3-8b")
    train = TrainSettings(seq_len=1024, global_batch_size=16).with_precision("fp32")
    cfg = RunConfig(model, Cluster.preset("dgx-h100"), ParallelPlan(pp=pp, dp_shard=8 // pp, zero_stage=0), train)
    bill = estimate_memory(cfg)
    total = sum(r.components["parameters"] for r in bill.per_stage)
    assert total == pytest.approx(model.n_params() * 4, abs=pp)


def test_tensor_parallel_splits_matrices_not_norms():
    model = ModelSpec.preset("llama3-8b")
    train = TrainSettings(seq_len=1024).with_precision("fp32")
    tp8 = estimate_memory(RunConfig(model, Cluster.preset("dgx-h100"), ParallelPlan(tp=8, zero_stage=0), train))
    norms = model.n_layers * 2 * model.d_model + model.d_model
    assert tp8.components["parameters"] == pytest.approx(4 * ((model.n_params() - norms) / 8 + norms), abs=1)


def test_expert_parallel_divides_expert_weights():
    model = ModelSpec.preset("mixtral-8x7b")
    train = TrainSettings(seq_len=1024).with_precision("fp32")
    cl = Cluster.preset("dgx-h100")
    one = estimate_memory(RunConfig(model, cl, ParallelPlan(dp_shard=8, zero_stage=0), train)).components
    four = estimate_memory(RunConfig(model, cl, ParallelPlan(dp_shard=8, ep=4, zero_stage=0), train)).components
    experts = model.n_layers * model.layer_params(0).experts
    assert one["parameters"] - four["parameters"] == pytest.approx(4 * experts * 3 / 4, abs=1)


def test_fits_reports_headroom():
    bill = estimate_memory(config("llama3-8b", dp_shard=8))
    fit = bill.fits()
    assert fit.fits and fit.headroom_bytes == fit.hbm_bytes - bill.peak_bytes > 0
    assert not bill.fits(bill.peak_bytes - 1)
    assert bill.fits(bill.peak_bytes).headroom_bytes == 0


def test_overhead_is_an_explicit_line():
    cfg = config("llama3-8b", dp_shard=8)
    bill = estimate_memory(cfg)
    c = bill.components
    allocated = sum(v for k, v in c.items() if k != "overhead")
    assert c["overhead"] == pytest.approx(cfg.cluster.gpu.context_bytes + 0.05 * allocated, abs=2)
    assert bill.peak_bytes == sum(c.values())


def test_per_rank_expands_every_rank():
    bill = estimate_memory(config("llama3-8b", nodes=2, pp=2, tp=4))
    ranks = bill.per_rank
    assert len(ranks) == 16
    assert [r.pp_rank for r in ranks] == [0] * 8 + [1] * 8
    assert max(r.total_bytes for r in ranks) == bill.peak_bytes


def test_llama3_70b_on_64_h100():
    """The issue's reference: llama3-70b, 64 H100, tp 8, pp 4, seq 8192, selective recompute."""
    train = TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron")
    cfg = RunConfig(ModelSpec.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=8), ParallelPlan(tp=8, pp=4), train)
    bill = estimate_memory(cfg)
    c = bill.components
    n = ModelSpec.preset("llama3-70b").n_params()
    # 18 bytes/param over tp*pp = 32 ranks with dp_shard = 2 ZeRO-3: ~ 18 N / 64 bytes of states
    assert states(c) == pytest.approx(18 * n / 64, rel=0.05)
    assert bill.fits()


def test_invalid_plans_are_config_errors():
    with pytest.raises(ConfigError, match="tp=3 does not divide n_heads=32"):
        config("llama3-8b", tp=3)
    with pytest.raises(ConfigError, match=r"pp x virtual_stages = 8 x 1 = 8 exceeds n_layers=4"):
        config(ModelSpec.preset("tiny"), pp=8)
    with pytest.raises(ConfigError, match=r"= 16 differs from the world size 8"):
        config("llama3-8b", dp_shard=2, tp=8)


# ---------------------------------------------------------------------------- properties
@st.composite
def valid_configs(draw):
    model = draw(st.sampled_from(["tiny", "tiny-moe", "llama3-8b", "mixtral-8x7b"]))
    spec = replace(ModelSpec.preset(model), max_seq_len=8192)  # the tiny presets' table is 256; tests double seq
    nodes = draw(st.sampled_from([1, 2, 4]))
    world = nodes * 8
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if spec.n_kv_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if p <= spec.n_layers]))
    assume(world % (tp * pp) == 0)
    rest = world // (tp * pp)
    cp = draw(st.sampled_from([c for c in (1, 2) if rest % c == 0]))
    dp_shard = rest // cp
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if spec.is_moe and (dp_shard * cp) % e == 0 and spec.n_experts % e == 0] or [1]))
    seq = draw(st.sampled_from([256, 1024, 4096]))
    mbs = draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"])) if pp > 1 else "1f1b"
    v = 2 if schedule == "interleaved-1f1b" else 1
    assume(pp * v <= spec.n_layers)
    # interleaved schedules run micro-batches in rounds of pp: keep m a multiple of pp
    m = pp * draw(st.integers(1, 4)) if v > 1 else draw(st.integers(max(pp, 1), 4 * pp))
    train = TrainSettings(
        seq_len=seq, micro_batch_size=mbs, global_batch_size=m * mbs * dp_shard,
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        attention=draw(st.sampled_from(["flash", "eager"])),
    ).with_precision(draw(st.sampled_from(["fp32", "bf16-megatron", "bf16-zero", "fsdp2-bf16", "bf16"])))
    plan = ParallelPlan(tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard, zero_stage=draw(st.integers(0, 3)),
                        pp_schedule=schedule, virtual_stages=v, sequence_parallel=draw(st.booleans()))
    return RunConfig(spec, Cluster.preset("dgx-h100", nodes=nodes), plan, train)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(valid_configs())
def test_any_valid_config_gives_a_nonnegative_bill(cfg):
    bill = estimate_memory(cfg)
    for r in bill.per_stage:
        assert set(r.components) == set(COMPONENTS)
        assert all(v >= 0 for v in r.components.values())
    assert bill.peak_bytes == max(r.total_bytes for r in bill.per_stage) > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(valid_configs(), st.sampled_from(["seq_len", "micro_batch_size"]))
def test_activations_grow_with_tokens(cfg, field):
    bigger = replace(cfg.train, **{field: getattr(cfg.train, field) * 2})
    if field == "micro_batch_size":
        bigger = replace(bigger, global_batch_size=cfg.train.global_batch_size * 2)
    cfg2 = RunConfig(cfg.model, cfg.cluster, cfg.plan, bigger)
    a = estimate_memory(cfg)
    b = estimate_memory(cfg2)
    for r1, r2 in zip(a.per_stage, b.per_stage):
        assert r2.components["activations"] > r1.components["activations"]
