"""The collective benchmark: ``python -m workbench.bench.collectives <run_dir>/bench.json`` under torchrun.

Every rank reads the :class:`~workbench.rundir.benchmarks.BenchSpec`, joins the job (gloo on CPU,
NCCL on CUDA), and builds the process groups of each group dimension of the plan from
``plan.group_ranks(dim)``, exactly as the trainer would. All groups of a dimension run at once, as
they do in training (the TP groups of every node all-reduce together), so contention is measured.

For each (dimension, collective, size), as nccl-tests does: ``warmup`` untimed calls, then samples
of k back-to-back calls, timed on each rank, with k so that a sample lasts ``min_sample_s``. No
barrier inside the series: a barrier before each sample would time the first call after it, which
pays for the barrier's exit skew and, on a busy CPU, for waking every process up again (on this
2-core machine 5x the time of a call back to back). Samples are taken round-robin over the sizes
(one per size per sweep), so that slow drifts in the machine's load affect every size alike, each
after one untimed call that lines the ranks up again. A sample's time per call is its time / k
averaged over the ranks (nccl-tests' default, ``-a 1``). Min, median and p95 over the samples;
algbw and busbw from the median, by nccl-tests' conventions (:mod:`workbench.predict.comms`).

What is timed (S = ``size_bytes``, n = group size, e = element bytes):

* all_reduce: ``all_reduce`` of S / e elements.
* all_gather: ``all_gather_into_tensor``, S / (n e) elements in, S / e out.
* reduce_scatter: ``reduce_scatter_tensor``, S / e in, S / (n e) out. It is probed once at the
  start (torch 2.13's gloo has it); where the backend lacks it the benchmark falls back to
  ``all_reduce`` of the input and a local slice: the same result, but twice the wire bytes of a
  ring reduce-scatter, so its busbw halves; ``implementations`` in comms.json records which ran.
* all_to_all: ``all_to_all_single``, S / e in and out (S counts the chunk a rank keeps).
* send_recv: every rank sends S to a partner and receives S from it at the same time (isend +
  irecv), like nccl-tests' sendrecv. Partners are i <-> i + n/2 in the group (for even n), so a
  group that spans nodes exchanges across them; odd n sends around the ring.

Before timing, each (dimension, collective) is run once on known values and checked, so a wrong
group or a broken fallback fails loudly instead of timing garbage. Sizes are rounded up to a
multiple of n x e so that every chunk is whole (8 B over 4 ranks of fp32 becomes 16 B).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from workbench.predict.stats import percentile
from workbench.rundir.record import workbench_version
from workbench.rundir.benchmarks import BenchSpec, CommsResults, CommsRow, save_results

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_CALLS_PER_SAMPLE = 256


@dataclass
class GroupSet:
    """One dimension's groups, and this rank's group and its place in it."""

    dim: str
    groups: list[list[int]]
    tier: str
    ranks: list[int]  # this rank's group (global ranks)
    pg: dist.ProcessGroup
    index: int  # this rank's index in ``ranks``

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Context:
    """What every step of the benchmark needs: the spec, this rank, its device and buffer dtype."""

    spec: BenchSpec
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self._token = torch.zeros(1, device=self.device)

    def sync(self) -> None:
        """Wait for queued GPU work: host timers only mean something after it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Line the ranks up: a 1-element all-reduce (gloo runs it in ~60% of its barrier's time;
        NCCL's barrier is one)."""
        dist.all_reduce(self._token)
        self.sync()

    def world_max(self, values: list[float]) -> list[float]:
        """Element-wise max over all ranks (so that every rank agrees on the same counts)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def world_mean(self, values: list[float]) -> list[float]:
        """Element-wise mean over all ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return (t / self.world).tolist()


# ---------------------------------------------------------------------------- groups
def build_groups(spec: BenchSpec, rank: int) -> list[GroupSet]:
    """Process groups of every timed dimension (:meth:`BenchSpec.measured_dims`). Every rank calls
    ``new_group`` for every group, in the same order: torch requires it, even of ranks outside."""
    sets = []
    for dim, tier in spec.measured_dims()[0]:
        groups = spec.groups(dim)
        mine = None
        for g in groups:
            pg = dist.group.WORLD if len(g) == spec.world_size else dist.new_group(g)
            if rank in g:
                mine = (g, pg)
        assert mine is not None, f"rank {rank} is in no group of {dim}"
        sets.append(GroupSet(dim, groups, tier, mine[0], mine[1], mine[0].index(rank)))
    return sets


def partners(gs: GroupSet) -> tuple[int, int]:
    """(send-to, receive-from) global ranks for send_recv: i <-> i + n/2, or the ring for odd n."""
    n, i = gs.size, gs.index
    if n % 2 == 0:
        p = gs.ranks[(i + n // 2) % n]
        return p, p
    return gs.ranks[(i + 1) % n], gs.ranks[(i - 1) % n]


# ---------------------------------------------------------------------------- the collectives
def reduce_scatter_supported(ctx: Context) -> bool:
    """Probe ``reduce_scatter_tensor`` once on the world (every rank gets the same answer: a
    backend without it raises before any communication)."""
    x = torch.ones(ctx.world, dtype=ctx.dtype, device=ctx.device)
    out = torch.empty(1, dtype=ctx.dtype, device=ctx.device)
    try:
        dist.reduce_scatter_tensor(out, x)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    ctx.sync()
    return bool(out.item() == ctx.world)


def rounded_size(op: str, size: int, n: int, elem: int) -> int:
    """S rounded up so that it is a whole number of elements, split into n equal chunks."""
    unit = elem * (n if op in ("all_gather", "reduce_scatter", "all_to_all") else 1)
    return max(unit, -(-size // unit) * unit)


def make_call(op: str, size: int, gs: GroupSet, ctx: Context, fused_rs: bool) -> tuple[Callable[[], None], dict]:
    """A zero-argument function issuing one ``op`` of S = ``size`` bytes on ``gs``, and its buffers."""
    elem = torch.tensor([], dtype=ctx.dtype).element_size()
    count, n, pg = size // elem, gs.size, gs.pg
    # zeros: sums stay 0 (uninitialised memory may hold NaNs or denormals, slow on CPUs)
    new = lambda c: torch.zeros(c, dtype=ctx.dtype, device=ctx.device)  # noqa: E731
    if op == "all_reduce":
        buf = {"x": new(count)}
        return lambda: dist.all_reduce(buf["x"], group=pg), buf
    if op == "all_gather":
        buf = {"x": new(count // n), "out": new(count)}
        return lambda: dist.all_gather_into_tensor(buf["out"], buf["x"], group=pg), buf
    if op == "reduce_scatter":
        buf = {"x": new(count), "out": new(count // n)}
        if fused_rs:
            return lambda: dist.reduce_scatter_tensor(buf["out"], buf["x"], group=pg), buf

        def fallback() -> None:
            dist.all_reduce(buf["x"], group=pg)
            buf["out"].copy_(buf["x"].view(n, -1)[gs.index])

        return fallback, buf
    if op == "all_to_all":
        buf = {"x": new(count), "out": new(count)}
        return lambda: dist.all_to_all_single(buf["out"], buf["x"], group=pg), buf
    if op == "send_recv":
        dst, src = partners(gs)
        buf = {"x": new(count), "out": new(count)}

        def exchange() -> None:
            reqs = [dist.isend(buf["x"], dst, group=pg), dist.irecv(buf["out"], src, group=pg)]
            for r in reqs:
                r.wait()

        return exchange, buf
    raise ValueError(op)


def check_call(op: str, gs: GroupSet, ctx: Context, fused_rs: bool) -> None:
    """Run ``op`` once on known values and compare with the answer worked out by hand."""
    n = gs.size
    size = rounded_size(op, 4 * n * 4, n, torch.tensor([], dtype=ctx.dtype).element_size())
    call, buf = make_call(op, size, gs, ctx, fused_rs)
    me = ctx.rank
    x = buf["x"]
    # Small integers stay exact in every dtype and every summation order.
    if op == "all_to_all":
        x.copy_(torch.arange(n, device=ctx.device).repeat_interleave(x.numel() // n) + 10 * (me + 1))
    else:
        x.fill_(me + 1)
    call()
    ctx.sync()
    total = float(sum(r + 1 for r in gs.ranks))
    if op == "all_reduce":
        want = torch.full_like(x, total)
        got = x
    elif op == "all_gather":
        want = torch.tensor([r + 1 for r in gs.ranks], dtype=ctx.dtype, device=ctx.device).repeat_interleave(x.numel())
        got = buf["out"]
    elif op == "reduce_scatter":
        want = torch.full_like(buf["out"], total)
        got = buf["out"]
    elif op == "all_to_all":
        chunk = x.numel() // n
        want = torch.tensor([10 * (r + 1) + gs.index for r in gs.ranks], dtype=ctx.dtype,
                            device=ctx.device).repeat_interleave(chunk)
        got = buf["out"]
    else:
        want = torch.full_like(x, partners(gs)[1] + 1)
        got = buf["out"]
    if not torch.equal(got, want):
        raise RuntimeError(f"rank {me}: {op} over dim={gs.dim} group {gs.ranks} gave {got.tolist()}, "
                           f"expected {want.tolist()}")


# ---------------------------------------------------------------------------- timing
def plan_point(call: Callable[[], None], ctx: Context, k_max: int) -> tuple[int, int]:
    """Warm up, then agree on (calls per sample k, samples) from the time t of one call (three
    back-to-back calls / 3, the slowest rank's): k t >= ``min_sample_s`` (host timer reads and GPU
    synchronisations cost nothing next to a sample), at most ``k_max`` (the k of the next smaller
    size: k never grows with the size, so a noisy estimate cannot single out one size)."""
    spec = ctx.spec
    for _ in range(spec.warmup):
        call()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(3):
        call()
    ctx.sync()
    (estimate,) = ctx.world_max([(time.perf_counter() - t0) / 3])
    estimate = max(estimate, 1e-7)
    k = min(k_max, max(1, math.ceil(spec.min_sample_s / estimate)))
    samples = int(spec.point_budget_s / ((k + 1) * estimate))
    return k, min(spec.max_samples, max(spec.min_samples, samples))


def take_sample(call: Callable[[], None], ctx: Context, k: int) -> float:
    """This rank's seconds per call over ``k`` back-to-back calls. One untimed call first: it
    lines the ranks up again after the previous size (a collective ends together on all ranks)."""
    call()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    ctx.sync()
    return (time.perf_counter() - t0) / k


def time_series(op: str, gs: GroupSet, ctx: Context, fused_rs: bool) -> list[CommsRow]:
    """Every size of one (dim, op), sampled round-robin: each sweep up the size ladder takes one
    sample of the sizes due one, so that a burst of load from elsewhere on the machine (seconds
    long) lands on all sizes alike instead of bending the curve at a few."""
    elem = torch.tensor([], dtype=ctx.dtype).element_size()
    points = []  # (requested, size, call, k, samples)
    k = MAX_CALLS_PER_SAMPLE
    for req in sorted(ctx.spec.sizes):
        size = rounded_size(op, req, gs.size, elem)
        call, _buf = make_call(op, size, gs, ctx, fused_rs)  # the buffers live as long as ``call``
        k, samples = plan_point(call, ctx, k)
        points.append((req, size, call, k, samples))
    local: list[list[float]] = [[] for _ in points]
    sweeps = max(p[4] for p in points)
    for sweep in range(sweeps):
        for i, (_, _, call, k, samples) in enumerate(points):
            # A size with fewer samples than sweeps takes them evenly spread over all the sweeps,
            # not in the first ones only: each size then sees the whole run's mix of load.
            if (sweep + 1) * samples // sweeps > sweep * samples // sweeps:
                local[i].append(take_sample(call, ctx, k))
    rows = []
    for (req, size, _, k, _), mine in zip(points, local):
        ts = ctx.world_mean(mine)
        rows.append(CommsRow(gs.dim, op, gs.size, gs.tier, size, req, len(ts), k, min(ts), percentile(ts, 50),
                             percentile(ts, 95)))
    return rows


def versions(backend: str) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "workbench": workbench_version(),
           "hostname": socket.gethostname(), "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if backend == "nccl":
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        out["devices"] = [f"cpu ({os.cpu_count()} cores)"]
    return out


def run(spec: BenchSpec, out_path: Path | None = None) -> CommsResults | None:
    """The benchmark on this rank of an initialised job; rank 0 returns (and writes) the results."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != spec.world_size:
        raise RuntimeError(f"the job has {world} ranks but cluster {spec.cluster.nodes} x "
                           f"{spec.cluster.gpus_per_node} needs {spec.world_size}")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ctx = Context(spec, rank, world, device, TORCH_DTYPES[spec.dtype])
    sets = build_groups(spec, rank)
    fused_rs = "reduce_scatter" not in spec.ops or reduce_scatter_supported(ctx)
    rows: list[CommsRow] = []
    for gs in sets:
        for op in spec.ops:
            check_call(op, gs, ctx, fused_rs)
            ctx.barrier()
            rows += time_series(op, gs, ctx, fused_rs)
    impl = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
            "reduce_scatter": "reduce_scatter_tensor" if fused_rs else "all_reduce + local slice (fallback)",
            "all_to_all": "all_to_all_single", "send_recv": "isend + irecv with a partner"}
    ctx.barrier()
    if rank != 0:
        return None
    results = CommsResults(
        cluster=spec.cluster, plan=spec.plan, world_size=world, backend=backend, device=device.type,
        dtype=spec.dtype, rows=tuple(rows), groups={d: spec.groups(d) for d in spec.bench_dims()},
        aliases=spec.measured_dims()[1],
        implementations={op: impl[op] for op in spec.ops}, versions=versions(backend),
        wall_s=time.perf_counter() - start,
    )
    if out_path is not None:
        save_results(results, out_path)
    return results


def pick_backend(spec: BenchSpec) -> str:
    """NCCL when asked for cuda, or on auto when every local rank can have its own GPU."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if spec.device == "cuda":
        return "nccl"
    if spec.device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local:
        return "nccl"
    return "gloo"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun ... -m workbench.bench.collectives <run_dir>/bench.json", file=sys.stderr)
        return 2
    spec_path = Path(argv[0])
    import json

    spec = BenchSpec.from_dict(json.loads(spec_path.read_text()))
    backend = pick_backend(spec)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    try:
        run(spec, spec_path.parent / "comms.json")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
