"""The files of a benchmark run: what to measure (``bench.json``) and what was measured
(``comms.json``, ``compute.json``), and the nccl-tests style table that prints them.

A benchmark run directory (DESIGN.md, ``runs/<run-id>/``) holds::

    bench.json     the BenchSpec: cluster, plan, sizes, ops, iteration budget
    comms.json     CommsResults, written by rank 0 of ``python -m workbench.bench.collectives``
    compute.json   ComputeResults of the matmul microbenchmark (optional)
    torchrun.log   the benchmark processes' output

Sizes and bandwidths follow :mod:`workbench.predict.comms` (nccl-tests, doc/PERFORMANCE.md): ``size_bytes``
is S as nccl-tests counts it (the all-gather *output*, the reduce-scatter *input*, one rank's whole
all-to-all send buffer), ``algbw = S / t`` and ``busbw = algbw x BUS_FACTOR[op](n)``. Times are
seconds per call; bandwidths are bytes per second. Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from workbench.spec.cluster import Cluster
from workbench.predict.comms import BUS_FACTOR, OPS
from workbench.spec.errors import ConfigError, check_choice, check_int, check_positive, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.files import TABLE_MAX_BYTES, read_user_json
from workbench.spec.plan import ParallelPlan

SCHEMA_VERSION = 1
# Group dimensions the benchmark measures, innermost first (the order of the table), and the
# whole world. Composite dimensions (dp, dp_shard_cp, dp_cp) are progressions of these ranks.
BENCH_DIMS = ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")
WORLD = "world"
DEVICES = ("auto", "cpu", "cuda")
MiB = 1 << 20
# Default largest message. GPU: 256 MiB, where NVLink and InfiniBand reach their plateau (as in
# nccl-tests' -e 256M). CPU: 16 MiB. gloo over loopback moves ~1 GB/s, so 16 MiB already takes
# ~10-30 ms, well inside the bandwidth-bound regime the fit needs; 256 MiB would take ~0.5 s per
# call and 4 ranks x 3 buffers x 256 MiB = 3 GiB of memory. Pass max_bytes=256 MiB to measure it.
DEFAULT_MAX_BYTES = {"cuda": 256 * MiB, "cpu": 16 * MiB}


def size_ladder(max_bytes: int, min_bytes: int = 8) -> tuple[int, ...]:
    """Message sizes from ``min_bytes`` doubling up to ``max_bytes`` (nccl-tests ``-b -e -f 2``)."""
    check_int("min_bytes", min_bytes)
    require(max_bytes >= min_bytes, f"max_bytes={max_bytes} is below min_bytes={min_bytes}",
            field="max_bytes", value=max_bytes)
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return tuple(out)


# ---------------------------------------------------------------------------- what to measure
@dataclass(frozen=True)
class BenchSpec:
    """``bench.json``: the cluster the ranks stand for, the plan whose groups are measured, and
    how long to measure.

    Iterations adapt to the time each call takes (see :mod:`workbench.bench.collectives`): after
    ``warmup`` untimed calls, a *sample* is ``k`` back-to-back calls, with k chosen so that a
    sample lasts at least ``min_sample_s``; ``min_samples``..``max_samples`` samples are taken, as
    many as fit in ``point_budget_s`` per (dim, op, size), round-robin over the sizes.
    """

    cluster: Cluster
    plan: ParallelPlan
    sizes: tuple[int, ...]
    ops: tuple[str, ...] = OPS
    dims: tuple[str, ...] | None = None  # None: every BENCH_DIMS with degree > 1, then "world"
    device: str = "auto"  # auto: cuda (NCCL) when there are enough GPUs, else cpu (gloo)
    dtype: str = "fp32"  # element type of the buffers (nccl-tests' default float)
    warmup: int = 2
    min_samples: int = 5
    max_samples: int = 30
    point_budget_s: float = 0.05
    min_sample_s: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "ops", tuple(self.ops))
        if self.dims is not None:
            object.__setattr__(self, "dims", tuple(self.dims))
        require(len(self.sizes) > 0, "sizes is empty", field="sizes", value=list(self.sizes))
        for s in self.sizes:
            check_int("sizes", s)
        for op in self.ops:
            check_choice("ops", op, OPS)
        for d in self.dims or ():
            check_choice("dims", d, BENCH_DIMS + (WORLD,))
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, ("fp32", "bf16", "fp16"))
        check_int("warmup", self.warmup, minimum=0)
        check_int("min_samples", self.min_samples)
        check_int("max_samples", self.max_samples, minimum=self.min_samples)
        check_positive("point_budget_s", self.point_budget_s)
        check_positive("min_sample_s", self.min_sample_s)
        object.__setattr__(self, "plan", self.plan.resolve(self.cluster.world_size))

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def bench_dims(self) -> tuple[str, ...]:
        """The dimensions to measure, in table order."""
        if self.dims is not None:
            return self.dims
        return tuple(d for d in BENCH_DIMS if self.plan.degree(d) > 1) + (WORLD,)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (``world``: all ranks)."""
        return [list(range(self.world_size))] if dim == WORLD else self.plan.group_ranks(dim)

    def measured_dims(self) -> tuple[list[tuple[str, str]], dict[str, str]]:
        """((dim, tier) of each dimension to time, aliases). A dimension whose groups equal an
        earlier one's (dp_shard=4 on 4 ranks *is* the world) is timed once and listed in
        ``aliases`` as dim -> the timed twin; groups of one rank are skipped."""
        placement = self.plan.placement(self.cluster)
        timed: list[tuple[str, str]] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for dim in self.bench_dims():
            groups = self.groups(dim)
            if len(groups[0]) < 2:
                continue
            key = tuple(tuple(g) for g in groups)
            if key in seen:
                aliases[dim] = seen[key]
                continue
            seen[key] = dim
            tier = self.cluster.tier_between(groups[0]) if dim == WORLD else placement.tiers[dim]
            timed.append((dim, tier))
        return timed, aliases

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(cluster=self.cluster.to_dict(), plan=self.plan.to_dict(), sizes=list(self.sizes),
                 ops=list(self.ops), dims=list(self.dims) if self.dims is not None else None)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BenchSpec":
        return from_mapping(cls, data, "bench", {"cluster": Cluster.from_dict, "plan": ParallelPlan.from_dict})


# ---------------------------------------------------------------------------- comms results
@dataclass(frozen=True)
class CommsRow:
    """One (group dimension, collective, message size): per-call times over the samples."""

    dim: str
    op: str
    group_size: int
    tier: str  # the slowest link tier the dimension's groups cross on the cluster
    size_bytes: int  # S, nccl-tests convention (rounded up so that it splits into n equal chunks)
    requested_bytes: int  # the size of the ladder this row stands for
    samples: int
    calls_per_sample: int
    time_min_s: float
    time_median_s: float
    time_p95_s: float

    def __post_init__(self) -> None:
        check_types(self, "rows[].")
        check_int("rows[].size_bytes", self.size_bytes)
        check_int("rows[].group_size", self.group_size)
        check_choice("rows[].op", self.op, OPS)
        for name in ("time_min_s", "time_median_s", "time_p95_s"):
            check_positive(f"rows[].{name}", getattr(self, name))

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth S / t from the median time (bytes/s)."""
        return self.size_bytes / self.time_median_s

    @property
    def busbw(self) -> float:
        """Bus bandwidth: algbw x BUS_FACTOR[op](n), comparable with the link bandwidth (bytes/s)."""
        return self.algbw * BUS_FACTOR[self.op](self.group_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(algbw_bytes_per_s=self.algbw, busbw_bytes_per_s=self.busbw)  # derived, for readers
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CommsRow":
        derived = ("algbw_bytes_per_s", "busbw_bytes_per_s")  # written for readers, computed again here
        return from_mapping(cls, _without(data, derived, "rows[]"), "rows[]")


@dataclass(frozen=True)
class CommsResults:
    """``comms.json``: every row, and what they were measured on."""

    cluster: Cluster
    plan: ParallelPlan
    world_size: int
    backend: str  # gloo | nccl
    device: str  # cpu | cuda
    dtype: str
    rows: tuple[CommsRow, ...]
    groups: Mapping[str, list[list[int]]] = field(default_factory=dict)  # dim -> its groups
    aliases: Mapping[str, str] = field(default_factory=dict)  # dim -> measured dim with the same groups
    implementations: Mapping[str, str] = field(default_factory=dict)  # op -> the torch call timed
    versions: Mapping[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0  # wall-clock time of the benchmark
    kind: str = "comms"
    path: str | None = field(default=None, compare=False)  # the file it was read from (not stored in it)

    def series(self, dim: str, op: str) -> list[CommsRow]:
        """Rows of one (dim, op), by size; an aliased dim reads its twin's rows."""
        dim = self.aliases.get(dim, dim)
        return sorted((r for r in self.rows if r.dim == dim and r.op == op), key=lambda r: r.size_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "schema_version": SCHEMA_VERSION,
            "cluster": self.cluster.to_dict(),
            "plan": self.plan.to_dict(),
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "groups": dict(self.groups),
            "aliases": dict(self.aliases),
            "implementations": dict(self.implementations),
            "versions": dict(self.versions),
            "wall_s": self.wall_s,
            "rows": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CommsResults":
        _check_kind(data, "comms")
        return from_mapping(cls, _without(data, ("schema_version", "path"), "comms"), "comms", {
            "cluster": Cluster.from_dict, "plan": ParallelPlan.from_dict, "rows": _rows(CommsRow)})

    def __post_init__(self) -> None:
        check_types(self, "comms.")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


# ---------------------------------------------------------------------------- compute results
@dataclass(frozen=True)
class ComputeRow:
    """One GEMM ``(m, k) x (k, n)`` in one dtype: 2 m k n FLOPs per call, ``count`` per forward pass."""

    dtype: str
    name: str  # qkv | latent_down | q_up | kv_up | attn_out | mlp_up | mlp_down | shared_up | shared_down | expert_up | expert_down | head
    m: int
    k: int
    n: int
    count: int
    samples: int
    time_min_s: float
    time_median_s: float

    def __post_init__(self) -> None:
        check_types(self, "rows[].")
        for name in ("m", "k", "n", "count"):
            check_int(f"rows[].{name}", getattr(self, name))
        for name in ("time_min_s", "time_median_s"):
            check_positive(f"rows[].{name}", getattr(self, name))

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.time_median_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flops_per_s"] = self.flops_per_s
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ComputeRow":
        return from_mapping(cls, _without(data, ("flops_per_s",), "rows[]"), "rows[]")


@dataclass(frozen=True)
class ComputeResults:
    """``compute.json``: achieved matmul FLOP/s at a model's per-TP-rank GEMM shapes."""

    model: str
    tp: int
    tokens: int
    device: str
    device_name: str
    threads: int
    rows: tuple[ComputeRow, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # dtype -> why it was not measured
    versions: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "compute"
    path: str | None = field(default=None, compare=False)  # the file it was read from (not stored in it)

    def flops_per_s(self) -> dict[str, float]:
        """Per dtype: total FLOPs / total time of one forward pass's GEMMs (each shape ``count``
        times), so that every GEMM weighs as much as the time it takes in the model."""
        out: dict[str, float] = {}
        for dtype in dict.fromkeys(r.dtype for r in self.rows):
            rows = [r for r in self.rows if r.dtype == dtype]
            out[dtype] = sum(r.flops * r.count for r in rows) / sum(r.time_median_s * r.count for r in rows)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "path"}
        d.update(schema_version=SCHEMA_VERSION, rows=[r.to_dict() for r in self.rows], skipped=dict(self.skipped),
                 versions=dict(self.versions), flops_per_s=self.flops_per_s())
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ComputeResults":
        _check_kind(data, "compute")
        return from_mapping(cls, _without(data, ("schema_version", "path", "flops_per_s"), "compute"), "compute",
                            {"rows": _rows(ComputeRow)})

    def __post_init__(self) -> None:
        check_types(self, "compute.")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


Results = CommsResults | ComputeResults


def _without(data: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    require(isinstance(data, Mapping), f"{where} must be a JSON object, not {type(data).__name__}", field=where)
    return {k: v for k, v in data.items() if k not in keys}


def _rows(kind: type) -> Any:
    def read(rows: Any) -> tuple:
        require(isinstance(rows, list), f"rows must be a list, not {type(rows).__name__}", field="rows")
        return tuple(kind.from_dict(r) for r in rows)
    return read


def _check_kind(data: Mapping[str, Any], kind: str) -> None:
    require(isinstance(data, Mapping), f"a {kind} results file must hold a JSON object", field="results")
    version = data.get("schema_version")
    require(version == SCHEMA_VERSION, f"schema_version={version!r} of a {kind} results file is not {SCHEMA_VERSION}",
            field="schema_version", value=version)
    found = data.get("kind")
    require(found == kind, f"kind={found!r} is not {kind!r}", field="kind", value=found)


def load_results(path: str | os.PathLike) -> Results:
    """Read ``comms.json`` or ``compute.json`` (a benchmark run directory reads its ``comms.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "comms.json"
    data = read_user_json(p, "results", TABLE_MAX_BYTES)
    require(isinstance(data, Mapping), f"results={str(p)!r} must hold a JSON object", field="results")
    kind = data.get("kind")
    if kind == "comms":
        return replace(CommsResults.from_dict(data), path=str(p))
    if kind == "compute":
        return replace(ComputeResults.from_dict(data), path=str(p))
    raise ConfigError(f"{str(p)!r} has kind={kind!r}; expected 'comms' or 'compute'", field="results", value=str(p))


def save_results(results: Results, path: str | os.PathLike) -> Path:
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(results.to_json())
    os.replace(tmp, p)  # readers never see half a file
    return p


# ---------------------------------------------------------------------------- tables
def _size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def format_table(results: Results | str | os.PathLike, ops: Sequence[str] | None = None) -> str:
    """The results as text, one block per group dimension in the manner of nccl-tests: a row per
    message size, and per collective the median time (us) and bus bandwidth (GB/s).
    Compute results print one row per (dtype, GEMM)."""
    if not isinstance(results, (CommsResults, ComputeResults)):
        results = load_results(results)
    if isinstance(results, ComputeResults):
        return _format_compute(results)
    r = results
    ops = [op for op in (ops or OPS) if any(row.op == op for row in r.rows)]
    lines = [f"# {r.world_size} ranks, backend {r.backend} ({r.device}), {r.dtype} buffers, plan {r.plan.describe()}, "
             f"{r.cluster.nodes} nodes x {r.cluster.gpus_per_node}",
             "# size: S as nccl-tests counts it; time: median per call (us); busbw = S / t x bus factor (GB/s)"]
    for dim in dict.fromkeys(row.dim for row in r.rows):
        first = next(row for row in r.rows if row.dim == dim)
        aka = [a for a, d in r.aliases.items() if d == dim]
        groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in r.groups.get(dim, []))
        lines.append("")
        lines.append(f"# dim={dim}{' (= ' + ', '.join(aka) + ')' if aka else ''}  group_size={first.group_size}  "
                     f"tier={first.tier}  groups {groups}")
        lines.append("#" + " " * 9 + "".join(f"{op:>22}" for op in ops))
        lines.append(f"#{'size':>9}" + "".join(f"{'time':>11}{'busbw':>11}" for _ in ops))
        by_key = {(row.op, row.requested_bytes): row for row in r.rows if row.dim == dim}
        for size in sorted({row.requested_bytes for row in r.rows if row.dim == dim}):
            cells = []
            for op in ops:
                row = by_key.get((op, size))
                cells.append(f"{row.time_median_s * 1e6:>11.1f}{row.busbw / 1e9:>11.3f}" if row else f"{'-':>22}")
            lines.append(f"{_size(size):>10}" + "".join(cells))
        peaks = []
        for op in ops:
            series = [row for row in r.rows if row.dim == dim and row.op == op]
            peaks.append(f"{'':>11}{max(x.busbw for x in series) / 1e9:>11.3f}" if series else f"{'':>22}")
        lines.append(f"#{'peak':>9}" + "".join(peaks))
    return "\n".join(lines)


def _format_compute(r: ComputeResults) -> str:
    lines = [f"# matmul FLOP/s: model {r.model}, tp={r.tp}, {r.tokens} tokens, {r.device_name}, {r.threads} threads",
             f"#{'dtype':>5} {'gemm':>12} {'m':>7} {'k':>7} {'n':>7} {'count':>6} {'time (us)':>11} {'TFLOP/s':>9}"]
    for row in r.rows:
        lines.append(f"{row.dtype:>6} {row.name:>12} {row.m:>7} {row.k:>7} {row.n:>7} {row.count:>6} "
                     f"{row.time_median_s * 1e6:>11.1f} {row.flops_per_s / 1e12:>9.4f}")
    for dtype, f in r.flops_per_s().items():
        lines.append(f"# {dtype}: {f / 1e12:.4f} TFLOP/s over a forward pass's GEMMs")
    for dtype, why in r.skipped.items():
        lines.append(f"# {dtype}: skipped ({why})")
    return "\n".join(lines)


__all__ = [
    "BENCH_DIMS",
    "BenchSpec",
    "CommsResults",
    "CommsRow",
    "ComputeResults",
    "ComputeRow",
    "DEFAULT_MAX_BYTES",
    "SCHEMA_VERSION",
    "WORLD",
    "format_table",
    "load_results",
    "save_results",
    "size_ladder",
]
