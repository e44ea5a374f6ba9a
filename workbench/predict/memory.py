"""The memory bill: bytes per GPU, per component, for every rank of a RunConfig.

``estimate_memory(config) -> MemoryBill``. Components, in bytes:

``parameters, gradients, optimizer, master_weights``
    Model states (Rajbhandari et al. 2020, "ZeRO", section 3): each rank holds its tensor- and
    pipeline-parallel slice of the weights (experts also split by expert parallelism); ZeRO
    stage z shards, over the ``dp_shard x cp`` group, the optimizer states and master weights
    (z >= 1), the gradients (z >= 2) and the parameters (z = 3). With mixed-precision Adam in
    the ZeRO paper's recipe (``bf16-zero``: 2 + 2 + K bytes with K = 12) a 7.5B model on 64
    data-parallel ranks needs 120 GB, 31.4 GB, 16.6 GB and 1.9 GB for z = 0..3 (Figure 1).
``activations``
    Tensors saved for backward, per layer (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", section 4), times the layers of each stage,
    times the micro-batches that stage holds in flight under the pipeline schedule, plus the
    fp32 log-probabilities of the output layer on the last stage and the MoE dispatch buffers.
``buffers``
    Communication and working buffers: FSDP's unsharded layers in flight (the current one and
    the prefetched next), unsharded gradients before their reduce-scatter, DDP buckets,
    pipeline receive buffers, the sequence-parallel all-gather buffer, the gradient of the logits.
``overhead``
    The CUDA context (``cluster.gpu.context_bytes``) and allocator fragmentation
    (``train.fragmentation``, the framework profile's unless the job sets one, x everything else):
    explicit, never hidden in the others.

Which profile (``train.framework``: bundled, megatron, fsdp or a fitted one,
:mod:`workbench.spec.framework`) changes ``activations`` (SP inputs kept gathered, the CP ring's
fp32 output, a RoPE cache per layer) and ``buffers`` (FSDP units in flight) and ``overhead``
(fragmentation); the model states are the plan's (ZeRO stage, degrees) under every profile.

Ranks differ: the first pipeline stage holds the most micro-batches in flight, the last holds the
output layer and the logits. The bill is computed per pipeline rank (all ranks of one stage hold
the same) and expanded per global rank on demand.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

from workbench.spec.config import DTYPE_BYTES, RunConfig, TrainSettings
from workbench.spec.framework import MemoryConventions
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.predict.pipeline import in_flight_at_peak

COMPONENTS = ("parameters", "gradients", "optimizer", "master_weights", "activations", "buffers", "overhead")
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Fit:
    """Whether a bill fits in a GPU's memory, and by how much."""

    fits: bool
    peak_bytes: int
    hbm_bytes: int

    @property
    def headroom_bytes(self) -> int:
        """Free bytes on the most loaded rank (negative: over by that much)."""
        return self.hbm_bytes - self.peak_bytes

    @property
    def headroom_fraction(self) -> float:
        return self.headroom_bytes / self.hbm_bytes

    def __bool__(self) -> bool:
        return self.fits


@dataclass(frozen=True)
class RankMemory:
    """The bill of one rank."""

    rank: int
    pp_rank: int
    stages: tuple[int, ...]
    components: dict[str, int]
    in_flight: tuple[int, ...]  # micro-batches in flight per stage held

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class MemoryBill:
    """Bytes per rank and component. ``components`` are the most loaded rank's."""

    per_stage: tuple[RankMemory, ...]  # one representative rank per pipeline rank
    world_size: int
    hbm_bytes: int
    plan: ParallelPlan

    @cached_property
    def _worst(self) -> RankMemory:
        return max(self.per_stage, key=lambda r: r.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self._worst.total_bytes

    @property
    def components(self) -> dict[str, int]:
        return dict(self._worst.components)

    @property
    def most_loaded_rank(self) -> int:
        return self._worst.rank

    @property
    def per_rank(self) -> list[RankMemory]:
        """Every global rank's bill (ranks of one pipeline stage hold the same)."""
        stride = self.world_size // self.plan.pp
        out = []
        for rank in range(self.world_size):
            r = self.per_stage[rank // stride]
            out.append(RankMemory(rank, r.pp_rank, r.stages, r.components, r.in_flight))
        return out

    def fits(self, hbm_bytes: int | None = None) -> Fit:
        hbm = self.hbm_bytes if hbm_bytes is None else hbm_bytes
        return Fit(self.peak_bytes <= hbm, self.peak_bytes, hbm)

    def to_dict(self) -> dict:
        fit = self.fits()
        return {
            "peak_bytes": self.peak_bytes,
            "most_loaded_rank": self.most_loaded_rank,
            "components": self.components,
            "hbm_bytes": self.hbm_bytes,
            "fits": fit.fits,
            "headroom_bytes": fit.headroom_bytes,
            "per_stage": [
                {"pp_rank": r.pp_rank, "rank": r.rank, "stages": list(r.stages), "in_flight": list(r.in_flight),
                 "components": r.components, "total_bytes": r.total_bytes}
                for r in self.per_stage
            ],
        }


# ---------------------------------------------------------------------------- model states
def model_state_bytes(
    n_params: float, train: TrainSettings, zero_stage: int, shard_degree: int
) -> dict[str, float]:
    """Bytes of parameters, gradients, optimizer states and master weights for ``n_params``
    parameters replicated over a ZeRO group of ``shard_degree`` ranks (ZeRO paper, section 5.1).

    z >= 1 shards optimizer states and master weights, z >= 2 gradients, z = 3 parameters.
    """
    def shard(stage: int) -> float:
        return shard_degree if zero_stage >= stage else 1

    master = DTYPE_BYTES[train.master_dtype] if train.master_dtype else 0
    return {
        "parameters": n_params * DTYPE_BYTES[train.param_dtype] / shard(3),
        "gradients": n_params * DTYPE_BYTES[train.grad_dtype] / shard(2),
        "optimizer": n_params * train.optimizer_states * DTYPE_BYTES[train.optim_dtype] / shard(1),
        "master_weights": n_params * master / shard(1),
    }


@dataclass(frozen=True)
class _StageParams:
    dense: float  # TP-local parameters of the stage that ZeRO shards over dp_shard x cp
    experts: float  # TP- and EP-local routed-expert parameters (ZeRO shards over dp_shard x cp / ep)
    largest_unit: float  # TP-local parameters of the largest FSDP unit (a block, or embedding/output)


@functools.lru_cache(maxsize=4096)
def _layer_local_params(model: ModelSpec, index: int, tp: int, ep: int) -> tuple[float, float]:
    """(non-expert, expert) parameters of block ``index`` on one TP/EP rank."""
    p = model.layer_params(index)
    # Megatron's default expert tensor parallelism: experts are split by tp too.
    return p.attention / tp + p.mlp / tp + p.replicated, p.experts / (ep * tp)


def _moe_layers_in(model: ModelSpec, first_layer: int, n_layers: int) -> int:
    """How many of layers [first_layer, first_layer + n_layers) are MoE blocks."""
    if not model.is_moe:
        return 0
    return max(0, first_layer + n_layers - max(first_layer, model.first_k_dense_layers))


def _stage_params(model: ModelSpec, plan: ParallelPlan, first_layer: int, n_layers: int, first: bool, last: bool) -> _StageParams:
    # Blocks come in two kinds (dense, MoE), so a stage is counted in O(1), not per layer.
    n_moe = _moe_layers_in(model, first_layer, n_layers)
    n_dense = n_layers - n_moe
    dense = experts = largest = 0.0
    if n_dense:
        d, e = _layer_local_params(model, 0, plan.tp, plan.ep)
        dense, experts, largest = n_dense * d, n_dense * e, d + e
    if n_moe:
        d, e = _layer_local_params(model, model.n_layers - 1, plan.tp, plan.ep)
        dense, experts, largest = dense + n_moe * d, experts + n_moe * e, max(largest, d + e)
    if first:  # token (and position) embeddings, split row-wise by TP
        emb = model.embedding_params / plan.tp
        dense += emb
        largest = max(largest, emb)
    if last:  # final norm (replicated) and output projection (split column-wise by TP)
        norm = model.norm_params(model.d_model)
        head = (model.output_params - norm) / plan.tp
        dense += head + norm
        largest = max(largest, head)
    return _StageParams(dense, experts, largest)


# ---------------------------------------------------------------------------- activations
def activation_bytes_per_layer(
    model: ModelSpec,
    train: TrainSettings,
    plan: ParallelPlan,
    moe: bool = False,
    recompute: str | None = None,
    *,
    conventions: MemoryConventions | None = None,
) -> float:
    """Bytes one block saves for backward, for one micro-batch on one rank.

    Following Korthikanti et al. 2022 (section 4.1), with s = seq_len / cp tokens per sequence
    on this rank, b = micro_batch_size, h = d_model, a = n_heads, t = tp, e = bytes of the compute
    dtype (2 in the paper), masks 1 byte, and SP = sequence parallel:

    attention: norm input e*sbh, QKV input e*sbh, Q and K e*sb(q_dim + kv_dim), V e*sb*kv_dim,
    scores (eager only) e*as^2b for the softmax output plus, with dropout, 1*as^2b mask and
    e*as^2b dropout output (flash: the fp32 log-sum-exp 4*asb instead), output-projection input
    e*sb*q_dim, dropout mask 1*sbh. MLP: norm input e*sbh, input e*sbh, GELU input and output
    2e*sb*d_ff (SwiGLU: gate, silu(gate), up and their product, 4e*sb*d_ff), dropout mask 1*sbh.
    TP divides what is inside the block (Q, K, V, scores, hidden); without SP the norm inputs,
    the QKV/MLP inputs and dropout masks stay whole; with SP everything is divided by t.

    For a GELU model with d_ff = 4h, eager attention, dropout and e = 2 this is the paper's
    sbh(34 + 5as/h) (no parallelism), sbh(10 + 24/t + 5as/(ht)) (TP), (sbh/t)(34 + 5as/h)
    (TP + SP), 34sbh/t (TP + SP + selective recompute) and 2sbh (full recompute).

    MoE blocks replace the MLP by: router probabilities 4*sbE (fp32), the dispatched tokens
    e*sb*k*h (top_k copies of every token; x capacity_factor when tokens can be dropped), the
    experts' hidden activations as for the MLP on s*b*k tokens, the experts' outputs e*sb*k*h
    (kept for the gate-weighted combine), and the shared experts' hidden activations.
    Norm statistics (a few floats per token) are neglected, as in the paper.

    ``conventions`` (a framework profile's :class:`~workbench.spec.framework.MemoryConventions`;
    None: the paper's accounting, which the ``megatron`` profile keeps) adds what a framework keeps
    beyond it. The ``bundled`` profile's, as the bundled trainer's saved-tensor hooks measure them
    (workbench/trainer/memory_meter.py): under sequence parallelism torch's ``PrepareModuleInput``
    + ``ColwiseParallel`` keep the all-gathered, full-sequence input of the QKV and MLP linears
    (Megatron keeps its 1/t shard and all-gathers again in backward, Korthikanti section 4.2.2);
    the context-parallel ring keeps its fp32 output besides the output projection's input; RoPE's
    cos and sin (2 s hd e per layer, not per sequence). :func:`estimate_memory` bills the job's
    profile (``train.framework``).
    """
    recompute = train.recompute if recompute is None else recompute
    e = DTYPE_BYTES[train.compute_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp  # tokens on this rank
    h = model.d_model
    if recompute == "full":
        return e * sb * h / sp  # only the block's input is kept; the rest is recomputed
    drop = train.dropout
    a = model.n_heads
    # attention block
    act = e * sb * h / sp  # attention-norm input
    act += e * sb * h / sp  # QKV input (norm output)
    act += e * sb * (model.q_dim + 2 * model.kv_dim) / t  # Q, K (for Q K^T) and V
    if train.attention == "eager" and recompute != "selective":
        scores = sb * a * train.seq_len / t  # each local query against every key
        act += scores * (2 * e + 1 if drop else e)  # softmax output (+ dropout mask and output)
    elif train.attention == "flash" and recompute != "selective":
        act += 4 * sb * a / t  # fp32 log-sum-exp per query and head
    act += e * sb * model.q_dim / t  # output-projection input
    if drop:
        act += sb * h / sp  # dropout mask after the attention block
    # MLP block
    act += e * sb * h / sp  # MLP-norm input
    act += e * sb * h / sp  # MLP input (norm output)
    per_hidden = 4 if model.activation == "swiglu" else 2  # saved tensors of width d_ff per token
    if moe and model.is_moe:
        k = model.top_k
        routed = sb * k * max(1.0, train.moe_capacity_factor)
        act += 4 * sb * model.n_experts / sp  # router probabilities (fp32)
        act += e * routed * h / sp  # dispatched tokens: the experts' input
        act += per_hidden * e * routed * model.moe_d_ff / t  # experts' hidden activations
        act += e * routed * h / sp  # experts' outputs, kept for the weighted combine
        if model.n_shared_experts:
            act += per_hidden * e * sb * model.n_shared_experts * (model.shared_d_ff or model.moe_d_ff) / t
    else:
        act += per_hidden * e * sb * model.d_ff / t
    if drop:
        act += sb * h / sp  # dropout mask after the MLP
    if conventions is not None:
        if sp > 1 and conventions.sp_inputs_gathered:
            act += 2 * e * sb * h * (1 - 1 / sp)  # QKV and MLP inputs kept all-gathered (whole, not / t)
        if plan.cp > 1 and recompute != "selective" and conventions.cp_fp32_output:
            act += 4 * sb * model.q_dim / t  # ring attention's fp32 output
        if model.position == "rope" and conventions.rope_cache_per_layer:
            act += 2 * e * (train.seq_len / plan.cp) * model.head_dim  # cos, sin
    return act


def output_activation_bytes(model: ModelSpec, train: TrainSettings, plan: ParallelPlan) -> float:
    """Saved by the last stage per micro-batch: final-norm input, output-projection input and the
    fp32 log-probabilities of the cross-entropy (V columns, split by TP under loss parallel)."""
    e = DTYPE_BYTES[train.compute_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    vocab = model.vocab_size / (t if plan.loss_parallel else 1)
    return 2 * e * sb * model.d_model / sp + 4 * sb * vocab


def in_flight_microbatches(plan: ParallelPlan, n_microbatches: int, pp_rank: int) -> tuple[int, ...]:
    """Micro-batches whose activations a pipeline rank holds at its peak, per stage it holds
    (stages ascending, as :meth:`ParallelPlan.stages_of_rank`).

    Read off the schedule's own action order (:func:`workbench.predict.pipeline.in_flight_at_peak`, the
    order torch.distributed.pipelining runs): GPipe holds all m; 1F1B (PipeDream-Flush) p - r on
    rank r; interleaved 1F1B Megatron's (p - r - 1) * 2 + (v - 1) * p + 1 stage-micro-batches on
    rank r; ZBV 2p on every rank.
    """
    if plan.pp == 1:
        return (1,)
    if plan.pp_schedule in ("gpipe", "looped-bfs"):  # every forward before any backward
        return (n_microbatches,) * plan.virtual_stages
    # The other schedules bound what is in flight by the warm-up, which depends on p and v, not m:
    # past 4p micro-batches (a multiple of p, valid for every schedule) the peak no longer grows.
    m = min(n_microbatches, 4 * plan.pp)
    return in_flight_at_peak(plan.pp_schedule, plan.pp, m, plan.virtual_stages)[pp_rank]


# ---------------------------------------------------------------------------- the bill
def estimate_memory(config: RunConfig) -> MemoryBill:
    """The memory bill of every rank of ``config`` (see the module docstring for each term)."""
    model, plan, train = config.model, config.plan, config.train
    m = config.n_microbatches
    counts = plan.stage_layer_counts(model.n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    n_stages = len(counts)
    e = DTYPE_BYTES[train.compute_dtype]
    grad_b = DTYPE_BYTES[train.grad_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    boundary = e * sb * model.d_model / sp  # activation crossing a pipeline boundary
    zero_d = plan.shard_degree
    zero_e = max(1, plan.shard_degree // plan.ep)
    conventions = train.profile.memory
    dense_layer_act = activation_bytes_per_layer(model, train, plan, moe=False, conventions=conventions)
    moe_layer_act = (activation_bytes_per_layer(model, train, plan, moe=True, conventions=conventions)
                     if model.is_moe else 0.0)
    stride = config.world_size // plan.pp
    context = config.cluster.gpu.context_bytes
    out = []
    # Stages of equal shape (same layer count and kind, not first/last) hold the same weights:
    # compute each shape once (the advisor calls this for thousands of plans of up to 64 stages).
    shapes: dict[tuple, tuple[_StageParams, dict[str, float], float, int]] = {}

    def stage_shape(stage: int) -> tuple[_StageParams, dict[str, float], float, int]:
        first, last = stage == 0, stage == n_stages - 1
        n_moe = _moe_layers_in(model, starts[stage], counts[stage])
        key = (counts[stage], n_moe, first, last)
        if key not in shapes:
            sp_ = _stage_params(model, plan, starts[stage], counts[stage], first, last)
            states = model_state_bytes(sp_.dense, train, plan.zero_stage, zero_d)
            if sp_.experts:
                for name, val in model_state_bytes(sp_.experts, train, plan.zero_stage, zero_e).items():
                    states[name] += val
            per_mb = (counts[stage] - n_moe) * dense_layer_act + n_moe * moe_layer_act
            if last:
                per_mb += output_activation_bytes(model, train, plan)
            shapes[key] = (sp_, states, per_mb, n_moe)
        return shapes[key]

    for r in range(plan.pp):
        stages = plan.stages_of_rank(r)
        in_flight = in_flight_microbatches(plan, m, r)
        comps = dict.fromkeys(COMPONENTS, 0.0)
        largest_unit = 0.0
        act = 0.0
        working_layer = 0.0
        pp_buffers = 0.0
        for stage, held in zip(stages, in_flight):
            first, last = stage == 0, stage == n_stages - 1
            sp_, states, per_mb, n_moe = stage_shape(stage)
            largest_unit = max(largest_unit, sp_.largest_unit)
            for name, val in states.items():
                comps[name] += val
            act += held * per_mb
            if train.recompute == "full":
                # backward recomputes one block at a time: its full activations are live once
                full_layer = activation_bytes_per_layer(model, train, plan, moe=n_moe > 0, recompute="none",
                                                        conventions=conventions)
                working_layer = max(working_layer, full_layer)
            # torch.distributed.pipelining's PipelineStage allocates a receive buffer per
            # micro-batch: activations on every stage but the first, gradients on all but the last.
            if plan.pp > 1:
                pp_buffers += m * boundary * ((0 if first else 1) + (0 if last else 1))
        comps["activations"] = act + working_layer
        buffers = pp_buffers
        if zero_d > 1 and plan.zero_stage == 3:
            # FSDP: the unit being computed and those prefetched, unsharded in compute dtype
            buffers += conventions.fsdp_units_in_flight * largest_unit * e
        if zero_d > 1 and plan.zero_stage >= 2:
            # unsharded gradients of a unit before (and while) they are reduce-scattered
            buffers += 2 * largest_unit * grad_b
        elif plan.dp > 1 or plan.cp > 1:
            buffers += 2 * DDP_BUCKET_BYTES  # DDP: the bucket being reduced and the one filling
        if sp > 1:
            buffers += e * sb * model.d_model  # sequence-parallel all-gather output (one at a time)
        if n_stages - 1 in stages:
            # gradient of the logits (fp32) at the start of backward
            buffers += 4 * sb * model.vocab_size / (t if plan.loss_parallel else 1)
        comps["buffers"] = buffers
        allocated = sum(comps.values())
        comps["overhead"] = context + train.fragmentation * allocated
        out.append(
            RankMemory(
                rank=r * stride,
                pp_rank=r,
                stages=stages,
                components={k: int(round(v)) for k, v in comps.items()},
                in_flight=in_flight,
            )
        )
    return MemoryBill(tuple(out), config.world_size, config.cluster.gpu.hbm_bytes, plan)
