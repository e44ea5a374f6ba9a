"""Communication: what every collective of a training step costs, in nccl-tests' units.

Conventions (nccl-tests, doc/PERFORMANCE.md), used by the planner here and by the trainer's
measurements, so that predicted and measured collectives join on ``(dim, op, size_bytes)``:

=================  ==============================================  ======================
op                 S = ``size_bytes`` of one call                  bus factor (busbw/algbw)
=================  ==============================================  ======================
``all_reduce``     the buffer (input = output)                     2 (n-1) / n
``all_gather``     the gathered *output* buffer (n x the input)    (n-1) / n
``reduce_scatter`` the *input* buffer (n x the output)             (n-1) / n
``all_to_all``     one rank's whole send buffer (self chunk too)   (n-1) / n
``send_recv``      the message                                     1
=================  ==============================================  ======================

``algbw = S / t`` and ``busbw = algbw x factor``. The bus factor is also the fraction of S that
one rank puts on the wire with a ring (or pairwise) algorithm, so ``S x factor`` is the bytes a GPU
sends per call (:attr:`Collective.wire_bytes`), and busbw is comparable with the link bandwidth.

Times follow the alpha-beta model (Hockney; Thakur, Rabenseifner & Gropp 2005, "Optimization of
collective communication operations in MPICH"), with alpha the link latency and B the per-GPU
bandwidth each way of :class:`~workbench.spec.cluster.LinkSpec`:

* ring all-reduce:                      2 (n-1) alpha + 2 (n-1)/n x S / B
* all-gather, reduce-scatter, all-to-all: (n-1) alpha +   (n-1)/n x S / B
* send/recv:                                    alpha +             S / B

A group that spans nodes with g > 1 of its ranks on each of N nodes runs hierarchically, every
phase on its own link (what NCCL's rings and trees achieve with one NIC per GPU): all-reduce =
intra-node reduce-scatter of S + inter-node all-reduce of S/g among the N ranks with the same local
index + intra-node all-gather of S. Measured figures in ``cluster.calibration`` replace the
datasheet ones (see :func:`collective_time`).

:func:`step_collectives` lists what one rank issues in one training step; :func:`traffic_by_dim`
and :func:`link_traffic` sum it per group dimension and per link tier (the mesh view).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from workbench.spec.cluster import Cluster
from workbench.spec.config import DTYPE_BYTES, RunConfig, TrainSettings
from workbench.spec.errors import check_choice, check_instance, require
from workbench.spec.float8 import converted_params
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.predict.pipeline import schedule_order

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
OPS = tuple(BUS_FACTOR)
PHASES = ("forward", "backward", "step")
# Group dimensions beyond plan.GROUP_DIMS: routed experts are sharded by FSDP over the
# dp_shard x cp / ep ranks that hold the same experts ("efsdp", torchtitan's dp_shard_mod_ep), and
# their gradients all-reduced without ZeRO over dp_replicate x dp_shard x cp / ep ranks ("edp").
EXPERT_DIMS = ("efsdp", "edp")
_INTRA = "intra_node"


@dataclass(frozen=True)
class Collective:
    """One kind of call a rank issues in a training step, ``count`` times, each of ``size_bytes``."""

    dim: str  # group dimension: tp, cp, ep, pp, dp_shard_cp (FSDP), dp_replicate/dp/dp_cp, efsdp/edp
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv
    phase: str  # forward | backward | step
    purpose: str
    size_bytes: int  # S of one call (nccl-tests convention, see the module docstring)
    count: int  # calls per training step on one rank
    group_size: int
    tier: str  # the slowest link tier the group crosses
    time_s: float  # predicted time of one call
    overlapped: bool  # hidden behind compute, or exposed on the critical path
    # bytes one GPU sends per call on each tier (sums to wire_bytes); hierarchical when spanning nodes
    wire_by_tier: tuple[tuple[str, float], ...] = ()

    @property
    def algbw(self) -> float:
        """S / t in bytes/s."""
        return self.size_bytes / self.time_s if self.time_s > 0 else 0.0

    @property
    def busbw(self) -> float:
        """algbw x bus factor: comparable with the link bandwidth (bytes/s)."""
        return self.algbw * BUS_FACTOR[self.op](self.group_size)

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends per call: S x bus factor (ring / pairwise algorithms)."""
        return self.size_bytes * BUS_FACTOR[self.op](self.group_size)

    @property
    def total_bytes(self) -> int:
        return self.size_bytes * self.count

    @property
    def total_time_s(self) -> float:
        return self.time_s * self.count

    @property
    def exposed_time_s(self) -> float:
        return 0.0 if self.overlapped else self.total_time_s

    @property
    def pipeline(self) -> bool:
        """Pipeline sends: their time is the schedule simulation's p2p time, not added on top."""
        return self.dim == "pp"


@dataclass(frozen=True)
class DimTraffic:
    """One group dimension's traffic in one step, on one rank."""

    dim: str
    group_size: int
    tier: str
    calls: int
    bytes: int  # sum of S x count (nccl-tests sizes)
    wire_bytes: float  # bytes this rank sends
    time_s: float  # all calls, as if none overlapped
    exposed_time_s: float  # calls not hidden behind compute


# ---------------------------------------------------------------------------- alpha-beta
def collective_time(
    op: str,
    size_bytes: float,
    group_size: int,
    cluster: "Cluster",
    tier: str,
    *,
    gpus_per_node_in_group: int | None = None,
) -> float:
    """Predicted seconds of one ``op`` of ``size_bytes`` (nccl-tests S) over ``group_size`` ranks.

    ``tier`` is the slowest link the group crosses. When it is not ``intra_node`` and
    ``gpus_per_node_in_group`` = g > 1, the call is hierarchical (module docstring); None or 1
    runs a flat ring over ``tier``. If ``cluster.calibration.link(tier, op)`` exists it replaces
    the whole model: ``t = latency + S x factor(n) / busbw`` (as nccl-tests measured it over such a
    group); a hierarchical call's phases are otherwise each looked up on their own tier.
    """
    return _cost(op, float(size_bytes), group_size, gpus_per_node_in_group or 1, tier, cluster)[0]


def _check(op: str, size: float, n: int) -> None:
    check_choice("op", op, OPS)
    require(size >= 0, f"size_bytes={size} must be >= 0", field="size_bytes", value=size)
    require(isinstance(n, int) and n >= 1, f"group_size={n} must be an integer >= 1", field="group_size", value=n)


def _flat(op: str, size: float, n: int, tier: str, cluster: "Cluster") -> float:
    """One flat ring/pairwise call on one tier (calibrated if measured)."""
    if n == 1 or size == 0:
        return 0.0
    cal = cluster.calibration.link(tier, op) if cluster.calibration else None
    if cal is not None:
        return cal.latency_s + size * BUS_FACTOR[op](n) / cal.bandwidth_bytes_per_s
    link = cluster.link(tier)
    alpha, bw = link.latency_s, link.bandwidth_bytes_per_s
    if op == "send_recv":
        return alpha + size / bw
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * alpha + size * BUS_FACTOR[op](n) / bw


def _cost(
    op: str, size: float, n: int, g: int, tier: str, cluster: "Cluster"
) -> tuple[float, tuple[tuple[str, float], ...]]:
    """(time of one call, bytes sent per tier). g: ranks of the group on one node."""
    _check(op, size, n)
    if n == 1 or size == 0:
        return 0.0, ()
    factor = BUS_FACTOR[op](n)
    hierarchical = tier != _INTRA and 1 < g < n and op != "send_recv"
    if not hierarchical or (cluster.calibration and cluster.calibration.link(tier, op)):
        return _flat(op, size, n, tier, cluster), ((tier, size * factor),)
    nodes = -(-n // g)  # N
    if op == "all_to_all":
        # Pairwise exchange of S/n chunks: g-1 go over NVLink, n-g over the network, concurrently,
        # so the slower of the two sets the time.
        intra_b, inter_b = (g - 1) / n * size, (n - g) / n * size
        t_intra = _flat("all_to_all", intra_b * g / (g - 1), g, _INTRA, cluster)  # an intra a2a of g ranks
        link = cluster.link(tier)
        t_inter = (n - g) * link.latency_s + inter_b / link.bandwidth_bytes_per_s
        return max(t_intra, t_inter), ((_INTRA, intra_b), (tier, inter_b))
    if op == "all_reduce":
        # intra reduce-scatter (S) + inter all-reduce (S/g) + intra all-gather (S)
        t = (
            _flat("reduce_scatter", size, g, _INTRA, cluster)
            + _flat("all_reduce", size / g, nodes, tier, cluster)
            + _flat("all_gather", size, g, _INTRA, cluster)
        )
        return t, ((_INTRA, 2 * (g - 1) / g * size), (tier, 2 * (nodes - 1) / nodes * size / g))
    # all-gather: inter all-gather to S/g among same-index ranks, then intra all-gather to S;
    # reduce-scatter: the mirror image. Same time and bytes either way.
    t = _flat(op, size / g, nodes, tier, cluster) + _flat(op, size, g, _INTRA, cluster)
    return t, ((_INTRA, (g - 1) / g * size), (tier, (nodes - 1) / nodes * size / g))


# ---------------------------------------------------------------------------- groups
# Every group used here is an arithmetic progression of global ranks {base + i * stride : i < n}
# (tp innermost, and composite dimensions are adjacent in the mesh order), so its placement on the
# nodes follows from (stride, n) alone: no need to list the groups of a 1,024-GPU mesh per plan.
def _progression(plan: ParallelPlan, dim: str) -> tuple[int, int]:
    """(stride, size) of the groups of ``dim``; the group of base rank r has r // stride % size == 0."""
    tp, cp, shard, rep, ep = plan.tp, plan.cp, plan.dp_shard, plan.dp_replicate, plan.ep
    if dim == "dp":
        require(cp == 1, "dim='dp' is not a rank progression under cp > 1; use 'dp_cp'", field="dim", value=dim)
    return {
        "tp": (1, tp),
        "cp": (tp, cp),
        "dp_shard": (cp * tp, shard),
        "dp_replicate": (shard * cp * tp, rep),
        "pp": (rep * shard * cp * tp, plan.pp),
        "dp_shard_cp": (tp, shard * cp),
        "dp_cp": (tp, rep * shard * cp),
        "dp": (tp, rep * shard),
        "ep": (tp, ep),  # ep consecutive (dp_shard, cp) positions
        "efsdp": (ep * tp, shard * cp // ep),  # every ep-th (dp_shard, cp) position: the same experts
        "edp": (ep * tp, rep * shard * cp // ep),
    }[dim]


def group_members(plan: ParallelPlan, dim: str) -> list[list[int]]:
    """Every group of ``dim`` (plan.GROUP_DIMS or EXPERT_DIMS) as sorted global ranks."""
    stride, n = _progression(plan, dim)
    return [[b + i * stride for i in range(n)] for b in range(plan.world_size) if (b // stride) % n == 0]


@functools.lru_cache(maxsize=65536)
def _shape(stride: int, n: int, world: int, gpn: int, npl: int | None) -> tuple[str, int]:
    """(slowest tier any group crosses, ranks per node of the most spread-out group)."""
    if n == 1 or gpn % (stride * n) == 0:  # aligned blocks inside one node
        return _INTRA, n
    if stride % gpn == 0:  # one rank per node, nodes base_node + i * stride / gpn
        g, node_stride, node_count = 1, stride // gpn, n
    elif gpn % stride == 0 and (stride * n) % gpn == 0:  # gpn / stride ranks on each of k nodes
        g, node_stride, node_count = gpn // stride, 1, stride * n // gpn
    else:
        return _shape_by_listing(stride, n, world, gpn, npl)
    node_span = node_stride * node_count
    if not npl or world // gpn <= npl or npl % node_span == 0:
        return "inter_node", g
    if node_span % npl == 0:
        return "inter_leaf", g
    return _shape_by_listing(stride, n, world, gpn, npl)


def _shape_by_listing(stride: int, n: int, world: int, gpn: int, npl: int | None) -> tuple[str, int]:
    tier, g, spread = _INTRA, n, 1
    for base in range(world):
        if (base // stride) % n:
            continue
        nodes = {(base + i * stride) // gpn for i in range(n)}
        if len(nodes) > 1:
            if npl and len({x // npl for x in nodes}) > 1:
                tier = "inter_leaf"
            elif tier == _INTRA:
                tier = "inter_node"
        if len(nodes) > spread:
            spread, g = len(nodes), -(-n // len(nodes))
    return tier, g


def group_shape(plan: ParallelPlan, dim: str, cluster: "Cluster") -> tuple[int, str, int]:
    """(group size, slowest link tier crossed, ranks of one group per node) of ``dim``."""
    stride, n = _progression(plan, dim)
    tier, g = _shape(stride, n, plan.world_size, cluster.gpus_per_node, cluster.nodes_per_leaf)
    return n, tier, g


def _degree(plan: ParallelPlan, dim: str) -> int:
    return _progression(plan, dim)[1]


class _Builder:
    """Collects the collectives of one rank; caches each group's shape."""

    def __init__(self, config: "RunConfig"):
        self.plan = config.plan
        self.cluster = config.cluster
        self.out: list[Collective] = []
        self._shapes: dict[str, tuple[int, str, int]] = {}

    def shape(self, dim: str) -> tuple[int, str, int]:
        if dim not in self._shapes:
            self._shapes[dim] = group_shape(self.plan, dim, self.cluster)
        return self._shapes[dim]

    def add(self, dim: str, op: str, phase: str, purpose: str, size: float, count: int, overlapped: bool) -> None:
        n, tier, g = self.shape(dim)
        size_i = int(round(size))
        if n <= 1 or count <= 0 or size_i <= 0:
            return
        t, wire = _cost(op, float(size_i), n, g, tier, self.cluster)
        self.out.append(Collective(dim, op, phase, purpose, size_i, count, n, tier, t, overlapped, wire))

    def add_split(self, dim: str, op: str, phase: str, purpose: str, size: float, count: int, exposed: int) -> None:
        """``count`` calls of which ``exposed`` are on the critical path (FSDP's first all-gather...)."""
        exposed = min(exposed, count)
        self.add(dim, op, phase, purpose + " (exposed)" if exposed else purpose, size, exposed, False)
        self.add(dim, op, phase, purpose, size, count - exposed, True)


# ---------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class _Unit:
    """An FSDP unit of one rank: TP-local parameters that ZeRO shards over dp_shard x cp
    (``dense``) and TP/EP-local routed experts that it shards over dp_shard x cp / ep."""

    name: str
    dense: float
    experts: float
    count: int
    # FSDP all-gathers of one such unit per step, (forward, backward): see _fsdp_gathers
    gathers: tuple[int, int] = (0, 0)
    # of ``dense``, the parameters all-gathered in FP8 (1 byte each): the Linear weights of an FP8
    # recipe with FSDP float8 all-gather (workbench.spec.float8); the rest in the compute dtype
    fp8: float = 0.0


@functools.lru_cache(maxsize=4096)
def _unit_params(model: "ModelSpec", tp: int, ep: int) -> tuple[tuple[float, float], tuple[float, float], float, float]:
    """TP/EP-local parameters (as memory.py counts them): (dense block: dense, experts),
    (MoE block: dense, experts), embedding, output (final norm whole + projection / tp)."""

    def block(i: int) -> tuple[float, float]:
        p = model.layer_params(i)
        # experts split by ep and, Megatron's default expert tensor parallelism, by tp too
        return p.attention / tp + p.mlp / tp + p.replicated, p.experts / (ep * tp)

    dense_block = block(0) if model.n_dense_layers else (0.0, 0.0)
    moe_block = block(model.n_layers - 1) if model.is_moe else (0.0, 0.0)
    head = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    norm = model.output_params - head
    return dense_block, moe_block, model.embedding_params / tp, head / tp + norm


@functools.lru_cache(maxsize=4096)
def _rank_layout(plan: ParallelPlan, n_layers: int, first_moe: int, pp_rank: int) -> tuple[tuple[int, int, int, bool, bool, bool, bool], ...]:
    """Per stage of ``pp_rank``: (stage, dense layers, MoE layers, first, last, sends forward,
    sends backward). Sends are skipped where the neighbour stage lives on this same rank (the
    bottom of a V schedule)."""
    counts = plan.stage_layer_counts(n_layers)
    n_stages = len(counts)
    owner = {s: r for r in range(plan.pp) for s in plan.stages_of_rank(r)}
    out = []
    for s in plan.stages_of_rank(pp_rank):
        start = sum(counts[:s])
        end = start + counts[s]
        moe = max(0, end - max(start, first_moe))
        out.append((
            s, counts[s] - moe, moe, s == 0, s == n_stages - 1,
            s < n_stages - 1 and owner[s + 1] != pp_rank,
            s > 0 and owner[s - 1] != pp_rank,
        ))
    return tuple(out)


def step_collectives(config: "RunConfig", pp_rank: int | None = None) -> list[Collective]:
    """Every collective one rank of pipeline rank ``pp_rank`` issues in one training step (None:
    the pipeline rank with the most communication time).

    Notation: b micro-batch size, s seq_len, m micro-batches per step, e / g / w bytes of the
    compute / gradient / parameter dtypes, t = tp, sp = t under sequence parallelism (else 1),
    T = b s / cp tokens per rank per micro-batch, L layers held by this rank, P a unit's TP-local
    parameters. Not modelled: FSDP padding of uneven shards, the scalar all-reduces of gradient
    clipping and loss logging, and the embedding-gradient all-reduce of tied embeddings under PP.
    The data-parallel traffic is the bundled trainer's (FSDP2 units per block and per stage root,
    one reduction per step: :func:`_gradient_sync`), checked call for call against its measured
    collectives by tests/test_compare.py.
    """
    plan = config.plan
    if pp_rank is None:
        if plan.pp == 1:
            return _rank_collectives(config, 0)
        # Middle pipeline ranks usually hold identical layouts: build each distinct one once.
        first_moe = config.model.first_k_dense_layers if config.model.is_moe else config.model.n_layers
        distinct: dict[tuple, int] = {}
        for r in range(plan.pp):
            key = tuple(x[1:] for x in _rank_layout(plan, config.model.n_layers, first_moe, r))
            distinct.setdefault(key, r)
        per_rank = [_rank_collectives(config, r) for r in distinct.values()]
        return max(per_rank, key=lambda cs: (sum(c.total_time_s for c in cs), sum(c.total_bytes for c in cs)))
    require(0 <= pp_rank < plan.pp, f"pp_rank={pp_rank} is outside 0..{plan.pp - 1}", field="pp_rank", value=pp_rank)
    return _rank_collectives(config, pp_rank)


def _rank_collectives(config: "RunConfig", pp_rank: int) -> list[Collective]:
    model, plan, train = config.model, config.plan, config.train
    b = _Builder(config)
    m = config.n_microbatches
    e = DTYPE_BYTES[train.compute_dtype]
    t, cp, ep = plan.tp, plan.cp, plan.ep
    sp = t if plan.sequence_parallel and t > 1 else 1
    tokens = train.micro_batch_size * train.seq_len // cp  # T
    recompute = train.recompute == "full"
    first_moe = model.first_k_dense_layers if model.is_moe else model.n_layers
    layout = _rank_layout(plan, model.n_layers, first_moe, pp_rank)
    dense_layers = sum(x[1] for x in layout)
    moe_layers = sum(x[2] for x in layout)
    layers = dense_layers + moe_layers  # L
    has_first = any(x[3] for x in layout)
    has_last = any(x[4] for x in layout)

    # FSDP units as the bundled trainer wraps them (parallelize.apply_fsdp): one per block, and
    # the root module of each stage (embedding, final norm and output projection together,
    # never resharded after forward). The root leads the forward when the rank holds stage 0.
    (pd, ed), (pm, em), p_emb, p_out = _unit_params(model, t, ep)
    gathers = _fsdp_gathers(plan, m, pp_rank)
    fp8 = train.fp8
    # FP8 all-gather (torchao's enable_fsdp_float8_all_gather): the attention and MLP Linear
    # weights of a block travel in FP8; its norms, and the root (embeddings, output head), do not
    fp8_d = fp8_m = 0.0
    if fp8 is not None and fp8.fsdp_fp8_all_gather:
        fp8_d = converted_params(model, 0, t, ep, fp8) if model.n_dense_layers else 0.0
        fp8_m = converted_params(model, model.n_layers - 1, t, ep, fp8) if model.is_moe else 0.0
    units = []
    root = (p_emb if has_first else 0.0) + (p_out if has_last else 0.0)
    if root:
        stage = next(x[0] for x in layout if x[3] or x[4])
        units.append(_Unit("root (embedding, output)", root, 0.0, 1, gathers[stage][1]))
    for stage, n_dense, n_moe, *_ in layout:
        if n_dense:
            units.append(_Unit("dense block", pd, ed, n_dense, gathers[stage][0], fp8_d))
        if n_moe:
            units.append(_Unit("MoE block", pm, em, n_moe, gathers[stage][0], fp8_m))
    first_unit = units[0].name if units else ""
    _gradient_sync(b, plan, train, units, first_unit, m)
    if fp8 is not None:
        _fp8_scale_sync(b, config, layers, m)
    if t > 1 and sp > 1 and layers:
        # Norm weights are replicated over TP while SP gives each rank a slice of the tokens: their
        # gradients are partial sums, all-reduced once per step (torch's SequenceParallel; Megatron's
        # "sequence-parallel gradient all-reduce"). 2 per block, plus the final norm.
        n_norms = 2 * layers + (1 if has_last else 0)
        b.add("tp", "all_reduce", "backward", "SP all-reduce of norm-weight gradients",
              model.d_model * DTYPE_BYTES[train.grad_dtype], n_norms, False)

    d_model = model.d_model
    act = tokens * d_model * e  # T x d_model activation, full size (nccl-tests S of AG output / RS input)
    if t > 1:
        # Megatron TP (Shoeybi et al. 2019; Korthikanti et al. 2022 for SP). Per block: attention
        # and MLP each open with a column-parallel and close with a row-parallel linear. With SP the
        # f/g pair is all-gather (S = T d e, output) before and reduce-scatter (S = T d e, input)
        # after; backward swaps them. Without SP: g = all-reduce forward, f = all-reduce backward.
        k = 2 * layers * m
        if sp > 1:
            # An FP8 recipe with FP8 TP (torchao tensorwise's Float8ColwiseParallel and
            # PrepareFloat8ModuleInput, TE's quantized gather_along_first_dim) casts before the
            # all-gathers: the input forward, the output gradient backward, 1 byte an element
            fp8_gather = fp8 is not None and fp8.tp_fp8_all_gather
            for op in ("all_gather", "reduce_scatter"):
                size = act / e if (fp8_gather and op == "all_gather") else act
                what = f"SP {op.replace('_', '-')}" + (" (fp8)" if size != act else "")
                b.add("tp", op, "forward", f"{what} around attention and MLP", size, k, False)
                b.add("tp", op, "backward", f"{what} (gradient) around attention and MLP", size, k, False)
                if recompute:
                    b.add("tp", op, "backward", f"{what} recomputed (full recompute)", size, k, False)
        else:
            b.add("tp", "all_reduce", "forward", "TP all-reduce after row-parallel linears", act, k, False)
            b.add("tp", "all_reduce", "backward", "TP all-reduce of input gradients of column-parallel linears", act, k, False)
            if recompute:
                b.add("tp", "all_reduce", "backward", "TP all-reduce recomputed (full recompute)", act, k, False)
        if has_first:  # row-parallel (vocab-split) embedding: partial sums reduced (SP: scattered)
            if sp > 1:
                b.add("tp", "reduce_scatter", "forward", "embedding output reduce-scatter", act, m, False)
                b.add("tp", "all_gather", "backward", "embedding output gradient all-gather", act, m, False)
            else:
                b.add("tp", "all_reduce", "forward", "embedding output all-reduce", act, m, False)
        if has_last:  # column-parallel output projection
            if sp > 1:
                b.add("tp", "all_gather", "forward", "final-norm output all-gather before the output layer", act, m, False)
                b.add("tp", "reduce_scatter", "backward", "output-layer input gradient reduce-scatter", act, m, False)
            else:
                b.add("tp", "all_reduce", "backward", "output-layer input gradient all-reduce", act, m, False)
            if plan.loss_parallel:
                # fp32 per-token max, sum of exponentials and target logit across vocab shards
                b.add("tp", "all_reduce", "forward", "loss-parallel all-reduces (max, sum-exp, target logit)", tokens * 4, 3 * m, False)
            else:
                # logits gathered over the vocabulary (backward is a local slice: no traffic)
                b.add("tp", "all_gather", "forward", "logits all-gather over the vocabulary", tokens * model.vocab_size * e, m, False)

    if plan.pp > 1:
        # Boundary activation forward / its gradient backward, T d e / sp per micro-batch per stage.
        boundary = act / sp
        fwd = sum(1 for x in layout if x[5])
        bwd = sum(1 for x in layout if x[6])
        b.add("pp", "send_recv", "forward", "PP send of the stage-boundary activation", boundary, fwd * m, False)
        b.add("pp", "send_recv", "backward", "PP send of the stage-boundary gradient", boundary, bwd * m, False)

    if cp > 1:
        # Ring attention as torch's context_parallel runs it (_templated_ring_attention): forward
        # passes the local K and V chunk (T kv_dim e x 2 / t) cp-1 times; backward passes K, V again
        # cp-1 times, and the fp32 dK, dV accumulators cp times (the last hop returns them home).
        # Latent attention's ring carries the key/value latent and the RoPE key instead
        # (ModelSpec.ring_kv_values_per_token), its gradient in the same form.
        kv = tokens * model.ring_kv_values_per_token(t) * e
        dkv = tokens * model.ring_kv_values_per_token(t) * 4
        k = layers * m
        b.add("cp", "send_recv", "forward", "CP ring exchange of K, V", kv, (cp - 1) * k, True)
        b.add("cp", "send_recv", "backward", "CP ring exchange of K, V", kv, (cp - 1) * k * (2 if recompute else 1), True)
        b.add("cp", "send_recv", "backward", "CP ring exchange of dK, dV (fp32)", dkv, cp * k, True)

    if ep > 1 and moe_layers:
        # Token dispatch and combine (Lepikhin et al. 2020): each rank sends T top_k d e / sp.
        a2a = tokens * model.top_k * d_model * e / sp
        k = 2 * moe_layers * m
        b.add("ep", "all_to_all", "forward", "EP all-to-all dispatch and combine", a2a, k, False)
        b.add("ep", "all_to_all", "backward", "EP all-to-all of dispatch and combine gradients", a2a, k * (2 if recompute else 1), False)
    return b.out


def _fsdp_gathers(plan: ParallelPlan, m: int, pp_rank: int) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
    """FSDP2 all-gathers per step of one block and of the root module of each stage of
    ``pp_rank``: ``{stage: ((block forward, block backward), (root forward, root backward))}``.

    A unit is gathered when it is needed and sharded: blocks are resharded after forward under
    zero 3 (``reshard_after_forward``), the root never is. Without a pipeline the trainer runs
    m forward/backward pairs and FSDP reshards after each backward: a block gathers m times in
    forward (and m in backward under zero 3), the root m times in forward. Under
    torch.distributed.pipelining, backward keeps parameters unsharded until the step's reduction
    (``set_reshard_after_backward(False)``), so the count follows the schedule's order of F and B
    (:func:`workbench.predict.pipeline.schedule_order`): e.g. 1F1B, p = 2, m = 4 on rank 0 gathers a
    zero-3 block 5 times (F0, F1, B0, B1, B2), GPipe 5 (F0..F3, B0), the root once."""
    z3 = plan.zero_stage == 3
    if plan.pp == 1:
        return {0: ((m, m if z3 else 0), (m, 0))}
    order = schedule_order(plan.pp_schedule, plan.pp, m, plan.virtual_stages)[pp_rank]
    out = {}
    for stage in plan.stages_of_rank(pp_rank):
        counts = []
        for reshard_after_forward in (z3, False):
            sharded, fwd, bwd = True, 0, 0
            for kind, s, _ in order:
                if s != stage or kind == "W":  # W reuses what I (its input-gradient half) gathered
                    continue
                if sharded:
                    fwd, bwd = (fwd + 1, bwd) if kind == "F" else (fwd, bwd + 1)
                sharded = kind == "F" and reshard_after_forward
            counts.append((fwd, bwd))
        out[stage] = (counts[0], counts[1])
    return out


def _fp8_scale_sync(b: _Builder, config: "RunConfig", layers: int, m: int) -> None:
    """The FP8 recipe's scale traffic: fp32 amaxes, a few bytes per FP8 tensor, latency-bound.

    * torchao tensorwise with FSDP float8 all-gather: one all-reduce over the FSDP group after the
      optimizer step gives every Linear weight its scale (``precompute_float8_dynamic_scale_for_fsdp``,
      "a single all-reduce"); activations and gradients are scaled locally.
    * TE delayed scaling: the amaxes of every FP8 tensor are all-reduced after each forward and each
      backward (``reduce_amax``, over Megatron's amax-reduction group; billed on the data-parallel
      group, its widest part).
    """
    plan, model, fp8 = config.plan, config.model, config.train.fp8
    if fp8 is None or not layers:
        return
    n_gemms = len(model.attention_gemms(plan.tp)) + 2  # the block's fused GEMMs: attention's, up (+ gate), down
    data_dim = "dp_cp" if plan.cp > 1 else ("dp" if plan.dp_shard > 1 else "dp_replicate")
    if fp8.weight_amax_reduce_per_step and plan.zero_stage == 3 and _degree(plan, "dp_shard_cp") > 1:
        weights = len(model.attention_projections()) + (3 if model.activation == "swiglu" else 2)  # torchtitan's nn.Linears
        b.add("dp_shard_cp", "all_reduce", "step", "FP8 weight-amax all-reduce (float8 scales for FSDP)",
              4 * weights * layers, 1, False)
    if fp8.amax_reduce_per_microbatch:
        dim = data_dim if plan.dp * plan.cp > 1 else "tp"
        b.add(dim, "all_reduce", "forward", "FP8 amax reduction (delayed scaling)", 4 * 3 * n_gemms * layers, m, False)
        b.add(dim, "all_reduce", "backward", "FP8 amax reduction (delayed scaling)", 4 * 2 * n_gemms * layers, m, False)


def _gradient_sync(b: _Builder, plan: ParallelPlan, train: "TrainSettings", units: list[_Unit], first_unit: str, m: int) -> None:
    """ZeRO / FSDP / DDP traffic of every unit, for dense parameters and routed experts, as the
    bundled trainer runs it (FSDP2 ``fully_shard`` per block and per stage root).

    * zero 3 (FSDP2, reshard after forward) and zero 2: all-gathers of P e (compute dtype) as
      :func:`_fsdp_gathers` counts them (forward and, zero 3, backward); one reduce-scatter of
      P g per unit per step: the trainer turns gradient synchronisation off for all but the
      last micro-batch (``set_requires_gradient_sync``; pipelining does the same and reduces once
      at the end), so gradients accumulate unsharded and are reduced once.
    * zero 1: once per step a reduce-scatter of P g in backward and an all-gather of the updated
      P w (parameter dtype) after the optimizer step.
    * zero 0, or nothing to shard: once per step an all-reduce of P g over all data ranks (DDP).
    * HSDP (dp_replicate > 1 with sharding): once per step an all-reduce of the shard P g / n.
    One all-gather (the step's first) and one gradient reduction (its last) are exposed; the rest
    are hidden by prefetching and bucketing (units are the buckets).
    """
    e = DTYPE_BYTES[train.compute_dtype]
    g = DTYPE_BYTES[train.grad_dtype]
    w = DTYPE_BYTES[train.param_dtype]
    z = plan.zero_stage
    data_dim = "dp_cp" if plan.cp > 1 else ("dp" if plan.dp_shard > 1 else "dp_replicate")
    for kind, shard_dim, full_dim in (("dense", "dp_shard_cp", data_dim), ("experts", "efsdp", "edp")):
        n_shard = _degree(plan, shard_dim)
        if kind == "experts" and n_shard == 1:
            full_dim = "dp_replicate"
        what = "expert weights" if kind == "experts" else "weights"
        for u in units:
            p = u.dense if kind == "dense" else u.experts
            if p <= 0:
                continue
            lead = 1 if u.name == first_unit and kind == "dense" else 0  # the exposed call
            label = f"{u.name} {what}"
            if z >= 2 and n_shard > 1:
                fwd, bwd = u.gathers
                # the FP8 recipe's Linear weights travel in FP8 (1 byte), the rest in the compute dtype
                gathered = p * e if kind == "experts" else (p - u.fp8) * e + u.fp8
                ag = f"FSDP all-gather of {label}" + (" (Linear weights in fp8)" if gathered != p * e else "")
                b.add_split(shard_dim, "all_gather", "forward", ag, gathered, u.count * fwd, lead)
                b.add(shard_dim, "all_gather", "backward", ag, gathered, u.count * bwd, True)
                b.add_split(shard_dim, "reduce_scatter", "backward", f"FSDP reduce-scatter of {label} gradients", p * g, u.count, lead)
            elif z == 1 and n_shard > 1:
                b.add_split(shard_dim, "reduce_scatter", "backward", f"ZeRO-1 reduce-scatter of {label} gradients", p * g, u.count, lead)
                b.add_split(shard_dim, "all_gather", "step", f"ZeRO-1 all-gather of updated {label}", p * w, u.count, lead)
            else:
                b.add_split(full_dim, "all_reduce", "backward", f"DDP all-reduce of {label} gradients", p * g, u.count, lead)
                continue
            if plan.dp_replicate > 1:
                b.add_split("dp_replicate", "all_reduce", "backward", f"HSDP all-reduce of {label} gradient shards",
                            p * g / n_shard, u.count, lead)


# ---------------------------------------------------------------------------- summaries
def traffic_by_dim(config: "RunConfig", pp_rank: int | None = None) -> dict[str, DimTraffic]:
    """Per group dimension: bytes, wire bytes, time and exposed time per step on one rank."""
    check_instance("config", config, RunConfig)
    out: dict[str, DimTraffic] = {}
    for c in step_collectives(config, pp_rank):
        d = out.get(c.dim)
        out[c.dim] = DimTraffic(
            c.dim, c.group_size, c.tier,
            (d.calls if d else 0) + c.count,
            (d.bytes if d else 0) + c.total_bytes,
            (d.wire_bytes if d else 0.0) + c.wire_bytes * c.count,
            (d.time_s if d else 0.0) + c.total_time_s,
            (d.exposed_time_s if d else 0.0) + c.exposed_time_s,
        )
    return out


def link_traffic(config: "RunConfig", pp_rank: int | None = None) -> dict[str, float]:
    """Bytes one GPU sends per step over each link tier (hierarchical collectives split)."""
    out = {tier: 0.0 for tier in ("intra_node", "inter_node", "inter_leaf")}
    for c in step_collectives(config, pp_rank):
        for tier, nbytes in c.wire_by_tier:
            out[tier] += nbytes * c.count
    return out


def p2p_time(config: "RunConfig") -> float:
    """Seconds of one pipeline send of a stage-boundary activation (the schedule's p2p time)."""
    plan, train = config.plan, config.train
    if plan.pp == 1:
        return 0.0
    sp = plan.tp if plan.sequence_parallel and plan.tp > 1 else 1
    size = train.micro_batch_size * train.seq_len // plan.cp * config.model.d_model * DTYPE_BYTES[train.compute_dtype] / sp
    n, tier, _ = group_shape(plan, "pp", config.cluster)
    return collective_time("send_recv", size, n, config.cluster, tier)


__all__ = [
    "BUS_FACTOR",
    "Collective",
    "DimTraffic",
    "collective_time",
    "group_members",
    "group_shape",
    "link_traffic",
    "p2p_time",
    "step_collectives",
    "traffic_by_dim",
]
