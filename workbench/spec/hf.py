"""Hugging Face ``config.json`` to :class:`~workbench.spec.model.ModelSpec` fields (Llama, Mistral,
Mixtral, Qwen2/3, dense and MoE).

This module returns the fields, not the object, so that ``ModelSpec.from_hf_config`` can call it
without the two modules importing each other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from workbench.spec.errors import ConfigError

SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_MOE_REQUIRED = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
}


def _load(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hf_config={str(path)!r} does not exist", field="hf_config", value=str(path)) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"hf_config={str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})", field="hf_config"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"hf_config={str(path)!r} must hold a JSON object", field="hf_config")
    return data


def hf_config_fields(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields a ``config.json`` (a path, a folder holding one, or the parsed dict) describes."""
    cfg = _load(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
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
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"hidden_act={act!r} is not supported for {model_type}: its gated MLP is modelled as SwiGLU (silu)",
            field="hidden_act",
            value=act,
        )
    kw: dict[str, Any] = dict(
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or None,
        d_ff=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        activation="swiglu",
        norm="rmsnorm",
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_seq_len=int(cfg.get("max_position_embeddings", 8192)),
        name=cfg.get("_name_or_path", "") or model_type,
    )
    if model_type in ("qwen2", "qwen2_moe"):
        kw["qkv_bias"] = True  # Qwen2 attention: bias on q, k, v
    elif cfg.get("attention_bias"):
        raise ConfigError(
            f"attention_bias=true is not supported for {model_type} (no released model of the family uses it)",
            field="attention_bias",
            value=True,
        )
    if model_type in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if cfg.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported (no released Llama-family model uses it)", field="mlp_bias")
    if model_type == "mixtral":
        kw.update(n_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], moe_d_ff=cfg["intermediate_size"])
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step", 1)
        dense_only = sorted(cfg.get("mlp_only_layers", []) or [])
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
        shared = cfg.get("shared_expert_intermediate_size", 0) or 0
        if shared:
            kw.update(n_shared_experts=1, shared_d_ff=shared, shared_expert_gate=True)
    return kw
