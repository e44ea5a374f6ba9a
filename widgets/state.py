"""The shared state of the planning views: one :class:`PlanState` per app session (or notebook).

Every view reads and writes the same parameters (the model, the cluster, the degrees, the
training settings, the framework profile that prices them); :attr:`PlanState.config` is the
validated RunConfig they describe, or None with :attr:`PlanState.error` naming the field to fix.

:attr:`PlanState.prediction` is the ONE prediction of that configuration (a
:class:`PlanPrediction`: the memory bill, the step prediction with the collectives of the
pipeline rank that sets the step, the pipeline schedule simulated with the plan's stage times),
computed once whenever ``config`` changes. Every view reads it (the sidebar, the memory bill,
the mesh's traffic, the pipeline), so a number reads the same in every tab; none predicts on
its own. A change anywhere (a field of the sketch, a toggle of the bill, an advisor plan) reaches
every view once.

The precision follows the cluster (:func:`widgets.transforms.cluster_precision`: the bf16 recipe
on GPUs, fp32 on the CPU cluster) until the user chooses one (``precision_follows_cluster``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import param

from workbench import PRECISIONS, Cluster, ModelSpec, RunConfig, estimate_memory, predict_step, simulate_schedule
from workbench.predict.comms import Collective, p2p_time, step_collectives
from workbench.predict.memory import MemoryBill
from workbench.predict.perf import StepPrediction
from workbench.predict.pipeline import ScheduleResult
from workbench.spec.config import ATTENTION, RECOMPUTE
from workbench.spec.errors import ConfigError
from workbench.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORKS, FrameworkProfile
from workbench.spec.plan import SCHEDULES

from widgets.transforms import build_config, cluster_precision, parse_framework_profile, profile_key

PLAN_PARAMS = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "zero_stage", "pp_schedule", "virtual_stages")
TRAIN_PARAMS = ("seq_len", "micro_batch_size", "global_batch_size", "recompute", "attention")


@dataclass(frozen=True)
class PlanPrediction:
    """Everything the views show about one configuration, predicted once.

    ``bill``: :func:`workbench.estimate_memory`; ``step``: :func:`workbench.predict_step` (its
    breakdown holds the exposed time of each group dimension); ``collectives``: what the pipeline
    rank that sets the step (``step.critical_pp_rank``) issues, the list ``predict_step`` priced
    (:func:`workbench.predict.comms.step_collectives` of that rank), each with its bytes per link
    tier; ``schedule``: the pipeline step simulated with the plan's stage times and p2p time (None
    without a pipeline); ``per_call_s``: the profile's host cost of issuing one collective.
    """

    config: RunConfig
    bill: MemoryBill
    step: StepPrediction
    collectives: tuple[Collective, ...]
    schedule: ScheduleResult | None
    p2p_time_s: float
    per_call_s: float

    @classmethod
    def of(cls, config: RunConfig) -> "PlanPrediction":
        bill = estimate_memory(config)
        step = predict_step(config, memory=bill)
        plan = config.plan
        collectives = tuple(step_collectives(config, pp_rank=step.critical_pp_rank))
        schedule, p2p = None, 0.0
        if plan.pp > 1:
            p2p = p2p_time(config)
            schedule = simulate_schedule(plan.pp_schedule, plan.pp, config.n_microbatches, plan.virtual_stages,
                                         stage_times=step.stage_times_s, p2p_time=p2p)
        per_call = config.train.profile.efficiency.overhead_s_per_collective
        return cls(config, bill, step, collectives, schedule, p2p, per_call)

    @property
    def link_bytes(self) -> dict[str, float]:
        """Bytes one GPU of the critical pipeline rank sends per step on each link tier."""
        out = {t: 0.0 for t in ("intra_node", "inter_node", "inter_leaf")}
        for c in self.collectives:
            for tier, nbytes in c.wire_by_tier:
                out[tier] += nbytes * c.count
        return out


@functools.lru_cache(maxsize=32)
def _cached_prediction(config: RunConfig) -> PlanPrediction:
    return PlanPrediction.of(config)


def prediction_of(source: "PlanPrediction | RunConfig | None") -> PlanPrediction | None:
    """The prediction of a configuration: a PlanPrediction as it is, a RunConfig's from a small
    cache (so a view handed the config finds the one its state computed, not a second one)."""
    if source is None or isinstance(source, PlanPrediction):
        return source
    try:
        return _cached_prediction(source)
    except TypeError:  # an unhashable part (a measured calibration's tables): predict it here
        return PlanPrediction.of(source)


class PlanState(param.Parameterized):
    """What to train, where, split how, trained how; and the RunConfig that results.

    Defaults are the app's embedded default: the tiny model on the ``local-cpu`` cluster (two
    processes on this machine), in fp32 as the CPU trainer runs. The precision follows the
    cluster (bf16 on GPUs) until one is chosen: given here, set by a view or by an advisor plan.
    """

    model = param.ClassSelector(class_=ModelSpec, default=ModelSpec.preset("tiny"), allow_None=True,
                                doc="The model; None while the sketch holds an invalid edit.")
    model_error = param.String(default="", doc="Why the sketch's current edit is not a valid model.")
    cluster = param.Selector(default="local-cpu", objects=list(Cluster.presets()))
    nodes = param.Integer(default=1, bounds=(1, 4096), allow_None=True)
    # the plan (dp_shard = -1: every rank the other degrees leave)
    tp = param.Integer(default=1, allow_None=True)
    pp = param.Integer(default=1, allow_None=True)
    cp = param.Integer(default=1, allow_None=True)
    ep = param.Integer(default=1, allow_None=True)
    dp_shard = param.Integer(default=-1, allow_None=True, doc="-1: all ranks the other degrees leave")
    dp_replicate = param.Integer(default=1, allow_None=True)
    zero_stage = param.Selector(default=3, objects=[0, 1, 2, 3])
    pp_schedule = param.Selector(default="1f1b", objects=list(SCHEDULES))
    virtual_stages = param.Integer(default=1, allow_None=True)
    # training settings
    seq_len = param.Integer(default=256, allow_None=True)
    micro_batch_size = param.Integer(default=1, allow_None=True)
    global_batch_size = param.Integer(default=0, allow_None=True, doc="0: one micro-batch per DP rank (x 2 pp)")
    recompute = param.Selector(default="none", objects=list(RECOMPUTE))
    attention = param.Selector(default="flash", objects=list(ATTENTION),
                               doc="The attention kernel: flash keeps no scores, so selective recompute saves little")
    precision = param.Selector(default="fp32", objects=list(PRECISIONS))
    precision_follows_cluster = param.Boolean(default=True, doc="False once a precision was chosen")
    framework = param.Selector(default=DEFAULT_FRAMEWORK, objects=list(FRAMEWORKS),
                               doc="The profile that prices the plan: a built-in, or one loaded by load_profile")
    profiles = param.Dict(default={}, doc="Profiles loaded from JSON, by their choice in framework")
    # derived
    config = param.ClassSelector(class_=RunConfig, allow_None=True, default=None)
    prediction = param.ClassSelector(class_=PlanPrediction, allow_None=True, default=None,
                                     doc="The one prediction of config (None while it is invalid)")
    error = param.String(default="")
    error_field = param.String(default="")

    def __init__(self, **params: Any):
        if "precision" in params:
            params.setdefault("precision_follows_cluster", False)
        super().__init__(**params)
        self._precision_seen = self.precision  # a precision other than this one was chosen
        self._validate()

    @property
    def framework_setting(self) -> "str | FrameworkProfile":
        """TrainSettings.framework for the chosen profile: a built-in's name, or the loaded profile."""
        return self.profiles.get(self.framework, self.framework)

    @property
    def profile(self) -> FrameworkProfile:
        """The chosen framework profile."""
        chosen = self.framework_setting
        return chosen if isinstance(chosen, FrameworkProfile) else FRAMEWORKS[chosen]

    def load_profile(self, source: "str | bytes | Mapping[str, Any] | FrameworkProfile") -> FrameworkProfile:
        """Add a fitted profile (its JSON text, a dict or a profile) to the framework choices and
        choose it. Raises ConfigError (field ``framework``) when it is not a valid profile; the
        choice is then left as it was."""
        if isinstance(source, FrameworkProfile):
            profile = source
        else:
            checked = parse_framework_profile(source)
            if not checked.ok:
                raise ConfigError(checked.error, field="framework")
            profile = checked.value
        key = profile_key(profile)
        objects = list(self.param.framework.objects)
        if key not in objects:
            self.param.framework.objects = [*objects, key]
        self.param.update(profiles={**self.profiles, key: profile}, framework=key)
        return profile

    @property
    def cluster_precision(self) -> str:
        """The precision the cluster trains in when none is chosen."""
        return cluster_precision(self.cluster)

    @param.depends("precision_follows_cluster", watch=True)
    def _on_follow(self) -> None:
        if self.precision_follows_cluster:
            self._validate()

    @param.depends("model", "model_error", "cluster", "nodes", *PLAN_PARAMS, *TRAIN_PARAMS, "precision",
                   "framework", "profiles", watch=True)
    def _validate(self) -> None:
        if self.precision != self._precision_seen:  # chosen (a view, an advisor plan): keep it
            self._precision_seen = self.precision
            if self.precision_follows_cluster:
                self.precision_follows_cluster = False
        elif self.precision_follows_cluster and self.precision != self.cluster_precision:
            self._precision_seen = self.cluster_precision
            self.precision = self._precision_seen  # validates again, with it
            return
        plan = {k: getattr(self, k) for k in PLAN_PARAMS}
        train = {k: getattr(self, k) for k in TRAIN_PARAMS}
        train["framework"] = self.framework_setting
        checked = build_config(self.model, self.cluster, self.nodes, plan, train, self.precision)
        if self.model is None and self.model_error:
            checked = type(checked)(None, f"model: {self.model_error}", "model")
        if checked.value is not None and checked.value == self.config:
            return  # nothing the views show changed (a field set to the value it had)
        self.param.update(config=checked.value, prediction=prediction_of(checked.value),
                          error=checked.error or "", error_field=checked.field or "")

    def apply(self, **values: Any) -> None:
        """Set several parameters at once (validated once, so no half-applied plan shows)."""
        self.param.update(**values)
