"""ModelSpec: exact parameter counts, FLOP convention, presets, Hugging Face import, validation."""

import json

import pytest

from workbench import ConfigError, ModelSpec

# Published totals (Llama 3 paper / model cards; Mixtral config.json summed by hand).
EXACT = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name,count", EXACT.items())
def test_exact_parameter_counts(name, count):
    assert ModelSpec.preset(name).n_params() == count


def test_moe_active_parameters():
    mixtral = ModelSpec.preset("mixtral-8x7b")
    # 2 of 8 experts per token: 12.9B active (Mixtral paper: "13B active parameters").
    assert mixtral.n_active_params() == 12_879_925_248
    qwen = ModelSpec.preset("qwen3-30b-a3b")
    assert round(qwen.n_params() / 1e9, 1) == 30.5  # "Qwen3-30B-A3B": 30.5B total
    assert round(qwen.n_active_params() / 1e9, 1) == 3.4  # 3.3B activated without embeddings (model card)
    assert round((qwen.n_active_params() - qwen.embedding_params) / 1e9, 1) == 3.0
    dense = ModelSpec.preset("llama3-8b")
    assert dense.n_active_params() == dense.n_params()


def test_gpt3_175b():
    assert round(ModelSpec.preset("gpt3-175b").n_params() / 1e9, 1) == 174.6


def test_flops_convention_palm():
    m = ModelSpec.preset("llama3-8b")
    n_matmul = 8_030_261_248 - 128256 * 4096  # embedding lookup excluded, output projection kept
    assert m.n_matmul_params() == n_matmul
    assert m.flops_per_token(4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096
    assert m.flops_per_token(4096, causal=True) == 6 * n_matmul + 6 * 32 * 4096 * 4096


def test_flops_match_megatron_formula():
    # Narayanan et al. 2021: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per iteration for GPT with d_ff = 4h.
    l, h, s, v = 24, 2048, 4096, 131072
    m = ModelSpec(n_layers=l, d_model=h, n_heads=16, d_ff=4 * h, vocab_size=v, activation="gelu")
    megatron = 72 * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert m.flops_per_token(s) == pytest.approx(megatron, rel=1e-3)  # only norm weights differ


def test_tied_embeddings_count_once():
    untied = ModelSpec(n_layers=2, d_model=64, n_heads=4, vocab_size=100)
    tied = ModelSpec(n_layers=2, d_model=64, n_heads=4, vocab_size=100, tie_embeddings=True)
    assert untied.n_params() - tied.n_params() == 100 * 64
    assert untied.n_matmul_params() == tied.n_matmul_params()


def test_json_round_trip():
    for name in ModelSpec.presets():
        m = ModelSpec.preset(name)
        assert ModelSpec.from_json(m.to_json()) == m


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="llama3-8b") as e:
        ModelSpec.preset("llama9")
    assert e.value.field == "model"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(n_layers=0, d_model=64, n_heads=4), "n_layers=0 must be >= 1"),
        (dict(n_layers=2, d_model=-64, n_heads=4), "d_model=-64 must be >= 1"),
        (dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=4"),
        (dict(n_layers=2, d_model=66, n_heads=4), "n_heads=4 does not divide d_model=66"),
        (dict(n_layers=2, d_model=64, n_heads=4, activation="relu"), "activation='relu' is not one of"),
        (dict(n_layers=2, d_model=64, n_heads=4, n_experts=4, top_k=5), "top_k=5 exceeds n_experts=4"),
        (dict(n_layers=2, d_model=64, n_heads=4, top_k=2), "need n_experts > 0"),
    ],
)
def test_bad_specs(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ModelSpec(**kwargs)


# ---------------------------------------------------------------------------- Hugging Face
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu",
    "rope_theta": 500000.0, "tie_word_embeddings": False, "max_position_embeddings": 8192,
}
MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "hidden_act": "silu", "tie_word_embeddings": False,
}
QWEN2_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "hidden_act": "silu",
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu",
}
QWEN15_MOE = {
    "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_attention_heads": 16, "num_hidden_layers": 24,
    "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu",
}


def test_hf_llama_equals_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    m = ModelSpec.from_hf_config(path)
    assert m.n_params() == EXACT["llama3-8b"]
    assert ModelSpec.from_hf_config(tmp_path).n_params() == EXACT["llama3-8b"]  # a directory works too


def test_hf_mixtral_and_qwen():
    assert ModelSpec.from_hf_config(MIXTRAL).n_params() == EXACT["mixtral-8x7b"]
    # Qwen2-7B model card: 7.62B; q/k/v biases included.
    assert ModelSpec.from_hf_config(QWEN2_7B).n_params() == 7_615_616_512
    q3 = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    assert q3.n_params() == ModelSpec.preset("qwen3-30b-a3b").n_params()
    assert q3.qk_norm and q3.n_experts == 128 and q3.top_k == 8
    # Qwen1.5-MoE-A2.7B model card: 14.3B total, 2.7B activated (embeddings included).
    q15 = ModelSpec.from_hf_config(QWEN15_MOE)
    assert round(q15.n_params() / 1e9, 1) == 14.3
    assert round(q15.n_active_params() / 1e9, 1) == 2.7
    assert q15.n_shared_experts == 1 and q15.shared_d_ff == 5632 and q15.shared_expert_gate


@pytest.mark.parametrize(
    "config,message",
    [
        ({**LLAMA3_8B, "model_type": "gpt2"}, "model_type='gpt2' is not supported; supported: llama"),
        ({k: v for k, v in LLAMA3_8B.items() if k != "vocab_size"}, "llama config.json is missing vocab_size"),
        ({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}, "missing num_local_experts"),
        ({**LLAMA3_8B, "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({**QWEN3_30B_A3B, "decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
        ({**LLAMA3_8B, "num_key_value_heads": 5}, "n_kv_heads=5 does not divide n_heads=32"),
    ],
)
def test_hf_errors_name_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_hf_config(config)


def test_hf_malformed_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelSpec.from_hf_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
