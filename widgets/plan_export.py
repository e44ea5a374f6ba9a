"""The current plan as something to take away: command lines that rebuild it and its RunConfig JSON.

Three exports, each exact or absent (with the reason), never approximate:

* :func:`memory_line`: ``workbench memory ...``, whose options rebuild the *plan* (model preset,
  cluster preset and nodes, every degree, batch, recompute, precision, framework); it prints the
  bill the app shows;
* :func:`train_line`: ``workbench train ...``, whose options rebuild the *launch* config (the plan
  with the trainer's steps and checkpoints) when ``train``'s few options can say it (a preset on
  ``local-cpu`` in fp32, ...); otherwise ``workbench train --config plan.json``, which always can;
* :func:`config_json`: the launch config as RunConfig JSON (``RunConfig.to_json``; ``from_json``
  gives an equal config back).

A line is checked before it is offered: the options are turned back into a RunConfig the way the
CLI turns them (:func:`~workbench.spec.config.build_run_config`, and
:func:`~workbench.launch.local.config_from_cli` for ``train``) and compared with the config; the
tests feed the same lines to the real CLI. (``widgets`` may not import ``workbench.cli``, so the
option names are spelled here; tests/test_plan_export.py checks them against the CLI's.)
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from typing import Any

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.launch.local import config_from_cli
from workbench.spec.config import build_cluster, build_run_config
from workbench.spec.errors import ConfigError
from workbench.spec.framework import DEFAULT_FRAMEWORK

PLAN_DEFAULTS = {f.name: f.default for f in fields(ParallelPlan) if f.name != "stage_layers"}
TRAIN_DEFAULTS = TrainSettings()
# `workbench memory`'s option per ParallelPlan field, and its defaults (those of the CLI's plan_options)
DEGREE_FLAGS = {"tp": "--tp", "pp": "--pp", "cp": "--cp", "ep": "--ep", "dp_replicate": "--dp-replicate",
                "dp_shard": "--dp-shard", "zero_stage": "--zero", "pp_schedule": "--schedule",
                "virtual_stages": "--virtual-stages"}
# `workbench train` builds on config_from_cli's CPU defaults: these are given only when they differ
TRAIN_CLI_DEFAULTS = {"seq_len": 64, "micro_batch_size": 2}
TRAIN_FLAGS = {"seq_len": "--seq", "micro_batch_size": "--mbs", "global_batch_size": "--gbs", "lr": "--lr",
               "seed": "--seed", "dataset": "--dataset", "data_path": "--data-path",
               "checkpoint_every": "--checkpoint-every", "checkpoint_keep": "--checkpoint-keep", "accept": "--accept"}
TRAIN_SWITCHES = {"deterministic": "--deterministic", "checkpoint_async": "--checkpoint-async"}
# TrainSettings fields `workbench train` has no option for: they must be the fp32 CPU run's
TRAIN_FIXED = ("recompute", "attention", "dropout", "optimizer", "framework", "allocator_fragmentation",
               "min_lr_ratio", "weight_decay", "betas", "grad_clip", "moe_aux_loss_coeff",
               "moe_capacity_factor", "instrument", "guard_nonfinite", "guard_grad_spike",
               "guard_min_tokens_per_s", "param_dtype", "grad_dtype", "master_dtype", "optim_dtype",
               "compute_dtype", "dropout_rate", "stop_after", "fp8_recipe")
JSON_NAME = "plan.json"


@dataclass(frozen=True)
class Line:
    """A command line (``argv``, its shell text in ``text``), or none (``argv`` empty) and ``why``."""

    argv: tuple[str, ...] = ()
    why: str = ""

    @property
    def text(self) -> str:
        return shlex.join(self.argv) if self.argv else ""

    def __bool__(self) -> bool:
        return bool(self.argv)


# ---------------------------------------------------------------------------- what the config is made of
def preset_name(model: ModelSpec) -> str | None:
    """The preset ``model`` is, unchanged (a sketch edit makes it a custom model: None)."""
    name = model.name
    if name in ModelSpec.presets() and ModelSpec.preset(name) == model:
        return name
    return None


def cluster_preset(cluster: Cluster) -> str | None:
    """The cluster preset that, with ``cluster.nodes`` nodes, is ``cluster`` (None: none is)."""
    for name in Cluster.presets():
        try:
            if build_cluster(name, nodes=cluster.nodes) == cluster:
                return name
        except ConfigError:
            continue
    return None


def framework_name(train: TrainSettings) -> str | None:
    """The built-in profile's name, or None for a profile loaded from a file."""
    return train.framework if isinstance(train.framework, str) else None


def auto_global_batch(config: RunConfig) -> int:
    """The global batch RunConfig picks for ``global_batch_size=0``."""
    plan = config.plan
    return config.train.micro_batch_size * plan.dp * (plan.pp * 2 if plan.pp > 1 else 1)


def _value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


# ---------------------------------------------------------------------------- workbench memory
def memory_argv(config: RunConfig) -> list[str]:
    """``workbench memory`` options for ``config`` (ConfigError naming what no option can say)."""
    model, cluster, plan, train = config.model, config.cluster, config.plan, config.train
    name = preset_name(model)
    if name is None:
        raise ConfigError(f"model={model.name or 'custom'!r} is an edited model: no option names it "
                          f"(the JSON holds it)", field="model")
    where = cluster_preset(cluster)
    if where is None:
        raise ConfigError(f"cluster={cluster.name!r} is no preset: no option names it (the JSON holds it)",
                          field="cluster")
    if plan.stage_layers is not None:
        raise ConfigError("stage_layers: no option gives layers per stage (the JSON holds them)", field="plan")
    profile = framework_name(train)
    if profile is None:
        raise ConfigError(f"framework={train.profile.name!r} is a loaded profile: --framework needs its file "
                          "(the JSON holds it)", field="framework")
    if train.precision is None:
        raise ConfigError("precision: a custom mix of dtypes has no --precision (the JSON holds it)",
                          field="precision")
    argv = ["workbench", "memory", "--model", name, "--cluster", where, "--nodes", str(cluster.nodes)]
    rest = config.world_size // (plan.pp * plan.dp_replicate * plan.cp * plan.tp)
    for field_name, flag in DEGREE_FLAGS.items():
        v = getattr(plan, field_name)
        if field_name == "dp_shard" and v == rest:
            continue  # -1 (the default: every rank the other degrees leave) is this
        if v != PLAN_DEFAULTS[field_name]:
            argv += [flag, _value(v)]
    if not plan.sequence_parallel:
        argv.append("--no-sp")
    if plan.loss_parallel:
        argv.append("--loss-parallel")
    argv += ["--seq", str(train.seq_len), "--mbs", str(train.micro_batch_size)]
    if train.global_batch_size != auto_global_batch(config):
        argv += ["--gbs", str(train.global_batch_size)]
    argv += ["--recompute", train.recompute, "--precision", train.precision]
    if train.attention != TRAIN_DEFAULTS.attention:
        argv += ["--attention", train.attention]
    if train.optimizer != TRAIN_DEFAULTS.optimizer:
        argv += ["--optimizer", train.optimizer]
    if train.dropout:
        argv.append("--dropout")
    if profile != DEFAULT_FRAMEWORK:
        argv += ["--framework", profile]
    return argv


def config_of_memory_argv(argv: list[str] | tuple[str, ...]) -> RunConfig:
    """The RunConfig ``workbench memory`` builds from :func:`memory_argv`'s options (as the CLI's
    ``build_config`` does: build_run_config of the model, cluster, nodes, degrees and settings)."""
    opts = _options(argv[2:], switches={"--no-sp", "--loss-parallel", "--dropout"})
    plan: dict[str, Any] = {f: (opts[flag] if f == "pp_schedule" else int(opts[flag]))
                            for f, flag in DEGREE_FLAGS.items() if flag in opts}
    plan.update(sequence_parallel="--no-sp" not in opts, loss_parallel="--loss-parallel" in opts)
    train: dict[str, Any] = {"seq_len": int(opts["--seq"]), "micro_batch_size": int(opts["--mbs"]),
                             "global_batch_size": int(opts.get("--gbs", 0)), "recompute": opts["--recompute"],
                             "attention": opts.get("--attention", TRAIN_DEFAULTS.attention),
                             "optimizer": opts.get("--optimizer", TRAIN_DEFAULTS.optimizer),
                             "dropout": "--dropout" in opts, "framework": opts.get("--framework", DEFAULT_FRAMEWORK)}
    return build_run_config(opts["--model"], cluster=opts["--cluster"], nodes=int(opts["--nodes"]), plan=plan,
                            precision=opts["--precision"], **train)


def memory_line(config: RunConfig) -> Line:
    """``workbench memory ...`` that rebuilds the plan ``config``, or why there is none."""
    try:
        argv = memory_argv(config)
    except ConfigError as err:
        return Line(why=str(err))
    if config_of_memory_argv(argv) != config:  # an option that does not carry: offer nothing rather than a near miss
        return Line(why="the options do not rebuild this plan exactly (the JSON does)")
    return Line(tuple(argv))


# ---------------------------------------------------------------------------- workbench train
def train_plan_text(plan: ParallelPlan) -> str:
    """``--plan`` of ``workbench train``: every field that is not its default there (dp_shard: 1)."""
    defaults = dict(PLAN_DEFAULTS, dp_shard=1)
    return ",".join(f"{k}={_value(getattr(plan, k))}" for k in defaults if getattr(plan, k) != defaults[k])


def train_argv(config: RunConfig, run_root: str = "") -> list[str]:
    """``workbench train`` options for the launch config (ConfigError naming what they cannot say)."""
    model, cluster, plan, train = config.model, config.cluster, config.plan, config.train
    name = preset_name(model)
    if name is None:
        raise ConfigError(f"model={model.name or 'custom'!r} is an edited model: --model takes a preset",
                          field="model")
    if cluster.gpu.name != "cpu" or cluster_preset(cluster) != "local-cpu":
        raise ConfigError(f"cluster={cluster.name!r}: workbench train's options run on local-cpu only",
                          field="cluster")
    if plan.stage_layers is not None:
        raise ConfigError("stage_layers: no option gives layers per stage", field="plan")
    if train.precision != "fp32":
        raise ConfigError(f"precision={train.precision or 'custom'!r}: workbench train has no --precision "
                          "(its options run fp32)", field="precision")
    for f in TRAIN_FIXED:
        if getattr(train, f) != getattr(TRAIN_DEFAULTS.with_precision("fp32"), f):
            raise ConfigError(f"{f}={getattr(train, f)!r}: workbench train has no option for it", field=f)
    argv = ["workbench", "train", "--model", name]
    text = train_plan_text(plan)
    if text:
        argv += ["--plan", text]
    argv += ["--steps", str(train.steps)]
    for f, flag in TRAIN_FLAGS.items():
        v = getattr(train, f)
        default = TRAIN_CLI_DEFAULTS.get(f, getattr(TRAIN_DEFAULTS, f))
        if f == "global_batch_size":
            default = auto_global_batch(config)
        if v != default:
            argv += [flag, _value(v)]
    argv += [flag for f, flag in TRAIN_SWITCHES.items() if getattr(train, f)]
    if train.warmup_steps != warmup_for(train.steps):
        raise ConfigError(f"warmup_steps={train.warmup_steps}: workbench train sets {warmup_for(train.steps)} "
                          f"for {train.steps} steps", field="warmup_steps")
    if run_root:
        argv += ["--runs", run_root]
    return argv


def warmup_for(steps: int) -> int:
    """The warm-up ``workbench train`` gives ``steps`` steps (config_from_cli's rule)."""
    return min(10, max(steps // 10, 1))


def config_of_train_argv(argv: list[str] | tuple[str, ...]) -> RunConfig:
    """The RunConfig ``workbench train`` builds from :func:`train_argv`'s options (config_from_cli
    with the options given)."""
    opts = _options(argv[2:], switches=set(TRAIN_SWITCHES.values()))
    kinds = {"lr": float, "dataset": str, "data_path": str, "accept": str}
    given: dict[str, Any] = {f: kinds.get(f, int)(opts[flag]) for f, flag in TRAIN_FLAGS.items() if flag in opts}
    given.update({f: True for f, flag in TRAIN_SWITCHES.items() if flag in opts})
    return config_from_cli(opts["--model"], opts.get("--plan", ""), int(opts["--steps"]), **given)


def train_line(config: RunConfig, run_root: str = "") -> Line:
    """``workbench train ...`` that runs the launch config ``config``; where its options cannot say
    it, ``workbench train --config plan.json`` (the JSON export) and, in ``why``, what they miss."""
    tail = ["--runs", run_root] if run_root else []
    by_file = Line(("workbench", "train", "--config", JSON_NAME, *tail))
    try:
        argv = train_argv(config, run_root)
    except ConfigError as err:
        return Line(by_file.argv, why=f"{err}: run it from the JSON")
    if config_of_train_argv(argv) != config:
        return Line(by_file.argv, why="the options do not rebuild this config exactly: run it from the JSON")
    return Line(tuple(argv))


# ---------------------------------------------------------------------------- JSON
def config_json(config: RunConfig) -> str:
    """The RunConfig JSON (``RunConfig.from_json`` gives ``config`` back)."""
    return config.to_json() + "\n"


def export_text(plan: RunConfig, launch: RunConfig | None, run_root: str = "") -> str:
    """The lines as one shell script: rebuild the plan's bill, train the launch config."""
    out = ["#!/bin/sh", "# the plan's memory bill and predictions (workbench memory)"]
    mem = memory_line(plan)
    out.append(mem.text if mem else f"# no memory line: {mem.why}")
    if launch is not None:
        line = train_line(launch, run_root)
        out.append("# train it with the bundled trainer" + (f" ({line.why})" if line.why else ""))
        out.append(line.text)
    return "\n".join(out) + "\n"


def _options(args: list[str] | tuple[str, ...], switches: set[str]) -> dict[str, Any]:
    """``--flag value`` pairs and bare switches of a line this module wrote."""
    out: dict[str, Any] = {}
    it = iter(args)
    for a in it:
        out[a] = True if a in switches else next(it)
    return out
