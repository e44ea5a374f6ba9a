"""What model: :class:`ModelSpec`, its presets, Hugging Face import, parameter and FLOP counts.

A ModelSpec describes a decoder-only transformer: ``n_layers`` blocks of attention and an MLP
(dense, or mixture-of-experts after the first ``first_k_dense_layers``), token embeddings, a final
norm and an output projection (tied to the embeddings or not).

Parameter counts are exact for the architectures covered (Llama, Mistral, Mixtral, Qwen2/Qwen3,
GPT-3): they are what the bundled trainer allocates, and the presets are tested against the
published totals (llama3-8b = 8,030,261,248 parameters).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from workbench.spec.errors import ConfigError, check_choice, check_int, check_positive, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.files import parse_json
from workbench.spec.hf import hf_config_fields

# Sizes past these are typos (or attacks), not models: the largest published models have ~200
# layers, d_model 2^15 and 2^18 vocabulary entries; the bounds leave two orders of magnitude.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 24  # d_model, d_ff, head_dim
MAX_VOCAB = 1 << 26
MAX_HEADS = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_SEQ_LEN = 1 << 26

ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer block, split by how parallelism shards them.

    ``attention`` and ``mlp`` are the projection matrices (and their column-parallel biases) that
    tensor parallelism splits; ``replicated`` is what every TP rank keeps whole (norm weights,
    row-parallel output biases, the router, a shared-expert gate); ``experts`` are the routed
    experts that expert parallelism splits.
    """

    attention: int
    mlp: int  # dense MLP, or the shared experts of an MoE block
    experts: int  # routed experts of an MoE block (all of them)
    replicated: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.replicated


@dataclass(frozen=True)
class Projection:
    """One projection matrix of an attention block: ``d_in -> d_out``.

    ``split`` is how tensor parallelism shards it: "column" (``d_out`` over TP ranks: heads),
    "row" (``d_in`` over TP ranks: the output projection) or "whole" (every TP rank keeps and
    applies it: latent attention's down-projections). ``gemm`` names the GEMM it runs in:
    projections of the same input and split are fused into one (Megatron's fused QKV)."""

    name: str
    d_in: int
    d_out: int
    split: str
    gemm: str

    @property
    def params(self) -> int:
        return self.d_in * self.d_out


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    ``head_dim`` defaults to ``d_model // n_heads``. ``n_experts = 0`` is a dense model; otherwise
    layers ``first_k_dense_layers ..`` are MoE layers with ``n_experts`` routed experts of hidden
    size ``moe_d_ff``, ``top_k`` of them per token, plus ``n_shared_experts`` always-on experts of
    hidden size ``shared_d_ff`` (default ``moe_d_ff``).
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # None: = n_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 0  # hidden size of dense MLPs; 0: 4 * d_model (gelu) or 8/3 * d_model (swiglu)
    vocab_size: int = 32000
    tie_embeddings: bool = False
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    # mixture of experts
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    moe_d_ff: int = 0
    first_k_dense_layers: int = 0
    shared_d_ff: int | None = None
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate Linear(d_model, 1) on shared experts
    # architecture details that change the parameter count
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    linear_bias: bool = False  # GPT-2/3: bias on every linear layer (and LayerNorm bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    # multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0 turns it on. Keys and values
    # are up-projected from a shared latent of kv_lora_rank (plus a decoupled RoPE key of
    # qk_rope_head_dim shared by all heads); queries from a latent of q_lora_rank (0: a plain
    # projection). A head's query/key width is qk_nope_head_dim + qk_rope_head_dim, its value's v_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek MoE routing: kept for the trainer and the record; only the per-expert score
    # correction bias (router_bias) changes a count
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    n_expert_groups: int = 1  # grouped top-k: experts in n_expert_groups groups, top topk_groups of them
    topk_groups: int = 1
    routed_scaling: float = 1.0
    router_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, one per routed expert
    moe_layer_freq: int = 1  # every moe_layer_freq-th layer after the dense ones is MoE (only 1 supported)
    # multi-token prediction (DeepSeek-V3): modules after the main model, counted separately
    n_mtp_layers: int = 0
    position: str = "rope"
    max_seq_len: int = 8192  # table size for learned position embeddings; RoPE has no table
    rope_theta: float = 500000.0
    name: str = ""

    def __post_init__(self) -> None:
        check_types(self)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        limits = {"n_layers": MAX_LAYERS, "d_model": MAX_WIDTH, "n_heads": MAX_HEADS, "n_kv_heads": MAX_HEADS,
                  "vocab_size": MAX_VOCAB}
        for f, most in limits.items():
            check_int(f, getattr(self, f), maximum=most)
        check_int("d_ff", self.d_ff, minimum=0, maximum=MAX_WIDTH)
        check_int("moe_d_ff", self.moe_d_ff, minimum=0, maximum=MAX_WIDTH)
        check_int("n_experts", self.n_experts, minimum=0, maximum=MAX_EXPERTS)
        check_int("top_k", self.top_k, minimum=0, maximum=MAX_EXPERTS)
        check_positive("rope_theta", self.rope_theta)
        self._check_latent_attention()
        if self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; set head_dim explicitly",
                field="n_heads",
                value=self.n_heads,
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        check_int("head_dim", self.head_dim, maximum=MAX_WIDTH)
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads} (grouped-query attention "
            "shares each KV head among n_heads / n_kv_heads query heads)",
            field="n_kv_heads",
            value=self.n_kv_heads,
        )
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("norm", self.norm, NORMS)
        check_choice("position", self.position, POSITIONS)
        if self.d_ff == 0:
            default = 4 * self.d_model if self.activation == "gelu" else _round_up(8 * self.d_model // 3, 64)
            object.__setattr__(self, "d_ff", default)
        check_int("d_ff", self.d_ff)
        check_int("n_experts", self.n_experts, minimum=0)
        check_int("n_shared_experts", self.n_shared_experts, minimum=0, maximum=MAX_EXPERTS)
        check_int("first_k_dense_layers", self.first_k_dense_layers, minimum=0)
        check_int("max_seq_len", self.max_seq_len, maximum=MAX_SEQ_LEN)
        if self.shared_d_ff is not None:
            check_int("shared_d_ff", self.shared_d_ff, maximum=MAX_WIDTH)
        if self.n_experts:
            check_int("top_k", self.top_k)
            require(
                self.top_k <= self.n_experts,
                f"top_k={self.top_k} exceeds n_experts={self.n_experts}",
                field="top_k",
                value=self.top_k,
            )
            if self.moe_d_ff == 0:
                object.__setattr__(self, "moe_d_ff", self.d_ff)
            check_int("moe_d_ff", self.moe_d_ff)
            require(
                self.first_k_dense_layers <= self.n_layers,
                f"first_k_dense_layers={self.first_k_dense_layers} exceeds n_layers={self.n_layers}",
                field="first_k_dense_layers",
                value=self.first_k_dense_layers,
            )
            if self.n_shared_experts and self.shared_d_ff is None:
                object.__setattr__(self, "shared_d_ff", self.moe_d_ff)
            self._check_routing()
        else:
            require(
                self.top_k == 0 and self.n_shared_experts == 0,
                f"top_k={self.top_k} and n_shared_experts={self.n_shared_experts} need n_experts > 0 "
                "(n_experts=0 is a dense model)",
                field="n_experts",
                value=self.n_experts,
            )

    def _check_latent_attention(self) -> None:
        names = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for f in names:
            check_int(f, getattr(self, f), minimum=0, maximum=MAX_WIDTH)
        check_int("n_mtp_layers", self.n_mtp_layers, minimum=0, maximum=MAX_LAYERS)
        if not self.kv_lora_rank:
            for f in names:
                require(getattr(self, f) == 0, f"{f}={getattr(self, f)} needs kv_lora_rank > 0 (multi-head latent "
                        "attention); kv_lora_rank=0 is standard attention", field=f, value=getattr(self, f))
            return
        for f in ("qk_nope_head_dim", "v_head_dim"):
            check_int(f, getattr(self, f))  # latent attention: each head's no-RoPE key and value widths
        require(self.n_kv_heads == self.n_heads, f"n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads} "
                "with kv_lora_rank > 0: latent attention up-projects keys and values for every head",
                field="n_kv_heads", value=self.n_kv_heads)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        require(self.head_dim in (None, qk), f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                f"= {qk} with latent attention (or unset)", field="head_dim", value=self.head_dim)
        object.__setattr__(self, "head_dim", qk)
        require(not (self.qkv_bias or self.linear_bias), "qkv_bias and linear_bias are not part of latent attention "
                "(no released model has them)", field="qkv_bias", value=self.qkv_bias)

    def _check_routing(self) -> None:
        check_choice("scoring", self.scoring, SCORINGS)
        check_int("n_expert_groups", self.n_expert_groups, maximum=MAX_EXPERTS)
        check_int("topk_groups", self.topk_groups, maximum=MAX_EXPERTS)
        check_positive("routed_scaling", self.routed_scaling)
        require(self.n_experts % self.n_expert_groups == 0, f"n_expert_groups={self.n_expert_groups} does not divide "
                f"n_experts={self.n_experts}", field="n_expert_groups", value=self.n_expert_groups)
        require(self.topk_groups <= self.n_expert_groups, f"topk_groups={self.topk_groups} exceeds "
                f"n_expert_groups={self.n_expert_groups}", field="topk_groups", value=self.topk_groups)
        reachable = self.topk_groups * self.n_experts // self.n_expert_groups
        require(self.top_k <= reachable, f"top_k={self.top_k} exceeds the {reachable} experts of the topk_groups="
                f"{self.topk_groups} groups a token may use ({self.n_experts} / {self.n_expert_groups} each)",
                field="top_k", value=self.top_k)
        require(self.moe_layer_freq == 1, f"moe_layer_freq={self.moe_layer_freq} is not supported: every layer "
                "after first_k_dense_layers is MoE (moe_layer_freq=1, as in DeepSeek-V2/V3)",
                field="moe_layer_freq", value=self.moe_layer_freq)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(PRESETS)

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        """A named architecture; ``ModelSpec.presets()`` lists them."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ConfigError(
                f"model={name!r} is not a preset; presets: {', '.join(PRESETS)}", field="model", value=name
            )
        return replace(PRESETS[name], name=name)

    @classmethod
    def from_hf_config(cls, config: str | os.PathLike | Mapping[str, Any]) -> "ModelSpec":
        """Read a Hugging Face ``config.json`` (a path, or the parsed dict)."""
        return cls(**hf_config_fields(config))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        return from_mapping(cls, data, "model")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        return cls.from_dict(parse_json(text, "model"))

    # ------------------------------------------------------------------ structure
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense_layers if self.is_moe else 0

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index >= self.first_k_dense_layers

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def norm_params(self, width: int) -> int:
        # RMSNorm: a weight; LayerNorm: weight and bias.
        return width * (2 if self.norm == "layernorm" else 1)

    def _mlp_params(self, hidden: int) -> tuple[int, int]:
        """(column/row matrices + column biases, row-parallel output bias) of one MLP."""
        d = self.d_model
        if self.activation == "swiglu":  # w1 (gate), w3 (up): d -> hidden; w2 (down): hidden -> d
            matrices, col_bias = 3 * d * hidden, 2 * hidden
        else:  # fc: d -> hidden; proj: hidden -> d
            matrices, col_bias = 2 * d * hidden, hidden
        if self.linear_bias:
            return matrices + col_bias, d
        return matrices, 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def v_dim(self) -> int:
        """Width of all heads' values (the attention output projection's input)."""
        return self.n_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def attention_projections(self) -> tuple[Projection, ...]:
        """The projection matrices of one attention block, in execution order (biases apart).

        Grouped-query attention: wq, wk, wv from the block's input, wo. Latent attention (DeepSeek-V2
        and V3): the down-projections q_a (to the query latent) and kv_a (to the key/value latent
        and the RoPE key shared by all heads) from the input, kept whole on every TP rank as
        Megatron-Core's MLA does; the per-head up-projections q_b (or a plain q_proj when
        q_lora_rank = 0) and kv_b (each head's non-RoPE key and its value), split by heads; o."""
        d, h = self.d_model, self.n_heads
        if not self.is_mla:
            return (Projection("wq", d, self.q_dim, "column", "qkv"), Projection("wk", d, self.kv_dim, "column", "qkv"),
                    Projection("wv", d, self.kv_dim, "column", "qkv"), Projection("wo", self.q_dim, d, "row", "attn_out"))
        out = []
        if self.q_lora_rank:
            out += [Projection("q_a", d, self.q_lora_rank, "whole", "latent_down"),
                    Projection("q_b", self.q_lora_rank, self.q_dim, "column", "q_up")]
        else:
            out.append(Projection("q_proj", d, self.q_dim, "column", "q_up"))
        out += [Projection("kv_a", d, self.kv_lora_rank + self.qk_rope_head_dim, "whole", "latent_down"),
                Projection("kv_b", self.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim), "column", "kv_up"),
                Projection("o", self.v_dim, d, "row", "attn_out")]
        return tuple(out)

    def attention_gemms(self, tp: int = 1) -> tuple[tuple[str, int, float, float], ...]:
        """(name, projections fused, K, N) of each GEMM of one attention block on one TP rank, in
        execution order: column-split ones N / tp, row-split ones K / tp, whole ones unsplit."""
        fused: dict[str, list[Projection]] = {}
        for p in self.attention_projections():
            fused.setdefault(p.gemm, []).append(p)
        out = []
        for name, group in fused.items():
            split, k, n = group[0].split, group[0].d_in, sum(p.d_out for p in group)
            out.append((name, len(group), k / tp if split == "row" else k, n / tp if split == "column" else n))
        return tuple(out)

    @property
    def latent_dims(self) -> tuple[int, int]:
        """(query latent, key/value latent) widths of latent attention; (0, 0) otherwise."""
        return (self.q_lora_rank, self.kv_lora_rank) if self.is_mla else (0, 0)

    @property
    def k_width(self) -> int:
        """Width of all heads' keys as attention reads them (latent attention: up-projected,
        the shared RoPE key repeated per head)."""
        return self.kv_dim

    @property
    def v_width(self) -> int:
        """Width of all KV heads' values as attention reads them."""
        return self.n_kv_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def kv_cache_values_per_token(self) -> int:
        """Values one token leaves in an inference KV cache, per layer: keys and values of every KV
        head (grouped-query attention), or the key/value latent and the shared RoPE key (latent
        attention: DeepSeek-V2's point, 576 for DeepSeek-V3 against 2 x 128 x 128 expanded)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.kv_dim + self.v_width

    @property
    def rope_dim(self) -> int:
        """Width of each head's part RoPE rotates (latent attention: the decoupled RoPE key and query)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def ring_kv_values_per_token(self, tp: int) -> float:
        """Values per token one ring-attention hop carries on one TP rank (context parallelism).

        Grouped-query attention: the rank's K and V heads, (k_width + v_width) / tp. Latent
        attention passes K/V in latent form, the key/value latent and the shared RoPE key (what
        its KV cache holds), whole on every TP rank as the down-projection that makes them; each
        rank re-expands a visiting chunk with its own slice of kv_b (FLOPs the step model adds)
        and sends the chunk's gradient back in the same form."""
        if self.is_mla:
            return float(self.kv_lora_rank + self.qk_rope_head_dim)
        return (self.k_width + self.v_width) / tp

    def _attention_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one attention block's projections and, for latent
        attention, the latents' norms (replicated, as the down-projections that feed them)."""
        projections = self.attention_projections()
        split = sum(p.params for p in projections if p.split != "whole")
        whole = sum(p.params for p in projections if p.split == "whole")
        if self.is_mla:
            whole += self.norm_params(self.kv_lora_rank) + (self.norm_params(self.q_lora_rank) if self.q_lora_rank else 0)
        return split, whole

    def layer_params(self, index: int) -> LayerParams:
        """Parameters of block ``index``, split by how they are sharded."""
        d = self.d_model
        attention, whole = self._attention_params()
        replicated = 2 * self.norm_params(d) + whole  # attention norm, MLP norm, latent projections
        if self.qkv_bias or self.linear_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.linear_bias:
            replicated += d  # wo bias (row parallel: not split by TP)
        if self.qk_norm:
            replicated += 2 * self.head_dim
        if not self.is_moe_layer(index):
            mlp, bias = self._mlp_params(self.d_ff)
            return LayerParams(attention, mlp, 0, replicated + bias)
        expert, expert_bias = self._mlp_params(self.moe_d_ff)
        experts = self.n_experts * (expert + expert_bias)
        replicated += d * self.n_experts  # router
        if self.router_bias:
            replicated += self.n_experts  # the score correction bias of each routed expert
        mlp = 0
        if self.n_shared_experts:
            shared, shared_bias = self._mlp_params(self.shared_d_ff or self.moe_d_ff)
            mlp = self.n_shared_experts * shared
            replicated += self.n_shared_experts * shared_bias
            if self.shared_expert_gate:
                replicated += d
        return LayerParams(attention, mlp, experts, replicated)

    @property
    def embedding_params(self) -> int:
        table = self.vocab_size * self.d_model
        if self.position == "learned":
            table += self.max_seq_len * self.d_model
        return table

    @property
    def output_params(self) -> int:
        """Final norm plus the output projection (0 for the projection when tied)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.norm_params(self.d_model) + head

    # ------------------------------------------------------------------ counts
    def n_params(self) -> int:
        """Every parameter the model stores."""
        dense = self.layer_params(0).total * self.n_dense_layers if self.n_dense_layers else 0
        moe = self.layer_params(self.n_layers - 1).total * self.n_moe_layers if self.n_moe_layers else 0
        return dense + moe + self.embedding_params + self.output_params

    def n_mtp_params(self) -> int:
        """Parameters of the multi-token-prediction modules (DeepSeek-V3), not in :meth:`n_params`:
        each a norm of the hidden state and of the next token's embedding, their joint projection
        (2 d -> d), one block like the model's last and a final norm; embedding and output head are
        the main model's."""
        d = self.d_model
        per = 2 * self.norm_params(d) + 2 * d * d + self.layer_params(self.n_layers - 1).total + self.norm_params(d)
        return self.n_mtp_layers * per

    def describe_size(self) -> str:
        """``671.03B parameters, 37.55B active, + 11.61B in 1 MTP module (apart)``: the counts a
        summary line names (the MTP modules are not in the total, the bill or the step time)."""
        out = f"{self.n_params() / 1e9:.2f}B parameters"
        if self.is_moe:
            out += f", {self.n_active_params() / 1e9:.2f}B active"
        if self.n_mtp_layers:
            out += (f", + {self.n_mtp_params() / 1e9:.2f}B in {self.n_mtp_layers} MTP module"
                    f"{'s' if self.n_mtp_layers > 1 else ''} (apart)")
        return out

    def _active_layer_params(self, index: int) -> int:
        p = self.layer_params(index)
        if not p.experts:
            return p.total
        return p.total - p.experts + p.experts * self.top_k // self.n_experts

    def n_active_params(self) -> int:
        """Parameters one token passes through: all of a dense model; top_k of n_experts in MoE."""
        dense = self._active_layer_params(0) * self.n_dense_layers if self.n_dense_layers else 0
        moe = self._active_layer_params(self.n_layers - 1) * self.n_moe_layers if self.n_moe_layers else 0
        return dense + moe + self.embedding_params + self.output_params

    def n_matmul_params(self) -> int:
        """Active parameters that cost FLOPs: the embedding and position tables are lookups, and a
        tied output projection is a matmul all the same."""
        tied_head = self.vocab_size * self.d_model if self.tie_embeddings else 0
        return self.n_active_params() - self.embedding_params + tied_head

    def attention_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Forward + backward FLOPs of the score and value matmuls, per token: 6 * L * seq_len *
        (n_heads * head_dim + v_dim) (2 FLOP per MAC x 3 for forward + backward), 12 * L *
        n_heads * head_dim * seq_len where values are as wide as keys. Latent attention is counted
        as trained: scores over the up-projected keys (qk_nope + qk_rope wide), values v_head_dim
        wide; the absorbed form (scores against the latent) is an inference kernel."""
        full = 6.0 * self.n_layers * (self.q_dim + self.v_dim) * seq_len
        return full / 2 if causal else full

    def flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward), the PaLM / Megatron convention.

        ``6 * N + 12 * L * n_heads * head_dim * seq_len``, with N = :meth:`n_matmul_params`
        (active parameters, embedding lookups excluded, output projection included). The
        attention term counts the full seq_len x seq_len score matrix although a causal mask
        leaves half of it unused, as PaLM and Megatron do, so MFU figures are comparable with
        published ones. ``causal=True`` halves the attention term instead (the work a
        FlashAttention kernel really does). Recomputation is not counted: it is overhead, not
        model FLOPs.
        """
        check_int("seq_len", seq_len)
        return 6.0 * self.n_matmul_params() + self.attention_flops_per_token(seq_len, causal)


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# Architectures from their papers and Hugging Face configs.
PRESETS: dict[str, ModelSpec] = {
    # Llama 3 (Dubey et al. 2024, Table 3; meta-llama/Meta-Llama-3-*/config.json)
    "llama3-8b": ModelSpec(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256
    ),
    "llama3-70b": ModelSpec(
        n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256
    ),
    "llama3-405b": ModelSpec(
        n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab_size=128256
    ),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1/config.json): every layer MoE, 8 experts, top-2
    "mixtral-8x7b": ModelSpec(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
        n_experts=8, top_k=2, moe_d_ff=14336, rope_theta=1e6,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B/config.json): 128 experts, top-8, QK-norm
    "qwen3-30b-a3b": ModelSpec(
        n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, d_ff=6144,
        vocab_size=151936, n_experts=128, top_k=8, moe_d_ff=768, qk_norm=True, rope_theta=1e6,
    ),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): GELU, LayerNorm, biases, learned positions, tied
    "gpt3-175b": ModelSpec(
        n_layers=96, d_model=12288, n_heads=96, d_ff=4 * 12288, vocab_size=50257,
        tie_embeddings=True, activation="gelu", norm="layernorm", linear_bias=True,
        position="learned", max_seq_len=2048,
    ),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3/config.json; DeepSeek-AI 2024): latent attention, 3 dense
    # layers then 58 MoE layers of 256 routed experts (top-8 of 4 groups of 8) and 1 shared; one
    # multi-token-prediction module. 671,026,419,200 parameters (published: 671B), 37.6B active.
    "deepseek-v3": ModelSpec(
        n_layers=61, d_model=7168, n_heads=128, d_ff=18432, vocab_size=129280, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=256,
        top_k=8, n_shared_experts=1, moe_d_ff=2048, first_k_dense_layers=3, scoring="sigmoid",
        n_expert_groups=8, topk_groups=4, routed_scaling=2.5, router_bias=True, n_mtp_layers=1,
        max_seq_len=163840, rope_theta=10000.0,
    ),
    # The CPU trainer's models: byte-level vocabulary, dimensions small enough for 2 cores.
    "tiny": ModelSpec(
        n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Qwen3-style: QK-norm, head_dim x n_heads (128) wider than d_model (64)
    "tiny-qk-norm": ModelSpec(
        n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=176, vocab_size=256, max_seq_len=256,
        qk_norm=True, rope_theta=10000.0,
    ),
    "tiny-tied": ModelSpec(
        n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, max_seq_len=256,
        tie_embeddings=True, rope_theta=10000.0,
    ),
    "tiny-moe": ModelSpec(
        n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, max_seq_len=256,
        n_experts=4, top_k=2, n_shared_experts=1, moe_d_ff=64, first_k_dense_layers=1,
        rope_theta=10000.0,
    ),
    "tiny-mla": ModelSpec(
        n_layers=4, d_model=64, n_heads=4, d_ff=176, vocab_size=256, max_seq_len=256, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
    ),
}
