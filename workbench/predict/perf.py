"""Step time, throughput and MFU: ``predict_step(config) -> StepPrediction``.

The model is physical, not fitted per row. One micro-batch on one pipeline stage costs

* matmuls: 2 x tokens x (active matmul parameters / tp) FLOPs forward, twice that backward, at
  ``peak x efficiency.matmul`` (a large bf16 GEMM reaches ~70-75% of an H100's dense peak);
  latent attention's down-projections are whole on every TP rank (:meth:`ModelSpec.attention_gemms`);
* attention scores and values: 2 x tokens x context x (q_dim + v_dim) / tp FLOPs forward (4 x
  tokens x context x q_dim where values are as wide as keys; a causal flash
  kernel skips the masked half, so context = seq_len / 2; eager attention computes all of it),
  2.5x that backward (FlashAttention-2's backward runs five matmuls to the forward's two), at
  ``peak x efficiency.attention``;
* element-wise work (norms, activations, residual adds, dropout, RoPE, the cross-entropy): bytes
  moved through HBM at ``hbm_bandwidth x efficiency.memory``; forward ``(k_h d_model / sp +
  k_ff hidden / tp) x e`` per token and layer, backward twice that.

Recomputation adds the recomputed forward to the backward (selective: the attention core; full:
the whole block). Communication comes from :mod:`workbench.predict.comms`: exposed TP/SP, CP and EP
collectives lengthen each stage's forward and backward; pipeline sends are the schedule's p2p
time; FSDP and data-parallel collectives overlap compute and are exposed only where they outlast
the compute they hide behind (plus the first all-gather and last reduce-scatter of a step, which
nothing hides). The stages' forward/backward times go through :func:`workbench.predict.pipeline.simulate_schedule`,
whose makespan includes the bubble. Then the optimizer step (memory bound) ends the step.

MFU follows PaLM (Chowdhery et al. 2022, appendix B): model FLOPs per token ``6 N + 12 L h s``
(:meth:`ModelSpec.flops_per_token`, full attention matrix counted) x tokens per step, divided by
step time x GPUs x dense bf16 peak. Recomputation is not model FLOPs.

An FP8 recipe (``train.fp8_recipe``, :mod:`workbench.spec.float8`) runs the Linears it converts
(forward and both backward GEMMs) at the FP8 peak x ``efficiency.matmul`` x the recipe's kernel
factor, and adds its casts to the element-wise traffic (:func:`_fp8_cast_bytes`): input and weight
in forward, output gradient (and the weight again) in backward. The attention core, the output head
and the router stay at the bf16 rate. MFU stays against the bf16 peak; ``mfu_fp8_peak`` is the same
step against the FP8 peak.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from workbench.predict.comms import step_collectives
from workbench.spec.config import DTYPE_BYTES, RunConfig
from workbench.spec.errors import check_instance
from workbench.spec.framework import Efficiency, FrameworkProfile
from workbench.predict.memory import MemoryBill, estimate_memory
from workbench.predict.pipeline import simulate_schedule

# Dims whose collectives sit inside a stage's forward/backward, per micro-batch.
_IN_STAGE_DIMS = ("tp", "cp", "ep")


DEFAULT_EFFICIENCY = Efficiency()  # the bundled profile's; a job's own comes from train.framework


@dataclass(frozen=True)
class StepPrediction:
    """One training step, predicted. ``breakdown`` adds up to ``step_time_s``."""

    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    model_flops_per_s_per_gpu: float  # achieved "model" FLOP/s by the MFU convention
    bubble_fraction: float  # share of the step the pipeline's busiest rank sits idle
    breakdown: dict[str, float] = field(default_factory=dict)
    stage_times_s: tuple[tuple[float, float], ...] = ()  # (forward, backward) per stage per micro-batch
    critical_pp_rank: int = 0
    # MFU against the dense FP8 peak, beside ``mfu`` (against bf16's) when an FP8 recipe runs the
    # Linears on FP8 tensor cores (None: no FP8 recipe; mfu(config, t, peak="fp8") gives it for any job)
    mfu_fp8_peak: float | None = None

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "mfu_fp8_peak": self.mfu_fp8_peak,
            "model_flops_per_s_per_gpu": self.model_flops_per_s_per_gpu,
            "bubble_fraction": self.bubble_fraction,
            "breakdown": dict(self.breakdown),
            "stage_times_s": [list(t) for t in self.stage_times_s],
            "critical_pp_rank": self.critical_pp_rank,
        }


@dataclass(frozen=True)
class _StageCost:
    forward_s: float
    backward_s: float  # without recomputation
    recompute_s: float  # added to backward


def _matmul_rate(config: RunConfig, eff: Efficiency) -> float:
    """Achieved FLOP/s of a large GEMM: measured if calibrated, else peak x efficiency.matmul."""
    dtype = config.train.compute_dtype
    measured = config.cluster.achieved_flops(dtype)
    return measured if measured else config.cluster.gpu.peak_flops(dtype) * eff.matmul


def _fp8_matmul_rate(config: RunConfig, eff: Efficiency) -> float | None:
    """Achieved FLOP/s of a large FP8 GEMM of the job's FP8 recipe (None: no FP8 GEMMs): measured fp8
    if calibrated, else the FP8 peak x efficiency.matmul (an FP8 GEMM reaches the same share of its
    peak as a bf16 one: torchao's roofline takes 0.78 for both), times the recipe's kernel factor
    (rowwise scaling's CUTLASS kernel against the tensorwise cuBLAS one)."""
    fp8 = config.train.fp8
    if fp8 is None:
        return None
    measured = config.cluster.achieved_flops("fp8")
    base = measured if measured else config.cluster.gpu.peak_flops("fp8") * eff.matmul
    return base * fp8.gemm_efficiency


def _gemm_efficiency(dim: float, eff: Efficiency, calibrated: bool = False) -> float:
    """Share of the large-GEMM rate a GEMM reaches when its smallest dimension is ``dim``: tiles
    and waves are under-filled and operands are re-read more often as a dimension shrinks
    (saturating in ``dim``; half the rate at ``dim = gemm_half_dim``). 1 on a calibrated cluster:
    ``workbench bench compute`` measured the rate at the model's own GEMM shapes, so the shapes'
    penalty is in it already (applied again, a CPU run's GEMMs came out 3x too slow)."""
    return 1.0 if calibrated else dim / (dim + eff.gemm_half_dim)


def _layer_gemms(config: RunConfig, tokens: float, moe: bool) -> list[tuple[float, float, float, bool]]:
    """(M, K, N, fp8) of each GEMM of one block's forward on one TP rank (M = tokens, K and N split by
    TP); ``fp8``: the job's FP8 recipe converts it (the attention and MLP Linears, shared experts,
    routed experts where the recipe converts them; never the router)."""
    model, t = config.model, config.plan.tp
    h = model.d_model
    fp8 = config.train.fp8
    linear = fp8 is not None
    experts = linear and fp8.converts_experts  # type: ignore[union-attr]
    gemms: list[tuple[float, float, float, bool]] = [
        (tokens, k, n, linear) for _, _, k, n in model.attention_gemms(t)]  # (M, K, N)
    n_mats = 2 if model.activation == "swiglu" else 1  # gate and up, or fc
    if moe and model.is_moe:
        per_expert = tokens * model.top_k / model.n_experts  # tokens an expert sees (balanced router)
        gemms.append((tokens, h, model.n_experts, False))  # router
        for _ in range(model.n_experts):
            gemms += [(per_expert, h, n_mats * model.moe_d_ff / t, experts),
                      (per_expert, model.moe_d_ff / t, h, experts)]
        if model.n_shared_experts:
            f = model.n_shared_experts * (model.shared_d_ff or model.moe_d_ff)
            gemms += [(tokens, h, n_mats * f / t, linear), (tokens, f / t, h, linear)]
    else:
        gemms += [(tokens, h, n_mats * model.d_ff / t, linear), (tokens, model.d_ff / t, h, linear)]
    return gemms


def _layer_gemm_time(config: RunConfig, tokens: float, moe: bool, rate: float, eff: Efficiency,
                     fp8_rate: float | None = None) -> float:
    """Forward seconds of the GEMMs of one block on one TP rank: each GEMM's FLOPs at the rate its
    shape allows, ``fp8_rate`` for those the FP8 recipe converts (:func:`_layer_gemms`)."""
    calibrated = bool(config.cluster.achieved_flops(config.train.compute_dtype))
    return sum(2 * mm * k * n / ((fp8_rate if (fp8 and fp8_rate) else rate)
                                 * _gemm_efficiency(min(mm, k, n), eff, calibrated))
               for mm, k, n, fp8 in _layer_gemms(config, tokens, moe))


def _fp8_cast_bytes(config: RunConfig, tokens: float, moe: bool) -> tuple[float, float]:
    """(forward, backward) bytes through HBM of one block's FP8 casts on one rank, per micro-batch:
    each converted GEMM's input (M x K), weight (K x N) and output gradient (M x N) at the recipe's
    bytes per element (:mod:`workbench.spec.float8`). A weight cached across micro-batches (TE) is
    cast once a step, 1 / m of it per micro-batch (unless ZeRO-3 gathers it anew each micro-batch).
    A weight FSDP all-gathers in FP8 is cast on its shard before each gather (forward, and backward
    under ZeRO-3), and the gathered FP8 weight is transposed for the input-gradient GEMM (read and
    write 1 byte each)."""
    fp8 = config.train.fp8
    if fp8 is None:
        return 0.0, 0.0
    plan = config.plan
    fwd = bwd = 0.0
    sharded = plan.zero_stage == 3 and plan.shard_degree > 1  # weights gathered per micro-batch
    gathered = fp8.fsdp_fp8_all_gather and sharded
    for mm, k, n, converted in _layer_gemms(config, tokens, moe):
        if not converted:
            continue
        fwd += fp8.cast_input_bytes[0] * mm * k
        bwd += fp8.cast_input_bytes[1] * mm * k + fp8.cast_grad_output_bytes * mm * n
        w_fwd, w_bwd = fp8.cast_weight_bytes
        if gathered:
            w_fwd, w_bwd = w_fwd / plan.shard_degree, w_fwd / plan.shard_degree + 2
        elif fp8.weight_cast_per_step and not sharded:
            w_fwd, w_bwd = (w_fwd + w_bwd) / config.n_microbatches, 0.0
        fwd += w_fwd * k * n
        bwd += w_bwd * k * n
    return fwd, bwd


def _stage_cost(config: RunConfig, first_layer: int, n_layers: int, first: bool, last: bool, eff: Efficiency) -> _StageCost:
    model, plan, train = config.model, config.plan, config.train
    t = plan.tp
    sp = t if (plan.sequence_parallel and t > 1) else 1
    e = DTYPE_BYTES[train.compute_dtype]
    tokens = train.micro_batch_size * train.seq_len / plan.cp
    rate = _matmul_rate(config, eff)
    fp8_rate = _fp8_matmul_rate(config, eff)  # the FP8 recipe's Linears (None: all at ``rate``)
    attn_rate = rate / eff.matmul * eff.attention
    hbm = config.cluster.gpu.hbm_bandwidth_bytes_per_s * eff.memory or 1e12

    n_moe = 0
    if model.is_moe:
        n_moe = max(0, first_layer + n_layers - max(first_layer, model.first_k_dense_layers))
    n_dense = n_layers - n_moe
    mm_time = 0.0
    cast_fwd = cast_bwd = 0.0  # the FP8 recipe's casts, bytes through HBM
    if n_dense:
        mm_time += n_dense * _layer_gemm_time(config, tokens, False, rate, eff, fp8_rate)
        f, b = _fp8_cast_bytes(config, tokens, False)
        cast_fwd, cast_bwd = cast_fwd + n_dense * f, cast_bwd + n_dense * b
    if n_moe:
        mm_time += n_moe * _layer_gemm_time(config, tokens, True, rate, eff, fp8_rate)
        f, b = _fp8_cast_bytes(config, tokens, True)
        cast_fwd, cast_bwd = cast_fwd + n_moe * f, cast_bwd + n_moe * b
    if model.is_mla and plan.cp > 1:
        # Latent attention's ring carries latents: each of the cp - 1 visiting chunks is
        # re-expanded to K and V by the rank's slice of kv_b (ModelSpec.ring_kv_values_per_token).
        kv_b = next(p for p in model.attention_projections() if p.name == "kv_b")
        calibrated = bool(config.cluster.achieved_flops(train.compute_dtype))
        shape_eff = _gemm_efficiency(min(tokens, kv_b.d_in, kv_b.d_out / t), eff, calibrated)
        mm_time += n_layers * (plan.cp - 1) * 2 * tokens * kv_b.params / t / (rate * shape_eff)
    heads = model.n_heads / t
    hidden_dense = model.d_ff
    hidden_moe = model.top_k * model.moe_d_ff + model.n_shared_experts * (model.shared_d_ff or 0)
    elem_fwd = tokens * e * (
        n_layers * eff.elementwise_bytes_per_hidden * model.d_model / sp
        + eff.elementwise_bytes_per_ff * (n_dense * hidden_dense + n_moe * hidden_moe) / t
    )
    if train.dropout:
        elem_fwd += tokens * n_layers * 2 * (e + 1) * model.d_model / sp  # two dropouts: mask and output
    if train.attention == "flash":
        # a causal flash kernel skips the masked half of the score matrix
        attn_fwd = 2 * tokens * (train.seq_len / 2) * (model.q_dim + model.v_dim) / t * n_layers
    else:
        # eager: batched GEMMs over the whole s x s matrix (the mask is applied after), and the
        # scores go through HBM: written, read and written by the softmax, read by the value
        # GEMM (4 passes; 7 with dropout's mask and output)
        attn_fwd = 2 * tokens * train.seq_len * (model.q_dim + model.v_dim) / t * n_layers
        passes = 7 if train.dropout else 4
        elem_fwd += tokens * train.seq_len * heads * n_layers * passes * e
    if last:
        mm_time += 2 * tokens * model.d_model * model.vocab_size / t / (
            rate * _gemm_efficiency(min(tokens, model.d_model, model.vocab_size / t), eff,
                                    bool(config.cluster.achieved_flops(train.compute_dtype))))
        # cross-entropy on fp32 logits: read logits, write log-probs, read them back (4 bytes each)
        elem_fwd += tokens * 4 * 3 * model.vocab_size / (t if plan.loss_parallel else 1)
    if first:
        elem_fwd += tokens * e * 2 * model.d_model / sp  # embedding gather
    attn_time, elem_time = attn_fwd / attn_rate, elem_fwd / hbm
    launch = eff.launch_overhead_s_per_layer * n_layers
    forward = mm_time + attn_time + elem_time + launch + eff.overhead_s_per_microbatch + cast_fwd / hbm
    backward = (2 * mm_time + eff.backward_attention_ratio * attn_time + 2 * elem_time + 2 * launch
                + cast_bwd / hbm)
    if train.recompute == "full":
        recompute = forward
    elif train.recompute == "selective":
        # the attention core (Korthikanti et al. 2022, section 5): scores, softmax, dropout
        recompute = attn_time
        if train.attention == "eager":
            recompute += tokens * train.seq_len * heads * n_layers * (7 if train.dropout else 4) * e / hbm
    else:
        recompute = 0.0
    return _StageCost(forward, backward, recompute)


def _optimizer_time(config: RunConfig, eff: Efficiency, bill: "MemoryBill | None" = None) -> float:
    """Memory-bound update of the rank's shard: read and write parameters, master weights and
    states, read gradients."""
    bill = (bill or estimate_memory(config)).components
    touched = 2 * (bill["parameters"] + bill["master_weights"] + bill["optimizer"]) + bill["gradients"]
    hbm = config.cluster.gpu.hbm_bandwidth_bytes_per_s * eff.memory or 1e12
    return touched / hbm


@functools.lru_cache(maxsize=8192)
def unit_makespan(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> float:
    """Makespan of a schedule with equal stages (forward 1, backward 2 units), for any m.

    Past the warm-up a schedule is periodic: every further round of pp micro-batches adds the same
    time. So beyond m0 = 4 pp it is extrapolated from two simulations, m0 and m0 + pp, both
    multiples of pp, which every schedule accepts: exact for the steady state, and O(pp^2 v) work
    however many micro-batches a step has."""
    m0 = 4 * pp
    if n_microbatches <= m0 + pp:
        return simulate_schedule(schedule, pp, n_microbatches, virtual_stages).step_time
    a = simulate_schedule(schedule, pp, m0, virtual_stages).step_time
    b = simulate_schedule(schedule, pp, m0 + pp, virtual_stages).step_time
    return a + (b - a) / pp * (n_microbatches - m0)


def _simulated_makespan(schedule: str, pp: int, m: int, v: int, stage_times: tuple, p2p: float) -> float:
    """The event-driven simulation's makespan, extrapolated past m0 = 8 pp as in
    :func:`unit_makespan` (the steady state repeats every pp micro-batches; with unequal stages
    it settles later than with equal ones, hence 8 pp rather than 4 pp)."""
    m0 = 8 * pp
    if m <= m0 + pp:
        return simulate_schedule(schedule, pp, m, v, stage_times=stage_times, p2p_time=p2p).step_time
    a = simulate_schedule(schedule, pp, m0, v, stage_times=stage_times, p2p_time=p2p).step_time
    b = simulate_schedule(schedule, pp, m0 + pp, v, stage_times=stage_times, p2p_time=p2p).step_time
    return a + (b - a) / pp * (m - m0)


def predict_step(
    config: RunConfig,
    efficiency: Efficiency | None = None,
    memory: MemoryBill | None = None,
    simulate: bool = True,
) -> StepPrediction:
    """Predict one training step of ``config`` (see the module docstring for the model).

    The constants are the job's framework profile's (``config.train.framework``): its
    :class:`~workbench.spec.framework.Efficiency` (``efficiency`` replaces it), the share of each
    tier's in-stage collectives left exposed, and the share of overlapped traffic that stays exposed.

    ``memory``: the config's bill if already computed (the advisor has it). ``simulate=False``
    replaces the event-driven pipeline simulation with the cached equal-stage simulation scaled to
    the slowest stage (an upper bound, exact when stages are equal): the advisor screens with it."""
    check_instance("config", config, RunConfig)
    if efficiency is not None:
        check_instance("efficiency", efficiency, Efficiency)
    if memory is not None:
        check_instance("memory", memory, MemoryBill)
    model, plan, train = config.model, config.plan, config.train
    profile: FrameworkProfile = train.profile
    efficiency = profile.efficiency if efficiency is None else efficiency
    m = config.n_microbatches
    counts = plan.stage_layer_counts(model.n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    n_stages = len(counts)
    per_call = efficiency.overhead_s_per_collective

    def call_time(c) -> float:
        """A collective's wire time (alpha-beta) plus the host's cost of issuing each call."""
        return c.total_time_s + c.count * per_call

    costs = [
        _stage_cost(config, starts[s], counts[s], s == 0, s == n_stages - 1, efficiency) for s in range(n_stages)
    ]

    # Communication per pipeline rank.
    stage_comm = [[0.0, 0.0] for _ in range(n_stages)]  # exposed in-stage comm per micro-batch
    outer_exposed: list[dict[str, float]] = []  # per pp rank: exposed comm outside the pipeline, by dim
    in_stage_by_dim: list[dict[str, float]] = []
    p2p = 0.0
    layouts: dict[tuple, list] = {}  # ranks whose stages look alike issue the same collectives
    for r in range(plan.pp):
        stages = plan.stages_of_rank(r)
        key = tuple((counts[s], starts[s] if model.is_moe else 0, s == 0, s == n_stages - 1) for s in stages)
        if key not in layouts:
            layouts[key] = step_collectives(config, pp_rank=r)
        colls = layouts[key]
        fwd_compute = m * sum(costs[s].forward_s for s in stages)
        bwd_compute = m * sum(costs[s].backward_s + costs[s].recompute_s for s in stages)
        overlapped = {"forward": 0.0, "backward": 0.0}
        outer: dict[str, float] = {}
        inside: dict[str, float] = {}
        for c in colls:
            if c.pipeline:
                p2p = max(p2p, c.time_s)
                continue
            if c.dim in _IN_STAGE_DIMS and c.phase in ("forward", "backward") and not c.overlapped:
                exposed = call_time(c) * profile.in_stage_exposed(c.tier)
                share = exposed / (m * len(stages))
                for s in stages:
                    stage_comm[s][0 if c.phase == "forward" else 1] += share
                inside[c.dim] = inside.get(c.dim, 0.0) + exposed
            elif c.overlapped:
                # the optimizer step's parameter all-gathers hide behind the next forward; a
                # share stays exposed whatever the compute (SMs and bandwidth taken from it)
                kept = profile.overlapped_exposed(c.tier)
                overlapped["backward" if c.phase == "backward" else "forward"] += call_time(c) * (1 - kept)
                outer[c.dim] = outer.get(c.dim, 0.0) + call_time(c) * kept
            else:
                outer[c.dim] = outer.get(c.dim, 0.0) + call_time(c)
        # Overlapped traffic is exposed where it outlasts the compute it hides behind; charge it
        # to the dims in proportion to their overlapped time.
        for phase, compute in (("forward", fwd_compute), ("backward", bwd_compute)):
            spill = max(0.0, overlapped[phase] - compute)
            if spill > 0:
                hides = [c for c in colls if c.overlapped and not c.pipeline
                         and ("backward" if c.phase == "backward" else "forward") == phase]
                hidden = [call_time(c) * (1 - profile.overlapped_exposed(c.tier)) for c in hides]
                total = sum(hidden)
                for c, h in zip(hides, hidden):
                    outer[c.dim] = outer.get(c.dim, 0.0) + spill * h / total
        outer_exposed.append(outer)
        in_stage_by_dim.append(inside)

    stage_times = [
        (costs[s].forward_s + stage_comm[s][0], costs[s].backward_s + costs[s].recompute_s + stage_comm[s][1])
        for s in range(n_stages)
    ]
    if plan.pp > 1 and simulate:
        makespan = _simulated_makespan(plan.pp_schedule, plan.pp, m, plan.virtual_stages, tuple(stage_times), p2p)
        busy = [m * sum(stage_times[s][0] + stage_times[s][1] for s in plan.stages_of_rank(r)) for r in range(plan.pp)]
    elif plan.pp > 1:
        slowest = max(f + b for f, b in stage_times)
        makespan = unit_makespan(plan.pp_schedule, plan.pp, m, plan.virtual_stages) / 3 * slowest
        makespan += 2 * (plan.pp - 1) * p2p
        busy = [m * sum(stage_times[s][0] + stage_times[s][1] for s in plan.stages_of_rank(r)) for r in range(plan.pp)]
    else:
        makespan = m * (stage_times[0][0] + stage_times[0][1])
        busy = [makespan]
    optimizer = _optimizer_time(config, efficiency, memory)
    totals = [makespan + sum(outer_exposed[r].values()) + optimizer for r in range(plan.pp)]
    crit = max(range(plan.pp), key=lambda r: totals[r])
    step = totals[crit]

    stages = plan.stages_of_rank(crit)
    compute = m * sum(costs[s].forward_s + costs[s].backward_s for s in stages)
    recompute = m * sum(costs[s].recompute_s for s in stages)
    breakdown = {"compute": compute, "recompute": recompute}
    for dim, v in sorted(in_stage_by_dim[crit].items()):
        breakdown[f"comm_{dim}"] = v
    for dim, v in sorted(outer_exposed[crit].items()):
        breakdown[f"comm_{dim}"] = breakdown.get(f"comm_{dim}", 0.0) + v
    bubble = max(0.0, makespan - busy[crit])
    # p2p waits are inside the makespan: the bubble absorbs them.
    breakdown["bubble"] = bubble
    breakdown["optimizer"] = optimizer
    # Close the books exactly (floating-point residue of the in-stage shares goes to compute).
    breakdown["compute"] += step - sum(breakdown.values())

    tokens = config.tokens_per_step
    world = config.world_size
    model_flops = model.flops_per_token(train.seq_len) * tokens
    return StepPrediction(
        step_time_s=step,
        tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / world,
        mfu=mfu(config, step),
        mfu_fp8_peak=mfu(config, step, peak="fp8") if train.fp8 is not None else None,
        model_flops_per_s_per_gpu=model_flops / step / world,
        bubble_fraction=bubble / step,
        breakdown=breakdown,
        stage_times_s=tuple(stage_times),
        critical_pp_rank=crit,
    )


def describe_step(step_time_s: float, profile: FrameworkProfile) -> str:
    """A step time with the error band its profile was validated to:
    ``step 1.820 s (+/- 9 %, fsdp profile, fitted on 56 runs (5-fold))``, or ``(uncalibrated, ...)``."""
    return f"step {step_time_s:.3f} s ({profile.describe_band()})"


def mfu(config: RunConfig, step_time_s: float, peak: str | None = None) -> float:
    """Model FLOPs utilisation of a step that took ``step_time_s``: PaLM's model FLOPs per token
    (``6 N + 12 L h s``, :meth:`ModelSpec.flops_per_token`) x tokens per step / (step time x GPUs x
    dense peak). The peak (None) is bf16's for every mixed-precision run, FP8 recipes too (the
    convention of torchtitan and Megatron: an FP8 run's MFU reads against the same peak as its bf16
    run, so the two compare), and fp32's for fp32 runs; ``peak="fp8"`` divides by the dense FP8
    peak instead, half the bf16 figure on an H100 (ConfigError on a GPU without FP8). The planner
    predicts with it and the trainer measures with it, so the two MFUs are the same quantity."""
    train = config.train
    flops = config.model.flops_per_token(train.seq_len) * config.tokens_per_step
    if peak is None:
        peak = "fp32" if train.compute_dtype == "fp32" else "bf16"
    return flops / (step_time_s * config.world_size * config.cluster.gpu.peak_flops(peak))
