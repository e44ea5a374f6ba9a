"""Multi-head latent attention and the DeepSeek MoE layout in ModelSpec: parameter counts against
the architecture (DeepSeek-V3's published 671B total, 37B active), the FLOP convention, the
Hugging Face import and the validation of the new fields."""

from __future__ import annotations

import pytest

from workbench import ConfigError, ModelSpec

V3_CONFIG = dict(  # deepseek-ai/DeepSeek-V3/config.json, the fields the count depends on
    model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
    num_key_value_heads=128, intermediate_size=18432, vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, moe_layer_freq=1,
    scoring_func="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5, topk_method="noaux_tc",
    num_nextn_predict_layers=1, hidden_act="silu", tie_word_embeddings=False, rope_theta=10000,
    max_position_embeddings=163840,
)


def mla_attention_by_hand(d, h, qr, kvr, nope, rope, v) -> int:
    q = d * qr + qr + qr * h * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
    kv = d * (kvr + rope) + kvr + kvr * h * (nope + v)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    return q + kv + h * v * d  # o_proj


def test_deepseek_v3_counts_follow_the_architecture():
    m = ModelSpec.preset("deepseek-v3")
    d = 7168
    attn = mla_attention_by_hand(d, 128, 1536, 512, 128, 64, 128)
    assert attn == 187_107_328
    assert m.layer_params(0).attention + m.layer_params(0).replicated - 2 * d == attn
    expert = 3 * d * 2048
    dense = attn + 3 * d * 18432 + 2 * d
    moe = attn + 257 * expert + 256 * d + 256 + 2 * d  # 256 routed + 1 shared, router, score bias, norms
    total = 3 * dense + 58 * moe + 2 * 129280 * d + d
    assert m.n_params() == total == 671_026_419_200  # published: 671B
    active = 3 * dense + 58 * (moe - 248 * expert) + 2 * 129280 * d + d
    assert m.n_active_params() == active == 37_552_297_472  # published: 37B activated
    assert m.n_mtp_params() == 2 * d + 2 * d * d + moe + d  # reported apart from the main model


def test_hf_deepseek_v3_equals_the_preset():
    imported = ModelSpec.from_hf_config(V3_CONFIG)
    preset = ModelSpec.preset("deepseek-v3")
    for f in ("n_params", "n_active_params", "n_mtp_params"):
        assert getattr(imported, f)() == getattr(preset, f)()
    assert (imported.scoring, imported.n_expert_groups, imported.topk_groups, imported.routed_scaling) == \
        ("sigmoid", 8, 4, 2.5)


def test_latent_attention_flops_count_keys_and_values_at_their_widths():
    m = ModelSpec.preset("tiny-mla")
    s = 128
    # scores over (nope + rope) = 24 wide keys, values 16 wide, per head
    assert m.attention_flops_per_token(s) == 6.0 * m.n_layers * m.n_heads * (24 + 16) * s
    dense = ModelSpec.preset("tiny")
    assert dense.attention_flops_per_token(s) == 12.0 * dense.n_layers * dense.q_dim * s  # unchanged


@pytest.mark.parametrize("kwargs, message", [
    (dict(q_lora_rank=8), "q_lora_rank=8 needs kv_lora_rank > 0"),
    (dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_kv_heads=2),
     "n_kv_heads=2 must equal n_heads=4"),
    (dict(kv_lora_rank=8, qk_nope_head_dim=0, v_head_dim=8), "qk_nope_head_dim"),
    (dict(kv_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=32), "head_dim=32 must be"),
    (dict(n_experts=8, top_k=2, n_expert_groups=3), "n_expert_groups=3 does not divide n_experts=8"),
    (dict(n_experts=8, top_k=5, n_expert_groups=4, topk_groups=2), "top_k=5 exceeds the 4 experts"),
    (dict(n_experts=8, top_k=2, scoring="tanh"), "scoring"),
    (dict(n_experts=8, top_k=2, moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
])
def test_bad_latent_and_routing_fields(kwargs, message):
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, vocab_size=64)
    with pytest.raises(ConfigError, match=message):
        ModelSpec(**{**base, **kwargs})


# ---------------------------------------------------------------------------- the planner prices MLA
def test_mtp_module_as_the_checkpoint_stores_it():
    """DeepSeek-V3's model card: 685B on Hugging Face, 671B main model + 14B MTP. The MTP module
    counted here (11.6B) holds no embedding or head of its own; the checkpoint stores copies of
    both with it (2 x 129280 x 7168 = 1.85B): 13.46B, 684.5B in all, the card's rounded figures."""
    m = ModelSpec.preset("deepseek-v3")
    copies = 2 * m.vocab_size * m.d_model
    assert m.n_mtp_params() == 11_610_068_224
    assert round((m.n_mtp_params() + copies) / 1e9, 2) == 13.46
    assert round((m.n_params() + m.n_mtp_params() + copies) / 1e9, 1) == 684.5


def test_attention_gemms_fuse_what_reads_the_same_input():
    v3 = ModelSpec.preset("deepseek-v3")
    assert v3.attention_gemms(8) == (
        ("latent_down", 2, 7168, 1536 + 512 + 64),  # q_a and kv_a, whole on every TP rank
        ("q_up", 1, 1536, 128 * 192 / 8),
        ("kv_up", 1, 512, 128 * (128 + 128) / 8),
        ("attn_out", 1, 128 * 128 / 8, 7168),
    )
    llama = ModelSpec.preset("llama3-8b")
    assert llama.attention_gemms(2) == (("qkv", 3, 4096, (4096 + 2 * 1024) / 2), ("attn_out", 1, 2048, 4096))
    # the projections' matrices are the counted attention parameters (norms apart)
    split, whole = v3._attention_params()
    assert sum(p.params for p in v3.attention_projections()) == split + whole - 1536 - 512


def test_kv_cache_per_token_is_the_latent():
    assert ModelSpec.preset("deepseek-v3").kv_cache_values_per_token() == 512 + 64
    assert ModelSpec.preset("llama3-8b").kv_cache_values_per_token() == 2 * 8 * 128


def _mla_config(plan, seq_len=4096, mbs=1):
    from workbench import Cluster, ParallelPlan, RunConfig, TrainSettings

    train = TrainSettings(seq_len=seq_len, micro_batch_size=mbs, global_batch_size=1024).with_precision("bf16-zero")
    return RunConfig(ModelSpec.preset("deepseek-v3"), Cluster.preset("dgx-h100", nodes=32), ParallelPlan.parse(plan), train)


@pytest.mark.parametrize("tp", [1, 8])
def test_latent_attention_activations_by_hand(tp):
    """What one MLA block keeps, by hand (e = 2, s b = 4096 tokens, no SP): Q, the expanded K and
    V split by TP; the latents whole on every TP rank; the rest as a dense block."""
    from workbench.predict.memory import activation_bytes_per_layer

    c = _mla_config(f"tp={tp},sequence_parallel=0")
    m, e, sb, h = c.model, 2, 4096, 7168
    got = activation_bytes_per_layer(m, c.train, c.plan, moe=False)
    attention = (2 * e * sb * h  # norm input, the down-projections' input
                 + e * sb * 128 * (192 + 192 + 128) / tp  # Q, K (nope + rope per head), V
                 + e * sb * (2 * 1536 + 512 + 64 + 512)  # q latent, normed; kv_a's output, normed latent
                 + 4 * sb * 128 / tp  # log-sum-exp
                 + e * sb * 128 * 128 / tp)  # o's input
    mlp = 2 * e * sb * h + 4 * e * sb * 18432 / tp
    assert got == pytest.approx(attention + mlp, rel=1e-12)


def test_cp_ring_carries_latents_not_expanded_kv():
    """Ring attention for MLA passes the key/value latent and the RoPE key per token (576
    values, whole on every TP rank) where grouped-query attention passes the rank's K and V."""
    from workbench.predict.comms import step_collectives

    def ring_bytes(plan):
        c = _mla_config(plan, seq_len=16384)
        kv = [x for x in step_collectives(c) if x.dim == "cp" and "K, V" in x.purpose and "dK" not in x.purpose]
        return kv[0].size_bytes

    tokens = 16384 / 2
    assert ring_bytes("cp=2,tp=1") == pytest.approx(tokens * 576 * 2)
    assert ring_bytes("cp=2,tp=8") == pytest.approx(tokens * 576 * 2)  # the latent is not split by TP


def test_cp_pays_to_reexpand_visiting_latents():
    from workbench.predict.perf import predict_step

    base = predict_step(_mla_config("cp=1,tp=8,ep=8,pp=4", seq_len=8192))
    ring = predict_step(_mla_config("cp=2,tp=8,ep=8,pp=4", seq_len=16384))
    # cp=2 on twice the sequence: the same tokens per rank, attention's context doubles, plus one
    # kv_b re-expansion of the visiting chunk per layer
    assert ring.step_time_s > base.step_time_s


def test_moe_block_bills_top8_of_256_dispatch_by_hand():
    """DeepSeek-V3's MoE block, e = 2, s b = 4096 tokens, tp = 1: the router's fp32 scores over
    256 experts, 8 dispatched copies of every token (the experts' input), the experts' SwiGLU
    hidden activations for 8 x 4096 token-visits, their 8 outputs kept for the weighted combine,
    the shared expert as a 2048-wide MLP. Under EP the same bytes: each rank keeps the visits its
    experts receive, which a balanced router makes the same number."""
    from workbench.predict.memory import activation_bytes_per_layer

    for plan in ("tp=1", "ep=8"):
        c = _mla_config(plan)
        e, sb, h = 2, 4096, 7168
        dense = activation_bytes_per_layer(c.model, c.train, c.plan, moe=False)
        moe = activation_bytes_per_layer(c.model, c.train, c.plan, moe=True)
        mlp_dense = 4 * e * sb * 18432
        mlp_moe = 4 * sb * 256 + e * sb * 8 * h + 4 * e * sb * 8 * 2048 + e * sb * 8 * h + 4 * e * sb * 2048
        assert moe - dense == pytest.approx(mlp_moe - mlp_dense, rel=1e-12)


V2_LITE = dict(  # deepseek-ai/DeepSeek-V2-Lite/config.json: no query latent (q_lora_rank null)
    model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=10944, vocab_size=102400, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    moe_intermediate_size=1408, first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", n_group=1,
    topk_group=1, routed_scaling_factor=1.0, topk_method="greedy", hidden_act="silu", tie_word_embeddings=False,
    max_position_embeddings=163840, rope_theta=10000,
)
V2 = dict(V2_LITE, num_hidden_layers=60, hidden_size=5120, num_attention_heads=128, num_key_value_heads=128,
          intermediate_size=12288, q_lora_rank=1536, n_routed_experts=160, moe_intermediate_size=1536, n_group=8,
          topk_group=3, routed_scaling_factor=16.0, topk_method="group_limited_greedy")


@pytest.mark.parametrize("config,total,activated", [(V2_LITE, 15.7, 2.4), (V2, 236, 21)])
def test_deepseek_v2_counts_against_the_published_ones(config, total, activated):
    """DeepSeek-V2 (236B, 21B activated) and V2-Lite (15.7B, 2.4B activated; a plain query
    projection). "Activated" there leaves out the embedding lookup: V2-Lite's 2.45B without it,
    2.66B with it (so V3's published 37B is 36.6B, the matmul parameters)."""
    m = ModelSpec.from_hf_config(config)
    digits = 1 if total < 100 else 0
    assert round(m.n_params() / 1e9, digits) == total
    assert int(m.n_matmul_params() / 1e9 * 10) / 10 == pytest.approx(activated, abs=0.11 if activated < 10 else 0.5)
    if config is V2_LITE:
        assert m.q_lora_rank == 0 and [p.name for p in m.attention_projections()] == ["q_proj", "kv_a", "kv_b", "o"]
        assert (m.n_params(), m.n_matmul_params()) == (15_706_484_224, 2_451_435_008)
