"""Context parallelism: causal ring attention over a load-balanced split of the sequence.

Context parallelism (CP) splits every sequence of ``S`` tokens across the ``cp`` ranks of a CP
group. Everything except attention is token-local, so it simply runs on the local tokens;
attention needs every earlier token's keys and values, so the K/V chunks travel around the
ring of CP ranks (point-to-point send/recv, ``cp - 1`` hops), and each rank attends its local
queries to each visiting chunk. The partial results are merged exactly with their
log-sum-exps, as in blockwise/flash attention. References: Liu et al., "Ring Attention with
Blockwise Transformers" (2023); Dao, "FlashAttention-2" (2023) for the merge and the backward.

Load balance (the "zig-zag" layout). Cut the sequence into ``2 cp`` chunks of ``c = S / (2 cp)``
tokens; rank ``i`` keeps chunks ``i`` and ``2 cp - 1 - i``. With a causal mask a query chunk ``a``
sees key chunk ``b`` fully when ``a > b``, causally when ``a == b``, not at all when ``a < b``.
For local chunks ``(i, 2cp-1-i)`` against the chunks ``(j, 2cp-1-j)`` of the rank ``j`` whose K/V
are visiting, that gives three cases, and every rank does the same amount of work in each:

- ``j == i`` (step 0): ordinary causal attention over the ``2c`` local tokens;
- ``j < i``: all local queries see the visitor's first chunk ``j`` fully, its second not at all;
- ``j > i``: only the local second chunk ``2cp-1-i`` sees anything, both visiting chunks fully.

Backward runs the ring again: the K/V chunks travel as before, and with each travels an
accumulator of its dK/dV to which every rank adds its contribution; one last hop brings the
accumulator home to the chunk's owner. Blocks are computed in fp32 (fp64 inputs stay fp64), so
bf16 inputs get fp32 softmax statistics and fp32 gradient accumulators.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.spec.errors import require

__all__ = [
    "chunk_ids",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "ring_attention",
    "RingAttention",
    "apply_cp",
]


# ---------------------------------------------------------------------- sequence sharding
def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the ``2 cp`` sequence chunks a CP rank keeps: ``(i, 2 cp - 1 - i)``."""
    require(cp_size >= 1, f"cp_size={cp_size} must be >= 1", field="cp", value=cp_size)
    require(0 <= cp_rank < cp_size, f"cp_rank={cp_rank} is outside 0..{cp_size - 1}", field="cp_rank", value=cp_rank)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(
    tokens: torch.Tensor, targets: torch.Tensor | None, cp_rank: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Keep this CP rank's share of a batch: ``(tokens_local, targets_local, positions_local)``.

    ``tokens`` and ``targets`` are (B, S); the local ones are (B, S / cp), the concatenation of
    chunks ``i`` and ``2 cp - 1 - i`` (see the module docstring). ``positions_local`` (S / cp,) are
    the global positions of the local tokens, for RoPE. ``cp_size == 1`` returns the inputs.
    """
    first, second = chunk_ids(cp_rank, cp_size)
    seq = tokens.shape[1]
    require(
        seq % (2 * cp_size) == 0,
        f"seq_len={seq} is not divisible by 2 x cp = {2 * cp_size} (load-balanced context parallel "
        "gives each CP rank two chunks)",
        field="cp",
        value=cp_size,
    )
    c = seq // (2 * cp_size)
    positions = torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])
    positions = positions.to(tokens.device)

    def take(x: torch.Tensor) -> torch.Tensor:
        return x if cp_size == 1 else x.index_select(1, positions)

    return take(tokens), None if targets is None else take(targets), positions


def unshard_sequence(local_by_rank: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the per-rank local tensors (in CP rank order) -> the
    whole sequence along ``dim``."""
    cp = len(local_by_rank)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, local in enumerate(local_by_rank):
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = local.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """All-gather the local shards of a CP group and restore token order (no autograd)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard_sequence(parts, dim=dim)


# ---------------------------------------------------------------------- blockwise attention
# Shapes inside: queries, outputs and their gradients are (B, H_kv, G, L, D) with G = H / H_kv
# query heads per KV head (grouped-query attention), keys and values (B, H_kv, L_k, D), log-sum-
# exps (B, H_kv, G, L). Query head h uses KV head h // G, as F.scaled_dot_product_attention
# with enable_gqa=True and Llama's repeat_kv do; broadcasting instead of repeating the K/V heads
# also sums dK/dV over the G query heads that share them, for free.


def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """True where key j > query i (masked out), for a block on the diagonal."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-1], s.device), float("-inf"))
    return s


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block: ``(out, lse)`` with ``lse = log sum_j exp(q.k_j * scale)``."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v), lse


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax attentions over disjoint key sets:
    ``lse = log(e^lse1 + e^lse2)``, ``out = out1 e^(lse1 - lse) + out2 e^(lse2 - lse)``."""
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return new_out, new_lse


def _attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* ``lse`` and ``delta = rowsum(dout * out)``
    (FlashAttention-2, Algorithm 2): ``P = exp(S - lse)``, ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P (dP - delta)``, ``dQ = dS K scale``, ``dK = dS^T Q scale``."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout, v)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------- the ring
class _Ring:
    """The CP ranks in a ring: each step sends a tensor to the next rank and receives the
    previous rank's. Uses batched isend/irecv, which both gloo and NCCL run."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def start_shift(self, tensor: torch.Tensor) -> "_Shift":
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size),
        ]
        return _Shift(dist.batch_isend_irecv(ops), tensor, received)

    def source(self, step: int) -> int:
        """The CP rank whose K/V chunks this rank holds at ``step``."""
        return (self.rank - step) % self.size


class _Shift:
    """An exchange in flight; keeps the sent tensor alive until it completes."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.received


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    c = q.shape[-2] // 2  # tokens per chunk; the local sequence is two chunks
    kv = torch.stack([k, v])
    out = lse = torch.empty(0)
    for step in range(ring.size):
        # Post the next hop before computing, so the transfer overlaps the block's math.
        shift = ring.start_shift(kv) if step + 1 < ring.size else None
        source = ring.source(step)
        kk, vv = kv[0].to(q.dtype), kv[1].to(q.dtype)
        if step == 0:
            out, lse = _attend(q, kk, vv, scale, causal=True)
        elif source < ring.rank:  # all local queries see the visitor's first chunk
            o, l = _attend(q, kk[..., :c, :], vv[..., :c, :], scale, causal=False)
            out, lse = _merge(out, lse, o, l)
        else:  # only the local second chunk sees anything: both visiting chunks
            o, l = _attend(q[..., c:, :], kk, vv, scale, causal=False)
            o, l = _merge(out[..., c:, :], lse[..., c:], o, l)
            out = torch.cat([out[..., :c, :], o], dim=-2)
            lse = torch.cat([lse[..., :c], l], dim=-1)
        if shift is not None:
            kv = shift.wait()
    return out, lse


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: _Ring,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = q.shape[-2] // 2
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    dkv = torch.empty(0)
    dkv_shift: _Shift | None = None
    for step in range(ring.size):
        kv_shift = ring.start_shift(kv) if step + 1 < ring.size else None
        source = ring.source(step)
        kk, vv = kv[0].to(q.dtype), kv[1].to(q.dtype)
        # This step's contribution to the visiting chunks' dK/dV, stacked like kv.
        part = torch.zeros((2,) + kk.shape, dtype=q.dtype, device=q.device)
        if step == 0:
            gq, gk, gv = _attend_backward(dout, q, kk, vv, lse, delta, scale, causal=True)
            dq += gq
            part[0], part[1] = gk, gv
        elif source < ring.rank:
            gq, gk, gv = _attend_backward(dout, q, kk[..., :c, :], vv[..., :c, :], lse, delta, scale, causal=False)
            dq += gq
            part[0, ..., :c, :], part[1, ..., :c, :] = gk, gv
        else:
            gq, gk, gv = _attend_backward(
                dout[..., c:, :], q[..., c:, :], kk, vv, lse[..., c:], delta[..., c:], scale, causal=False
            )
            dq[..., c:, :] += gq
            part[0], part[1] = gk, gv
        # The accumulator that arrived last step belongs to the chunks visiting now.
        dkv = part if dkv_shift is None else dkv_shift.wait() + part
        # Pass it on with its chunks; after the last step this hop brings it home to the owner.
        dkv_shift = ring.start_shift(dkv) if ring.size > 1 else None
        if kv_shift is not None:
            kv = kv_shift.wait()
    if dkv_shift is not None:
        dkv = dkv_shift.wait()
    return dq, dkv[0], dkv[1]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (softmax and merges need the range), fp64 stays fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _group_heads(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H_kv, G, L, D) in the compute dtype."""
    b, h, length, d = x.shape
    return x.to(_compute_dtype(x)).reshape(b, n_kv_heads, h // n_kv_heads, length, d)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):  # type: ignore[override]
        ring = _Ring(group)
        qg = _group_heads(q, k.shape[1])
        out, lse = _ring_forward(qg, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        douts = _group_heads(dout, k.shape[1])
        dq, dk, dv = _ring_backward(douts, _group_heads(q, k.shape[1]), k, v, out, lse, ring, ctx.scale)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the CP-sharded sequence, equal to full causal attention on the whole.

    ``q``, ``k`` (B, H, S/cp, D), (B, H_kv, S/cp, D) and ``v`` (B, H_kv, S/cp, D_v) hold this rank's
    tokens in the layout of :func:`shard_sequence`; ``H_kv`` divides ``H`` (GQA). Returns
    (B, H, S/cp, D_v). ``scale`` defaults to ``1 / sqrt(D)``. ``group`` is the CP group (None: the
    default group; without an initialised process group this is plain causal attention).
    Differentiable.

    Values as wide as keys travel stacked with them. Latent attention's are not (D_v = v_head_dim,
    D = qk_nope + qk_rope): the narrower side is zero-padded to the wider, which changes nothing
    (zero query/key columns add nothing to q.k; zero value columns give output columns that are
    cut off) at the price of moving and multiplying the padding.
    """
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and v.shape[:-1] == k.shape[:-1] and q.shape[-1] == k.shape[-1],
            "ring_attention expects q (B, H, L, D), k (B, H_kv, L, D) and v (B, H_kv, L, D_v); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}", field="q")
    require(q.shape[1] % k.shape[1] == 0, f"n_kv_heads={k.shape[1]} does not divide n_heads={q.shape[1]}",
            field="n_kv_heads", value=k.shape[1])
    require(q.shape[2] == k.shape[2], f"q has {q.shape[2]} tokens but k has {k.shape[2]}", field="seq_len",
            value=q.shape[2])
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    require(cp == 1 or q.shape[2] % 2 == 0,
            f"local sequence length {q.shape[2]} must be even under cp={cp} (two chunks per CP rank)",
            field="seq_len", value=q.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    width, v_width = max(k.shape[-1], v.shape[-1]), v.shape[-1]
    if width != v_width or width != k.shape[-1]:
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return _RingAttention.apply(q, k, v, group, scale)[..., :v_width]
    return _RingAttention.apply(q, k, v, group, scale)


# ---------------------------------------------------------------------- applying it to a model
class RingAttention(nn.Module):
    """Drop-in for a block's ``attention.sdpa(q, k, v)``: causal ring attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup | None):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                is_causal: bool = True, **_: object) -> torch.Tensor:
        require(is_causal, "context parallel supports causal attention only", field="is_causal", value=is_causal)
        return ring_attention(q, k, v, self.group, scale=scale)

    def extra_repr(self) -> str:
        size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        return f"cp={size}"


def _cp_group(cp_mesh_or_group: object) -> dist.ProcessGroup:
    """A ProcessGroup from a group, a 1-D DeviceMesh, or a mesh with a "cp" dimension."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh_or_group, DeviceMesh):
        names = cp_mesh_or_group.mesh_dim_names or ()
        if cp_mesh_or_group.ndim > 1:
            require("cp" in names, f"mesh dimensions {names} have no 'cp'", field="cp", value=names)
            return cp_mesh_or_group["cp"].get_group()
        return cp_mesh_or_group.get_group()
    return cp_mesh_or_group  # type: ignore[return-value]


def apply_cp(model: nn.Module, cp_mesh_or_group: object) -> nn.Module:
    """Make every block's attention a ring attention over the CP group; returns ``model``.

    The caller feeds each CP rank its :func:`shard_sequence` share of the batch and passes
    ``positions_local`` to ``model(tokens, positions)`` so that RoPE sees global positions.
    Each rank's loss is the mean over its local tokens, and every CP rank holds equally many, so
    averaging gradients over the CP ranks (FSDP's dp_shard x cp group) gives the full gradient.
    """
    group = _cp_group(cp_mesh_or_group)
    layers = getattr(model, "layers", None)
    require(layers is not None, f"{type(model).__name__} has no .layers to apply context parallel to", field="model")
    for block in layers.values():  # type: ignore[union-attr]
        attention = block.attention
        ring = RingAttention(group)
        if "sdpa" in attention._modules:
            attention.sdpa = ring
        else:
            # sdpa is a method (or a plain attribute): an instance attribute shadows it without
            # registering a child module (the ring has no parameters or state).
            object.__setattr__(attention, "sdpa", ring)
    return model
