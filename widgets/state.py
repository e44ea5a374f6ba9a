"""The shared state of the planning views: one :class:`PlanState` per app session (or notebook).

Every view reads and writes the same parameters (the model, the cluster, the degrees, the
training settings, the framework profile that prices them); :attr:`PlanState.config` is the validated RunConfig they describe, or None
with :attr:`PlanState.error` naming the field to fix. Views depend on ``config``, so a change
anywhere (a field of the sketch, a toggle of the bill, an advisor plan) reaches every view once.
"""

from __future__ import annotations

from typing import Any, Mapping

import param

from workbench import PRECISIONS, Cluster, ModelSpec, RunConfig
from workbench.spec.config import RECOMPUTE
from workbench.spec.errors import ConfigError
from workbench.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORKS, FrameworkProfile
from workbench.spec.plan import SCHEDULES

from widgets.transforms import build_config, parse_framework_profile, profile_key

PLAN_PARAMS = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "zero_stage", "pp_schedule", "virtual_stages")
TRAIN_PARAMS = ("seq_len", "micro_batch_size", "global_batch_size", "recompute")


class PlanState(param.Parameterized):
    """What to train, where, split how, trained how; and the RunConfig that results.

    Defaults are the app's embedded default: the tiny model on the ``local-cpu`` cluster (two
    processes on this machine), in fp32 as the CPU trainer runs.
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
    precision = param.Selector(default="fp32", objects=list(PRECISIONS))
    framework = param.Selector(default=DEFAULT_FRAMEWORK, objects=list(FRAMEWORKS),
                               doc="The profile that prices the plan: a built-in, or one loaded by load_profile")
    profiles = param.Dict(default={}, doc="Profiles loaded from JSON, by their choice in framework")
    # derived
    config = param.ClassSelector(class_=RunConfig, allow_None=True, default=None)
    error = param.String(default="")
    error_field = param.String(default="")

    def __init__(self, **params: Any):
        super().__init__(**params)
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

    @param.depends("model", "model_error", "cluster", "nodes", *PLAN_PARAMS, *TRAIN_PARAMS, "precision",
                   "framework", "profiles", watch=True)
    def _validate(self) -> None:
        plan = {k: getattr(self, k) for k in PLAN_PARAMS}
        train = {k: getattr(self, k) for k in TRAIN_PARAMS}
        train["framework"] = self.framework_setting
        checked = build_config(self.model, self.cluster, self.nodes, plan, train, self.precision)
        if self.model is None and self.model_error:
            checked = type(checked)(None, f"model: {self.model_error}", "model")
        self.param.update(config=checked.value, error=checked.error or "", error_field=checked.field or "")

    def apply(self, **values: Any) -> None:
        """Set several parameters at once (validated once, so no half-applied plan shows)."""
        self.param.update(**values)
