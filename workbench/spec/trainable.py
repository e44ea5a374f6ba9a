"""What the bundled trainer can run, checked before any process starts (no torch import here).

The planner plans every layout Megatron or torchtitan could run; the bundled trainer implements
most of them (TP inside MoE layers, TP with QK-norm, latent attention under TP and CP, tied
embeddings across pipeline stages, hidden dropout). The few it does not are refused here with the
reason, so that ``workbench train`` and the launchers fail in one line instead of inside torch on
every rank. Among them: the pipeline schedules torch's constructors refuse
(:func:`workbench.spec.schedules.torch_schedule_limits`), which the planner predicts with a note.
"""

from __future__ import annotations

from workbench.spec.config import RunConfig, torch_limits
from workbench.spec.errors import ConfigError


def unsupported(config: RunConfig) -> list[str]:
    """Reasons the bundled trainer cannot run ``config`` (empty: it can)."""
    model, plan, train = config.model, config.plan, config.train
    out = []
    if plan.tp > 1 and model.is_moe and model.linear_bias:
        out.append(f"tp={plan.tp} with MoE layers and linear_bias: the experts' row-parallel output biases are "
                   "not split by the bundled trainer")
    if plan.tp > 1 and model.is_moe and not plan.sequence_parallel and (train.seq_len // plan.cp) % plan.tp:
        out.append(f"tp={plan.tp} with MoE layers and sequence_parallel=false needs seq_len / cp = "
                   f"{train.seq_len // plan.cp} divisible by tp (each TP rank routes its 1/tp of the sequence)")
    if model.is_mla and model.qk_norm:
        out.append("qk_norm with latent attention: not built by the bundled trainer (no released model has both)")
    if train.fp8_recipe:
        out.append(f"fp8_recipe={train.fp8_recipe!r}: the bundled trainer has no FP8 GEMMs (torchao's float8 or "
                   "Transformer Engine run them); the planner prices the recipe, train its base recipe here")
    if model.n_mtp_layers:
        out.append(f"n_mtp_layers={model.n_mtp_layers}: the bundled trainer trains the main model only, without "
                   "multi-token prediction (the planner counts those modules apart)")
    if plan.tp > 1 and plan.sequence_parallel and model.position == "learned":
        out.append("learned position embeddings with sequence parallel: not supported by the bundled trainer")
    # The planner predicts schedules torch refuses (plan_notes); the trainer runs torch's schedules.
    mbs, dp = train.micro_batch_size, plan.dp
    for why in torch_limits(config):
        hint = ""
        if plan.pp_schedule == "1f1b":
            hint = (f"; use pp_schedule=gpipe (the same step with equal stages), or global_batch_size >= "
                    f"pp x micro_batch_size x dp = {plan.pp} x {mbs} x {dp} = {plan.pp * mbs * dp}")
        out.append(f"global_batch_size / (micro_batch_size x dp) = {train.global_batch_size} / ({mbs} x {dp}) = "
                   f"{config.n_microbatches} micro-batches: {why}, and the bundled trainer runs torch's schedules{hint}")
    return out


def check_trainable(config: RunConfig) -> None:
    """Raise :class:`ConfigError` naming the first thing the bundled trainer cannot run."""
    reasons = unsupported(config)
    if reasons:
        raise ConfigError(reasons[0], field="plan")
