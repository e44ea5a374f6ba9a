"""Hugging Face ``config.json`` to :class:`~workbench.spec.model.ModelSpec` fields (Llama, Mistral,
Mixtral, Qwen2/3, dense and MoE).

This module returns the fields, not the object, so that ``ModelSpec.from_hf_config`` can call it
without the two modules importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from workbench.spec.errors import ConfigError
from workbench.spec.files import read_user_json

SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_MOE_REQUIRED = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "deepseek_v2": ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "deepseek_v3": ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size"),
}


def _load(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"hf_config={config!r} must be a path or a JSON object", field="hf_config")
    path = Path(config)
    try:
        if path.is_dir():  # a model folder: its config.json
            path = path / "config.json"
    except (OSError, ValueError):
        pass  # read_user_json names the path and the cause
    data = read_user_json(path, "hf_config")
    if not isinstance(data, dict):
        raise ConfigError(f"hf_config={str(path)!r} must hold a JSON object, not {type(data).__name__}",
                          field="hf_config")
    return data


def _typed(cfg: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``cfg[key]`` checked against ``kind`` under its Hugging Face name (``num_hidden_layers='x'
    must be an integer``), ``default`` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        what = "a number"
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        what = "an integer"
    elif kind is bool:
        ok, what = isinstance(value, bool), "true or false"
    elif kind is list:
        ok, what = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value), \
            "a list of integers"
    else:
        ok, what = isinstance(value, kind), f"a {kind.__name__}"
    if not ok:
        raise ConfigError(f"{key}={value!r} must be {what}", field=key, value=value)
    return value


def hf_config_fields(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields a ``config.json`` (a path, a folder holding one, or the parsed dict) describes."""
    cfg = _load(config)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED)}",
            field="model_type",
            value=model_type,
        )
    missing = [k for k in _REQUIRED + _MOE_REQUIRED.get(model_type, ()) if k not in cfg]
    if missing:
        raise ConfigError(
            f"{model_type} config.json is missing {', '.join(missing)}", field=missing[0], value=None
        )
    act = _typed(cfg, "hidden_act", str, "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"hidden_act={act!r} is not supported for {model_type}: its gated MLP is modelled as SwiGLU (silu)",
            field="hidden_act",
            value=act,
        )
    for key in _REQUIRED + _MOE_REQUIRED.get(model_type, ()):
        _typed(cfg, key, int)
    kw: dict[str, Any] = dict(
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=_typed(cfg, "num_key_value_heads", int) or cfg["num_attention_heads"],
        head_dim=_typed(cfg, "head_dim", int) or None,
        d_ff=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_embeddings=_typed(cfg, "tie_word_embeddings", bool, False),
        activation="swiglu",
        norm="rmsnorm",
        rope_theta=_typed(cfg, "rope_theta", float, 10000.0),
        max_seq_len=_typed(cfg, "max_position_embeddings", int, 8192),
        name=_typed(cfg, "_name_or_path", str, "") or model_type,
    )
    if model_type in ("qwen2", "qwen2_moe"):
        kw["qkv_bias"] = True  # Qwen2 attention: bias on q, k, v
    elif _typed(cfg, "attention_bias", bool, False):
        raise ConfigError(
            f"attention_bias=true is not supported for {model_type} (no released model of the family uses it)",
            field="attention_bias",
            value=True,
        )
    if model_type in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if _typed(cfg, "mlp_bias", bool, False):
        raise ConfigError("mlp_bias=true is not supported (no released Llama-family model uses it)", field="mlp_bias")
    if model_type == "mixtral":
        kw.update(n_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], moe_d_ff=cfg["intermediate_size"])
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        step = _typed(cfg, "decoder_sparse_step", int, 1)
        dense_only = sorted(_typed(cfg, "mlp_only_layers", list, []))
        if step != 1:
            raise ConfigError(
                f"decoder_sparse_step={step} is not supported: MoE layers must follow first_k_dense_layers dense ones",
                field="decoder_sparse_step",
                value=step,
            )
        if dense_only != list(range(len(dense_only))):
            raise ConfigError(
                f"mlp_only_layers={dense_only} is not supported: dense layers must be the first k",
                field="mlp_only_layers",
                value=dense_only,
            )
        kw.update(
            n_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            moe_d_ff=cfg["moe_intermediate_size"],
            first_k_dense_layers=len(dense_only),
        )
        shared = _typed(cfg, "shared_expert_intermediate_size", int, 0)
        if shared:
            kw.update(n_shared_experts=1, shared_d_ff=shared, shared_expert_gate=True)
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        kw.update(_deepseek_fields(cfg, model_type))
    return kw


def _deepseek_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Latent attention and the DeepSeek MoE layout (DeepSeek-V2's and V3's ``config.json``)."""
    kw: dict[str, Any] = dict(
        q_lora_rank=_typed(cfg, "q_lora_rank", int, 0) or 0,  # null in V2-Lite: a plain query projection
        kv_lora_rank=_typed(cfg, "kv_lora_rank", int),
        qk_nope_head_dim=_typed(cfg, "qk_nope_head_dim", int),
        qk_rope_head_dim=_typed(cfg, "qk_rope_head_dim", int),
        v_head_dim=_typed(cfg, "v_head_dim", int),
        n_kv_heads=cfg["num_attention_heads"],  # every head gets its keys and values from the latent
        head_dim=None,
        n_mtp_layers=_typed(cfg, "num_nextn_predict_layers", int, 0),
    )
    experts = _typed(cfg, "n_routed_experts", int, 0)
    if experts:
        kw.update(
            n_experts=experts,
            top_k=_typed(cfg, "num_experts_per_tok", int),
            moe_d_ff=_typed(cfg, "moe_intermediate_size", int),
            n_shared_experts=_typed(cfg, "n_shared_experts", int, 0),
            first_k_dense_layers=_typed(cfg, "first_k_dense_replace", int, 0),
            moe_layer_freq=_typed(cfg, "moe_layer_freq", int, 1),
            scoring=_typed(cfg, "scoring_func", str, "softmax"),
            n_expert_groups=_typed(cfg, "n_group", int, 1),
            topk_groups=_typed(cfg, "topk_group", int, 1),
            routed_scaling=_typed(cfg, "routed_scaling_factor", float, 1.0),
            # V3's sigmoid router carries a per-expert bias that balances the load (e_score_correction_bias)
            router_bias=model_type == "deepseek_v3" and _typed(cfg, "topk_method", str, "noaux_tc") == "noaux_tc",
        )
    return kw
