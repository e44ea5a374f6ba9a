"""The ``workbench`` command.

Every subcommand turns its options into the shared configuration objects and calls the one public
function of the concept (``estimate_memory``, ...). Invalid input is a :class:`ConfigError`: the
command prints its one-line message and exits with code 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import click

from workbench.spec.cluster import GPUS, Cluster
from workbench.spec.config import (PRECISIONS, RunConfig, TrainSettings, build_cluster, build_model,
                                   build_run_config, plan_notes)
from workbench.spec.errors import ConfigError, check_int, one_line, require
from workbench.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORKS, resolve_framework
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.rundir.record import check_runs_root
from workbench.spec.schedules import SCHEDULES
from workbench.predict.advisor import advise
from workbench.predict.comms import traffic_by_dim
from workbench.predict.fit import fit_report
from workbench.predict.measurements import published_measurements, validate as validate_measurements
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import describe_step
from workbench.rundir.benchmarks import format_table
from workbench.rundir.compare import compare_run
from workbench.rundir.measured import load_measured
from workbench.launch.benchmark import run_comms_benchmark
from workbench.launch.follow import start_and_follow
from workbench.launch.handle import TERMINAL, launch as launch_run, open_run
from workbench.launch.kernels import KernelError
from workbench.launch.slurm_options import SlurmRequest
from workbench.launch.local import STOP_TIMEOUT_S, config_from_cli, resume_local, train_local
from workbench.launch.outcome import EXIT_BAD_INPUT, EXIT_CODES
from workbench.spec.acceptance import METRICS as ACCEPT_METRICS
from workbench.rundir.acceptance import evaluate_acceptance, format_results
from workbench.rundir.runs_compare import compare_runs
from workbench.launch.baseline import BASELINE_STEPS, baseline_config
from workbench.launch.preflight import check_launch, check_run_id_free, load_config_file, load_run_config
from workbench.bench import calibration_report, format_fit, run_compute_benchmark

GiB = float(1 << 30)
APP_MODULE = "widgets"  # `workbench serve` runs `python -m widgets` (widgets/__main__.py)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with ``code``."""
    click.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def check_output_path(path: str, field: str = "output") -> None:
    """Refuse an output path that cannot be written before the work that fills it is done."""
    parent = os.path.dirname(os.path.abspath(path))
    require(not os.path.isdir(path), f"{field}={path!r} is a directory; give a file name", field=field, value=path)
    require(os.path.isdir(parent), f"{field}={path!r}: its folder {parent!r} does not exist", field=field, value=path)
    require(os.access(parent, os.W_OK), f"{field}={path!r}: its folder is not writable", field=field, value=path)


class WorkbenchGroup(click.Group):
    """The CLI's one error boundary: bad input of every command, a ConfigError, a file that cannot
    be read or written, an unknown option or a malformed value, becomes one line on stderr and exit
    code 2, never a traceback (click's own usage errors print three lines: here they print one)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as e:
            fail(str(e))
        except OSError as e:  # an output path in a missing folder, a full disk, a directory given as a file
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}")

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "workbench"
            fail(f"{e.format_message()} (see {command} --help)")
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code)
        except click.Abort:  # Ctrl-C outside a run (a run reports its own interruption)
            fail("interrupted", 130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=WorkbenchGroup)
@click.version_option(package_name="workbench")
def main() -> None:
    """Plan, launch and watch distributed training of large models."""


# ---------------------------------------------------------------------------- shared options
def model_options(f: Callable) -> Callable:
    f = click.option("--hf-config", type=click.Path(), default=None,
                     help="A Hugging Face config.json instead of --model.")(f)
    f = click.option("--model", default="llama3-8b", show_default=True,
                     help=f"Model preset: {', '.join(ModelSpec.presets())}.")(f)
    return f


def cluster_options(f: Callable) -> Callable:
    f = click.option("--nodes", type=int, default=None, help="Nodes (default: --gpus / GPUs per node, or 1).")(f)
    f = click.option("--gpus", type=int, default=None, help="Total GPUs (default: nodes x GPUs per node).")(f)
    f = click.option("--gpu", default=None, help=f"GPU: {', '.join(GPUS)} (picks its cluster preset).")(f)
    f = click.option("--cluster", "cluster_name", default=None,
                     help=f"Cluster preset ({', '.join(Cluster.presets())}) or a cluster JSON file.")(f)
    return f


def plan_options(f: Callable) -> Callable:
    opts = [
        click.option("--plan", "plan_text", default=None, help='Plan as "tp=8,pp=4,..." (overrides the degree options).'),
        click.option("--tp", type=int, default=1, show_default=True),
        click.option("--pp", type=int, default=1, show_default=True),
        click.option("--cp", type=int, default=1, show_default=True),
        click.option("--ep", type=int, default=1, show_default=True),
        click.option("--dp-replicate", type=int, default=1, show_default=True),
        click.option("--dp-shard", type=int, default=-1, show_default=True, help="-1: all remaining ranks."),
        click.option("--zero", "zero_stage", type=int, default=3, show_default=True, help="ZeRO stage 0-3 over dp_shard x cp."),
        click.option("--schedule", default="1f1b", show_default=True, help=f"Pipeline schedule: {', '.join(SCHEDULES)}."),
        click.option("--virtual-stages", type=int, default=1, show_default=True),
        click.option("--sp/--no-sp", "sequence_parallel", default=True, show_default=True, help="Sequence parallel with TP."),
        click.option("--loss-parallel", is_flag=True, default=False),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def train_options(f: Callable) -> Callable:
    opts = [
        click.option("--seq", "seq_len", type=int, default=4096, show_default=True),
        click.option("--mbs", "micro_batch_size", type=int, default=1, show_default=True),
        click.option("--gbs", "global_batch_size", type=int, default=0,
                     help="Global batch in sequences (default: 2 x pp micro-batches per DP rank)."),
        click.option("--recompute", default="none", show_default=True, help="none | selective | full."),
        click.option("--attention", default="flash", show_default=True, help="flash | eager."),
        click.option("--precision", default="bf16-megatron", show_default=True, help=f"{', '.join(PRECISIONS)}."),
        click.option("--optimizer", default="adamw", show_default=True, help="adamw | adam | sgd."),
        click.option("--dropout", is_flag=True, default=False, help="Keep dropout masks (Korthikanti's accounting)."),
        click.option("--framework", default=DEFAULT_FRAMEWORK, show_default=True,
                     help=f"Framework profile: {', '.join(FRAMEWORKS)}, or a profile JSON "
                          "(workbench calibrate --measured writes one)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _split(kw: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {n: kw.pop(n) for n in names}


DEGREE_KEYS = ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "zero_stage", "schedule",
               "virtual_stages", "sequence_parallel", "loss_parallel")
TRAIN_KEYS = ("seq_len", "micro_batch_size", "global_batch_size", "recompute", "attention",
              "optimizer", "dropout", "framework")


def build_train(precision: str, **kw: Any) -> TrainSettings:
    return TrainSettings(**kw).with_precision(precision)


def build_config(kw: dict[str, Any]) -> RunConfig:
    """The options of ``memory``-style commands -> RunConfig (by :func:`build_run_config`). A plan
    given as text (``--plan``) takes only ``--zero`` from the degree options."""
    degrees = _split(kw, DEGREE_KEYS)
    plan_text = kw.pop("plan_text")
    plan = plan_text if plan_text else degrees
    return build_run_config(kw.pop("model"), hf_config=kw.pop("hf_config"), cluster=kw.pop("cluster_name"),
                            gpu=kw.pop("gpu"), gpus=kw.pop("gpus"), nodes=kw.pop("nodes"), plan=plan,
                            plan_defaults={"zero_stage": degrees["zero_stage"]} if plan_text else None,
                            precision=kw.pop("precision"), **_split(kw, TRAIN_KEYS))


# ---------------------------------------------------------------------------- memory
@main.command()
@model_options
@cluster_options
@plan_options
@train_options
@click.option("--json", "as_json", is_flag=True, help="Print the bill as JSON.")
def memory(as_json: bool, **kw: Any) -> None:
    """Print the memory bill of the most loaded GPU."""

    config = build_config(kw)
    bill = estimate_memory(config)
    if as_json:
        click.echo(json.dumps({"config": config.to_dict(), "bill": bill.to_dict()}, indent=2))
        return
    click.echo(format_bill(config, bill))


def describe_config(config: RunConfig) -> list[str]:
    c, t, m = config.cluster, config.train, config.model
    name = m.name or "custom model"
    return [
        f"{name} ({m.describe_size()}) on {c.world_size} x {c.gpu.name} "
        f"({c.nodes} node{'s' if c.nodes > 1 else ''} x {c.gpus_per_node}), plan {config.plan.describe()}",
        f"seq {t.seq_len}, micro-batch {t.micro_batch_size}, global batch {t.global_batch_size} "
        f"({config.n_microbatches} micro-batches per DP rank), recompute {t.recompute}, "
        f"attention {t.attention}, precision {t.precision or 'custom'}",
        f"framework {t.profile.name}: predictions {t.profile.describe_band()}",
    ]


def format_bill(config: RunConfig, bill: Any) -> str:
    worst = next(r for r in bill.per_stage if r.rank == bill.most_loaded_rank)
    lines = describe_config(config)
    lines.append(
        f"Most loaded: rank {worst.rank} (pipeline rank {worst.pp_rank} of {config.plan.pp}, "
        f"stages {', '.join(map(str, worst.stages))}, micro-batches in flight {', '.join(map(str, worst.in_flight))})"
    )
    lines.append("")
    lines.append(f"{'component':<16}{'GiB':>10}")
    for name, value in worst.components.items():
        lines.append(f"{name:<16}{value / GiB:>10.2f}")
    lines.append(f"{'total':<16}{worst.total_bytes / GiB:>10.2f}")
    fit = bill.fits()
    lines.append(f"{'HBM':<16}{fit.hbm_bytes / GiB:>10.2f}")
    verdict = "fits" if fit.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: headroom {fit.headroom_bytes / GiB:.2f} GiB ({fit.headroom_fraction:.1%} of HBM)")
    if config.plan.pp > 1:
        lines.append("")
        lines.append("per pipeline rank: " + ", ".join(
            f"pp{r.pp_rank} {r.total_bytes / GiB:.1f} GiB" for r in bill.per_stage))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- serve
@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=5006, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Interface to bind; anything but loopback requires --basic-auth.")
@click.option("--basic-auth", default=None, help="A password, or a JSON file of {user: password}.")
@click.option("--show", is_flag=True, default=False, help="Open a browser tab.")
@click.option("--runs", "run_root", default=None, help="Where launched runs go (default $WORKBENCH_RUNS or ./runs).")
def serve(port: int, address: str, basic_auth: str | None, show: bool, run_root: str | None) -> None:
    """Serve the workbench app (local-cpu cluster, tiny model, local kernels by default)."""
    if run_root is not None:
        check_runs_root(run_root)  # before the server starts: the first launch would find it otherwise
    click.echo(f"workbench app on http://{address}:{port}/ (Ctrl-C stops it)", err=True)
    # The UI is the top layer: the command starts it by module name and imports none of it.
    argv = [sys.executable, "-m", APP_MODULE, "--port", str(port), "--address", address]
    argv += (["--basic-auth", basic_auth] if basic_auth else []) + (["--show"] if show else [])
    argv += ["--runs", run_root] if run_root else []
    sys.stdout.flush()
    os.execv(sys.executable, argv)


# ---------------------------------------------------------------------------- train
# `train` options a resume may change (the rest of a run's config is its own), and those that go
# with --config (the file holds the whole RunConfig). Any other option given with either is refused.
ACCEPT_HELP = ("Acceptance thresholds declared before the run, e.g. \"tokens_per_s_per_gpu>=2000,step_time_error<=0.25\" "
               f"(metrics: {', '.join(f'{m}{op}' for m, (op, _) in ACCEPT_METRICS.items())}); kept in config.json, "
               "judged at the end (exit status 4 when one fails).")
RESUME_OPTIONS = ("resume_dir", "steps", "checkpoint_every", "checkpoint_keep", "checkpoint_async", "max_restarts")
CONFIG_FILE_OPTIONS = ("config_path", "run_root", "run_id", "balance_stages", "max_restarts", "baseline")


def _train_help() -> str:
    import inspect

    text = inspect.cleandoc(f"""Train the bundled model locally with torchrun; the exit status says how the job ended.

    SIGINT (Ctrl-C) and SIGTERM stop the job: its ranks get SIGTERM (through torchrun) and end with
    run_end "interrupted"; what is left after {STOP_TIMEOUT_S:g} s is SIGKILLed.

    --resume runs/<id> continues a run from its latest good checkpoint with the run's own
    config.json; only --steps, --checkpoint-every, --checkpoint-keep, --checkpoint-async and
    --max-restarts may be given with it. A larger --steps extends the run: config.json is rewritten
    (the launched values stay in manifest.json's "resumes"), and since the learning-rate schedule
    is a function of the total steps, its cosine decay is stretched over the new total.

    \b
    Exit status:""")
    return text + "".join(f"\n  {code:>3}  {what}" for code, what in EXIT_CODES.items())


def _given_options(ctx: click.Context) -> list[str]:
    """The options given (on the command line or by the environment), whatever their value: 0,
    "" and False are values, not "unset"."""
    from click.core import ParameterSource

    return [p.name for p in ctx.command.params
            if p.name and ctx.get_parameter_source(p.name) not in (None, ParameterSource.DEFAULT)]


def _refuse_options(ctx: click.Context, given: list[str], allowed: tuple[str, ...], why: str) -> None:
    """One line naming every given option outside ``allowed``."""
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
    extra = [n for n in given if n not in allowed]
    if extra:
        raise ConfigError(f"{', '.join(flags[n] for n in extra)} cannot be given with {why} (with it give only "
                          f"{', '.join(flags[n] for n in allowed if n != allowed[0])})", field=extra[0])


@main.command(help=_train_help())
@click.option("--model", default="tiny", show_default=True, help="Model preset.")
@click.option("--hf-config", default=None, help="A Hugging Face config.json instead of --model (its hash joins the lineage).")
@click.option("--plan", "plan_text", default="", help='Plan, e.g. "dp_shard=2,tp=2" (unset degrees are 1).')
@click.option("--steps", type=int, default=50, show_default=True, help="Steps to train (with --resume: extend the run to this many).")
@click.option("--config", "config_path", type=click.Path(), default=None, help="A RunConfig JSON file instead.")
@click.option("--seq", "seq_len", type=int, default=None, help="Sequence length (default 64).")
@click.option("--mbs", "micro_batch_size", type=int, default=None, help="Micro-batch size (default 2).")
@click.option("--gbs", "global_batch_size", type=int, default=None, help="Global batch in sequences.")
@click.option("--lr", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--deterministic", is_flag=True, default=False, help="Bit-identical losses across runs.")
@click.option("--dataset", default=None, help="pydoc (default) | synthetic | text | bin.")
@click.option("--data-path", default=None, help="Text file or uint16 .bin for --dataset text/bin.")
@click.option("--runs", "run_root", default="runs", show_default=True, help="Where run directories go.")
@click.option("--run-id", default=None)
@click.option("--balance-stages", is_flag=True, default=False,
              help="Profile each layer, then split the pipeline stages by measured cost.")
@click.option("--checkpoint-every", type=int, default=None, help="Checkpoint every N steps (and at the end).")
@click.option("--checkpoint-async", is_flag=True, default=False, help="Save with torch.distributed.checkpoint's async_save.")
@click.option("--checkpoint-keep", type=int, default=None, help="Keep the last K committed checkpoints (default 3).")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="torchrun restarts after a fault.")
@click.option("--accept", default=None, help=ACCEPT_HELP)
@click.option("--baseline", is_flag=True, default=False,
              help=f"Run the plan's naive baseline instead: plain data parallel over the same ranks, the same model, "
                   f"data and global batch, the first {BASELINE_STEPS} steps of its schedule "
                   "(then: workbench compare PLAN_RUN BASELINE_RUN).")
@click.option("--resume", "resume_dir", type=click.Path(), default=None,
              help="Continue runs/<id> from its latest good checkpoint.")
def train(model: str, hf_config: str | None, plan_text: str, steps: int, config_path: str | None, run_root: str,
          run_id: str | None, balance_stages: bool, max_restarts: int, baseline: bool, resume_dir: str | None,
          **overrides: Any) -> None:
    ctx = click.get_current_context()
    given = _given_options(ctx)
    if resume_dir is not None:  # "" too: a given path that names no run is an error, not a new run
        _refuse_options(ctx, given, RESUME_OPTIONS, "--resume: the run continues as it was launched")
        values = dict(overrides, steps=steps)
        changes = {n: values[n] for n in given if n in RESUME_OPTIONS and n in values}
        sys.exit(resume_local(resume_dir, stream=click.echo, max_restarts=max_restarts, **changes))
    if config_path is not None:
        _refuse_options(ctx, given, CONFIG_FILE_OPTIONS, "--config: the file holds the whole RunConfig")
        config = load_config_file(config_path, field="config")
    else:
        config = config_from_cli(model, plan_text, steps, hf_config=hf_config,
                                 **{k: v for k, v in overrides.items() if k in given})
    baseline_of = None
    if baseline:
        require(not balance_stages, "--baseline runs plain data parallel: it has no stages to balance",
                field="balance_stages", value=True)
        baseline_of = {"plan": config.plan.describe()}
        config = baseline_config(config)
        click.echo(f"naive baseline of {baseline_of['plan']}: {config.plan.describe()}, "
                   f"{config.train.stop_after} of {config.train.steps} steps")
    check_launch(config, max_restarts)  # before --balance-stages spends its time profiling
    check_run_id_free(run_root, run_id)
    if balance_stages:
        from workbench.trainer.profile import balance_stages as balance  # imports torch: only when asked

        config = balance(config)
        click.echo(f"balanced stages (layers per stage): {list(config.plan.stage_layers or ())}")
    sys.exit(train_local(config, run_root=run_root, run_id=run_id, stream=click.echo, max_restarts=max_restarts,
                         baseline_of=baseline_of, hf_config=hf_config))


# ---------------------------------------------------------------------------- launch
LAUNCH_BACKENDS = ("local", "ssh", "gateway", "slurm")
GATEWAY_TOKEN_ENV = "WORKBENCH_GATEWAY_TOKEN"  # never an option: a command line is visible to every user
# Backend options (by parameter name) and the backends that take them; any other backend refuses
# them, instead of starting a run that silently ignores what the user asked for.
BACKEND_OPTIONS: dict[str, tuple[str, ...]] = {
    "hosts": ("ssh",), "hosts_file": ("ssh",), "identity_file": ("ssh",), "known_hosts_file": ("ssh",),
    "url": ("gateway",),
    "partition": ("slurm",), "account": ("slurm",), "time_limit": ("slurm",), "sbatch_args": ("slurm",),
    "remote_root": ("ssh", "gateway", "slurm"), "shared_run_root": ("ssh", "gateway", "slurm"),
}
SLURM_OPTIONS = ("partition", "account", "time_limit", "sbatch_args")
SLURM_FLAGS = {"partition": "--partition", "account": "--account", "time_limit": "--time-limit",
               "extra_sbatch": "--sbatch-arg"}  # SlurmRequest's fields -> the options they come from
LAUNCH_CONFIG_FILE_OPTIONS = ("config_path", "run_root", "run_id", "max_restarts", "join_timeout", "backend",
                              *BACKEND_OPTIONS)


def _launch_help() -> str:
    import inspect

    text = inspect.cleandoc(f"""Launch the bundled trainer through Jupyter kernels, one per node, and follow it to its end.

    \b
    --backend local    kernels on this machine (the local-cpu cluster: one node per 2 ranks)
    --backend ssh      kernels on --hosts (or --hosts-file), one [user@]host[:port] per node
    --backend gateway  kernels of the Kernel Gateway at --url (token from ${GATEWAY_TOKEN_ENV})
    --backend slurm    kernels on the nodes of a Slurm allocation (--partition, --account,
                       --time-limit, --sbatch-arg --option[=value], repeatable)

    The run is the --config file's RunConfig, or the one the --model, --plan, --steps... options
    describe (as for workbench train). Everything is checked before anything starts: a bad value
    is one line naming the option, exit status 2.

    While the run goes: a line per node whenever its state changes, a line per step of rank 0,
    every error, checkpoint and fault, and a final line. SIGINT (Ctrl-C) and SIGTERM stop the run
    (SIGTERM to every node's torchrun and ranks, SIGKILL to what is left after the stop timeout);
    the kernels are ended however the run ends.

    --resume RUN_DIR starts a launched run that has ended (stopped, failed or finished) again from
    its latest good checkpoint, with its own config.json and backend, on new kernels; no other
    option may be given with it.

    \b
    Exit status:""")
    return text + "".join(f"\n  {code:>3}  {what}" for code, what in EXIT_CODES.items())


def run_config_options(f: Callable) -> Callable:
    """The RunConfig of a launched run, as ``workbench train`` takes it (see :func:`config_from_cli`)."""
    opts = [
        click.option("--model", default="tiny", show_default=True, help="Model preset."),
        click.option("--plan", "plan_text", default="", help='Plan, e.g. "dp_shard=4" (unset degrees are 1).'),
        click.option("--steps", type=int, default=50, show_default=True, help="Steps to train."),
        click.option("--config", "config_path", type=click.Path(), default=None, help="A RunConfig JSON file instead."),
        click.option("--seq", "seq_len", type=int, default=None, help="Sequence length (default 64)."),
        click.option("--mbs", "micro_batch_size", type=int, default=None, help="Micro-batch size (default 2)."),
        click.option("--gbs", "global_batch_size", type=int, default=None, help="Global batch in sequences."),
        click.option("--lr", type=float, default=None),
        click.option("--seed", type=int, default=None),
        click.option("--deterministic", is_flag=True, default=False, help="Bit-identical losses across runs."),
        click.option("--dataset", default=None, help="pydoc (default) | synthetic | text | bin."),
        click.option("--data-path", default=None, help="Text file or uint16 .bin for --dataset text/bin (absolute)."),
        click.option("--checkpoint-every", type=int, default=None, help="Checkpoint every N steps (and at the end)."),
        click.option("--checkpoint-async", is_flag=True, default=False,
                     help="Save with torch.distributed.checkpoint's async_save."),
        click.option("--checkpoint-keep", type=int, default=None, help="Keep the last K committed checkpoints (default 3)."),
        click.option("--accept", default=None, help=ACCEPT_HELP),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def slurm_options(f: Callable) -> Callable:
    """What a run asks of Slurm (checked by :class:`SlurmRequest`)."""
    opts = [
        click.option("--partition", default=None, help="slurm: the partition(s), comma-separated."),
        click.option("--account", default=None, help="slurm: the account to charge."),
        click.option("--time-limit", default=None, help='slurm: the time limit ("30", "1:30:00", "2-00:00:00").'),
        click.option("--sbatch-arg", "sbatch_args", multiple=True,
                     help="slurm: one more salloc/sbatch option, --option or --option=value (repeatable)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _either(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def refuse_other_backends_options(ctx: click.Context, given: list[str], backend: str,
                                  names: tuple[str, ...] | None = None) -> None:
    """One line for a backend option given with a backend that does not take it (``names``: the
    options to look at, default every one of :data:`BACKEND_OPTIONS`)."""
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
    for name in given:
        owners = BACKEND_OPTIONS.get(name)
        if owners and backend not in owners and (names is None or name in names):
            raise ConfigError(f"{flags[name]} is an option of --backend {_either(owners)}, not {backend}",
                              field=name, value=backend)


def slurm_request(partition: str | None, account: str | None, time_limit: str | None,
                  sbatch_args: tuple[str, ...]) -> SlurmRequest:
    """The slurm options as a checked :class:`SlurmRequest`; an error names the option it came from."""
    try:
        return SlurmRequest(partition, account, time_limit, tuple(sbatch_args))
    except ConfigError as e:
        flag = SLURM_FLAGS.get(e.field or "", "--backend slurm")
        raise ConfigError(f"{flag}: {e}", field=e.field, value=e.value) from None


def slurm_backend_options(request: SlurmRequest) -> dict[str, Any]:
    """A checked SlurmRequest as the slurm backend's options (unset ones keep its defaults)."""
    options = {k: v for k, v in request.to_dict().items() if k != "extra_sbatch" and v is not None}
    if request.extra_sbatch:
        options["extra_sbatch"] = tuple(request.extra_sbatch)
    return options


def launch_backend_options(backend: str, config: RunConfig, given: list[str], values: dict[str, Any]) -> dict[str, Any]:
    """The given backend options of ``values`` as launch()'s keyword arguments, each checked
    where it can be before anything starts."""
    options = {n: values[n] for n in ("remote_root", "shared_run_root") if n in given}
    if backend == "ssh":
        hosts = [h.strip() for h in (values["hosts"] or "").split(",") if h.strip()]
        require(not (hosts and values["hosts_file"]), "give --hosts or --hosts-file, not both", field="hosts")
        require(bool(hosts or values["hosts_file"] or getattr(config.cluster, "hosts", None)),
                f"--backend ssh needs --hosts (comma-separated [user@]host[:port], one per node: "
                f"{config.cluster.nodes} here) or --hosts-file", field="hosts")
        if hosts:
            options["hosts"] = hosts
        options.update({n: values[n] for n in ("hosts_file", "identity_file", "known_hosts_file") if values[n]})
    elif backend == "gateway":
        require(bool(values["url"]), f"--backend gateway needs --url (the Kernel Gateway's URL; its token comes "
                                     f"from ${GATEWAY_TOKEN_ENV})", field="url")
        options["url"] = values["url"]
        if os.environ.get(GATEWAY_TOKEN_ENV):
            options["token"] = os.environ[GATEWAY_TOKEN_ENV]
    elif backend == "slurm":
        options.update(slurm_backend_options(slurm_request(*(values[n] for n in SLURM_OPTIONS))))
    return options


def launch_and_follow(config: RunConfig, backend: str, options: dict[str, Any], run_root: str,
                      run_id: str | None, max_restarts: int, join_timeout: float) -> int:
    """Launch ``config`` and follow it to its end (:func:`workbench.launch.follow.start_and_follow`)."""
    def start() -> Any:
        return launch_run(config, backend, run_root=run_root, run_id=run_id, max_restarts=max_restarts,
                          join_timeout_s=join_timeout, **options)

    def announce(run: Any) -> str:
        c = config.cluster
        return (f"run {run.path}  ({config.world_size} ranks on {c.nodes} node{'s' if c.nodes > 1 else ''} "
                f"x {c.gpus_per_node}, {backend} kernels, {config.plan.describe()})")

    try:
        return start_and_follow(start, click.echo, config.train.steps_to_run, announce)
    except KernelError as e:  # launch() has ended the kernels that did start: nothing is left running
        raise click.ClickException(f"could not start the run: {e}") from None  # exit status 1 (EXIT_FAILED)


def resume_and_follow(resume_dir: str) -> int:
    """``--resume RUN_DIR``: a launched run that has ended, started again from its latest good
    checkpoint on new kernels (:meth:`RunHandle.resume`), followed to its end."""
    load_run_config(resume_dir, field="resume")  # not a run directory: one line naming --resume
    run = open_run(resume_dir)
    state = run.status().state
    if not run.nodes:
        run.close()
        raise ConfigError(f"resume={resume_dir!r} was not launched through kernels: continue it with "
                          f"workbench train --resume {resume_dir}", field="resume", value=resume_dir)
    if state not in TERMINAL:
        run.close()  # leave it as it is: it is another driver's live run
        raise ConfigError(f"resume={resume_dir!r} is {state}: a run is resumed once it has ended (stop it first)",
                          field="resume", value=resume_dir)
    config = run.config
    skip = len(run.history())  # the earlier attempts' events are not printed again

    def announce(r: Any) -> str:
        return f"resume {r.path}  ({config.world_size} ranks, {config.plan.describe()}, attempt {r.attempt})"

    try:
        return start_and_follow(run.resume, click.echo, config.train.steps_to_run, announce, skip=skip)
    except KernelError as e:
        run.shutdown()  # the kernels that did start
        raise click.ClickException(f"could not resume the run: {e}") from None  # exit status 1 (EXIT_FAILED)
    except KeyboardInterrupt:  # a second signal during the start: end what it started, then "interrupted"
        run.shutdown()
        raise


@main.command("launch", help=_launch_help())
@click.option("--backend", type=click.Choice(LAUNCH_BACKENDS), default="local", show_default=True,
              help="Where the nodes' kernels run.")
@run_config_options
@click.option("--runs", "run_root", default="runs", show_default=True, help="Where run directories go.")
@click.option("--run-id", default=None)
@click.option("--max-restarts", type=int, default=0, show_default=True, help="torchrun restarts after a fault.")
@click.option("--join-timeout", type=float, default=120.0, show_default=True,
              help="Seconds the nodes may take to meet at the rendezvous.")
@click.option("--resume", "resume_dir", type=click.Path(), default=None, metavar="RUN_DIR",
              help="Start the launched run RUN_DIR again from its latest good checkpoint.")
@click.option("--hosts", default=None, help="ssh: comma-separated [user@]host[:port], one per node.")
@click.option("--hosts-file", type=click.Path(), default=None, help="ssh: a file of hosts, one per line.")
@click.option("--identity-file", type=click.Path(), default=None, help="ssh: the private key.")
@click.option("--known-hosts-file", type=click.Path(), default=None, help="ssh: the known_hosts file to check.")
@click.option("--url", default=None, help=f"gateway: the Kernel Gateway URL (token from ${GATEWAY_TOKEN_ENV}).")
@slurm_options
@click.option("--remote-root", default=None,
              help="ssh, gateway, slurm: where run directories go on the nodes (default ~/.workbench/runs).")
@click.option("--shared-run-root/--no-shared-run-root", default=None,
              help="ssh, gateway, slurm: the nodes share this machine's disk (they write into the run directory); "
                   "default: yes for slurm, no for ssh and gateway.")
def launch_command(backend: str, model: str, plan_text: str, steps: int, config_path: str | None, run_root: str,
                   run_id: str | None, max_restarts: int, join_timeout: float, resume_dir: str | None,
                   **kw: Any) -> None:
    ctx = click.get_current_context()
    given = _given_options(ctx)
    if resume_dir is not None:  # "" too: a given path that names no run is an error, not a new run
        flags = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
        extra = [n for n in given if n != "resume_dir"]
        require(not extra, f"{', '.join(flags[n] for n in extra)} cannot be given with --resume: the run continues "
                           "with its own config.json and backend", field=extra[0] if extra else None)
        sys.exit(resume_and_follow(resume_dir))
    refuse_other_backends_options(ctx, given, backend)
    backend_values = {n: kw.pop(n) for n in BACKEND_OPTIONS}
    if config_path is not None:
        _refuse_options(ctx, given, LAUNCH_CONFIG_FILE_OPTIONS, "--config: the file holds the whole RunConfig")
        config = load_config_file(config_path, field="config")
    else:
        config = config_from_cli(model, plan_text, steps, **{k: v for k, v in kw.items() if k in given})
    options = launch_backend_options(backend, config, given, backend_values)
    sys.exit(launch_and_follow(config, backend, options, run_root, run_id, max_restarts, join_timeout))


# ---------------------------------------------------------------------------- compare
@main.command()
@click.argument("run_dir", type=click.Path())
@click.argument("other_run", type=click.Path(), required=False)
@click.option("--cluster", "cluster_path", default=None,
              help="Price the run on this cluster (a calibrated cluster JSON from workbench calibrate), "
                   "with the run's nodes x GPUs per node.")
@click.option("--framework", default=None,
              help=f"Price the run under this profile ({', '.join(FRAMEWORKS)} or a fitted profile JSON).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def compare(run_dir: str, other_run: str | None, cluster_path: str | None, framework: str | None,
            as_json: bool) -> None:
    """Predicted next to measured for a run: memory, bubble, collective bytes, step time, and its
    declared acceptance thresholds. With a second run, the two side by side: what differs in
    their lineages first, then throughput, memory and the loss over the steps both ran (a plan
    beside its naive baseline: workbench train --baseline). On a CPU the step-time rows mean
    something on the calibrated cluster under a fitted profile (benchmarks/bench_cpu_loop.py)."""
    for name, path in (("run_dir", run_dir), ("other_run", other_run)):
        if path is not None and not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError(f"{name}={path!r} is not a run directory (no config.json)", field=name)
    if other_run is not None:
        require(cluster_path is None and framework is None, "--cluster and --framework price one run against its "
                "prediction; two runs are compared as measured", field="other_run", value=other_run)
        both = compare_runs(run_dir, other_run)
        click.echo(json.dumps(both.to_dict(), indent=2) if as_json else both.format())
        return
    cluster = build_cluster(cluster_path) if cluster_path else None
    profile = resolve_framework(framework) if framework else None
    comparison = compare_run(run_dir, cluster=cluster, framework=profile)
    results, ended = evaluate_acceptance(run_dir, comparison)
    if as_json:
        click.echo(json.dumps(comparison.to_dict() | {"acceptance": [r.to_dict() for r in results]}, indent=2))
        return
    click.echo(comparison.format())
    for line in format_results(results, ended):
        click.echo(line)


# ---------------------------------------------------------------------------- bench, calibrate
@main.group()
def bench() -> None:
    """Measure the cluster: collectives over the plan's real process groups, and matmul FLOP/s."""


@bench.command("comms")
@click.option("--cluster", "cluster_name", default="local-cpu", show_default=True,
              help="Cluster preset or a cluster JSON file.")
@click.option("--nodes", type=int, default=2, show_default=True)
@click.option("--plan", "plan_text", default="", help='Plan whose groups to measure, e.g. "tp=2,dp_shard=2".')
@click.option("--backend", type=click.Choice(["local", "ssh", "gateway", "slurm", "torchrun"]), default="local",
              show_default=True,
              help="The launcher of training runs (Jupyter kernels: local, ssh, gateway, slurm), or plain local torchrun.")
@click.option("--hosts", default=None, help="ssh: comma-separated [user@]host[:port], one per node.")
@click.option("--url", default=None, help="gateway: the Kernel Gateway URL (token from $WORKBENCH_GATEWAY_TOKEN).")
@slurm_options
@click.option("--max-bytes", type=int, default=None, help="Largest message (default 256 MiB on GPU, 16 MiB on CPU).")
@click.option("--runs", "run_root", default="runs", show_default=True)
def bench_comms(cluster_name: str, nodes: int, plan_text: str, backend: str, hosts: str | None, url: str | None,
                partition: str | None, account: str | None, time_limit: str | None, sbatch_args: tuple[str, ...],
                max_bytes: int | None, run_root: str) -> None:
    """All-reduce, all-gather, reduce-scatter, all-to-all and send/recv from 8 B up, per group dimension."""
    require(backend != "gateway" or bool(url), "--backend gateway needs --url (the Kernel Gateway's URL)", field="url")
    require(backend != "ssh" or bool(hosts), "--backend ssh needs --hosts (one [user@]host[:port] per node)",
            field="hosts")
    ctx = click.get_current_context()
    refuse_other_backends_options(ctx, _given_options(ctx), backend, SLURM_OPTIONS)
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, minimum=8)
    options: dict[str, Any] = {}
    if backend == "slurm":  # checked before the benchmark sizes anything
        options.update(slurm_backend_options(slurm_request(partition, account, time_limit, sbatch_args)))
    cluster = load_cluster(cluster_name, nodes)
    if hosts:
        options["hosts"] = [h.strip() for h in hosts.split(",") if h.strip()]
    if url:
        options["url"] = url
    results = run_comms_benchmark(cluster, plan_text or None, run_root, max_bytes=max_bytes, stream=click.echo,
                                  backend=None if backend == "torchrun" else backend, backend_options=options)
    click.echo(format_table(results))
    click.echo(f"results: {results.path}")


@bench.command("compute")
@model_options
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--tokens", type=int, default=None, help="Tokens per GEMM (M dimension).")
@click.option("-o", "--output", type=click.Path(), default=None, help="Write the results JSON here.")
def bench_compute(model: str, hf_config: str | None, tp: int, tokens: int | None, output: str | None) -> None:
    """Achieved matmul FLOP/s per dtype at the GEMM shapes of the model on one TP rank."""
    check_int("tp", tp)
    if tokens is not None:
        check_int("tokens", tokens)
    if output is not None:
        check_output_path(output)
    results = run_compute_benchmark(build_model(model, hf_config), tp=tp, tokens=tokens, out_path=output)
    click.echo(format_table(results))


@main.command()
@click.argument("results", nargs=-1, type=click.Path(exists=True))
@click.option("--measured", "measured_paths", multiple=True, type=click.Path(),
              help="A CSV of measured runs or a run directory of the bundled trainer (repeatable): fit a "
                   "framework profile to them instead of a cluster to benchmark results.")
@click.option("--framework", default="megatron", show_default=True,
              help=f"With --measured: the profile to refit ({', '.join(FRAMEWORKS)} or a profile JSON).")
@click.option("--name", default=None, help="With --measured: the fitted profile's name (default <base>-fitted).")
@click.option("-o", "--output", type=click.Path(), required=True,
              help="The calibrated cluster JSON (or, with --measured, the fitted profile JSON) to write.")
def calibrate(results: tuple[str, ...], measured_paths: tuple[str, ...], framework: str, name: str | None,
              output: str) -> None:
    """Fit latency and bandwidth per link tier and collective (and FLOP/s) to benchmark results;
    or, with --measured, a framework profile's constants to measured runs (see workbench/predict/fit.py).

    The --measured CSV's columns: the model (``model`` preset, ``hf_config`` path, or shape columns
    n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, ...); ``gpu`` or ``cluster`` and
    ``n_gpus``; ``plan`` as a string ("tp=8,pp=4"); seq_len, micro_batch_size, global_batch_size,
    recompute, precision; measured ``tokens_per_s_per_gpu`` and/or ``step_time_s``, optional
    ``peak_memory_gib``; label, framework, source, notes."""
    if output != os.devnull:
        check_output_path(output)
    if measured_paths:
        require(not results, "give benchmark results or --measured runs, not both", field="measured")
        base = resolve_framework(framework)
        report = fit_report(load_measured(list(measured_paths), base), base=base, name=name)
        with open(output, "w") as f:
            f.write(json.dumps({"profile": report.profile.to_dict(),
                                "report": {"method": report.method, "stats": report.stats(),
                                           "in_sample": report.stats(held_out=False),
                                           "values": report.values}}, indent=2) + "\n")
        click.echo(report.format())
        click.echo(f"fitted profile: {output} ({report.profile.describe_band()}; use it as: "
                   f"workbench plan --framework {output})")
        return
    require(bool(results), "calibrate needs benchmark result files, or --measured runs", field="results")
    # one series a busy machine left flat (no growth with size) keeps its previous figure, reported
    report = calibration_report(list(results), skip_unfit=True)
    with open(output, "w") as f:
        f.write(report.cluster.to_json())
    click.echo(format_fit(report))
    click.echo(f"calibrated cluster: {output} (use it as: workbench plan --cluster {output})")


# ---------------------------------------------------------------------------- validate
@main.command()
@click.option("--measured", "measured_paths", multiple=True, type=click.Path(),
              help="A CSV of measured runs (columns: see workbench calibrate --help) or a run directory "
                   "(repeatable); default: the published tables that ship with workbench.")
@click.option("--framework", default=None,
              help=f"Price every run under this profile ({', '.join(FRAMEWORKS)} or a profile JSON); "
                   "default: each row's own framework column.")
@click.option("--json", "as_json", is_flag=True, help="Print rows and statistics as JSON.")
def validate(measured_paths: tuple[str, ...], framework: str | None, as_json: bool) -> None:
    """Predicted next to measured tokens/s per GPU for every measured run: median and p90 error,
    and the rank correlation."""
    profile = resolve_framework(framework) if framework else None  # a bad name fails here, once
    measurements = load_measured(list(measured_paths), profile) if measured_paths else published_measurements(profile)
    result = validate_measurements(measurements)
    if as_json:
        click.echo(json.dumps({"rows": [{"label": r.label, "predicted": r.predicted, "measured": r.measured,
                                         "error": r.error} for r in result.rows], "stats": result.stats}, indent=2))
        return
    click.echo(result.format())


# ---------------------------------------------------------------------------- plan
def _cluster_only_options(f: Callable) -> Callable:
    f = click.option("--nodes", type=int, default=1, show_default=True)(f)
    f = click.option("--cluster", "cluster_name", default="dgx-h100", show_default=True,
                     help=f"Cluster preset ({', '.join(Cluster.presets())}) or a cluster JSON file.")(f)
    return f


def load_cluster(cluster_name: str, nodes: int) -> Cluster:
    return build_cluster(cluster_name, nodes=nodes)


@main.command()
@model_options
@_cluster_only_options
@train_options
@click.option("--top", type=int, default=5, show_default=True, help="How many plans to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
def plan(model: str, hf_config: str | None, cluster_name: str, nodes: int, top: int, as_json: bool, **kw: Any) -> None:
    """Search every valid plan and print the fastest that fit, explained."""
    check_int("top", top)
    spec = build_model(model, hf_config)
    cluster = load_cluster(cluster_name, nodes)
    train = build_train(**kw)
    advice = advise(spec, cluster, train, top=top)
    if as_json:
        click.echo(json.dumps(advice_to_dict(advice), indent=2))
        return
    click.echo(f"{spec.name or 'model'} ({spec.describe_size()}) on {cluster.world_size} x {cluster.gpu.name} "
               f"({cluster.nodes} nodes x {cluster.gpus_per_node}), seq {train.seq_len}, global batch "
               f"{train.global_batch_size or 'auto'}; searched {advice.stats['plans']} plans, "
               f"{advice.stats['too_big']} did not fit, {advice.stats['predicted']} predicted")
    b = advice.baseline
    if b.fits:
        fp8_mfu = b.prediction.mfu_fp8_peak
        click.echo(f"baseline, plain data parallel: step {b.prediction.step_time_s:.3f} s, MFU {b.prediction.mfu:.1%}"
                   + (f" ({fp8_mfu:.1%} of the FP8 peak)" if fp8_mfu is not None else ""))
    else:
        click.echo(f"baseline: {b.reason}")
    if not advice:
        raise ConfigError("no plan fits: try more nodes, a shorter sequence or a smaller model", field="plan")
    for c in advice:
        click.echo("")
        click.echo(f"#{c.rank} {c.summary()}")
        click.echo(f"    {describe_step(c.prediction.step_time_s, c.config.train.profile)}")
        for line in c.explanation:
            click.echo(f"    - {line}")
        for note in plan_notes(c.config):  # e.g. a schedule torch refuses, predicted as Megatron runs it
            click.echo(f"note: {note}")


def advice_to_dict(advice: Any) -> dict:
    def cand(c: Any) -> dict:
        return {"rank": c.rank, "plan": c.plan.to_dict(), "micro_batch_size": c.train.micro_batch_size,
                "recompute": c.train.recompute, "memory": c.memory.to_dict(), "prediction": c.prediction.to_dict(),
                "explanation": list(c.explanation), "notes": plan_notes(c.config)}
    b = advice.baseline
    return {
        "candidates": [cand(c) for c in advice],
        "baseline": {"fits": b.fits, "reason": b.reason,
                     "prediction": b.prediction.to_dict() if b.prediction else None},
        "stats": advice.stats,
        "gain_over_baseline": advice.gain_over_baseline(),
    }


# ---------------------------------------------------------------------------- mesh
@main.command()
@model_options
@_cluster_only_options
@click.option("--plan", "plan_text", required=True, help='The plan, e.g. "tp=8,pp=4".')
@train_options
@click.option("--max-nodes", type=int, default=4, show_default=True, help="Nodes drawn in the rank grid.")
@click.option("--json", "as_json", is_flag=True, help="Print the mesh as JSON.")
def mesh(model: str, hf_config: str | None, cluster_name: str, nodes: int, plan_text: str, max_nodes: int,
         as_json: bool, **kw: Any) -> None:
    """Lay the plan's ranks out on the nodes; per group dimension its link tier and traffic."""
    check_int("max_nodes", max_nodes)
    config = RunConfig(build_model(model, hf_config), load_cluster(cluster_name, nodes),
                       ParallelPlan.parse(plan_text), build_train(**kw))
    plan_, cluster = config.plan, config.cluster
    placement = plan_.placement(cluster)
    traffic = traffic_by_dim(config)
    dims = [d for d, _ in plan_.mesh_dims()] + (["ep"] if plan_.ep > 1 else [])
    if as_json:
        click.echo(json.dumps({
            "config": config.to_dict(),
            "ranks": [{"rank": r, "node": placement.node_of(r), "gpu": placement.gpu_of(r), **plan_.rank_coords(r)}
                      for r in range(config.world_size)],
            "groups": {d: {"degree": plan_.degree(d), "tier": placement.tiers.get(d, "intra_node"),
                           "ranks": plan_.group_ranks(d)} for d in dims},
            "traffic": {d: t.__dict__ for d, t in traffic.items()},
            "warnings": list(placement.warnings),
        }, indent=2))
        return
    for line in describe_config(config):
        click.echo(line)
    click.echo("")
    for node in range(min(cluster.nodes, max_nodes)):
        cells = []
        for gpu in range(cluster.gpus_per_node):
            r = node * cluster.gpus_per_node + gpu
            c = plan_.rank_coords(r)
            cells.append(f"r{r}(" + ",".join(f"{_short(d)}{c[d]}" for d in dims) + ")")
        click.echo(f"node {node}: " + " ".join(cells))
    if cluster.nodes > max_nodes:
        click.echo(f"... {cluster.nodes - max_nodes} more nodes")
    click.echo("")
    click.echo(f"{'group':<14}{'degree':>7}  {'link tier':<11}{'GB/step/rank':>13}{'time ms':>10}{'exposed ms':>12}")
    for d, t in sorted(traffic.items(), key=lambda kv: -kv[1].bytes):
        click.echo(f"{d:<14}{t.group_size:>7}  {t.tier:<11}{t.bytes / 1e9:>13.2f}{t.time_s * 1e3:>10.1f}{t.exposed_time_s * 1e3:>12.1f}")
    for w in placement.warnings:
        click.echo(f"warning: {w}")


def _short(dim: str) -> str:
    return {"pp": "pp", "dp_replicate": "dr", "dp_shard": "ds", "cp": "cp", "tp": "tp", "ep": "ep"}[dim]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
