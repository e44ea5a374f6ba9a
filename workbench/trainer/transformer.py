"""The bundled trainer's model: a Llama-style decoder built from a :class:`~workbench.spec.model.ModelSpec`.

Module names follow torchtitan so that sharding plans read the same::

    Transformer
      tok_embeddings        nn.Embedding(vocab, d)            (None on non-first pipeline stages)
      pos_embeddings        nn.Embedding(max_seq_len, d)      (only for position="learned")
      layers["0".."L-1"]    TransformerBlock                  (a ModuleDict: stages delete entries)
        attention_norm, attention, ffn_norm, feed_forward (w1, w2[, w3])
          or moe (router (gate[, bias]), experts (GroupedExperts), shared_experts[, shared_gate])
        attention: Attention (wq, wk, wv, wo [, q_norm, k_norm])
          or, latent attention, LatentAttention (q_a, q_a_norm, q_b | q_proj, kv_a, kv_a_norm, kv_b, wo)
      norm                  RMSNorm / LayerNorm               (None on non-last stages)
      output                nn.Linear(d, vocab, bias=False)   (None on non-last stages)

The parameter count equals ``ModelSpec.n_params()`` exactly (tests/test_trainer_model.py). With
tied embeddings the output projection *is* the embedding table; a pipeline splits them onto the
first and the last stage, initialised equal and kept equal (workbench/trainer/pipeline.py).

Build it on the meta device (``with torch.device("meta"): Transformer(spec)``), shard it, then
materialise with ``model.to_empty(device=...)`` and :func:`init_weights`, which draws every
parameter from a generator seeded by (seed, parameter name): the values do not depend on how the
model is sharded or split into stages, which is what lets every layout reproduce the
single-process losses.

Mixture of experts, capacity policy: **dropless** by default (``capacity_factor=0``): every token
reaches its top-k experts however unbalanced the routing. With ``capacity_factor = c >= 1`` each
expert takes at most ``ceil(c * N * k / E)`` of the N*k assignments of a forward (first come,
first served in token order); the rest are dropped (they contribute zero; the residual carries the
token) and counted in ``moe.dropped_tokens``. Routing is Mixtral's (softmax, top-k renormalised)
or DeepSeek's (``scoring="sigmoid"``, grouped top-k, ``routed_scaling``, a selection-only
``router_bias``): :class:`Router`.

Dropout (``dropout > 0``, TrainSettings ``dropout`` and ``dropout_rate``): Megatron's *hidden*
dropout, after the embeddings and after each attention and MLP output, before the residual add.
No attention-probability dropout (SDPA draws it from the global RNG stream, which differs with
the layout). Each element's mask is a counter-based hash of (seed, step, global sample index,
global token position, layer, site, hidden index) (:class:`HiddenDropout`), so every layout
(data, tensor, sequence, context or pipeline parallel, recomputation) drops the same elements
as the single-process run.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.spec.model import ModelSpec

# --------------------------------------------------------------------------- building blocks


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with the backward written out, so that it saves what fused kernels save: the input
    and ``rstd`` (one fp32 per token), not the normalised copy that autograd would keep for the
    weight's gradient (a second activation-sized tensor per norm; workbench.predict.memory counts the
    norm input only, as Korthikanti et al. do). Normalises in fp32 even under bf16 compute.

    With x_hat = x * rstd, g = dy * weight:  dx = rstd * (g - x_hat * mean(g * x_hat)),
    dweight = sum over tokens of dy * x_hat."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = (dy * weight).to(rstd.dtype)
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        # sum over every token dimension; a sequence-sharded DTensor gives a Partial sum, as autograd would
        dweight = (dy * x_hat.type_as(x)).sum(dim=tuple(range(dy.dim() - 1)))
        return dx.type_as(x), dweight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def build_norm(spec: ModelSpec, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-5) if spec.norm == "layernorm" else RMSNorm(dim)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (S, head_dim) for RoPE (Su et al. 2021): angle(p, i) = p * theta^(-2i/hd).

    Computed from explicit positions (not a table) so that context parallel can pass each rank's
    non-contiguous token positions."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(0, half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (S, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hd): rotate-half layout
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, hd): rotate each (x_i, x_{i+hd/2}) pair by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention. q (B, Hq, S, hd); k, v (B, Hkv, S, hd) -> (B, Hq, S, hd).

    Grouped-query attention: each KV head serves Hq / Hkv query heads. ``enable_gqa`` lets the
    kernel broadcast them instead of materialising repeated copies (which backward would keep:
    K and V saved at n_heads width instead of n_kv_heads)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional QK-norm (Qwen3) and QKV bias (Qwen2).

    ``self.sdpa(q, k, v)`` is the attention core; context parallel replaces it per layer and
    selective activation checkpointing wraps it (the part Korthikanti et al. recompute)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, hd = spec.d_model, spec.head_dim
        qkv_bias = spec.qkv_bias or spec.linear_bias
        self.head_dim = hd
        self.rope_theta = spec.rope_theta
        self.use_rope = spec.position == "rope"
        self.wq = nn.Linear(d, spec.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(d, spec.n_kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(d, spec.n_kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(spec.n_heads * hd, d, bias=spec.linear_bias)
        self.q_norm = RMSNorm(hd) if spec.qk_norm else None
        self.k_norm = RMSNorm(hd) if spec.qk_norm else None
        self.sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_sdpa

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        hd = self.head_dim
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, S, -1, hd)
        k = self.wk(x).view(B, S, -1, hd)
        v = self.wv(x).view(B, S, -1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        if self.use_rope:
            cos, sin = rope_cos_sin(positions, hd, self.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(q, k, v)  # (B, Hq, S, hd)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3), as trained (no
    absorbed inference form)::

        q          = q_b(q_a_norm(q_a(x)))  or  q_proj(x)     (B, S, H, nope + rope)
        kv_a(x)    = [latent (kv_lora_rank), k_rope (rope)]   one RoPE key shared by all heads
        k_nope, v  = kv_b(kv_a_norm(latent))                  (B, S, H, nope), (B, S, H, v_head_dim)
        scores     = [q_nope, rope(q_rope)] . [k_nope, rope(k_rope)] / sqrt(nope + rope)
        out        = wo(softmax(scores) v)                    wo: H * v_head_dim -> d

    Tensor parallelism splits q_b (or q_proj), kv_b by heads and wo by its input; q_a, kv_a and
    their norms stay whole on every TP rank, as Megatron-Core's MLA keeps them.
    ``share_rope_key`` is where the shared RoPE key meets this rank's heads: the identity, and
    under TP an identity whose backward sums the key's gradient over the TP ranks (each rank's
    heads contribute a part of it: Megatron's "f" operator)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, h = spec.d_model, spec.n_heads
        self.nope, self.rope, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.kv_rank = spec.kv_lora_rank
        self.rope_theta = spec.rope_theta
        self.use_rope = spec.position == "rope"
        qk = self.nope + self.rope
        if spec.q_lora_rank:
            self.q_a = nn.Linear(d, spec.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(spec.q_lora_rank)
            self.q_b = nn.Linear(spec.q_lora_rank, h * qk, bias=False)
            self.q_proj = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank)
        self.kv_b = nn.Linear(self.kv_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_sdpa
        self.share_rope_key: Callable[[torch.Tensor], torch.Tensor] = _identity

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b(self.q_a_norm(self.q_a(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self._queries(x).view(B, S, -1, self.nope + self.rope).transpose(1, 2)  # (B, H, S, nope + rope)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, H, S, nope), (B, H, S, v)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        k_rope = self.share_rope_key(k_rope).unsqueeze(1)  # (B, 1, S, rope): one key for every head
        if self.use_rope and self.rope:
            cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta, q.dtype)
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = self.sdpa(q, k, v)  # (B, H, S, v): the default scale is 1 / sqrt(nope + rope)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


def build_attention(spec: ModelSpec) -> nn.Module:
    return LatentAttention(spec) if spec.is_mla else Attention(spec)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer 2020); GELU: w2(gelu(w1 x))."""

    def __init__(self, d: int, hidden: int, activation: str, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, d, bias=bias)
        self.w3 = nn.Linear(d, hidden, bias=bias) if activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------- mixture of experts


class GroupedExperts(nn.Module):
    """E experts as 3-D parameters: w1, w3 (E, hidden, d); w2 (E, d, hidden) (nn.Linear layout).

    ``forward(x_sorted (N, d), num_tokens_per_expert (E,)) -> (N, d)``: tokens arrive sorted by
    expert, the first ``counts[0]`` for expert 0 and so on. Expert parallelism wraps this call
    (all-to-all dispatch before, combine after) and shards dimension 0 of the parameters."""

    def __init__(self, n_experts: int, d: int, hidden: int, activation: str, bias: bool = False):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d))
        self.w2 = nn.Parameter(torch.empty(n_experts, d, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d)) if self.swiglu else None
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n_experts, d)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden)) if bias and self.swiglu else None

    def forward(self, x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.tolist()
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        b1, b2, b3 = _local(self.b1), _local(self.b2), _local(self.b3)
        outs = []
        # A loop over experts: clear and exact; grouped GEMMs are a GPU optimisation.
        for e, chunk in enumerate(torch.split(x_sorted, counts, dim=0)):
            h = F.linear(chunk, w1[e], None if b1 is None else b1[e])
            if self.swiglu:
                h = F.silu(h) * F.linear(chunk, w3[e], None if b3 is None else b3[e])
            else:
                h = F.gelu(h)
            outs.append(F.linear(h, w2[e], None if b2 is None else b2[e]))
        return torch.cat(outs, dim=0) if outs else x_sorted.new_zeros(0, w2.shape[1])


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    """Local shard of a DTensor parameter (expert parallelism), the tensor itself otherwise."""
    return p.to_local() if p is not None and hasattr(p, "to_local") else p


class Router(nn.Module):
    """Top-k router. ``scoring="softmax"`` (Mixtral): scores = softmax(gate(x)), the k largest,
    renormalised. ``scoring="sigmoid"`` (DeepSeek-V3): scores = sigmoid(gate(x)), likewise.

    DeepSeek's refinements, each off by default: grouped top-k (experts in ``n_groups`` groups;
    a token picks among the ``topk_groups`` groups of highest score: the best expert of a group,
    or with ``bias`` its best two, as DeepSeek-V3 ranks them), ``routed_scaling`` times the
    renormalised weights, and ``bias`` (DeepSeek-V3's e_score_correction_bias), added to the
    scores for the *choice* of experts only, never to the weights. The bias is a frozen parameter
    (so the count is the spec's and checkpoints carry it) initialised to zeros; DeepSeek's
    auxiliary-loss-free balancing, which nudges it after every step by the expert loads, is not
    run by the bundled trainer: it stays zero and balance comes from the auxiliary loss."""

    def __init__(self, d: int, n_experts: int, top_k: int, scoring: str = "softmax", n_groups: int = 1,
                 topk_groups: int = 1, routed_scaling: float = 1.0, bias: bool = False):
        super().__init__()
        self.top_k, self.scoring = top_k, scoring
        self.n_groups, self.topk_groups, self.routed_scaling = n_groups, topk_groups, routed_scaling
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.bias = nn.Parameter(torch.empty(n_experts), requires_grad=False) if bias else None

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "Router":
        return cls(spec.d_model, spec.n_experts, spec.top_k, spec.scoring, spec.n_expert_groups,
                   spec.topk_groups, spec.routed_scaling, spec.router_bias)

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """(N, E) choice scores with every expert outside the token's topk_groups best groups at -inf."""
        grouped = choice.view(choice.shape[0], self.n_groups, -1)  # (N, G, E/G)
        if self.bias is not None and grouped.shape[-1] >= 2:
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_score = grouped.amax(-1)
        best = group_score.topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> probs (N, E) (a distribution per token, for the auxiliary loss), top-k
        weights (N, k), top-k expert ids (N, k)."""
        logits = self.gate(x).float()
        scores = F.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if self.bias is None else scores + self.bias.float()
        if self.n_groups > 1:
            choice = self._keep_best_groups(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        probs = scores if self.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, weights.type_as(x), experts


class LocalTokens:
    """How an MoE layer's tokens meet tensor parallelism, without it: every exchange is the
    identity. Under TP, :class:`workbench.trainer.expert_parallel.TensorParallelTokens` (Megatron's
    expert tensor parallelism) takes its place."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (B, S, ...) -> the TP group's (B, S x tp, ...)."""
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The TP group's partial outputs (B, S x tp, d) -> this rank's tokens, summed over TP."""
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """A value summed over the TP group (no gradient)."""
        return x


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: return ``hidden`` unchanged. Backward: also send gradient ``weight`` into ``aux``.

    This adds ``weight * aux`` to the training objective without threading the aux loss through
    the model's outputs, so it works across pipeline stages (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight
        ctx.aux_dtype = aux.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (+ optional shared experts), with a load-balancing auxiliary loss.

    aux = E * sum_e f_e * P_e (Switch Transformer, Fedus et al. 2021; Mixtral): f_e is the fraction
    of the N*k routing assignments that went to expert e, P_e the mean router probability of e.
    It is 1 under perfect balance. ``aux_loss_weight`` (set by the trainer to
    moe_aux_loss_coeff / n_microbatches) scales its gradient; the value is kept in ``aux_loss``.

    ``tokens`` says how the tokens meet tensor parallelism (:class:`LocalTokens` without it): each
    rank routes its own tokens, the experts see the whole TP group's, and their partial outputs
    come back summed to the rank that owns the token. Each rank's aux is its own tokens' share
    (P_e summed over its tokens, divided by the group's N), so the shares add up to the aux.
    """

    def __init__(self, spec: ModelSpec, capacity_factor: float = 0.0):
        super().__init__()
        d = spec.d_model
        self.n_experts, self.top_k = spec.n_experts, spec.top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_weight = 0.0
        self.router = Router.from_spec(spec)
        self.experts = GroupedExperts(spec.n_experts, d, spec.moe_d_ff, spec.activation, spec.linear_bias)
        self.shared_experts = None
        self.shared_gate = None
        if spec.n_shared_experts:
            # n shared experts of hidden h are one FFN of hidden n*h (DeepSeekMoE).
            hidden = spec.n_shared_experts * (spec.shared_d_ff or spec.moe_d_ff)
            self.shared_experts = FeedForward(d, hidden, spec.activation, spec.linear_bias)
            if spec.shared_expert_gate:
                self.shared_gate = nn.Linear(d, 1, bias=False)
        self.tokens: LocalTokens = LocalTokens()
        # Statistics of the last forward, for telemetry.
        self.tokens_per_expert = torch.zeros(spec.n_experts, dtype=torch.long)
        self.dropped_tokens = 0
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape  # S: this rank's tokens of each sequence (under TP, its sequence shard)
        E, k = self.n_experts, self.top_k
        probs, weights, experts = self.router(x.reshape(-1, d))  # (B*S, E), (B*S, k), (B*S, k)
        # The experts run on the TP group's tokens (identity without TP): N = B x S x tp.
        flat = self.tokens.gather(x).reshape(-1, d)  # (N, d)
        weights = self.tokens.gather(weights.view(B, S, k)).reshape(-1, k)
        experts = self.tokens.gather(experts.view(B, S, k)).reshape(-1, k)
        N = flat.shape[0]
        assignment_expert = experts.reshape(-1)  # (N*k,) token t's j-th choice at t*k + j
        counts = torch.bincount(assignment_expert, minlength=E)
        aux = E * ((counts.float() / (N * k)) * (probs.sum(0) / N)).sum()
        # Sort assignments by expert; stable, so tokens keep their order inside an expert.
        order = torch.argsort(assignment_expert, stable=True)
        token_of = order // k
        kept = order
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * N * k / E)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(N * k, device=x.device) - starts[assignment_expert[order]]
            keep = rank_in_expert < capacity
            self.dropped_tokens = int((~keep).sum())
            kept, token_of = order[keep], token_of[keep]
            counts = counts.clamp(max=capacity)
        else:
            self.dropped_tokens = 0
        routed = self.experts(flat[token_of], counts)  # (N_kept, d)
        routed = routed * weights.reshape(-1, 1)[kept]
        out = torch.zeros_like(flat).index_add_(0, token_of, routed)  # unsort and sum the k choices
        out = self.tokens.reduce_scatter(out.view(B, -1, d))  # (B, S, d)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        self.tokens_per_expert = counts.detach()
        self.aux_loss = self.tokens.sum(aux.detach())
        if self.aux_loss_weight and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_weight)
        return out


# --------------------------------------------------------------------------- dropout

SITE_EMBEDDING, SITE_ATTENTION, SITE_MLP = 0, 1, 2
_MASK32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2^32 for 0 <= x < 2^32 (an int or an int64 tensor), in 16-bit halves of c so
    that no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x):
    """A bijective 32-bit integer hash (Wellons' "lowbias32"), for ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _stream_key(*values: int) -> int:
    """One 32-bit key from (seed, step, layer, site): a hash chain over their 32-bit halves."""
    key = 0
    for v in values:
        key = _mix32(key ^ (v & _MASK32))
        key = _mix32(key ^ ((v >> 32) & _MASK32))
    return key


def dropout_keep_mask(p: float, seed: int, step: int, layer: int, site: int, samples: torch.Tensor,
                      positions: torch.Tensor, width: int) -> torch.Tensor:
    """(B, S, width) bool: True where the element survives dropout of rate ``p``.

    Element (b, s, i) is dropped when the hash of (seed, step, layer, site, samples[b],
    positions[s], i) falls under p x 2^24 (24 bits of the hash: the rate is p to within 6e-8).
    A counter-based mask, not a draw from a generator: any rank computes any element's mask, so a
    layout's shard of the batch, sequence or stages drops what the single process drops."""
    key = _stream_key(seed, step, layer, site)
    h = _mix32(samples.to(torch.int64) ^ key)  # (B,)
    h = _mix32(h[:, None] ^ positions.to(device=h.device, dtype=torch.int64)[None, :])  # (B, S)
    h = _mix32(h[..., None] ^ torch.arange(width, device=h.device, dtype=torch.int64))  # (B, S, width)
    return (h >> 8) >= round(p * (1 << 24))


class _Dropout(torch.autograd.Function):
    """x * keep / (1 - p), saving the 1-byte mask for backward (what Korthikanti et al. count)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x * scale, torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad * ctx.scale, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None


@dataclass(frozen=True)
class HiddenDropout:
    """The hidden dropout of one forward: rate, the run's seed and step, and where this rank's
    residual-stream rows sit in the step: ``samples`` (B,) their global sample indices,
    ``positions`` (S,) their global token positions (a sequence or context shard's own)."""

    p: float
    seed: int
    step: int
    samples: torch.Tensor
    positions: torch.Tensor

    def __call__(self, x: torch.Tensor, layer: int, site: int) -> torch.Tensor:
        keep = dropout_keep_mask(self.p, self.seed, self.step, layer, site, self.samples, self.positions, x.shape[-1])
        return _Dropout.apply(x, keep, 1.0 / (1.0 - self.p))


def _drop(x: torch.Tensor, dropout: HiddenDropout | None, layer: int, site: int) -> torch.Tensor:
    return x if dropout is None else dropout(x, layer, site)


# --------------------------------------------------------------------------- the transformer


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + drop(attention(norm(x))); out = h + drop(mlp(norm(h)))."""

    def __init__(self, spec: ModelSpec, layer_id: int, capacity_factor: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(spec, spec.d_model)
        self.attention = build_attention(spec)
        self.ffn_norm = build_norm(spec, spec.d_model)
        if spec.is_moe_layer(layer_id):
            self.moe = MoE(spec, capacity_factor)
            self.feed_forward = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(spec.d_model, spec.d_ff, spec.activation, spec.linear_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, dropout: HiddenDropout | None = None) -> torch.Tensor:
        h = x + _drop(self.attention(self.attention_norm(x), positions), dropout, self.layer_id, SITE_ATTENTION)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + _drop(mlp(self.ffn_norm(h)), dropout, self.layer_id, SITE_MLP)


class Transformer(nn.Module):
    """Decoder-only transformer. ``forward(tokens_or_hidden, positions=None, samples=None)``:

    * input: token ids (B, S) when ``tok_embeddings`` is present, else hidden states (B, S, d);
    * ``positions`` (S,): absolute positions for RoPE / learned positions; default arange(S);
    * ``samples`` (B,): the rows' global sample indices in the step, for dropout; default arange(B);
    * output: logits (B, S, vocab) when ``output`` is present, else hidden states (B, S, d).

    ``dropout`` > 0: hidden dropout of that rate in training mode, its masks keyed by
    ``dropout_seed`` and ``dropout_step`` (which the trainer sets every step).
    """

    def __init__(self, spec: ModelSpec, capacity_factor: float = 0.0, dropout: float = 0.0, dropout_seed: int = 0):
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_embeddings = nn.Embedding(spec.max_seq_len, spec.d_model) if spec.position == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i, capacity_factor) for i in range(spec.n_layers)})
        self.norm: nn.Module | None = build_norm(spec, spec.d_model)
        self.output: nn.Linear | None = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        # Hidden-state inputs (pipeline stages after the first) may arrive split over the
        # sequence (sequence parallel): their full length is x.shape[1] * sequence_split, and this
        # rank holds shard sequence_rank of it.
        self.sequence_split = 1
        self.sequence_rank = 0
        # Positions used when forward() gets none: set by the trainer when a pipeline schedule
        # (which only passes the hidden states) runs under context parallel.
        self.default_positions: torch.Tensor | None = None
        self.dropout = dropout
        self.dropout_seed = dropout_seed
        self.dropout_step = 0
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding table with the output projection (re-run after ``to_empty``)."""
        if self.spec.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _hidden_dropout(self, batch: int, positions: torch.Tensor, samples: torch.Tensor | None) -> HiddenDropout | None:
        if not (self.training and self.dropout > 0):
            return None
        if samples is None:
            samples = torch.arange(batch, device=positions.device)
        if self.sequence_split > 1:  # sequence parallel: the residual stream holds one shard of the tokens
            positions = positions.chunk(self.sequence_split)[self.sequence_rank]
        return HiddenDropout(self.dropout, self.dropout_seed, self.dropout_step, samples, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                samples: torch.Tensor | None = None) -> torch.Tensor:
        S = x.shape[1] if self.tok_embeddings is not None else x.shape[1] * self.sequence_split
        if positions is None:
            positions = self.default_positions
        if positions is None:
            positions = torch.arange(S, device=x.device)
        dropout = self._hidden_dropout(x.shape[0], positions, samples)
        h = x
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)  # (B, S, d)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
            h = _drop(h, dropout, 0, SITE_EMBEDDING)
        for layer in self.layers.values():
            h = layer(h, positions, dropout)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (B, S, vocab)
        return h

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if getattr(layer, "moe", None) is not None]


# --------------------------------------------------------------------------- initialisation

INIT_STD = 0.02
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def canonical_name(name: str) -> str:
    """Parameter name without wrapper prefixes (activation checkpointing, compile, DDP)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_value(name: str, shape: torch.Size | tuple[int, ...], spec: ModelSpec, seed: int,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: a function of (seed, name) only.

    Norm weights 1, biases 0 (the router's selection bias too); other weights N(0, 0.02), except
    the projections that write into the residual stream (wo, w2), scaled by 1/sqrt(2 L) (GPT-2,
    Radford et al. 2019). A tied output projection takes the embedding table's values."""
    if spec.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # a pipeline's last stage holds its own copy of the tied table
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name.rsplit(".", 2)[-2] and leaf == "weight":
        return torch.ones(shape, device=device, dtype=dtype)
    if leaf in ("bias", "b1", "b2", "b3"):
        return torch.zeros(shape, device=device, dtype=dtype)
    std = INIT_STD
    if ".wo." in name or ".w2." in name or name.endswith(".w2"):
        std /= math.sqrt(2 * spec.n_layers)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of a materialised (possibly sharded, possibly partial) model.

    Each rank draws the full tensor and keeps its own shard (DTensor: ``distribute_tensor`` with
    ``src_data_rank=None`` slices locally, no communication), so values match the unsharded model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    spec: ModelSpec = model.spec  # type: ignore[assignment]
    for name, p in model.named_parameters():
        full = init_value(canonical_name(name), p.shape, spec, seed, device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def build_model(spec: ModelSpec, device: str | torch.device = "meta", capacity_factor: float = 0.0,
                dropout: float = 0.0, dropout_seed: int = 0) -> Transformer:
    """A Transformer on ``device`` (meta by default: no memory until ``to_empty``)."""
    with torch.device(device):
        return Transformer(spec, capacity_factor, dropout, dropout_seed)


def materialize(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate a meta-built (and possibly sharded) model on ``device`` and initialise it."""
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, seed)
    for moe in model.moe_layers():
        moe.tokens_per_expert = torch.zeros(moe.n_experts, dtype=torch.long, device=device)
        moe.aux_loss = torch.zeros((), device=device)
    return model
