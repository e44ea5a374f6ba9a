"""The DeviceMesh the plan describes, built once per run (and checked against the planner's picture).

Dimensions, outermost first: ``pp, dp_replicate, dp_shard, cp, tp`` (``ParallelPlan.mesh_dims()``;
degrees of 1 are dropped). Derived groups, as in torchtitan:

* ``dp_shard_cp`` = dp_shard x cp: the FSDP group (CP ranks hold different tokens of the same
  weights, so they shard and reduce weights together);
* ``dp`` = dp_replicate x dp_shard, ``dp_cp`` = dp x cp: loss averaging and data loading
  (``dp`` decides which batch slice a rank reads; CP ranks of one DP rank read the same rows);
* ``ep``: the expert-parallel group, borrowed from dp_shard x cp (``plan.group_ranks("ep")``);
  with tp > 1 also the 2-D ``(ep, tp)`` mesh of this rank's EP group by its TP group, over which
  routed experts are split (``Meshes.expert_mesh``: experts by EP, their hidden units by TP).

:func:`check_mesh` asserts that every group this rank belongs to equals the group the planner
computes with ``ParallelPlan.group_ranks``: the mesh drawn is the mesh that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.spec.plan import COMPOSITE_DIMS, GROUP_DIMS, ParallelPlan
from workbench.trainer.expert_parallel import expert_data_parallel_ranks


@dataclass
class Meshes:
    """The world mesh and a 1-D mesh per group dimension of degree > 1 (``get(name)``)."""

    plan: ParallelPlan
    device_type: str
    world: DeviceMesh | None
    dims: dict[str, DeviceMesh] = field(default_factory=dict)
    ep_group: dist.ProcessGroup | None = None
    ep_mesh: DeviceMesh | None = None
    # ranks that hold the same experts and different tokens: expert gradients are reduced here
    expert_dp_group: dist.ProcessGroup | None = None
    # (ep, tp): this rank's EP group x TP group, when both degrees are > 1
    ep_tp_mesh: DeviceMesh | None = None

    def get(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of ``name`` (None when its degree is 1)."""
        return self.dims.get(name)

    def size(self, name: str) -> int:
        return self.plan.degree(name)

    def local_rank(self, name: str) -> int:
        m = self.get(name)
        return m.get_local_rank() if m is not None else 0

    def group(self, name: str) -> dist.ProcessGroup | None:
        if name == "ep":
            return self.ep_group
        m = self.get(name)
        return m.get_group() if m is not None else None

    def expert_mesh(self) -> DeviceMesh | None:
        """What routed experts are split over under TP: the (ep, tp) mesh, or the TP mesh without
        EP (None without TP: EP alone shards them over ``ep_mesh``)."""
        if self.plan.tp == 1:
            return None
        return self.ep_tp_mesh if self.plan.ep > 1 else self.get("tp")

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The data-parallel mesh for FSDP: 1-D over dp_shard_cp, or 2-D (dp_replicate,
        dp_shard_cp) for HSDP; None when there is no sharding."""
        if self.plan.dp_shard * self.plan.cp == 1:
            return None
        if self.plan.dp_replicate == 1:
            return self.dims["dp_shard_cp"]
        assert self.world is not None
        return self.world["dp_replicate", self._name("dp_shard_cp")]

    def _name(self, composite: str) -> str:
        """The world-mesh name of a composite: itself when flattened, else its only member."""
        present = [m for m in COMPOSITE_DIMS[composite] if self.plan.degree(m) > 1]
        return present[0] if len(present) == 1 else composite


def build_meshes(plan: ParallelPlan, device_type: str = "cpu") -> Meshes:
    """Build the mesh of ``plan`` (dist must be initialised with ``plan.world_size`` ranks)."""
    dims = plan.mesh_dims()
    out = Meshes(plan=plan, device_type=device_type, world=None)
    if not dims:
        return out
    names = tuple(n for n, _ in dims)
    world = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
    out.world = world
    for name in names:
        out.dims[name] = world[name]
    for composite, members in COMPOSITE_DIMS.items():
        present = tuple(m for m in members if plan.degree(m) > 1)
        if len(present) == 1:
            out.dims[composite] = world[present[0]]  # same ranks: reuse the group
        elif len(present) > 1:
            out.dims[composite] = world[present]._flatten(composite)
    if plan.ep > 1:
        if plan.ep == plan.dp_shard * plan.cp:
            out.ep_mesh = out.dims["dp_shard_cp"]
            out.ep_group = out.ep_mesh.get_group()
        else:
            # Every rank must take part in creating every subgroup.
            out.ep_group, _ = dist.new_subgroups_by_enumeration(plan.group_ranks("ep"))
            out.ep_mesh = DeviceMesh.from_group(out.ep_group, device_type, mesh_dim_names=("ep",))
        groups = expert_data_parallel_ranks(plan)
        if len(groups[0]) > 1:
            out.expert_dp_group, _ = dist.new_subgroups_by_enumeration(groups)
        if plan.tp > 1:
            out.ep_tp_mesh = _ep_tp_mesh(plan, out, device_type)
    return out


def _ep_tp_mesh(plan: ParallelPlan, meshes: Meshes, device_type: str) -> DeviceMesh:
    """The 2-D (ep, tp) mesh of this rank, from the groups already made (no new process group):
    row i is the TP group of the i-th member of this rank's EP group."""
    ep_ranks = sorted(dist.get_process_group_ranks(meshes.ep_group))
    rows = [[plan.coords_rank({**plan.rank_coords(r), "tp": t}) for t in range(plan.tp)] for r in ep_ranks]
    return DeviceMesh.from_group([meshes.ep_group, meshes.get("tp").get_group()], device_type,
                                 mesh=torch.tensor(rows, dtype=torch.int), mesh_dim_names=("ep", "tp"))


def check_mesh(meshes: Meshes, rank: int) -> dict[str, list[int]]:
    """Assert that this rank's group of every dimension equals the planner's; return them."""
    plan = meshes.plan
    found: dict[str, list[int]] = {}
    for dim in GROUP_DIMS:
        if plan.degree(dim) == 1:
            continue
        group = meshes.group(dim)
        ranks = sorted(dist.get_process_group_ranks(group))
        expected = next(g for g in plan.group_ranks(dim) if rank in g)
        if ranks != expected:
            raise RuntimeError(f"mesh group {dim} of rank {rank} is {ranks}, the plan says {expected}")
        found[dim] = ranks
    return found
