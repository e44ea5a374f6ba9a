"""Start the collective benchmark on this machine: a run directory with ``bench.json``, then
``torchrun`` with one process per rank of the cluster running ``python -m workbench.bench.collectives``.

Other launchers (the Jupyter-kernel ones, issue 6) start the same entry module with the same
``bench.json``; only how the processes are started differs. No torch is imported here.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from workbench.spec.cluster import Cluster
from workbench.spec.config import RunConfig, TrainSettings
from workbench.spec.errors import require
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.launch.handle import launch
from workbench.rundir.benchmarks import DEFAULT_MAX_BYTES, BenchSpec, CommsResults, load_results, size_ladder

ENTRY = "workbench.bench.collectives"


def _cuda_devices() -> int:
    """Local GPUs, asked of a child process so that this one never imports torch."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def bench_spec(config_or_cluster: RunConfig | Cluster, plan: ParallelPlan | str | None = None, *,
               sizes: Sequence[int] | None = None, max_bytes: int | None = None, min_bytes: int = 8,
               device: str = "auto", **options: Any) -> BenchSpec:
    """The BenchSpec for a RunConfig (its cluster and plan) or a Cluster and a plan (a
    ParallelPlan, or text like ``"tp=2,dp_shard=2"``; None: pure data parallelism over the world).
    ``sizes`` defaults to 8 B doubling to ``max_bytes`` (DEFAULT_MAX_BYTES of the device);
    ``options`` are the other BenchSpec fields (ops, dims, warmup, point_budget_s, ...)."""
    if isinstance(config_or_cluster, RunConfig):
        cluster = config_or_cluster.cluster
        plan = plan if plan is not None else config_or_cluster.plan
    else:
        cluster = config_or_cluster
    if plan is None or isinstance(plan, str):
        plan = ParallelPlan.parse(plan or "")
    if sizes is None:
        kind = device if device != "auto" else ("cuda" if _cuda_devices() >= cluster.world_size else "cpu")
        sizes = size_ladder(max_bytes or DEFAULT_MAX_BYTES[kind], min_bytes)
    return BenchSpec(cluster=cluster, plan=plan, sizes=tuple(sizes), device=device, **options)


def torchrun_command(spec_path: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", ENTRY, str(spec_path)]


def new_bench_id(spec: BenchSpec) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    label = spec.plan.describe().split(" ")[0].replace(",", "_")
    return f"{stamp}-bench-comms-{spec.world_size}r-{label}"


def run_comms_benchmark(config_or_cluster: RunConfig | Cluster | BenchSpec, plan: ParallelPlan | str | None = None,
                        run_root: str | os.PathLike = "runs", *, run_id: str | None = None,
                        stream: Callable[[str], None] = print, env: dict[str, str] | None = None,
                        timeout_s: float | None = None, backend: str | None = None,
                        backend_options: dict[str, Any] | None = None, **spec_options: Any) -> CommsResults:
    """Benchmark the collectives of ``plan`` on this machine: write ``<run_root>/<run_id>/bench.json``,
    run torchrun with one process per rank of the cluster (all on this host for now), and return
    the results rank 0 wrote to ``comms.json`` there (``results.path``). ``spec_options`` go to :func:`bench_spec`
    (sizes, max_bytes, ops, dims, device, point_budget_s, ...). Raises RuntimeError with the tail of
    ``torchrun.log`` when the job fails."""
    spec = config_or_cluster if isinstance(config_or_cluster, BenchSpec) else \
        bench_spec(config_or_cluster, plan, **spec_options)
    if backend is not None:
        return _run_through_launcher(spec, backend, run_root, run_id=run_id, stream=stream, env=env,
                                     timeout_s=timeout_s, **(backend_options or {}))
    run_dir = Path(run_root) / (run_id or new_bench_id(spec))
    run_dir.mkdir(parents=True, exist_ok=False)
    spec_path = run_dir / "bench.json"

    spec_path.write_text(json.dumps(spec.to_dict(), indent=1))
    stream(f"bench {run_dir}  ({spec.world_size} ranks, plan {spec.plan.describe()}, "
           f"{len(spec.sizes)} sizes {spec.sizes[0]} B .. {spec.sizes[-1]} B, ops {', '.join(spec.ops)})")
    # One thread per rank: the ranks share the cores, and gloo's copies are single-threaded anyway.
    child_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    with open(run_dir / "torchrun.log", "w") as log:
        try:
            code = subprocess.run(torchrun_command(spec_path, spec.world_size), stdout=log,
                                  stderr=subprocess.STDOUT, env=child_env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code != 0 or not (run_dir / "comms.json").exists():
        tail = "\n".join((run_dir / "torchrun.log").read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"benchmark failed (exit status {code}); log {run_dir / 'torchrun.log'}:\n{tail}")
    results = load_results(run_dir / "comms.json")
    require(isinstance(results, CommsResults), "comms.json is not a comms results file", field="results")
    stream(f"done: {run_dir / 'comms.json'} ({results.wall_s:.1f} s)")
    return results


def _run_through_launcher(spec: BenchSpec, backend: str, run_root: str | os.PathLike, *, run_id: str | None,
                          stream: Callable[[str], None], env: dict[str, str] | None, timeout_s: float | None,
                          **options: Any) -> CommsResults:
    """The benchmark through the same launcher as training runs (issue 6): one Jupyter kernel per
    node (``backend`` local, ssh or gateway) starts torchrun over the benchmark's entry. The run
    directory holds ``bench.json`` and, from rank 0, ``comms.json`` (with a remote backend it is
    written on node 0: use ``shared_run_root=True`` to read it here)."""
    # The launcher sizes the job from a RunConfig: the cluster, and a plan of the same world size.
    sizing = RunConfig(ModelSpec.preset("tiny"), spec.cluster, ParallelPlan(dp_shard=spec.world_size, zero_stage=0),
                       TrainSettings(seq_len=64))
    run = launch(sizing, backend, run_root=run_root, run_id=run_id or new_bench_id(spec), env=env,
                 program=[ENTRY, "{run_dir}/bench.json"], files={"bench.json": json.dumps(spec.to_dict(), indent=1)},
                 **options)
    stream(f"bench {run.path}  ({spec.world_size} ranks through {backend} kernels, plan {spec.plan.describe()})")
    try:
        status = run.wait(timeout_s)
    finally:
        run.shutdown()
    out = Path(run.path) / "comms.json"
    if status.state != "finished":
        raise RuntimeError(f"benchmark through the {backend} launcher ended {status.state}: {status.why}")
    if not out.exists():
        raise RuntimeError(f"benchmark through the {backend} launcher finished, but node 0 wrote comms.json under "
                           f"its own run directory, not in {out}: run it with shared_run_root=True (a file system "
                           "the nodes share with this machine)")
    results = load_results(out)
    require(isinstance(results, CommsResults), "comms.json is not a comms results file", field="results")
    stream(f"done: {out} ({results.wall_s:.1f} s)")
    return results


__all__ = ["bench_spec", "new_bench_id", "run_comms_benchmark", "torchrun_command"]
