"""Apply tensor parallelism, activation checkpointing and data parallelism to a (meta) model.

Order matters, and :func:`parallelize` keeps it: **TP, then AC, then FSDP/DDP.**

* TP first: ``parallelize_module`` replaces weights by DTensors sharded over the TP mesh and
  installs the layout hooks; activation checkpointing must then recompute *those* sharded ops.
* AC before FSDP: checkpoint wrappers go around each block; FSDP then wraps the (wrapped) block,
  so its all-gather hooks run outside the recomputed region and the parameters gathered for the
  forward are gathered again for the recomputation only if resharded (ZeRO-3).
* FSDP last: ``fully_shard`` shards whatever each parameter already is (a TP DTensor becomes a 2-D
  DTensor over (dp, tp)); per block first, the root last, so each block is one all-gather group.

Inside MoE layers TP is Megatron's expert tensor parallelism (workbench/trainer/expert_parallel.py):
each expert's hidden units split over TP, the router whole, tokens gathered over TP and the partial
outputs reduce-scattered back. What the bundled trainer cannot parallelise (learned positions with
sequence parallel, expert biases under TP...) is refused before any of this runs:
:func:`workbench.spec.trainable.check_trainable`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.trainer.context_parallel import apply_cp
from workbench.trainer.expert_parallel import TensorParallelTokens, apply_ep, apply_expert_tp, expert_params
from workbench.trainer.transformer import LatentAttention, Transformer


def copy_to_tp_region(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Megatron's "f": the identity forward; backward all-reduces the gradient over TP. For a
    tensor that every TP rank holds whole and that feeds rank-local work (latent attention's
    shared RoPE key, used by each rank's heads): each rank's gradient is then a part of the sum."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _attention_plan(attention: torch.nn.Module, seq, tp_mesh: DeviceMesh) -> dict[str, object]:
    """Column-parallel projections into heads, row-parallel out of them.

    Grouped-query attention: wq, wk, wv split by heads, wo by its input. QK-norm (Qwen3) normalises
    each local head over its whole head_dim: its weight (head_dim) is a Replicate DTensor fed the
    local heads as ``Shard(2)``, so its gradient comes out Partial (each rank saw some heads) and
    is reduced like a sequence-parallel norm's. Latent attention: q_b (or q_proj) and kv_b split
    by heads, wo by its input; q_a, kv_a and their norms whole on every rank (Megatron-Core's MLA),
    computing on the plain gathered input (``use_local_output``)."""
    if isinstance(attention, LatentAttention):
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=True),
            "attention.kv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        plan["attention.q_proj" if attention.q_proj is not None else "attention.q_b"] = ColwiseParallel()
        attention.share_rope_key = functools.partial(copy_to_tp_region, tp_mesh=tp_mesh)
        return plan
    plan = {
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if attention.q_norm is not None:
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _mlp_plan(block: torch.nn.Module, seq) -> dict[str, object]:
    """The dense MLP: w1, w3 column-parallel, w2 row-parallel (reduce-scatter under SP)."""
    plan: dict[str, object] = {
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def _moe_plan(moe: torch.nn.Module, seq) -> dict[str, object]:
    """An MoE layer sees this rank's sequence shard (``Shard(1)`` in, ``Shard(1)`` out, whatever
    the residual stream's layout); the router's gate is whole, fed its tokens as a shard (its
    gradient is Partial); the shared experts are the dense MLP on the gathered sequence, reduce-
    scattered back to the shard; the shared-expert gate is per token, like the router."""
    plan: dict[str, object] = {
        "moe": PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Shard(1),), use_local_input=True,
                                        output_layouts=(Shard(1),), desired_output_layouts=(seq,), use_local_output=True),
        "moe.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    }
    if moe.shared_experts is not None:
        plan["moe.shared_experts"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan["moe.shared_experts.w1"] = ColwiseParallel()
        plan["moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Shard(1))
        if moe.shared_experts.w3 is not None:
            plan["moe.shared_experts.w3"] = ColwiseParallel()
    if moe.shared_gate is not None:
        plan["moe.shared_gate"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True, loss_parallel: bool = False,
             expert_mesh: DeviceMesh | None = None) -> None:
    """Megatron tensor parallelism (Shoeybi et al. 2019) with sequence parallelism (Korthikanti
    et al. 2022) on DTensor.

    Column-parallel wq, wk, wv, w1, w3 (each rank computes n_heads/tp heads, d_ff/tp hidden units);
    row-parallel wo, w2 (partial sums, reduced: all-reduce without SP, reduce-scatter over the
    sequence with SP). With SP the residual stream and the norms run on seq_len/tp tokens per rank
    (``Shard(1)``); ``PrepareModuleInput`` all-gathers the sequence before attention and the MLP.
    The output projection is column-parallel over the vocabulary: logits are all-gathered
    (Replicate) or left sharded for a loss-parallel cross-entropy. MoE layers: expert tensor
    parallelism over ``expert_mesh`` (the TP mesh, or (ep, tp) under EP; default the TP mesh).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, object] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root:
        parallelize_module(model, tp_mesh, root)  # type: ignore[arg-type]

    if model.moe_layers():
        apply_expert_tp(model, expert_mesh if expert_mesh is not None else tp_mesh)
    for block in model.layers.values():
        plan = _attention_plan(block.attention, seq, tp_mesh)
        if block.moe is not None:
            plan.update(_moe_plan(block.moe, seq))
            block.moe.tokens = TensorParallelTokens(tp_mesh)
        else:
            plan.update(_mlp_plan(block, seq))
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
    # Stages after the first receive hidden states sharded over the sequence: remember the split
    # so that the default positions cover the whole sequence (and dropout knows this rank's shard).
    model.sequence_split = tp_mesh.size() if sequence_parallel else 1
    model.sequence_rank = tp_mesh.get_local_rank() if sequence_parallel else 0


def apply_ac(model: Transformer, mode: str) -> None:
    """Activation checkpointing, with the planner's meaning (memory.py):

    * ``"none"``: keep every activation;
    * ``"selective"``: recompute the attention core only (softmax(QK^T)V, the s^2 part;
      Korthikanti et al. 2022): each attention's ``sdpa`` call runs under ``checkpoint``;
    * ``"full"``: keep only each block's input and recompute the whole block in backward.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective":
            attention = block.attention
            attention.sdpa = functools.partial(checkpoint, attention.sdpa, use_reentrant=False, preserve_rng_state=False)
        else:
            raise ValueError(f"recompute={mode!r} is not one of none, selective, full")


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, zero_stage: int = 3, mp_policy=None,
               ignored_params: set | None = None) -> None:
    """FSDP2 ``fully_shard``: each block, then the root (embeddings, final norm, output).

    ``reshard_after_forward = (zero_stage == 3)``: ZeRO-3 frees gathered parameters after the
    forward and gathers them again for the backward; stages 1 and 2 keep them until the backward
    (FSDP2 always shards gradients and optimizer states, so 1 behaves as 2). A 2-D ``dp_mesh``
    (dp_replicate, dp_shard_cp) gives HSDP: shard inside, all-reduce across replicas.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    ignored_params=ignored_params)
    # The root's parameters are needed again right at the start of the backward: keep them.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, ignored_params=ignored_params)


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh, mp_policy=None, ignored_params: set | None = None) -> None:
    """Replicated data parallelism (DDP semantics: all-reduce of gradients, mean) over
    ``dp_mesh``, per block then root so gradients of late blocks are reduced while earlier
    blocks still compute. Uses FSDP2's ``replicate``, which composes with TP DTensors."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored_params)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored_params)


def mixed_precision_policy(compute_dtype: torch.dtype):
    """FSDP2: gather parameters in ``compute_dtype``, reduce gradients in fp32 (fp32 master)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` wrapped a module in, for the caller to keep."""

    data_parallel: str | None  # "fsdp" (fully_shard), "ddp" (replicate) or None

    @property
    def casts_compute_dtype(self) -> bool:
        """The data-parallel wrapper casts to the compute dtype itself (its MixedPrecisionPolicy),
        so no autocast is needed; it also owns the gradient sync (``set_requires_gradient_sync``)."""
        return self.data_parallel is not None


def parallelize(model: Transformer, meshes, plan, recompute: str,
                compute_dtype: torch.dtype = torch.float32) -> Parallelized:
    """Apply CP, EP, TP, AC and data parallelism in that order; say which data-parallel wrapper
    the module got."""
    if plan.cp > 1:
        apply_cp(model, meshes.get("cp"))
    if plan.ep > 1:
        apply_ep(model, meshes.ep_mesh if meshes.ep_mesh is not None else meshes.ep_group)
    if plan.tp > 1:
        apply_tp(model, meshes.get("tp"), plan.sequence_parallel, plan.loss_parallel, meshes.expert_mesh())
    # Under EP the experts are already sharded; their gradients are reduced over the ranks that
    # hold the same experts (train.py, reduce_expert_grads), not by FSDP/DDP. (Collected after TP,
    # which re-creates them as (ep, tp) DTensors.)
    ignored = (set(expert_params(model)) or None) if plan.ep > 1 else None
    apply_ac(model, recompute)
    mp = mixed_precision_policy(compute_dtype)
    fsdp_mesh = meshes.fsdp_mesh()
    if fsdp_mesh is not None and plan.zero_stage > 0:
        apply_fsdp(model, fsdp_mesh, plan.zero_stage, mp, ignored_params=ignored)
        return Parallelized("fsdp")
    dp_mesh = meshes.get("dp_cp") if fsdp_mesh is not None else meshes.get("dp_replicate")
    if dp_mesh is not None:
        apply_ddp(model, dp_mesh, mp, ignored_params=ignored)
        return Parallelized("ddp")
    return Parallelized(None)
