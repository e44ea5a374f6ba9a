"""The trainer's model, data and schedule pieces, on one process."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from workbench import ModelSpec
from workbench.trainer.data import BatchLoader, decode, encode, load_tokens
from workbench.trainer.transformer import MoE, build_model, causal_sdpa, dropout_keep_mask, materialize
from workbench.trainer.pipeline import split_stage, stage_layers, sum_tied_grads, tied_copies
from workbench.trainer.train import lr_at

ODD_SPECS = {
    "gpt-like": ModelSpec(n_layers=2, d_model=48, n_heads=4, vocab_size=100, activation="gelu", norm="layernorm",
                          linear_bias=True, position="learned", max_seq_len=64, tie_embeddings=True),
    "qwen-moe-like": ModelSpec(n_layers=3, d_model=64, n_heads=8, n_kv_heads=2, head_dim=16, vocab_size=300,
                               qkv_bias=True, qk_norm=True, n_experts=6, top_k=2, n_shared_experts=2, moe_d_ff=32,
                               shared_expert_gate=True, first_k_dense_layers=1),
    "mqa-gelu-moe": ModelSpec(n_layers=2, d_model=32, n_heads=4, n_kv_heads=1, vocab_size=50, activation="gelu",
                              n_experts=3, top_k=1, moe_d_ff=24),
    # DeepSeek-V2-Lite-like: latent attention with a plain query projection, sigmoid grouped routing
    "deepseek-like": ModelSpec(n_layers=3, d_model=48, n_heads=4, vocab_size=80, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=6, n_experts=8, top_k=2, n_shared_experts=2, moe_d_ff=16,
                               first_k_dense_layers=1, scoring="sigmoid", n_expert_groups=4, topk_groups=2,
                               routed_scaling=2.5, router_bias=True),
}


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-mla", "tiny-qk-norm", "tiny-tied", *ODD_SPECS])
def test_parameter_count_matches_spec(name):
    spec = ModelSpec.preset(name) if name in ModelSpec.presets() else ODD_SPECS[name]
    model = build_model(spec)  # meta: no memory
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == spec.n_params()
    materialize(model, "cpu", seed=0)
    logits = model(torch.randint(0, spec.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, spec.vocab_size) and torch.isfinite(logits).all()


def test_deepseek_v3_on_meta_counts_as_the_spec():
    """The whole of DeepSeek-V3 (671B parameters) built on the meta device: the count is the spec's,
    multi-token prediction apart; the score correction bias is a frozen parameter."""
    spec = ModelSpec.preset("deepseek-v3")
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params() == 671_026_419_200
    bias = model.layers["3"].moe.router.bias
    assert bias.shape == (256,) and not bias.requires_grad
    assert model.layers["0"].attention.q_b.weight.shape == (128 * (128 + 64), 1536)
    assert model.layers["0"].attention.kv_a.weight.shape == (512 + 64, 7168)


def test_init_depends_on_seed_and_name_only():
    spec = ModelSpec.preset("tiny")
    a = materialize(build_model(spec), "cpu", seed=3)
    b = materialize(build_model(spec), "cpu", seed=3)
    c = materialize(build_model(spec), "cpu", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert torch.equal(sa["layers.0.attention_norm.weight"], torch.ones(spec.d_model))
    # A pipeline stage (other layers deleted) gets the same values for the same names.
    stage = materialize(split_stage(build_model(spec), 1, 2, [2, 3]), "cpu", seed=3)
    assert set(stage.state_dict()) == {k for k in sa if k.startswith(("layers.2.", "layers.3.", "norm.", "output."))}
    assert all(torch.equal(v, sa[k]) for k, v in stage.state_dict().items())


def test_stages_compose_to_the_whole_model():
    from workbench import ParallelPlan

    spec = ModelSpec.preset("tiny")
    plan = ParallelPlan(pp=2, dp_shard=1, pp_schedule="interleaved-1f1b", virtual_stages=2)
    layers = stage_layers(plan, spec.n_layers)
    assert layers == [[0], [1], [2], [3]]
    whole = materialize(build_model(spec), "cpu", seed=0)
    stages = [materialize(split_stage(build_model(spec), s, 4, ids), "cpu", seed=0) for s, ids in enumerate(layers)]
    x = torch.randint(0, 256, (2, 12))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=0)


def eager_attention(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    S = q.shape[2]
    scores = scores.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
    return scores.softmax(-1) @ v


def test_sdpa_is_causal_gqa_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    torch.testing.assert_close(causal_sdpa(q, k, v), eager_attention(q, k, v))


def test_positions_drive_rope():
    """Explicit positions equal the default arange; a swapped-in sdpa is used; and RoPE makes
    attention depend on relative position only (shifting every position changes nothing)."""
    spec = ModelSpec.preset("tiny")
    model = materialize(build_model(spec), "cpu", seed=0)
    x = torch.randint(0, 256, (2, 16))
    base = model(x)
    torch.testing.assert_close(model(x, torch.arange(16)), base)
    torch.testing.assert_close(model(x, torch.arange(16) + 7), base, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model(x, torch.arange(16).flip(0)), base, atol=1e-3)
    calls = []
    for layer in model.layers.values():
        layer.attention.sdpa = lambda q, k, v: calls.append(q.shape) or eager_attention(q, k, v)
    torch.testing.assert_close(model(x), base, rtol=1e-5, atol=1e-5)
    assert calls[0] == (2, 4, 16, 16) and len(calls) == spec.n_layers


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts one by one."""
    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router.gate(flat), -1)
    w, e = probs.topk(moe.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(moe.top_k):
            i = int(e[t, j])
            h = F.silu(flat[t] @ ex.w1[i].T) * (flat[t] @ ex.w3[i].T)
            out[t] += w[t, j] * (h @ ex.w2[i].T)
    if moe.shared_experts is not None:
        out += moe.shared_experts(flat)
    return out.view_as(x)


def test_moe_dropless_equals_per_token_routing():
    spec = ModelSpec.preset("tiny-moe")
    model = materialize(build_model(spec), "cpu", seed=0)
    moe = model.layers["1"].moe
    x = torch.randn(2, 8, spec.d_model)
    with torch.no_grad():
        out = moe(x)
        torch.testing.assert_close(out, naive_moe(moe, x), rtol=1e-5, atol=1e-5)
    assert int(moe.tokens_per_expert.sum()) == 16 * spec.top_k and moe.dropped_tokens == 0
    # aux = E * sum_e f_e P_e, with f_e the routed fraction and P_e the mean probability.
    with torch.no_grad():
        probs = F.softmax(moe.router.gate(x.reshape(-1, spec.d_model)), -1)
    f = moe.tokens_per_expert.float() / (16 * spec.top_k)
    assert float(moe.aux_loss) == pytest.approx(float(spec.n_experts * (f * probs.mean(0)).sum()), rel=1e-5)


def test_moe_capacity_drops_and_counts():
    spec = ModelSpec.preset("tiny-moe")
    model = materialize(build_model(spec, capacity_factor=1.0), "cpu", seed=0)
    moe = model.layers["1"].moe
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 1.0  # push most tokens to expert 0
        moe(torch.randn(2, 16, spec.d_model).abs())
    capacity = math.ceil(32 * spec.top_k / spec.n_experts)
    assert int(moe.tokens_per_expert.max()) <= capacity
    assert moe.dropped_tokens == 32 * spec.top_k - int(moe.tokens_per_expert.sum()) > 0


def test_moe_aux_loss_reaches_the_router_without_changing_the_output():
    spec = ModelSpec.preset("tiny-moe")
    model = materialize(build_model(spec), "cpu", seed=0)
    x = torch.randint(0, 256, (2, 8))
    base = model(x)
    base.sum().backward()
    g0 = model.layers["1"].moe.router.gate.weight.grad.clone()
    o0 = model.output.weight.grad.clone()
    model.zero_grad()
    for moe in model.moe_layers():
        moe.aux_loss_weight = 0.5
    out = model(x)
    torch.testing.assert_close(out, base)
    out.sum().backward()
    # The forward is unchanged but the router now also gets the gradient of 0.5 * aux.
    gate = model.layers["1"].moe.router.gate
    assert not torch.allclose(gate.weight.grad, g0)
    # Without the injection, aux only reaches the router through it: the output grad is unchanged.
    torch.testing.assert_close(model.output.weight.grad, o0)


def naive_deepseek_route(scores: torch.Tensor, bias: torch.Tensor, groups: int, topk_groups: int, k: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's gate, token by token: groups ranked by their two best biased scores, experts
    chosen by biased score among the best groups, weighted by their unbiased scores."""
    experts, weights = [], []
    for row in scores:
        biased = (row + bias).view(groups, -1)
        best = biased.topk(2, -1).values.sum(-1).topk(topk_groups).indices.tolist()
        allowed = [g * biased.shape[1] + j for g in best for j in range(biased.shape[1])]
        chosen = sorted(allowed, key=lambda e: -float(row[e] + bias[e]))[:k]
        w = row[chosen]
        experts.append(chosen)
        weights.append(w / w.sum() * scale)
    return torch.tensor(experts), torch.stack(weights)


def test_deepseek_routing_groups_bias_and_scaling():
    spec = ODD_SPECS["deepseek-like"]
    model = materialize(build_model(spec), "cpu", seed=0)
    router = model.layers["1"].moe.router
    assert torch.equal(router.bias, torch.zeros(8))  # zeros: no auxiliary-loss-free update
    with torch.no_grad():
        router.bias.copy_(torch.linspace(-0.3, 0.3, 8))  # selection only: weights stay unbiased
        x = torch.randn(40, spec.d_model)
        probs, weights, experts = router(x)
        scores = torch.sigmoid(router.gate(x))
    want_experts, want_weights = naive_deepseek_route(scores, router.bias, 4, 2, 2, 2.5)
    assert torch.equal(experts.sort(-1).values, want_experts.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), 2.5))
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(probs.sum(-1), torch.ones(40))  # the aux loss sees a distribution per token
    out = model(torch.randint(0, 80, (2, 8)))
    out.sum().backward()
    assert router.bias.grad is None and router.gate.weight.grad is not None


def test_dropout_mask_is_a_function_of_its_keys():
    """The same element gets the same mask whichever rank computes it: a shard of the batch (data
    parallel), of the sequence (sequence and context parallel) or a later step differ only by
    their keys. The rate is p."""
    samples, positions = torch.arange(8), torch.arange(32)
    full = dropout_keep_mask(0.1, 1, 3, 2, 1, samples, positions, 64)  # (8, 32, 64)
    assert full.shape == (8, 32, 64)
    assert abs(1 - float(full.float().mean()) - 0.1) < 0.01
    part = dropout_keep_mask(0.1, 1, 3, 2, 1, samples[4:6], positions[8:24], 64)  # a rank's rows, its shard
    assert torch.equal(part, full[4:6, 8:24])
    zigzag = torch.tensor([0, 1, 2, 3, 28, 29, 30, 31])  # a context-parallel rank's positions
    assert torch.equal(dropout_keep_mask(0.1, 1, 3, 2, 1, samples, zigzag, 64), full[:, zigzag])
    # another seed, step, layer or site: another mask
    for other in [(0.1, 2, 3, 2, 1), (0.1, 1, 4, 2, 1), (0.1, 1, 3, 3, 1), (0.1, 1, 3, 2, 2)]:
        assert not torch.equal(dropout_keep_mask(*other, samples, positions, 64), full)
    assert bool(dropout_keep_mask(0.0, 1, 3, 2, 1, samples, positions, 64).all())


def test_dropout_only_in_training_and_reproducible():
    spec = ModelSpec.preset("tiny")
    plain = materialize(build_model(spec), "cpu", seed=0)
    dropped = materialize(build_model(spec, dropout=0.1, dropout_seed=5), "cpu", seed=0)
    x = torch.randint(0, 256, (2, 16))
    base = plain(x)
    out = dropped(x)
    assert not torch.allclose(out, base)
    torch.testing.assert_close(dropped(x), out, rtol=0, atol=0)  # the same keys, the same masks
    dropped.dropout_step = 1
    assert not torch.allclose(dropped(x), out)
    # rows 2 and 3 of a batch of 4 are what a second data-parallel rank computes with samples (2, 3)
    x4 = torch.randint(0, 256, (4, 16))
    torch.testing.assert_close(dropped(x4[2:], samples=torch.tensor([2, 3])), dropped(x4)[2:], rtol=1e-5, atol=1e-5)
    dropped.eval()
    torch.testing.assert_close(dropped(x), base, rtol=0, atol=0)


def test_tied_weights_stay_equal_across_stages():
    """Stage 0 holds the table, the last stage the output projection (one rank with both, as a V
    schedule places them): initialised equal, their gradients summed to the tied model's, equal
    after an optimizer step; the norm counts the pair once."""
    spec = ModelSpec.preset("tiny-tied")
    whole = materialize(build_model(spec), "cpu", seed=2)
    stages = [materialize(split_stage(build_model(spec), s, 2, ids), "cpu", seed=2)
              for s, ids in enumerate([[0, 1], [2, 3]])]
    table, head = stages[0].tok_embeddings.weight, stages[1].output.weight
    assert table is not head and torch.equal(table, head) and torch.equal(table, whole.tok_embeddings.weight)
    x = torch.randint(0, 256, (2, 12))
    whole(x).square().mean().backward()
    stages[1](stages[0](x)).square().mean().backward()
    sum_tied_grads(stages, None)
    torch.testing.assert_close(table.grad, whole.tok_embeddings.weight.grad)
    assert torch.equal(table.grad, head.grad)
    assert tied_copies(stages) == {id(head)} and tied_copies([whole]) == set()
    optimizer = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=1e-2)
    optimizer.step()
    assert torch.equal(table, head) and not torch.equal(table, whole.tok_embeddings.weight)


def test_trainable_refuses_only_what_it_does_not_build():
    from dist import make_config
    from workbench.spec.trainable import unsupported

    runs = [("tiny-moe", "tp=2"), ("tiny-qk-norm", "tp=2"), ("tiny-tied", "pp=2"), ("tiny-mla", "tp=2"),
            ("tiny-mla", "cp=2")]
    for model, plan in runs:
        assert unsupported(make_config(plan, 2, model)) == [], (model, plan)
    assert unsupported(make_config("dp_shard=2", 2, "tiny", dropout=True, dropout_rate=0.2)) == []
    mtp = replace(ModelSpec.preset("tiny-mla"), n_mtp_layers=1)
    (why,) = unsupported(make_config("", 1, mtp))
    assert why.startswith("n_mtp_layers=1: the bundled trainer trains the main model only")
    biased = replace(ModelSpec.preset("tiny-moe"), linear_bias=True, activation="gelu", norm="layernorm")
    assert "linear_bias" in unsupported(make_config("tp=2", 2, biased))[0]
    no_sp = unsupported(make_config("tp=2,sequence_parallel=0", 2, "tiny-moe", seq_len=31))
    assert "seq_len / cp = 31 divisible by tp" in no_sp[0]


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_rate_is_validated(rate):
    from workbench import ConfigError, TrainSettings

    with pytest.raises(ConfigError, match=rf"dropout_rate={rate} must be in \[0, 1\)") as e:
        TrainSettings(dropout=True, dropout_rate=rate)
    assert e.value.field == "dropout_rate"


def test_data_slices_and_state():
    tokens = load_tokens("pydoc")
    assert decode(encode("héllo")) == "héllo"
    assert len(tokens) > 400_000 and int(tokens.max()) < 256
    whole = BatchLoader(tokens, seq_len=16, global_batch_size=8, micro_batch_size=2, seed=5)
    x, y = whole.batch(3)
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    parts = [BatchLoader(tokens, 16, 8, 2, dp_rank=r, dp_size=4, seed=5).batch(3) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    loader = BatchLoader(tokens, 16, 8, 2, seed=5)
    loader.next_batch()
    state = loader.state_dict()
    again = BatchLoader(tokens, 16, 8, 2, seed=5)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch()[0], loader.next_batch()[0])
    synthetic = load_tokens("synthetic")
    assert len(synthetic) > 100_000


def test_lr_schedule():
    assert lr_at(0, 1.0, 4, 100, 0.1) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(4, 1.0, 4, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(52, 1.0, 4, 100, 0.1) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 4, 100, 0.1) == pytest.approx(0.1)


@pytest.mark.slow  # two tiny-moe runs in deterministic mode, in this process
def test_deterministic_mode_repeats_bitwise():
    from workbench import Cluster, ParallelPlan, RunConfig, TrainSettings
    from workbench.trainer.train import run_training

    train = TrainSettings(seq_len=32, micro_batch_size=2, global_batch_size=4, steps=4, warmup_steps=1,
                          deterministic=True, dataset="synthetic").with_precision("fp32")
    config = RunConfig(ModelSpec.preset("tiny-moe"), Cluster.preset("local-cpu", gpus_per_node=1),
                       ParallelPlan(dp_shard=1), train)
    try:
        first, second = run_training(config), run_training(config)
    finally:
        torch.use_deterministic_algorithms(False)
    assert first == second
    assert all(math.isfinite(x) for x in first)
