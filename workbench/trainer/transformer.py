"""The bundled trainer's model: a Llama-style decoder built from a :class:`~workbench.spec.model.ModelSpec`.

Module names follow torchtitan so that sharding plans read the same::

    Transformer
      tok_embeddings        nn.Embedding(vocab, d)            (None on non-first pipeline stages)
      pos_embeddings        nn.Embedding(max_seq_len, d)      (only for position="learned")
      layers["0".."L-1"]    TransformerBlock                  (a ModuleDict: stages delete entries)
        attention_norm, attention (wq, wk, wv, wo [, q_norm, k_norm]), ffn_norm,
        feed_forward (w1, w2[, w3])  or  moe (router.gate, experts (GroupedExperts), shared_experts)
      norm                  RMSNorm / LayerNorm               (None on non-last stages)
      output                nn.Linear(d, vocab, bias=False)   (None on non-last stages)

The parameter count equals ``ModelSpec.n_params()`` exactly (tests/test_trainer_model.py).

Build it on the meta device (``with torch.device("meta"): Transformer(spec)``), shard it, then
materialise with ``model.to_empty(device=...)`` and :func:`init_weights`, which draws every
parameter from a generator seeded by (seed, parameter name): the values do not depend on how the
model is sharded or split into stages, which is what lets every layout reproduce the
single-process losses.

Mixture of experts, capacity policy: **dropless** by default (``capacity_factor=0``): every token
reaches its top-k experts however unbalanced the routing. With ``capacity_factor = c >= 1`` each
expert takes at most ``ceil(c * N * k / E)`` of the N*k assignments of a forward (first come,
first served in token order); the rest are dropped (they contribute zero; the residual carries the
token) and counted in ``moe.dropped_tokens``.
"""

from __future__ import annotations

import math
import zlib
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
    """Top-k softmax router: probs = softmax(gate(x)); the k largest, renormalised (Mixtral)."""

    def __init__(self, d: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> probs (N, E), top-k weights (N, k), top-k expert ids (N, k)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.type_as(x), experts


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
    """

    def __init__(self, spec: ModelSpec, capacity_factor: float = 0.0):
        super().__init__()
        d = spec.d_model
        self.n_experts, self.top_k = spec.n_experts, spec.top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_weight = 0.0
        self.router = Router(d, spec.n_experts, spec.top_k)
        self.experts = GroupedExperts(spec.n_experts, d, spec.moe_d_ff, spec.activation, spec.linear_bias)
        self.shared_experts = None
        self.shared_gate = None
        if spec.n_shared_experts:
            # n shared experts of hidden h are one FFN of hidden n*h (DeepSeekMoE).
            hidden = spec.n_shared_experts * (spec.shared_d_ff or spec.moe_d_ff)
            self.shared_experts = FeedForward(d, hidden, spec.activation, spec.linear_bias)
            if spec.shared_expert_gate:
                self.shared_gate = nn.Linear(d, 1, bias=False)
        # Statistics of the last forward, for telemetry.
        self.tokens_per_expert = torch.zeros(spec.n_experts, dtype=torch.long)
        self.dropped_tokens = 0
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        flat = x.reshape(-1, d)  # (N, d)
        N, E, k = flat.shape[0], self.n_experts, self.top_k
        probs, weights, experts = self.router(flat)  # (N, E), (N, k), (N, k)
        assignment_expert = experts.reshape(-1)  # (N*k,) token t's j-th choice at t*k + j
        counts = torch.bincount(assignment_expert, minlength=E)
        aux = E * ((counts.float() / (N * k)) * probs.mean(0)).sum()
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
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        self.tokens_per_expert = counts.detach()
        self.aux_loss = aux.detach()
        if self.aux_loss_weight and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_weight)
        return out.view(B, S, d)


# --------------------------------------------------------------------------- the transformer


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, spec: ModelSpec, layer_id: int, capacity_factor: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(spec, spec.d_model)
        self.attention = Attention(spec)
        self.ffn_norm = build_norm(spec, spec.d_model)
        if spec.is_moe_layer(layer_id):
            self.moe = MoE(spec, capacity_factor)
            self.feed_forward = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(spec.d_model, spec.d_ff, spec.activation, spec.linear_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only transformer. ``forward(tokens_or_hidden, positions=None)``:

    * input: token ids (B, S) when ``tok_embeddings`` is present, else hidden states (B, S, d);
    * ``positions`` (S,): absolute positions for RoPE / learned positions; default arange(S);
    * output: logits (B, S, vocab) when ``output`` is present, else hidden states (B, S, d).
    """

    def __init__(self, spec: ModelSpec, capacity_factor: float = 0.0):
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_embeddings = nn.Embedding(spec.max_seq_len, spec.d_model) if spec.position == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i, capacity_factor) for i in range(spec.n_layers)})
        self.norm: nn.Module | None = build_norm(spec, spec.d_model)
        self.output: nn.Linear | None = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        # Hidden-state inputs (pipeline stages after the first) may arrive split over the
        # sequence (sequence parallel): their full length is x.shape[1] * sequence_split.
        self.sequence_split = 1
        # Positions used when forward() gets none: set by the trainer when a pipeline schedule
        # (which only passes the hidden states) runs under context parallel.
        self.default_positions: torch.Tensor | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding table with the output projection (re-run after ``to_empty``)."""
        if self.spec.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        S = x.shape[1] if self.tok_embeddings is not None else x.shape[1] * self.sequence_split
        if positions is None:
            positions = self.default_positions
        if positions is None:
            positions = torch.arange(S, device=x.device)
        h = x
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)  # (B, S, d)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h, positions)
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

    Norm weights 1, biases 0; other weights N(0, 0.02), except the projections that write into the
    residual stream (wo, w2), scaled by 1/sqrt(2 L) (GPT-2, Radford et al. 2019)."""
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


def build_model(spec: ModelSpec, device: str | torch.device = "meta", capacity_factor: float = 0.0) -> Transformer:
    """A Transformer on ``device`` (meta by default: no memory until ``to_empty``)."""
    with torch.device(device):
        return Transformer(spec, capacity_factor)


def materialize(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate a meta-built (and possibly sharded) model on ``device`` and initialise it."""
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, seed)
    for moe in model.moe_layers():
        moe.tokens_per_expert = torch.zeros(moe.n_experts, dtype=torch.long, device=device)
        moe.aux_loss = torch.zeros((), device=device)
    return model
