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
