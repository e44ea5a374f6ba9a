"""Pipeline schedules: their names, the rules that define them and the further limits torch's
``torch.distributed.pipelining`` (2.13) puts on them.

One place for all, read by the plan's validation, the schedule simulation
(:mod:`workbench.predict.pipeline`) and the trainer's support check. :func:`check_schedule` refuses
what no framework can place or order (a ConfigError for everyone); :func:`torch_schedule_limits`
lists what only torch's constructors refuse: the planner predicts it with a note
(:func:`workbench.spec.config.plan_notes`), the bundled trainer, which runs torch's schedules,
refuses it (:func:`workbench.spec.trainable.unsupported`).
"""

from __future__ import annotations

from workbench.spec.errors import check_choice, check_int, require

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
# Schedules that give each rank several stages (virtual_stages > 1) and those that need exactly 2
# (the V-shape: rank r holds stages r and 2p-1-r).
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
# Schedules whose backward is split into I and W (dualpipev mixes full B with I/W).
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
# One stage per rank: torch's PipelineScheduleSingle takes exactly one stage.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def _check_args(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> None:
    check_choice("pp_schedule", schedule, SCHEDULES)
    check_int("pp", pp)
    check_int("n_microbatches", n_microbatches)
    check_int("virtual_stages", virtual_stages)


def check_schedule(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise :class:`ConfigError` unless the schedule is defined for this combination: the rules
    without which a plan has no stage placement or no order, for every framework alike.

    - ``gpipe``, ``1f1b``: one stage per rank (``virtual_stages = 1``).
    - ``zbv``, ``dualpipev``: exactly 2 stages per rank (the V).
    - ``dualpipev``: ``n_microbatches >= 2 pp`` (the stage count): its phases are defined only
      there (torch's ScheduleDualPipeV and DeepSeek's DualPipeV both assert it).
    - ``interleaved-1f1b``, ``looped-bfs``, ``zero-bubble``: any ``virtual_stages >= 1``.

    Torch's constructors refuse more (``1f1b`` with fewer micro-batches than stages, interleaved
    rounds that do not divide the micro-batches): those are :func:`torch_schedule_limits`, which
    the planner predicts anyway (with a note) and the bundled trainer refuses.
    """
    _check_args(schedule, pp, n_microbatches, virtual_stages)
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
    if schedule == "dualpipev":
        require(
            m >= 2 * p,
            f"pp_schedule=dualpipev needs n_microbatches >= pp x 2 stages: n_microbatches={m} < "
            f"{p} x 2 = {2 * p}",
            field="n_microbatches",
            value=m,
        )


def torch_schedule_limits(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> list[str]:
    """Why torch 2.13's ``torch.distributed.pipelining`` constructors refuse a combination that
    :func:`check_schedule` accepts, one line each naming the field, the value and the rule (empty:
    torch builds it). Call :func:`check_schedule` first; this checks only the micro-batch counts:

    - ``1f1b``: ``n_microbatches >= pp`` (Schedule1F1B). Megatron runs fewer: a degenerate
      pipeline whose warm-up is cut to the micro-batches there are.
    - ``interleaved-1f1b``, ``zero-bubble``: micro-batches run in rounds of
      ``n_microbatches // rounds`` with ``rounds = max(1, n_microbatches // pp)``, so
      ``n_microbatches`` must be a multiple of ``rounds``. Megatron-core runs the rest with
      other rounds (:func:`round_size`).

    :func:`degenerate_form` says how the planner predicts each of them.
    """
    _check_args(schedule, pp, n_microbatches, virtual_stages)
    p, m = pp, n_microbatches
    out = []
    if schedule == "1f1b" and m < p:
        out.append(
            f"pp_schedule=1f1b with n_microbatches={m} < pp={p}: torch.distributed.pipelining refuses it "
            "(Schedule1F1B needs n_microbatches >= pp to fill the pipeline)"
        )
    elif schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // p)
        if m % rounds:
            ok = [x for x in range(max(1, m - p), m + p + 1) if x % max(1, x // p) == 0]
            below = max((x for x in ok if x < m), default=None)
            above = min(x for x in ok if x > m)
            hint = f"{below} or {above}" if below is not None else f"{above}"
            out.append(
                f"pp_schedule={schedule} with n_microbatches={m}: torch.distributed.pipelining refuses it "
                f"(it runs micro-batches in rounds = max(1, n_microbatches // pp) = max(1, {m} // {p}) = "
                f"{rounds}, and {m} is not a multiple of it: {m} % {rounds} = {m % rounds}; nearest valid: {hint})"
            )
    return out


def round_size(pp: int, n_microbatches: int) -> int:
    """Micro-batches per round of ``interleaved-1f1b`` and ``zero-bubble`` (a rank runs a round
    through each of its stages in turn, then the next round).

    Torch's: ``n_microbatches // rounds`` with ``rounds = max(1, n_microbatches // pp)``, when
    ``rounds`` divides ``n_microbatches``. Otherwise (torch refuses it) Megatron-core's: the
    smallest ``microbatch_group_size_per_vp_stage`` it accepts, some g in [pp, n_microbatches]
    whose last, shorter round is empty or holds >= pp micro-batches (``m % g == 0 or m % g >= pp``;
    g = m always does)."""
    p, m = pp, n_microbatches
    rounds = max(1, m // p)
    if m % rounds == 0:
        return m // rounds
    return next(g for g in range(p, m + 1) if m % g == 0 or m % g >= p)


def degenerate_form(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> str:
    """How the planner predicts a combination :func:`torch_schedule_limits` lists (the schedule
    simulation builds this order): one clause, for the plan's notes."""
    p, m = pp, n_microbatches
    if schedule == "1f1b":
        return (f"predicted as a degenerate pipeline, as Megatron runs it (warm-up cut to the micro-batches "
                f"there are: rank r runs min({m}, {p} - r) forwards first): GPipe's step with equal stages")
    g = round_size(p, m)
    last = f" and a last one of {m % g}" if m % g else ""
    runs = "runs it" if schedule == "interleaved-1f1b" else "groups interleaved micro-batches"
    return (f"predicted in rounds of {g} micro-batches{last}, as Megatron-core {runs} "
            f"(microbatch_group_size_per_vp_stage={g})")


def stage_ranks(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The rank of every stage: ``s % pp`` (looped), or the V for zbv/dualpipev."""
    n = pp * virtual_stages
    if schedule in V_SCHEDULES:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))
