"""Start a run on this machine: a run directory, then ``torchrun`` with one process per rank.

``workbench train`` calls :func:`config_from_cli` and :func:`train_local`. Validation happens when
the RunConfig is built, so a bad config raises :class:`~workbench.spec.errors.ConfigError` before any
process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from workbench.spec.config import RunConfig, build_run_config
from workbench.rundir.events import next_seq, read_events
from workbench.rundir.record import create_run_dir
from workbench.spec.trainable import check_trainable

POLL_S = 0.2


def config_from_cli(model: str, plan: str, steps: int, **train_overrides: Any) -> RunConfig:
    """A RunConfig for the bundled trainer on this machine's CPUs: the defaults of a CPU run, built
    by :func:`~workbench.spec.config.build_run_config`. ``model`` preset, ``plan`` text
    (``"dp_shard=2,tp=2"``; an unset dp_shard is 1), ``steps``; one "node" per 2 ranks; the world
    size is the product of the plan's degrees.
    Defaults: seq_len 64, micro_batch_size 2, fp32; ``train_overrides`` replace any of them
    (``precision="bf16"`` picks a precision preset)."""
    precision = train_overrides.pop("precision", "fp32")
    fields = dict(seq_len=64, micro_batch_size=2, steps=steps, warmup_steps=min(10, max(steps // 10, 1)))
    fields.update(train_overrides)
    return build_run_config(model, cluster="local-cpu", plan=plan or "", plan_defaults={"dp_shard": 1},
                            size_from_plan=True, precision=precision, **fields)


def format_step(event: dict[str, Any], total: int) -> str:
    """One progress line: ``step   12/50  loss 4.1234  gnorm 0.812  lr 3.0e-04  2,345 tok/s  0.11 s``."""
    return (f"step {event['step'] + 1:>5}/{total}  loss {event['loss']:.4f}  gnorm {event['grad_norm']:.3f}  "
            f"lr {event['lr']:.1e}  {event['tokens_per_s']:,.0f} tok/s  {event['step_time_s']:.2f} s")


def torchrun_command(config_path: Path, nproc: int, resume: bool = False, max_restarts: int = 0) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N [--max-restarts=R] -m workbench.trainer config.json [--resume]``.

    With ``max_restarts`` > 0 torchrun restarts every rank when one dies; the restarted trainer
    resumes from the latest good checkpoint by itself (it sees ``TORCHELASTIC_RESTART_COUNT``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "workbench.trainer", str(config_path)]
    return cmd + (["--resume"] if resume else [])


def format_event(event: dict[str, Any], total: int) -> str | None:
    """The progress line of an event, or None for events not shown (other ranks' steps, phases of
    a checkpoint before it is committed...)."""
    kind, rank = event["kind"], event.get("rank")
    if kind == "step" and rank == 0:
        return format_step(event, total)
    if kind == "error":
        return f"error: {event['error']}"
    if kind == "checkpoint" and event.get("phase") == "committed":
        return f"checkpoint {Path(event['path']).name} committed ({event['bytes'] / 1e6:.1f} MB, {event['duration_s']:.2f} s)"
    if kind == "checkpoint_rejected":
        return f"checkpoint {Path(event['path']).name} rejected: {event['reason']}"
    if kind == "fault":
        return f"fault: rank {rank} {event['cause']} after step {event['last_step']} (attempt {event['attempt']}): {event['detail']}"
    if kind == "restart" and rank == 0:
        return f"restart: attempt {event['attempt']}" + (f" of at most {event['max_restarts']}" if event.get("max_restarts") else "")
    if kind == "resume" and rank == 0:
        where = Path(event["path"]).name if event.get("path") else "the start (no good checkpoint)"
        return f"resume at step {event['step']} from {where}" + (" (resharded)" if event.get("resharded") else "")
    return None


def train_local(config: RunConfig, run_root: str | os.PathLike = "runs", run_id: str | None = None,
                stream: Callable[[str], None] = print, env: dict[str, str] | None = None,
                max_restarts: int = 0) -> int:
    """Create the run directory, run torchrun with one process per rank, stream one line per
    step (from rank 0's events), every error, checkpoint commit, fault, restart and resume; return
    the job's exit status. ``max_restarts``: torchrun restarts the job that many times at most."""
    check_trainable(config)  # before any process starts
    run_dir = create_run_dir(config, run_root, run_id)
    stream(f"run {run_dir}  ({config.world_size} ranks, {config.plan.describe()})")
    return _run_torchrun(run_dir, config, stream, env, resume=False, max_restarts=max_restarts)


def resume_local(run_dir: str | os.PathLike, stream: Callable[[str], None] = print,
                 env: dict[str, str] | None = None, max_restarts: int = 0) -> int:
    """``workbench train --resume runs/<id>``: run the run directory's own config.json again, from
    its latest good checkpoint (from step 0 when there is none), appending to the same events."""
    run_dir = Path(run_dir)
    config = RunConfig.load(str(run_dir / "config.json"))
    check_trainable(config)
    stream(f"resume {run_dir}  ({config.world_size} ranks, {config.plan.describe()})")
    return _run_torchrun(run_dir, config, stream, env, resume=True, max_restarts=max_restarts)


def _run_torchrun(run_dir: Path, config: RunConfig, stream: Callable[[str], None], env: dict[str, str] | None,
                  resume: bool, max_restarts: int) -> int:
    child_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    if max_restarts:
        # torchrun shares its rendezvous TCPStore with the workers and keeps it across restarts,
        # without a per-attempt prefix: a restarted rank can read a dead peer's gloo/NCCL address
        # left by the previous attempt and fail to connect (pytorch/pytorch#135712). A store per
        # attempt (hosted by worker rank 0) avoids the race.
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    since = next_seq(read_events(run_dir))  # a resumed run streams only what it adds
    log = open(run_dir / "torchrun.log", "a" if resume else "w")
    proc = subprocess.Popen(torchrun_command(run_dir / "config.json", config.world_size, resume, max_restarts),
                            stdout=log, stderr=subprocess.STDOUT, env=child_env)
    total = config.train.steps

    def drain() -> None:
        for e in read_events(run_dir, since):
            since[e["rank"]] = e["seq"] + 1
            line = format_event(e, total)
            if line is not None:
                stream(line)

    try:
        while proc.poll() is None:
            drain()
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        log.close()
    drain()
    code = proc.returncode
    if code != 0:
        tail = (run_dir / "torchrun.log").read_text().strip().splitlines()[-5:]
        stream(f"job failed with exit status {code}; log: {run_dir / 'torchrun.log'}")
        for line in tail:
            stream(f"  {line}")
    else:
        stream(f"done: {run_dir}")
    return code
