"""Split how: :class:`ParallelPlan`, its validation, the rank <-> mesh mapping and placement.

Mesh dimensions, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. TP is innermost
so that TP peers are neighbouring ranks and land inside one node. Expert parallelism borrows its
ranks from ``dp_shard x cp`` (the innermost ``ep`` of them), as in torchtitan.

:meth:`ParallelPlan.rank_coords` is the single mapping from a global rank to mesh coordinates:
the planner draws it and the trainer builds its process groups from it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from workbench.spec.cluster import Cluster
from workbench.spec.errors import ConfigError, check_choice, check_int, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.schedules import SCHEDULES, V_SCHEDULES

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Composite groups, each the flattening of mesh dimensions: "dp" reduces gradients without CP,
# "dp_cp" with it; "dp_shard_cp" is the FSDP sharding group (CP ranks hold different tokens of
# the same weights, so they shard too). The planner's groups and the trainer's flattened
# DeviceMesh dimensions are both built from this one table.
COMPOSITE_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
GROUP_DIMS = MESH_DIMS + ("ep",) + tuple(COMPOSITE_DIMS)
MAX_DEGREE = 1 << 20  # a million ranks in one dimension: beyond any cluster
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Short names a plan may be written with ("tp=8,pp=4,schedule=gpipe,zero=1") and the fields they set.
PLAN_ALIASES = {"dp": "dp_shard", "schedule": "pp_schedule", "v": "virtual_stages", "zero": "zero_stage"}


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of each parallelism and how they are run.

    ``dp_shard=-1`` takes every rank the other degrees leave. ``zero_stage`` applies to the
    ``dp_shard x cp`` group: 1 shards optimizer states (and master weights), 2 also gradients,
    3 also parameters (FSDP full sharding). ``virtual_stages`` is the number of pipeline stages
    each rank holds (interleaved and V schedules).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 3
    sequence_parallel: bool = True
    loss_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    # Layers per pipeline stage (pp * virtual_stages entries) when not split evenly, e.g. from a
    # profiling run ("balanced stages"). None: split by layer count.
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_types(self)
        for f in ("dp_replicate", "tp", "pp", "cp", "ep", "virtual_stages"):
            check_int(f, getattr(self, f), maximum=MAX_DEGREE)
        if self.dp_shard != -1:
            check_int("dp_shard", self.dp_shard, maximum=MAX_DEGREE)
        check_choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        check_choice("pp_schedule", self.pp_schedule, SCHEDULES)
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    # ------------------------------------------------------------------ parsing and JSON
    @classmethod
    def parse(cls, text: str, **defaults: Any) -> "ParallelPlan":
        """``"dp_shard=2,tp=2,pp_schedule=gpipe"`` -> ParallelPlan (``dp`` is an alias of dp_shard)."""
        if not isinstance(text, str):
            raise ConfigError(f"plan={text!r} must be a string like 'tp=8,pp=4'", field="plan", value=text)
        kw: dict[str, Any] = dict(defaults)
        names = {f.name: f for f in fields(cls)}
        given: set[str] = set()
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ConfigError(f"plan item {part!r} is not of the form name=value", field="plan", value=text)
            key, value = (s.strip() for s in part.split("=", 1))
            key = PLAN_ALIASES.get(key, key)
            if key not in names or key == "stage_layers":
                raise ConfigError(
                    f"plan has no field {key!r}; fields: {', '.join(n for n in names if n != 'stage_layers')}",
                    field="plan",
                    value=key,
                )
            if key in given:
                raise ConfigError(f"plan gives {key} twice", field=key, value=text)
            given.add(key)
            if key in ("sequence_parallel", "loss_parallel"):
                if value.lower() not in _TRUE + _FALSE:
                    raise ConfigError(f"{key}={value!r} must be one of {', '.join(_TRUE + _FALSE)}", field=key,
                                      value=value)
                kw[key] = value.lower() in _TRUE
            elif key == "pp_schedule":
                kw[key] = value
            else:
                # int() would take "８" (full-width) and "1_000": a degree is written in ASCII digits
                digits = value[1:] if value[:1] == "-" else value
                if not (digits.isascii() and digits.isdigit()):
                    raise ConfigError(f"{key}={value!r} must be an integer", field=key, value=value)
                kw[key] = int(value)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_layers"] = list(self.stage_layers) if self.stage_layers is not None else None
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelPlan":
        return from_mapping(cls, data, "plan")

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def describe(self) -> str:
        """Short label: ``"tp=8,pp=4,dp_shard=2 1f1b zero3"``."""
        parts = [f"{d}={getattr(self, d)}" for d in ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate") if getattr(self, d) != 1]
        label = ",".join(parts) or "single"
        if self.pp > 1:
            label += f" {self.pp_schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        sharded = self.dp_shard == -1 or self.dp_shard * self.cp > 1
        return label + (f" zero{self.zero_stage}" if sharded else "")

    # ------------------------------------------------------------------ degrees
    @property
    def world_size(self) -> int:
        require(self.dp_shard > 0, "dp_shard=-1 is unresolved; call resolve(world_size) first", field="dp_shard")
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct micro-batches per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_degree(self) -> int:
        """ZeRO/FSDP sharding degree of dense weights (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def degree(self, dim: str) -> int:
        if dim in MESH_DIMS or dim == "ep":
            return getattr(self, dim)
        if dim in COMPOSITE_DIMS:
            return math.prod(getattr(self, d) for d in COMPOSITE_DIMS[dim])
        raise ConfigError(f"dim={dim!r} is not one of {', '.join(GROUP_DIMS)}", field="dim", value=dim)

    def resolve(self, world_size: int) -> "ParallelPlan":
        """Fill ``dp_shard=-1`` from the world size and check that the degrees multiply to it."""
        check_int("world_size", world_size)
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            require(
                world_size % others == 0,
                f"world size {world_size} is not divisible by pp x dp_replicate x cp x tp = "
                f"{self.pp} x {self.dp_replicate} x {self.cp} x {self.tp} = {others}",
                field="dp_shard",
                value=-1,
            )
            return replace(self, dp_shard=world_size // others)
        product = others * self.dp_shard
        require(
            product == world_size,
            f"pp x dp_replicate x dp_shard x cp x tp = {self.pp} x {self.dp_replicate} x {self.dp_shard} x "
            f"{self.cp} x {self.tp} = {product} differs from the world size {world_size}",
            field="dp_shard",
            value=self.dp_shard,
        )
        return self

    # ------------------------------------------------------------------ the mesh
    def strides(self) -> dict[str, int]:
        """Global-rank stride of each mesh dimension (tp innermost)."""
        out: dict[str, int] = {}
        stride = 1
        for dim in reversed(MESH_DIMS):
            out[dim] = stride
            stride *= getattr(self, dim)
        return out

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: ``pp, dp_replicate, dp_shard, cp, tp`` and ``ep``
        (the rank's index inside its expert-parallel group)."""
        world = self.world_size
        require(0 <= rank < world, f"rank={rank} is outside the world size {world}", field="rank", value=rank)
        coords: dict[str, int] = {}
        rest = rank
        for dim in reversed(MESH_DIMS):
            n = getattr(self, dim)
            coords[dim] = rest % n
            rest //= n
        ordered = {d: coords[d] for d in MESH_DIMS}
        ordered["ep"] = (coords["dp_shard"] * self.cp + coords["cp"]) % self.ep
        return ordered

    def coords_rank(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`rank_coords` (``ep`` is ignored: it is derived)."""
        st = self.strides()
        return sum(coords.get(d, 0) * st[d] for d in MESH_DIMS)

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every process group of ``dim``: lists of global ranks, each sorted."""
        return [list(g) for g in _group_ranks(self, dim)]

    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The DeviceMesh the trainer builds: (name, size) for every degree > 1, outermost first."""
        return tuple((d, getattr(self, d)) for d in MESH_DIMS if getattr(self, d) > 1)

    # ------------------------------------------------------------------ pipeline stages
    def stage_layer_counts(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage (pp * virtual_stages of them)."""
        if self.stage_layers is not None:
            return self.stage_layers
        return split_layers(n_layers, self.n_stages)

    def stages_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        """Stage indices a pipeline rank holds: looped (r, r+p, ...) or V-shaped (r, 2p-1-r)."""
        p, v = self.pp, self.virtual_stages
        if self.pp_schedule in V_SCHEDULES and v == 2:
            return (pp_rank, 2 * p - 1 - pp_rank)
        return tuple(pp_rank + i * p for i in range(v))

    # ------------------------------------------------------------------ placement
    def placement(self, cluster: Cluster) -> "Placement":
        """Where each rank runs and which link tier each group dimension's traffic crosses."""
        plan = self.resolve(cluster.world_size)
        tiers = {dim: group_tier(plan, dim, cluster) for dim in GROUP_DIMS if plan.degree(dim) > 1}
        warnings = []
        link_names = {"intra_node": "NVLink" if "nvlink" in cluster.intra_node.name else cluster.intra_node.name,
                      "inter_node": "the network", "inter_leaf": "the spine"}
        fast = cluster.intra_node
        for dim, why in (("tp", "all-reduces"), ("cp", "ring K/V exchanges"), ("ep", "all-to-alls")):
            tier = tiers.get(dim)
            if tier and tier != "intra_node":
                n = plan.degree(dim)
                span = _nodes_spanned(plan, dim, cluster)
                slow = cluster.link(tier)
                warnings.append(
                    f"{dim}={n} spans {span} nodes: its {why} cross {link_names[tier]} at "
                    f"{slow.bandwidth_bytes_per_s / 1e9:.0f} GB/s per GPU instead of "
                    f"{link_names['intra_node']} at {fast.bandwidth_bytes_per_s / 1e9:.0f} GB/s"
                )
        return Placement(plan=plan, gpus_per_node=cluster.gpus_per_node, tiers=tiers, warnings=tuple(warnings))


@dataclass(frozen=True)
class Placement:
    """Ranks on the machines: ``node_of(rank)``, ``gpu_of(rank)``, the tier of each group dimension."""

    plan: ParallelPlan
    gpus_per_node: int
    tiers: Mapping[str, str]
    warnings: tuple[str, ...]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def gpu_of(self, rank: int) -> int:
        return rank % self.gpus_per_node


def split_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Split layers evenly; the remainder goes to stages 1.. (stage 0 already holds the embedding
    and the most in-flight micro-batches)."""
    check_int("n_stages", n_stages)
    base, rem = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = list(range(1, n_stages)) + [0]
    for i in range(rem):
        counts[order[i % n_stages]] += 1
    return tuple(counts)


def split_layers_by_cost(
    layer_costs: list[float] | tuple[float, ...],
    n_stages: int,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
) -> tuple[int, ...]:
    """Contiguous layers per stage that minimise the slowest stage's cost (the pipeline's pace).

    ``layer_costs`` are per block (e.g. measured forward + backward seconds); the embedding's cost
    is charged to the first stage and the output layer's (final norm, projection, loss) to the
    last, so those stages get fewer blocks. Exact: binary search on the bottleneck with a greedy
    feasibility check (the linear-partition problem), every stage keeping >= 1 block.
    """
    n = len(layer_costs)
    check_int("n_stages", n_stages)
    require(n >= n_stages, f"{n} layers cannot fill {n_stages} stages", field="n_stages", value=n_stages)
    costs = [float(c) for c in layer_costs]
    require(min(costs) >= 0 and embedding_cost >= 0 and output_cost >= 0,
            "layer costs must be >= 0", field="layer_costs")

    def split(limit: float) -> list[int] | None:
        counts, i = [], 0
        for stage in range(n_stages):
            budget = limit - (embedding_cost if stage == 0 else 0.0) - (output_cost if stage == n_stages - 1 else 0.0)
            left = n_stages - stage - 1  # stages still to fill, each needs >= 1 block
            used, k = 0.0, 0
            while i + k < n - left and (k == 0 or used + costs[i + k] <= budget):
                if k == 0 and costs[i] > budget:
                    return None
                used += costs[i + k]
                k += 1
            counts.append(k)
            i += k
        return counts if i == n else None

    lo = max(max(costs), 0.0)
    hi = sum(costs) + embedding_cost + output_cost
    best = split(hi)
    for _ in range(100):  # bisect the bottleneck to float precision
        mid = (lo + hi) / 2
        trial = split(mid)
        if trial is None:
            lo = mid
        else:
            hi, best = mid, trial
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    assert best is not None
    return tuple(best)


@functools.lru_cache(maxsize=4096)
def _group_ranks(plan: ParallelPlan, dim: str) -> tuple[tuple[int, ...], ...]:
    world = plan.world_size
    if dim == "ep":
        key_of = lambda c: (c["pp"], c["dp_replicate"], (c["dp_shard"] * plan.cp + c["cp"]) // plan.ep, c["tp"])  # noqa: E731
    else:
        members = COMPOSITE_DIMS.get(dim, (dim,))
        if dim not in GROUP_DIMS:
            raise ConfigError(f"dim={dim!r} is not one of {', '.join(GROUP_DIMS)}", field="dim", value=dim)
        others = tuple(d for d in MESH_DIMS if d not in members)
        key_of = lambda c: tuple(c[d] for d in others)  # noqa: E731
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        groups.setdefault(key_of(plan.rank_coords(r)), []).append(r)
    return tuple(tuple(g) for g in groups.values())


@functools.lru_cache(maxsize=65536)
def _tier_cached(plan: ParallelPlan, dim: str, gpus_per_node: int, nodes_per_leaf: int | None) -> str:
    n = plan.degree(dim)
    if n == 1:
        return "intra_node"
    if dim in MESH_DIMS:
        # A group is {base + i * stride}: it stays in one node when its span fits an aligned block.
        stride = plan.strides()[dim]
        if gpus_per_node % (stride * n) == 0:
            return "intra_node"
        if stride % gpus_per_node == 0 and not nodes_per_leaf:
            return "inter_node"
    worst = "intra_node"
    for g in _group_ranks(plan, dim):
        nodes = {r // gpus_per_node for r in g}
        if len(nodes) > 1:
            if nodes_per_leaf and len({x // nodes_per_leaf for x in nodes}) > 1:
                return "inter_leaf"
            worst = "inter_node"
    return worst


def group_tier(plan: ParallelPlan, dim: str, cluster: Cluster) -> str:
    """The slowest link tier any group of ``dim`` crosses."""
    return _tier_cached(plan, dim, cluster.gpus_per_node, cluster.nodes_per_leaf)


def _nodes_spanned(plan: ParallelPlan, dim: str, cluster: Cluster) -> int:
    return max(len({r // cluster.gpus_per_node for r in g}) for g in _group_ranks(plan, dim))
