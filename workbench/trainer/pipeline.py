"""Pipeline parallelism with ``torch.distributed.pipelining``: stage modules and schedules.

Stages: ``plan.stage_layer_counts(n_layers)`` layers each, in order; the first stage also holds
the token embeddings, the last the final norm, the output projection and the loss. A pipeline rank
holds the stages ``plan.stages_of_rank(pp_rank)``: one (GPipe, 1F1B), a loop r, r+p, ...
(interleaved, looped BFS, zero bubble) or a V r, 2p-1-r (ZBV, DualPipeV).

Each stage module is a copy of the meta model with the other layers deleted (``layers`` is a
ModuleDict keyed by the global layer index, so parameter names, and hence initial values, are the
same as in the unsplit model).

Tied embeddings (``tie_embeddings``) across stages, as Megatron's embedding group does it: the
first stage holds the embedding table, the last the output projection, two parameters initialised
equal (``init_value`` gives ``output.weight`` the table's values). After backward,
:func:`sum_tied_grads` sums their gradients between the two ranks that hold them (the pipeline's
first and last rank with the same other coordinates; one rank with both under a V schedule), so
both take the tied parameter's gradient and the optimizer keeps them equal; the gradient norm
counts it once (:func:`tied_copies`).

Loss: the schedule calls ``loss_fn`` per micro-batch and backpropagates it. We return the
micro-batch mean cross-entropy divided by the number of micro-batches and turn the schedule's own
scaling off, so the sum of the micro-batch losses is the mean loss of the local batch, exactly the
objective of the non-pipelined run with gradient accumulation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from workbench.spec.plan import ParallelPlan
from workbench.spec.schedules import SCHEDULES, SINGLE_STAGE_SCHEDULES
from workbench.trainer.transformer import Transformer

SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved-1f1b": S.ScheduleInterleaved1F1B,
    "looped-bfs": S.ScheduleLoopedBFS,
    "zero-bubble": S.ScheduleInterleavedZeroBubble,
    "zbv": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}
# The names are the planner's (workbench.spec.schedules); this table only binds them to torch.
assert tuple(SCHEDULE_CLASSES) == SCHEDULES, "every planned schedule needs its torch class"


def stage_layers(plan: ParallelPlan, n_layers: int) -> list[list[int]]:
    """Global layer indices of every stage, in stage order."""
    out, start = [], 0
    for count in plan.stage_layer_counts(n_layers):
        out.append(list(range(start, start + count)))
        start += count
    return out


def split_stage(model: Transformer, stage: int, n_stages: int, layer_ids: list[int]) -> Transformer:
    """A copy of ``model`` (on meta: free) that keeps only what stage ``stage`` computes."""
    module = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in list(module.layers.keys()):
        if name not in keep:
            del module.layers[name]
    if stage != 0:
        module.tok_embeddings = None
        module.pos_embeddings = None
    if stage != n_stages - 1:
        module.norm = None
        module.output = None
    return module


def build_stages(
    model: Transformer,
    plan: ParallelPlan,
    pp_rank: int,
    pp_group,
    device: torch.device,
    prepare: Callable[[Transformer], Transformer],
) -> tuple[list[PipelineStage], list[Transformer]]:
    """This rank's stages. ``prepare`` parallelises and materialises one stage module."""
    layers = stage_layers(plan, model.spec.n_layers)
    n_stages = plan.n_stages
    stages, modules = [], []
    for s in plan.stages_of_rank(pp_rank):
        module = prepare(split_stage(model, s, n_stages, layers[s]))
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, device, group=pp_group))
    return stages, modules


@dataclass
class PipelineSchedule:
    """A torch schedule and the stages of this rank it runs (the instrument times each of them)."""

    schedule: Any  # a torch.distributed.pipelining schedule: PipelineScheduleSingle or PipelineScheduleMulti
    stages: list[PipelineStage]


def build_schedule(plan: ParallelPlan, stages: list[PipelineStage], n_microbatches: int,
                   loss_fn: Callable) -> PipelineSchedule:
    """The schedule object ``plan.pp_schedule`` names, with our own loss scaling (see module doc)."""
    cls = SCHEDULE_CLASSES[plan.pp_schedule]
    if plan.pp_schedule in SINGLE_STAGE_SCHEDULES:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return PipelineSchedule(schedule, list(stages))


def holds_first(plan: ParallelPlan, pp_rank: int) -> bool:
    return 0 in plan.stages_of_rank(pp_rank)


def holds_last(plan: ParallelPlan, pp_rank: int) -> bool:
    return plan.n_stages - 1 in plan.stages_of_rank(pp_rank)


def stage_modules_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


# --------------------------------------------------------------------------- tied embeddings


def tied_rank_pairs(plan: ParallelPlan) -> list[list[int]]:
    """Global ranks that hold the tied embedding (first stage) and the output projection (last
    stage), one pair per combination of the other coordinates; empty when one pipeline rank holds
    both stages (a V schedule) or pp = 1."""
    first = next(r for r in range(plan.pp) if 0 in plan.stages_of_rank(r))
    last = next(r for r in range(plan.pp) if plan.n_stages - 1 in plan.stages_of_rank(r))
    if first == last:
        return []
    pairs = []
    for rank in range(plan.world_size):
        coords = plan.rank_coords(rank)
        if coords["pp"] == first:
            pairs.append([rank, plan.coords_rank({**coords, "pp": last})])
    return pairs


def tied_embedding_group(plan: ParallelPlan, tie_embeddings: bool) -> dist.ProcessGroup | None:
    """This rank's embedding group (every rank takes part in creating every pair's group)."""
    pairs = tied_rank_pairs(plan) if tie_embeddings and plan.pp > 1 else []
    if not pairs:
        return None
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _tied_pair(modules: list[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(embedding tables, output projections) among this rank's stage modules of a tied model."""
    if not modules or not modules[0].spec.tie_embeddings:  # type: ignore[union-attr]
        return [], []
    embeddings = [m.tok_embeddings.weight for m in modules if m.tok_embeddings is not None and m.output is None]
    outputs = [m.output.weight for m in modules if m.output is not None and m.tok_embeddings is None]
    return embeddings, outputs


def tied_copies(modules: list[nn.Module]) -> set[int]:
    """ids of the parameters that copy another (a stage's output projection tied to the first
    stage's table): the gradient norm counts the pair once."""
    return {id(p) for p in _tied_pair(modules)[1]}


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


@torch.no_grad()
def sum_tied_grads(modules: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Give the tied table and output projection the sum of their gradients (call after backward,
    with every gradient in its parameter's placements: both are split alike over TP and FSDP, so
    their local shards match element for element)."""
    embeddings, outputs = _tied_pair(modules)
    if embeddings and outputs:  # one rank holds both stages
        total = _local_grad(embeddings[0]) + _local_grad(outputs[0])
        _local_grad(embeddings[0]).copy_(total)
        _local_grad(outputs[0]).copy_(total)
    elif (embeddings or outputs) and group is not None:
        dist.all_reduce(_local_grad((embeddings or outputs)[0]), group=group)
