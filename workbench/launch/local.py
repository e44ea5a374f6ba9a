"""Start a run on this machine: a run directory, then ``torchrun`` with one process per rank.

``workbench train`` calls :func:`config_from_cli` and :func:`train_local`. Validation happens when
the RunConfig is built, so a bad config raises :class:`~workbench.errors.ConfigError` before any
process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..cluster import Cluster
from ..config import RunConfig, TrainSettings
from ..model import ModelSpec
from ..plan import ParallelPlan
from ..telemetry.events import read_events
from ..telemetry.rundir import create_run_dir
from ..trainer.support import check_trainable

POLL_S = 0.2


def config_from_cli(model: str, plan: str, steps: int, **train_overrides: Any) -> RunConfig:
    """A RunConfig for the local CPU trainer: ``model`` preset, ``plan`` text
    (``"dp_shard=2,tp=2"``; an unset dp_shard is 1), ``steps``; one "node" per 2 ranks; the world
    size is the product of the plan's degrees.
    Defaults: seq_len 64, micro_batch_size 2, fp32; ``train_overrides`` replace any of them
    (``precision="bf16"`` picks a precision preset)."""
    spec = ModelSpec.preset(model)
    parsed = ParallelPlan.parse(plan or "", dp_shard=1)
    world = parsed.pp * parsed.dp_replicate * parsed.dp_shard * parsed.cp * parsed.tp
    # Two ranks per "node" (an odd world size is one node holding them all).
    per_node = 2 if world % 2 == 0 else world
    cluster = Cluster.preset("local-cpu", nodes=world // per_node, gpus_per_node=per_node)
    precision = train_overrides.pop("precision", "fp32")
    fields = dict(seq_len=64, micro_batch_size=2, steps=steps, warmup_steps=min(10, max(steps // 10, 1)))
    fields.update(train_overrides)
    train = TrainSettings(**fields).with_precision(precision)
    return RunConfig(spec, cluster, parsed, train)


def format_step(event: dict[str, Any], total: int) -> str:
    """One progress line: ``step   12/50  loss 4.1234  gnorm 0.812  lr 3.0e-04  2,345 tok/s  0.11 s``."""
    return (f"step {event['step'] + 1:>5}/{total}  loss {event['loss']:.4f}  gnorm {event['grad_norm']:.3f}  "
            f"lr {event['lr']:.1e}  {event['tokens_per_s']:,.0f} tok/s  {event['step_time_s']:.2f} s")


def torchrun_command(config_path: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "workbench.trainer", str(config_path)]


def train_local(config: RunConfig, run_root: str | os.PathLike = "runs", run_id: str | None = None,
                stream: Callable[[str], None] = print, env: dict[str, str] | None = None) -> int:
    """Create the run directory, run torchrun with one process per rank, stream one line per
    step (from rank 0's events) and every error event; return the job's exit status."""
    check_trainable(config)  # before any process starts
    run_dir = create_run_dir(config, run_root, run_id)
    stream(f"run {run_dir}  ({config.world_size} ranks, {config.plan.describe()})")
    child_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    log = open(run_dir / "torchrun.log", "w")
    proc = subprocess.Popen(torchrun_command(run_dir / "config.json", config.world_size),
                            stdout=log, stderr=subprocess.STDOUT, env=child_env)
    since: dict[int, int] = {}
    total = config.train.steps

    def drain() -> None:
        events = read_events(run_dir, since)
        for e in events:
            since[e["rank"]] = e["seq"] + 1
            if e["kind"] == "step" and e["rank"] == 0:
                stream(format_step(e, total))
            elif e["kind"] == "error":
                stream(f"error: {e['error']}")

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
