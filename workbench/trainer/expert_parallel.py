"""Expert parallelism: each rank of an EP group keeps ``E / ep`` of the routed experts, and the
tokens travel to their experts and back with two all-to-alls.

Who holds what. Rank ``i`` of an EP group of ``ep`` ranks keeps experts
``[i E/ep, (i+1) E/ep)``: dimension 0 of every expert weight becomes a ``DTensor`` sharded
``Shard(0)`` over a 1-D ``"ep"`` mesh, so that ``init_weights`` gives each rank exactly its
slice of the unsharded initial values, and ``GroupedExperts.forward`` (which takes
``to_local()``) computes with the local experts only.

The forward pass of a MoE layer under EP (Lepikhin et al., "GShard", 2020; DeepSeek-V3's
"dispatch" and "combine"):

1. the router (replicated) sorts this rank's token copies by *global* expert id;
   ``num_tokens_per_expert`` (E,) counts them. The experts of EP rank ``r`` are a contiguous
   block, so the first ``sum(counts of rank 0's experts)`` rows go to rank 0, and so on;
2. exchange counts (an all-to-all of ``ep x E/ep`` integers) so that every rank knows how many
   rows it will receive from each peer - the splits are uneven and change every step;
3. **dispatch**: ``all_to_all_single`` with those input/output splits;
4. the received rows arrive grouped by source rank, then by local expert; a stable sort regroups
   them by local expert, the local experts run, the inverse permutation restores the order;
5. **combine**: the reverse all-to-all (splits swapped) returns each result to its token's rank.

Backward is the same two all-to-alls with the splits swapped (:class:`_AllToAll`).

Tokens are not split by EP. EP borrows its ranks from ``dp_shard x cp`` (:meth:`ParallelPlan
.rank_coords`): every EP rank is also a data-parallel rank with its own tokens. After backward,
a local expert's gradient holds the contributions of every token of its EP group; the ranks
that hold the *same* experts (one per EP group: "dp_shard mod ep", times dp_replicate - see
:func:`expert_data_parallel_ranks`) must still be summed, and the sum divided by the full
data-parallel degree ``dp_replicate x dp_shard x cp`` to match the mean that FSDP/DDP takes for
dense weights. :func:`reduce_expert_grads` does exactly that. Therefore the data-parallel
wrappers must leave expert weights alone (FSDP2: ``fully_shard(..., ignored_params=...)`` with
:func:`expert_params`); an FSDP of the experts over the expert-data-parallel group with
``set_gradient_divide_factor(dp_replicate x dp_shard x cp)`` is the memory-saving alternative.

Tensor parallelism inside MoE layers: Megatron-Core's default *expert tensor parallelism*
(expert TP = TP), what the planner bills (``workbench.predict.memory``: the experts split by
``ep x tp``). Every expert's w1 and w3 are column-split and its w2 row-split over the TP ranks
(each keeps ``moe_d_ff / tp`` hidden units of every local expert; :func:`apply_expert_tp`), so
the expert weights are ``DTensor`` over a 2-D ``(ep, tp)`` mesh (``Shard(0)``, then the hidden
dimension) or the 1-D TP mesh without EP. The router stays whole on every TP rank; the shared
experts are split like the dense MLP. A MoE layer under TP (:class:`TensorParallelTokens`):

1. each TP rank holds its sequence shard (with sequence parallelism: the residual stream's;
   without: its 1/tp of the replicated sequence) and routes those tokens;
2. tokens, routing weights and expert ids are all-gathered over TP: every TP rank of an EP
   group now holds the same token copies and dispatches the same rows over EP (steps 2-5 above);
3. the local experts compute with their hidden slice: partial outputs;
4. after the combine (weights applied, the k choices summed per token) the partial outputs are
   reduce-scattered over TP back to each rank's sequence shard (without sequence parallelism
   then all-gathered into the replicated residual stream: an all-reduce in two halves).

Backward is the transpose: step 2's all-gathers become reduce-scatters, which sum the partial
input and routing-weight gradients of the TP ranks; step 4's reduce-scatter an all-gather. The
router's weight gradient is partial over TP (each rank routed its own tokens) and reduced like a
sequence-parallel norm's (a ``Replicate`` DTensor parameter with a ``Partial`` gradient).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from workbench.spec.errors import require
from workbench.spec.plan import ParallelPlan

__all__ = [
    "apply_ep",
    "apply_expert_tp",
    "TensorParallelTokens",
    "expert_params",
    "expert_data_parallel_ranks",
    "reduce_expert_grads",
    "local_expert_range",
    "all_to_all",
]


# ---------------------------------------------------------------------- differentiable all-to-all
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits. Its adjoint is the same exchange
    with input and output splits swapped: the gradient of a row goes back where the row came from."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):  # type: ignore[override]
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x``: ``input_splits[r]`` rows go to rank r,
    ``output_splits[r]`` rows arrive from rank r, concatenated in rank order."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


# ---------------------------------------------------------------------- the EP forward
class ExpertParallel:
    """Mixin put in front of the experts' class by :func:`apply_ep` (as FSDP2 does with its own):
    ``forward`` takes the rank's tokens sorted by *global* expert, runs them on whichever rank
    holds their expert, and returns the results in the same order.

    Attributes set by :func:`apply_ep`: ``ep_group``, ``ep_size``, ``ep_rank``, ``n_experts``
    (global); ``tokens_received`` (E/ep,) is what each local expert processed in the last
    forward, from all ranks of the EP group.
    """

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    n_experts: int
    tokens_received: torch.Tensor

    def forward(self, x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep_size, self.n_experts // self.ep_size
        with torch.no_grad():  # 2. exchange counts: recv[r, e] = rows rank r sends my expert e
            send = num_tokens_per_expert.to(torch.int64).reshape(ep, local).contiguous()
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
        input_splits = send.sum(1).tolist()
        output_splits = recv.sum(1).tolist()
        # 3. dispatch: rows arrive grouped by source rank, then by local expert.
        x_recv = all_to_all(x_sorted, output_splits, input_splits, self.ep_group)
        # 4. regroup by local expert (stable: source-rank order inside an expert), compute, undo.
        expert_of_row = torch.arange(local, device=recv.device).repeat(ep).repeat_interleave(recv.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True).to(x_sorted.device)
        per_expert = recv.sum(0)
        y = super().forward(x_recv[order], per_expert)  # type: ignore[misc]
        y = torch.empty_like(y).index_copy(0, order, y)  # y_back[order[i]] = y[i]
        self.tokens_received = per_expert.detach()
        # 5. combine: the reverse exchange brings every result home.
        return all_to_all(y, input_splits, output_splits, self.ep_group)


def local_expert_range(n_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """Experts ``[start, stop)`` kept by EP rank ``ep_rank``: ``[i E/ep, (i+1) E/ep)``."""
    require(n_experts % ep_size == 0, f"ep={ep_size} does not divide n_experts={n_experts}", field="ep", value=ep_size)
    per = n_experts // ep_size
    return ep_rank * per, (ep_rank + 1) * per


def _ep_mesh(ep_mesh_or_group: object):
    """A 1-D DeviceMesh named "ep" from a mesh (1-D, or with an "ep" dimension) or a ProcessGroup."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(ep_mesh_or_group, DeviceMesh):
        if ep_mesh_or_group.ndim > 1:
            names = ep_mesh_or_group.mesh_dim_names or ()
            require("ep" in names, f"mesh dimensions {names} have no 'ep'", field="ep", value=names)
            return ep_mesh_or_group["ep"]
        return ep_mesh_or_group
    group = ep_mesh_or_group if ep_mesh_or_group is not None else dist.group.WORLD
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, device_type, mesh=ranks, mesh_dim_names=("ep",))


def _grouped_experts(model: nn.Module) -> Iterator[nn.Module]:
    for block in getattr(model, "layers", {}).values():  # type: ignore[union-attr]
        moe = getattr(block, "moe", None)
        if moe is not None:
            yield moe.experts


def apply_ep(model: nn.Module, ep_mesh_or_group: object) -> nn.Module:
    """Shard every MoE layer's experts over the EP group and route tokens with all-to-all.

    Call it before FSDP/DDP (whose wrappers must then ignore :func:`expert_params`), on the meta
    or on a materialised model: the parameters become ``DTensor`` ``Shard(0)`` on the "ep" mesh
    (a materialised value is sliced locally, without communication). Returns ``model``.
    """
    mesh = _ep_mesh(ep_mesh_or_group)
    group, ep, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    for experts in _grouped_experts(model):
        require(not isinstance(experts, ExpertParallel), "apply_ep was already applied", field="ep", value=ep)
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        n_experts = getattr(experts, "w1").shape[0]
        local_expert_range(n_experts, rank, ep)  # validates ep | E
        for name in names:
            p = getattr(experts, name)
            shard = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        cls = type(experts)
        experts.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
        experts.ep_group, experts.ep_size, experts.ep_rank, experts.n_experts = group, ep, rank, n_experts
        experts.tokens_received = torch.zeros(n_experts // ep, dtype=torch.int64)
    return model


# The hidden dimension of each expert weight (GroupedExperts: w1, w3 (E, hidden, d); w2 (E, d,
# hidden); b1, b3 (E, hidden)): column-parallel w1/w3, row-parallel w2. b2 (E, d), the row-parallel
# output bias, would be added once per TP group: the bundled trainer refuses TP with expert biases.
EXPERT_TP_DIMS = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1}


def apply_expert_tp(model: nn.Module, mesh: object) -> nn.Module:
    """Split every routed expert's hidden units over TP (Megatron's expert tensor parallelism).

    ``mesh``: the 1-D TP mesh, or under expert parallelism the 2-D ``("ep", "tp")`` mesh of this
    rank's EP group x its TP group (after :func:`apply_ep`, whose ``Shard(0)`` is kept). Call it
    before FSDP/DDP on the meta model (a materialised expert is gathered and re-sliced). The MoE
    layer itself needs :class:`TensorParallelTokens` as its ``tokens`` (``apply_tp`` sets both)."""
    two_d = getattr(mesh, "ndim", 1) == 2
    for experts in _grouped_experts(model):
        for name, p in list(experts.named_parameters(recurse=False)):
            require(name in EXPERT_TP_DIMS, f"expert parameter {name} has no tensor-parallel split (expert biases "
                    "of the output projection)", field="tp", value=name)
            if isinstance(p, DTensor):
                require(two_d, f"expert parameter {name} is already sharded (EP): give the (ep, tp) mesh",
                        field="tp", value=name)
                full = torch.empty(p.shape, dtype=p.dtype, device="meta") if p.is_meta else p.full_tensor()
            else:
                full = p.data
            placements = ([Shard(0)] if two_d else []) + [Shard(EXPERT_TP_DIMS[name])]
            shard = distribute_tensor(full, mesh, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    return model


class TensorParallelTokens:
    """An MoE layer's token exchanges over the TP group (steps 1-4 of the module docstring), on
    DTensor redistributions so that backward is their transpose. Tokens are (B, S, ...) tensors,
    each TP rank holding the S / tp positions of its sequence shard (sequence-parallel layout)."""

    def __init__(self, tp_mesh):
        self.mesh = tp_mesh

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S/tp, ...) -> (B, S, ...); backward: reduce-scatter (the ranks' partial gradients summed)."""
        full = DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False).redistribute(self.mesh, [Replicate()])
        return full.to_local(grad_placements=[Partial()]) if x.requires_grad else full.to_local()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Partial (B, S, d) -> this rank's (B, S/tp, d), summed over TP; backward: all-gather."""
        return DTensor.from_local(x, self.mesh, [Partial()], run_check=False).redistribute(self.mesh, [Shard(1)]).to_local()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """A statistic summed over TP (the auxiliary loss's shares), without gradient."""
        out = x.detach().clone()
        dist.all_reduce(out, group=self.mesh.get_group())
        return out


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (to pass as FSDP2's ``ignored_params`` under EP)."""
    return [p for experts in _grouped_experts(model) for p in experts.parameters(recurse=False)]


# ---------------------------------------------------------------------- gradients of the experts
def expert_data_parallel_ranks(plan: ParallelPlan, include_replicate: bool = True) -> list[list[int]]:
    """Groups of global ranks that hold the same experts and different tokens: equal pp, tp and
    EP index, varying ``(dp_shard x cp) // ep`` (torchtitan's "dp_shard_mod_ep") and, with
    ``include_replicate``, dp_replicate. Each group has ``dp_replicate x dp_shard x cp / ep``
    ranks (without dp_replicate: ``dp_shard x cp / ep``); every rank calls ``new_group`` for all."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(plan.world_size):
        c = plan.rank_coords(r)
        key = (c["pp"], c["tp"], c["ep"]) + (() if include_replicate else (c["dp_replicate"],))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, group: dist.ProcessGroup | None, divide_by: int | None = None) -> None:
    """Sum the local experts' gradients over ``group`` (the expert-data-parallel group of
    :func:`expert_data_parallel_ranks`) and divide by ``divide_by``, default ``|group| x ep`` =
    ``dp_replicate x dp_shard x cp``: then an expert's gradient is the mean over data-parallel
    ranks, like a dense weight's under FSDP/DDP. Call after backward, before clipping.
    ``group=None`` (or of size 1): no communication, only the division."""
    size = dist.get_world_size(group) if group is not None else 1
    for experts in _grouped_experts(model):
        ep = getattr(experts, "ep_size", 1)
        factor = divide_by if divide_by is not None else size * ep
        for p in experts.parameters(recurse=False):
            if p.grad is None:
                continue
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if size > 1:
                dist.all_reduce(grad, group=group)
            grad.div_(factor)
