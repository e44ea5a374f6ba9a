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
    dropout mask after the embeddings on the first stage and the output layer (final-norm and
    output-projection inputs, the fp32 log-probabilities) on the last. Under the ``megatron``
    profile the first stage of Table 3's models is Figure 1's sbhL/t (34 + p/L [+ 4/L (1 + v/h)]).
``buffers``
    Working memory, audited against what the frameworks allocate (torch 2.13, FSDP2,
    torch.distributed.pipelining, torchtitan, Megatron-LM), the reason for each term beside it in
    :func:`estimate_memory`. Two kinds. Live through the step: pipeline receive buffers (one per
    micro-batch, activations and gradients), the last stage's kept outputs (torch pipelining keeps
    every micro-batch's logits), FSDP gradients held unsharded in the reduce dtype across
    micro-batches. Live at one moment, of which the bill takes the worse: the loss's backward on
    the last stage (the fp32 gradients of the log-probabilities and logits) or a block's backward
    (the recomputed block, the gradients of its widest tensors and the sequence-parallel gather,
    FSDP's gathered units and their unsharded gradients and reduce-scatter input, DDP buckets,
    MoE dispatch, the context-parallel ring's K/V chunks).
    An FP8 recipe (:mod:`workbench.spec.float8`) adds what it keeps all step to the buffers: TE's
    cached FP8 weights and their transposes, 2 bytes per local Linear parameter, and the amax
    histories; with FSDP float8 all-gather the gathered units hold their Linear weights in FP8.
    TE's saved Linear inputs are FP8 in ``activations`` (:func:`fp8_saved_input_bytes`); torchao's
    are the bf16 run's.
``overhead``
    The CUDA context (``cluster.gpu.context_bytes``) and allocator fragmentation
    (``train.fragmentation``, the framework profile's unless the job sets one, x everything else):
    explicit, never hidden in the others. The bill's peak is thus reserved memory, what
    ``torch.cuda.max_memory_reserved`` reports, plus the context.

Which profile (``train.framework``: bundled, megatron, fsdp or a fitted one,
:mod:`workbench.spec.framework`) changes ``activations`` (SP inputs kept gathered, the CP ring's
fp32 output, a RoPE cache per layer, what selective recomputation keeps) and ``buffers`` (FSDP
units in flight, the loss's working memory, the pipeline's kept outputs) and ``overhead``
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
from workbench.spec.errors import check_choice, check_instance
from workbench.spec.float8 import converted_params
from workbench.spec.framework import SELECTIVE_POLICIES, MemoryConventions
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
    block_unit: float  # TP-local parameters of the stage's largest block (one FSDP unit)
    embedding: float  # TP-local token (and position) embeddings on the first stage, else 0
    head: float  # TP-local output projection on the last stage, else 0

    @property
    def root_unit(self) -> float:
        """The root FSDP unit of this stage (``fully_shard(model)`` after the blocks): what is left
        outside the blocks, the embeddings on the first stage and the output projection on the last."""
        return self.embedding + self.head


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
    dense = experts = block = emb = head = 0.0
    if n_dense:
        d, e = _layer_local_params(model, 0, plan.tp, plan.ep)
        dense, experts, block = n_dense * d, n_dense * e, d + e
    if n_moe:
        d, e = _layer_local_params(model, model.n_layers - 1, plan.tp, plan.ep)
        dense, experts, block = dense + n_moe * d, experts + n_moe * e, max(block, d + e)
    if first:  # token (and position) embeddings, split row-wise by TP
        emb = model.embedding_params / plan.tp
        dense += emb
    if last:  # final norm (replicated) and output projection (split column-wise by TP)
        norm = model.norm_params(model.d_model)
        head = (model.output_params - norm) / plan.tp
        dense += head + norm
    return _StageParams(dense, experts, block, emb, head)


# ---------------------------------------------------------------------------- conventions


# ---------------------------------------------------------------------------- activations
def _mlp_width(model: ModelSpec, moe: bool) -> tuple[float, float]:
    """(tokens routed through the MLP per token, hidden width per routed token): 1 and d_ff for a
    dense MLP; top_k and moe_d_ff for an MoE block."""
    if moe and model.is_moe:
        return model.top_k, model.moe_d_ff
    return 1, model.d_ff


def _op_policy_bytes_per_layer(model: ModelSpec, train: TrainSettings, plan: ParallelPlan) -> float:
    """What torchtitan's per-op selective checkpointing keeps of a dense block, per micro-batch
    (torchtitan ``parallelize_llama.py``: ``_save_list`` and ``_get_custom_policy``, at the
    llama3 benchmarks' commit 9dec370 and since): the block's input (the checkpoint's); the outputs
    of every other ``aten.mm`` of the block, the 1st, 3rd, 5th and 7th in execution order (wq, wv,
    w1, w2 for a SwiGLU block; wq, wv, fc for GELU); SDPA's output and log-sum-exp (flash and
    memory-efficient kernels; eager attention's bmm and softmax are recomputed); under TP + SP the
    outputs of ``reduce_scatter_tensor``. A row-parallel matmul's local output (wo, w2) is the
    whole hidden width (partial sums before the reduction)."""
    e = DTYPE_BYTES[train.compute_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    h = model.d_model
    split = {"column": t, "row": 1, "whole": 1}  # a row-parallel output is whole (partial sums)
    widths = [p.d_out / split[p.split] for p in model.attention_projections()]  # wq wk wv wo; MLA's five
    widths += [model.d_ff / t, model.d_ff / t, h] if model.activation == "swiglu" else [model.d_ff / t, h]
    act = e * sb * h / sp + e * sb * sum(widths[0::2])  # the input; matmuls 1, 3, 5, 7...
    if train.attention == "flash":
        act += e * sb * model.v_dim / t + 4 * sb * model.n_heads / t  # SDPA output, log-sum-exp
    if sp > 1:
        act += 2 * e * sb * h / sp  # the reduce-scatters after wo and w2
    return act


def activation_bytes_per_layer(
    model: ModelSpec,
    train: TrainSettings,
    plan: ParallelPlan,
    moe: bool = False,
    recompute: str | None = None,
    *,
    conventions: MemoryConventions | None = None,
    selective_policy: str = "attention",
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

    ``selective_policy`` says what ``recompute="selective"`` keeps: "attention" is the paper's
    (the attention core, softmax(QK^T)V and its dropout, is recomputed); "op" is torchtitan's
    per-op policy (:func:`_op_policy_bytes_per_layer`: about a third of the paper's for a Llama
    block; MoE blocks, which its policy also covers, are billed as "attention").

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
    if selective_policy not in SELECTIVE_POLICIES:
        raise ValueError(f"selective_policy={selective_policy!r} is not one of {', '.join(SELECTIVE_POLICIES)}")
    e = DTYPE_BYTES[train.compute_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp  # tokens on this rank
    h = model.d_model
    if recompute == "full":
        return e * sb * h / sp  # only the block's input is kept; the rest is recomputed
    if recompute == "selective" and selective_policy == "op" and not (moe and model.is_moe):
        return _op_policy_bytes_per_layer(model, train, plan)  # recomputed: no framework extras kept
    drop = train.dropout
    a = model.n_heads
    # attention block
    act = e * sb * h / sp  # attention-norm input
    act += e * sb * h / sp  # QKV input (norm output)
    act += e * sb * (model.q_dim + model.k_width + model.v_width) / t  # Q, K (for Q K^T) and V
    if model.is_mla:
        act += _latent_bytes(model, e, sb)
    if train.attention == "eager" and recompute != "selective":
        scores = sb * a * train.seq_len / t  # each local query against every key
        attention_drop = drop and (conventions is None or conventions.attention_dropout)
        act += scores * (2 * e + 1 if attention_drop else e)  # softmax output (+ dropout mask and output)
    elif train.attention == "flash" and recompute != "selective":
        act += 4 * sb * a / t  # fp32 log-sum-exp per query and head
    act += e * sb * model.v_dim / t  # output-projection input
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
            act += 4 * sb * model.v_dim / t  # ring attention's fp32 output
        if model.position == "rope" and conventions.rope_cache_per_layer:
            act += 2 * e * (train.seq_len / plan.cp) * model.rope_dim  # cos, sin
    return act


def _latent_bytes(model: ModelSpec, e: int, sb: float) -> float:
    """What latent attention keeps beyond Q, K and V for one micro-batch (whole on every TP rank,
    as the down-projections that make the latents, and on the whole sequence under SP, where they
    are computed from the all-gathered input): the query latent before its norm and after (q_b's
    input), kv_a's output (the key/value latent and the RoPE key: the norm's input is a view that
    keeps it all) and the normed latent (kv_b's input). The expanded K and V are kept as well
    (attention's backward reads them); recomputing the up-projections from the latent instead is
    Megatron's ``--recompute-modules mla_up_proj``, not billed here."""
    q_latent, kv_latent = model.latent_dims
    return e * sb * (2 * q_latent + 2 * kv_latent + model.qk_rope_head_dim)


def fp8_saved_input_bytes(model: ModelSpec, train: TrainSettings, plan: ParallelPlan, moe: bool = False,
                          recompute: str | None = None, selective_policy: str = "attention") -> float:
    """What an FP8 recipe that saves its Linears' inputs in FP8 (Transformer Engine:
    ``saved_inputmat`` is the quantized input) changes in what one block keeps for backward, per
    micro-batch (negative: bytes saved), against :func:`activation_bytes_per_layer`'s accounting.

    The Linears' saved inputs drop from e to ``saved_input_bytes`` per element: the attention and
    MLP inputs (the norm outputs, s b h / sp each), the MLP's down-projection input (SwiGLU's
    product, GELU's output: s b d_ff / t), in an MoE block the dispatched tokens and the experts'
    down-projection inputs where the recipe converts the experts (its norm output still feeds the
    bf16 router, so it stays). The attention output is the output projection's input: with flash
    attention and nothing recomputed the kernel keeps it in bf16 for its own backward and TE keeps
    an FP8 copy besides (+1 byte); otherwise only the projection keeps it, in FP8. Simplified: MLA's
    latents, the inputs of its up-projections, stay in the compute dtype; the shared experts' FP8
    copy of the MLP input is not billed. 0 for torchao recipes (bf16 inputs saved, as their bf16
    runs), for full recomputation (only the block input is kept) and under the per-op policy."""
    fp8 = train.fp8
    recompute = train.recompute if recompute is None else recompute
    if fp8 is None or fp8.saved_input_bytes is None or recompute == "full":
        return 0.0
    if recompute == "selective" and selective_policy == "op" and not (moe and model.is_moe):
        return 0.0
    e = DTYPE_BYTES[train.compute_dtype]
    less = e - fp8.saved_input_bytes
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    h = model.d_model
    delta = -less * sb * h / sp  # attention input (the norm output)
    if train.attention == "flash" and recompute == "none":
        delta += fp8.saved_input_bytes * sb * model.v_dim / t  # TE's FP8 copy beside the kernel's output
    else:
        delta -= less * sb * model.v_dim / t
    if moe and model.is_moe:
        if fp8.converts_experts:
            routed = sb * model.top_k * max(1.0, train.moe_capacity_factor)
            delta -= less * routed * h / sp + less * routed * model.moe_d_ff / t
    else:
        delta -= less * sb * h / sp + less * sb * model.d_ff / t  # MLP input, down-projection input
    return delta


def _vocab_split(plan: ParallelPlan, vocab_parallel: bool) -> int:
    """How many ways the logits are split over the vocabulary on one rank's TP group."""
    return plan.tp if (plan.tp > 1 and (plan.loss_parallel or vocab_parallel)) else 1


def output_activation_bytes(model: ModelSpec, train: TrainSettings, plan: ParallelPlan,
                            conventions: MemoryConventions | None = None, vocab_parallel: bool = False) -> float:
    """Saved by the last stage per micro-batch (Korthikanti section 4.3: 4sbh/t (1 + v/h) with SP and
    a vocabulary-parallel loss): the final-norm input, the output projection's input and the fp32
    log-probabilities of the cross-entropy (torch's log_softmax output, Megatron's softmax), over
    V / t columns under a vocabulary-parallel loss (``loss_parallel``, or ``vocab_parallel``, a
    framework that always shards it), over all V otherwise: torch's ``ColwiseParallel(
    output_layouts=Replicate())`` all-gathers the logits. Under ``sp_inputs_gathered`` the output
    projection, a ``ColwiseParallel(input_layouts=Shard(1))``, keeps its gathered input whole."""
    e = DTYPE_BYTES[train.compute_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    gathered = conventions is not None and conventions.sp_inputs_gathered
    head_input = e * sb * model.d_model / (1 if gathered else sp)
    return e * sb * model.d_model / sp + head_input + 4 * sb * model.vocab_size / _vocab_split(plan, vocab_parallel)


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
def estimate_memory(config: RunConfig, *, selective_policy: str | None = None) -> MemoryBill:
    """The memory bill of every rank of ``config`` (see the module docstring for each term).

    ``selective_policy`` ("attention" or "op", :func:`activation_bytes_per_layer`) overrides what the
    profile's ``recompute="selective"`` keeps: "op" prices torchtitan's per-op checkpointing."""
    check_instance("config", config, RunConfig)
    if selective_policy is not None:
        check_choice("selective_policy", selective_policy, SELECTIVE_POLICIES)
    model, plan, train = config.model, config.plan, config.train
    profile = train.profile
    conventions = profile.memory
    policy = str(selective_policy or conventions.selective_policy)
    vocab_parallel = bool(conventions.vocab_parallel_loss)
    loss_grad_bytes = float(conventions.loss_grad_bytes_per_logit)  # type: ignore[arg-type]
    keeps_outputs = bool(conventions.pipeline_keeps_outputs)
    no_sync_accumulation = bool(conventions.fsdp_no_sync_accumulation)
    pipeline_no_sync = bool(conventions.pipeline_fsdp_no_sync)
    recv_per_microbatch = bool(conventions.pipeline_recv_per_microbatch)
    foreach_optimizer = bool(conventions.foreach_optimizer)
    m = config.n_microbatches
    counts = plan.stage_layer_counts(model.n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    n_stages = len(counts)
    e = DTYPE_BYTES[train.compute_dtype]
    grad_b = DTYPE_BYTES[train.grad_dtype]
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    sb = train.micro_batch_size * train.seq_len / plan.cp
    h = model.d_model
    boundary = e * sb * h / sp  # activation crossing a pipeline boundary
    logits = sb * model.vocab_size / _vocab_split(plan, vocab_parallel)  # per micro-batch on one rank
    zero_d = plan.shard_degree
    zero_e = max(1, plan.shard_degree // plan.ep)
    sharded_grads = zero_d > 1 and plan.zero_stage >= 2  # reduce-scattered per FSDP unit
    sharded_params = zero_d > 1 and plan.zero_stage == 3
    # FSDP2 under set_requires_gradient_sync(False) keeps the gradients unsharded, in the reduce
    # dtype, and reduce-scatters them once after the last micro-batch (MemoryConventions: the pipeline
    # runtime's and the gradient accumulation's no-sync).
    accumulate_unsharded = sharded_grads and ((plan.pp > 1 and pipeline_no_sync) or
                                              (plan.pp == 1 and m > 1 and no_sync_accumulation))

    def layer(moe: bool, recompute: str | None = None) -> float:
        return (activation_bytes_per_layer(model, train, plan, moe=moe, recompute=recompute, conventions=conventions,
                                           selective_policy=policy)
                + fp8_saved_input_bytes(model, train, plan, moe, recompute, policy))

    def backward_working(moe: bool) -> float:
        """Transient bytes of one block's backward (the peak of a stage that is not the loss's)."""
        # Recomputation rebuilds what the block did not keep, for one block at a time.
        rebuilt = layer(moe, "none") - layer(moe) if train.recompute != "none" else 0.0
        # Gradients of the widest tensors: SwiGLU's d(hidden), d(gate), d(up) (GELU's d(hidden),
        # d(pre-activation)), the MLP input's gradient over the whole sequence (before SP's
        # reduce-scatter) and the residual stream's.
        moe_block = moe and model.is_moe
        k, ff = _mlp_width(model, moe_block)
        routed = sb * k * (max(1.0, train.moe_capacity_factor) if moe_block else 1.0)
        grads = (3 if model.activation == "swiglu" else 2) * e * routed * ff / t + e * sb * h * (1 + 1 / sp)
        if moe_block:
            # MoE dispatch: the tokens permuted for the experts before the all-to-all, and the
            # experts' outputs before the combine (the bundled trainer's ExpertParallel, Megatron's
            # token dispatcher); the kept ones are billed in activations.
            grads += 2 * e * routed * h / sp
        if plan.cp > 1:
            # Ring attention: the visiting K/V chunk and the one arriving, and their fp32 dK/dV
            # accumulators travelling the ring in backward (the bundled trainer's ring; TE's too).
            # Latent attention's ring carries latents and re-expands the visiting chunk's K and V.
            grads += (2 * e + 8) * sb * model.ring_kv_values_per_token(t)
            if model.is_mla:
                grads += (e + 4) * sb * (model.k_width + model.v_width) / t
        return rebuilt + grads

    dense_layer_act = layer(False)
    moe_layer_act = layer(True) if model.is_moe else 0.0
    # An FP8 recipe's Linears (workbench.spec.float8): the TP/EP-local parameters they convert per
    # dense and per MoE block, the bytes FSDP gathers of each (FP8 all-gather: the converted
    # weights at 1 byte), and what it keeps all step per block: TE's cached FP8 weight and its
    # transpose, and the fp32 amax history and scales of each FP8 tensor of each GEMM.
    fp8 = train.fp8
    conv_dense = converted_params(model, 0, t, plan.ep, fp8) if fp8 and model.n_dense_layers else 0.0
    conv_moe = converted_params(model, model.n_layers - 1, t, plan.ep, fp8) if fp8 and model.is_moe else 0.0
    gathered_fp8 = fp8 is not None and fp8.fsdp_fp8_all_gather and sharded_params
    fp8_state = 0.0
    if fp8 is not None:
        gemms_per_block = len(model.attention_gemms(t)) + 2  # attention's GEMMs, MLP up (+ gate) and down
        fp8_state = gemms_per_block * fp8.amax_state_bytes_per_gemm()
    stride = config.world_size // plan.pp
    context = config.cluster.gpu.context_bytes
    out = []
    # Stages of equal shape (same layer count and kind, not first/last) hold the same weights:
    # compute each shape once (the advisor calls this for thousands of plans of up to 64 stages).
    shapes: dict[tuple, tuple[_StageParams, dict[str, float], float, int, float]] = {}

    def stage_shape(stage: int) -> tuple[_StageParams, dict[str, float], float, int, float]:
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
            if first and train.dropout:
                per_mb += sb * h / sp  # the dropout mask after the embeddings (Korthikanti 4.3: sbhp/t)
            if last:
                per_mb += output_activation_bytes(model, train, plan, conventions, vocab_parallel)
            working = max(backward_working(False) if counts[stage] > n_moe else 0.0,
                          backward_working(True) if n_moe else 0.0)
            shapes[key] = (sp_, states, per_mb, n_moe, working)
        return shapes[key]

    for r in range(plan.pp):
        stages = plan.stages_of_rank(r)
        in_flight = in_flight_microbatches(plan, m, r)
        comps = dict.fromkeys(COMPONENTS, 0.0)
        block_unit = root_unit = head = 0.0
        act = 0.0
        working = 0.0  # the worst block backward of the stages held
        recv = 0.0  # pipeline receive buffers, live through the whole step
        held_to_step = 0.0  # live through forward and backward, freed before the optimizer step
        loss = 0.0  # the loss's backward, on the rank holding the last stage
        first_and_last = 0 in stages and n_stages - 1 in stages
        fp8_kept = 0.0  # the FP8 recipe's per-step state (TE's weight cache, amax histories)
        unit_fp8 = 0.0  # of the largest block, the parameters FSDP gathers in FP8
        for stage, held in zip(stages, in_flight):
            first, last = stage == 0, stage == n_stages - 1
            sp_, states, per_mb, n_moe, stage_working = stage_shape(stage)
            if fp8 is not None:
                n_dense_here = counts[stage] - n_moe
                # the weight cache holds whole (TP/EP-local) weights across micro-batches: with the
                # weights ZeRO-3 sharded, each unit's FP8 copy is made per gather and freed with it
                # (a simplification: not billed then)
                cache = 0.0 if sharded_params else fp8.weight_cache_bytes
                fp8_kept += cache * (n_dense_here * conv_dense + n_moe * conv_moe) + counts[stage] * fp8_state
                if gathered_fp8:
                    unit_fp8 = max(unit_fp8, conv_dense if n_dense_here else 0.0, conv_moe if n_moe else 0.0)
            block_unit = max(block_unit, sp_.block_unit)
            root_unit += sp_.root_unit
            head += sp_.head
            for name, val in states.items():
                comps[name] += val
            act += held * per_mb
            working = max(working, stage_working)
            if plan.pp > 1 and recv_per_microbatch:
                # torch.distributed.pipelining: a receive buffer per micro-batch, kept: activations
                # on every stage but the first (those of the micro-batches in flight are their
                # first block's input, billed in activations), gradients on every stage but the last
                recv += boundary * ((0 if first else m - held) + (0 if last else m))
            elif plan.pp > 1:
                recv += boundary * (0 if last else 1)  # the gradient being received (Megatron)
            if accumulate_unsharded:
                # every unit's gradients, unsharded, until the last micro-batch; the sharded ones
                # of the model states exist only after it (zero_grad(set_to_none=True))
                held_to_step += grad_b * sp_.dense * (1 - 1 / zero_d)
            if last:
                # The loss's backward: the fp32 gradients of the log-probabilities and of the logits
                # (torch: F.cross_entropy on logits.float(); Megatron: in place, cast to bf16).
                loss = loss_grad_bytes * logits
                if plan.pp > 1 and keeps_outputs:
                    held_to_step += m * e * logits  # every micro-batch's logits, kept until step() returns
        # FSDP (FSDP2 fully_shard per block, then the root) during a block's backward.
        fsdp = 0.0
        if sharded_params:
            # the unit computing and the one prefetched, unsharded in the compute dtype (FSDP2's
            # forward and backward prefetch of 1); the root unit (embeddings, output projection),
            # gathered for the output projection's backward and held until its embeddings' gradient,
            # the last of the backward, is reduce-scattered
            # (an FP8 all-gather delivers the converted Linear weights in FP8: 1 byte, not e)
            unit = e * block_unit - (e - 1) * unit_fp8
            fsdp += conventions.fsdp_units_in_flight * unit + e * root_unit
        if sharded_grads:
            fsdp += e * block_unit  # the unit's gradients from autograd, in its unsharded params' dtype
            if not accumulate_unsharded:
                # FSDP2 copies them into a reduce-scatter input in the reduce dtype and keeps one
                # such input in flight (reduce_scatter_max_input_buffers = 1)
                fsdp += grad_b * block_unit
                if first_and_last:
                    fsdp += e * head  # the output projection's gradient waits for the embeddings'
        elif plan.dp * plan.cp > 1:
            # replicated gradients: FSDP2's replicate (the bundled trainer) copies one unit's
            # gradients into an all-reduce buffer in the reduce dtype; torch DDP and Megatron
            # reduce buckets (25 MiB: the one reducing and the one filling)
            fsdp += max(2 * DDP_BUCKET_BYTES, grad_b * block_unit)
        loss_moment = loss + (e * root_unit if sharded_params else 0.0)  # the root unit is still gathered
        # The optimizer step, after the activations are freed: foreach Adam's sqrt(v) temporary,
        # one element per element of the optimizer's (sharded) parameters, in the optimizer dtype.
        step = (comps["optimizer"] / train.optimizer_states
                if foreach_optimizer and train.optimizer in ("adam", "adamw") else 0.0)
        comps["activations"] = act
        comps["buffers"] = recv + fp8_kept + max(held_to_step + max(loss_moment, working + fsdp), step - act)
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
