"""Pipeline schedules: their names and the rules torch's ``torch.distributed.pipelining`` (2.13)
applies to them.

One place for both, read by the plan's validation, the schedule simulation
(:mod:`workbench.predict.pipeline`) and the trainer's schedule builder, so a schedule the planner
accepts is one torch will construct.
"""

from __future__ import annotations

from workbench.spec.errors import ConfigError, check_choice, check_int, require

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
# Schedules that give each rank several stages (virtual_stages > 1) and those that need exactly 2
# (the V-shape: rank r holds stages r and 2p-1-r).
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
# Schedules whose backward is split into I and W (dualpipev mixes full B with I/W).
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
# One stage per rank: torch's PipelineScheduleSingle takes exactly one stage.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def check_schedule(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise :class:`ConfigError` unless torch 2.13's pipelining accepts this combination.

    The rules, as torch's schedule constructors have them:

    - ``gpipe``, ``1f1b``: one stage per rank (``virtual_stages = 1``);
      ``1f1b`` also needs ``n_microbatches >= pp`` (Schedule1F1B).
    - ``interleaved-1f1b``, ``zero-bubble``: any ``virtual_stages >= 1``; micro-batches run in
      rounds of ``n_microbatches // rounds`` with ``rounds = max(1, n_microbatches // pp)``,
      so ``n_microbatches`` must be a multiple of ``rounds``.
    - ``looped-bfs``: any ``virtual_stages``, any ``n_microbatches``.
    - ``zbv``: exactly 2 stages per rank (the V), any ``n_microbatches``.
    - ``dualpipev``: exactly 2 stages per rank and ``n_microbatches >= 2 pp`` (the stage count).
    """
    check_choice("pp_schedule", schedule, SCHEDULES)
    check_int("pp", pp)
    check_int("n_microbatches", n_microbatches)
    check_int("virtual_stages", virtual_stages)
    p, m, v = pp, n_microbatches, virtual_stages
    if schedule in SINGLE_STAGE_SCHEDULES:
        require(
            v == 1,
            f"pp_schedule={schedule} runs one stage per rank; virtual_stages={v} needs an interleaved "
            "schedule, one holding several stages per rank (interleaved-1f1b, looped-bfs, zero-bubble, "
            "zbv, dualpipev)",
            field="virtual_stages",
            value=v,
        )
    if schedule in V_SCHEDULES:
        require(
            v == 2,
            f"pp_schedule={schedule} places exactly 2 stages per rank in a V (rank r holds stages r and "
            f"2 x pp - 1 - r); virtual_stages={v} must be 2",
            field="virtual_stages",
            value=v,
        )
    if schedule == "1f1b":
        require(
            m >= p,
            f"pp_schedule=1f1b needs n_microbatches >= pp to fill the pipeline: n_microbatches={m} < pp={p}",
            field="n_microbatches",
            value=m,
        )
    elif schedule == "dualpipev":
        require(
            m >= 2 * p,
            f"pp_schedule=dualpipev needs n_microbatches >= pp x 2 stages: n_microbatches={m} < "
            f"{p} x 2 = {2 * p}",
            field="n_microbatches",
            value=m,
        )
    elif schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // p)
        if m % rounds:
            ok = [x for x in range(max(1, m - p), m + p + 1) if x % max(1, x // p) == 0]
            below = max((x for x in ok if x < m), default=None)
            above = min(x for x in ok if x > m)
            hint = f"{below} or {above}" if below is not None else f"{above}"
            raise ConfigError(
                f"pp_schedule={schedule} runs micro-batches in rounds = max(1, n_microbatches // pp) = "
                f"max(1, {m} // {p}) = {rounds}, and n_microbatches={m} is not a multiple of it "
                f"({m} % {rounds} = {m % rounds}); nearest valid: {hint}",
                field="n_microbatches",
                value=m,
            )


def stage_ranks(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The rank of every stage: ``s % pp`` (looped), or the V for zbv/dualpipev."""
    n = pp * virtual_stages
    if schedule in V_SCHEDULES:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))
