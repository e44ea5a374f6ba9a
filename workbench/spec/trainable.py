"""What the bundled trainer can run, checked before any process starts (no torch import here).

The planner plans every layout Megatron or torchtitan could run; the bundled trainer implements
most of them. The few it does not are refused here with the reason, so that ``workbench train``
and the launchers fail in one line instead of inside torch on every rank. Among them: the pipeline
schedules torch's constructors refuse (:func:`workbench.spec.schedules.torch_schedule_limits`),
which the planner predicts with a note.
"""

from __future__ import annotations

from workbench.spec.config import RunConfig, torch_limits
from workbench.spec.errors import ConfigError


def unsupported(config: RunConfig) -> list[str]:
    """Reasons the bundled trainer cannot run ``config`` (empty: it can)."""
    model, plan, train = config.model, config.plan, config.train
    out = []
    if plan.tp > 1 and model.is_moe:
        out.append(f"tp={plan.tp} with MoE layers: the bundled trainer does not split experts by TP "
                   "(use ep and dp_shard for MoE models)")
    if plan.tp > 1 and model.qk_norm:
        out.append(f"tp={plan.tp} with qk_norm: not supported by the bundled trainer")
    if plan.tp > 1 and plan.sequence_parallel and model.position == "learned":
        out.append("learned position embeddings with sequence parallel: not supported by the bundled trainer")
    if plan.pp > 1 and model.tie_embeddings:
        out.append(f"tie_embeddings with pp={plan.pp}: the tied weights would live on two stages")
    if train.dropout:
        out.append("dropout=true: the bundled trainer trains without dropout, as modern LLMs do")
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
