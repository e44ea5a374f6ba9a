# %% [markdown]
# # 2 · Meshes and topology
#
# A parallel plan is a set of degrees (`tp`, `pp`, `dp_shard`, ...) whose product is the number of
# GPUs. This notebook shows how those degrees become a **device mesh** (every rank gets a coordinate
# per dimension), how the mesh lands on **machines** (which ranks share a node and its NVLink), and
# what the resulting **traffic** costs on each link, in the units `nccl-tests` reports.
#
# References: Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021, *Efficient Large-Scale
# Language Model Training on GPU Clusters Using Megatron-LM*, section 3: tensor parallelism inside a
# node, pipeline parallelism across nodes); torchtitan's `DeviceMesh` layout; NVIDIA's nccl-tests
# (`doc/PERFORMANCE.md`: algorithm and bus bandwidth); the alpha-beta cost model (Hockney 1994;
# Thakur, Rabenseifner & Gropp 2005, *Optimization of Collective Communication Operations in MPICH*).

# %%
import holoviews as hv
import pandas as pd

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, predict_step
from workbench.predict.comms import BUS_FACTOR, collective_time, link_traffic, traffic_by_dim
from workbench.spec.plan import MESH_DIMS
from widgets.mesh_view import mesh_figure
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
GB = 1e9

# %% [markdown]
# ## 1. Ranks and mesh coordinates
#
# The mesh dimensions are ordered outermost to innermost **`pp, dp_replicate, dp_shard, cp, tp`**.
# A rank's coordinates are the digits of its number in that mixed radix:
# `rank = Σ_d coord_d × stride_d`, with `stride_tp = 1`, `stride_cp = tp`, `stride_dp_shard = tp × cp`,
# and so on outwards. Putting `tp` innermost makes tensor-parallel peers *neighbouring ranks*, and
# neighbouring ranks share a node. Take 16 GPUs (two DGX H100 nodes) split `tp=4, pp=2, dp_shard=2`:

# %%
cluster = Cluster.preset("dgx-h100", nodes=2)
plan = ParallelPlan(tp=4, pp=2, dp_shard=2).resolve(cluster.world_size)
placement = plan.placement(cluster)
print("strides:", plan.strides())
ranks = pd.DataFrame([{"rank": r, "node": placement.node_of(r), "gpu": placement.gpu_of(r),
                       **{d: c for d, c in plan.rank_coords(r).items() if d in ("pp", "dp_shard", "tp")}}
                      for r in range(plan.world_size)]).set_index("rank")
ranks.T

# %%
assert plan.strides() == {"tp": 1, "cp": 4, "dp_shard": 4, "dp_replicate": 8, "pp": 8}
assert plan.rank_coords(13) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1, "ep": 0}
for r in range(plan.world_size):  # coordinates <-> rank is a bijection
    coords = plan.rank_coords(r)
    assert plan.coords_rank(coords) == r == sum(coords[d] * plan.strides()[d] for d in MESH_DIMS)

# %% [markdown]
# ## 2. Process groups
#
# A **group** of dimension *d* is the set of ranks that differ only in their *d* coordinate: they
# run *d*'s collectives together (TP all-reduces, FSDP all-gathers, pipeline sends). Every
# dimension's groups partition the world. `group_ranks` is the exact list the trainer hands to
# `torch.distributed` when it builds the mesh, so the picture is the mesh that runs.

# %%
groups = {d: plan.group_ranks(d) for d in ("tp", "dp_shard", "pp")}
for d, gs in groups.items():
    print(f"{d:9s} ({len(gs)} groups of {len(gs[0])}): {gs}")

# %%
assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
assert groups["dp_shard"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
assert groups["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
for gs in groups.values():
    assert sorted(r for g in gs for r in g) == list(range(16))  # a partition of the world

# %% [markdown]
# ## 3. The mesh on the machines
#
# The app's mesh view draws the nodes (boxes), NVLink inside each node (green) and the network
# below (purple), with every rank coloured by its group of one dimension (hover a GPU for its
# coordinates). TP groups are four consecutive GPUs; the two pipeline stages are the two nodes;
# each data-parallel pair sits inside one node, four GPUs apart.

# %%
config16 = RunConfig(ModelSpec.preset("llama3-8b"), cluster, plan, TrainSettings(seq_len=4096))
hv.Layout([mesh_figure(config16, d)[0].opts(title=f"coloured by {d} group") for d in ("tp", "dp_shard", "pp")]).cols(3)

# %% [markdown]
# Each dimension's traffic crosses the **slowest link tier** any of its groups spans.
# `placement.tiers` names it: `intra_node` (NVLink/NVSwitch), `inter_node` (the scale-out network),
# `inter_leaf` (across leaf switches). The cluster presets give each tier a bandwidth per GPU, each
# way, and a latency: on a DGX H100, NVLink is 9× the network.

# %%
print(placement.tiers)
assert placement.tiers["tp"] == "intra_node" and placement.tiers["dp_shard"] == "intra_node"
assert placement.tiers["pp"] == "inter_node"
links = pd.DataFrame([{"cluster": name, "tier": tier, "link": c.link(tier).name,
                       "GB/s per GPU each way": c.link(tier).bandwidth_bytes_per_s / GB,
                       "latency (µs)": c.link(tier).latency_s * 1e6}
                      for name in ("dgx-h100", "dgx-a100", "pcie-l40s") for c in [Cluster.preset(name)]
                      for tier in ("intra_node", "inter_node")])
links

# %% [markdown]
# ## 4. When a group leaves the node: the `tp=16` warning
#
# Tensor parallelism all-reduces (or, with sequence parallelism, all-gathers and reduce-scatters)
# activations *twice per layer in forward and twice in backward*, on the critical path. Inside a node
# that rides NVLink; `tp=16` on 8-GPU nodes spans two nodes and every one of those collectives drops
# to the network. The placement says so, and the step-time model shows the price: GPT-3 175B on 32
# H100s, `tp=16, pp=2` against `tp=8, pp=4`.

# %%
gpt3 = ModelSpec.preset("gpt3-175b")
four_nodes = Cluster.preset("dgx-h100", nodes=4)
train = TrainSettings(seq_len=2048, global_batch_size=64, recompute="selective").with_precision("bf16-megatron")
compare = {}
for p in (ParallelPlan(tp=16, pp=2), ParallelPlan(tp=8, pp=4)):
    cfg = RunConfig(gpt3, four_nodes, p, train)
    pred = predict_step(cfg)
    compare[cfg.plan.describe()] = {"tp tier": cfg.plan.placement(four_nodes).tiers["tp"],
                                    "TP comm (s)": pred.breakdown["comm_tp"], "step (s)": pred.step_time_s,
                                    "MFU": pred.mfu, "warnings": cfg.plan.placement(four_nodes).warnings}
for name, row in compare.items():
    print(name, "->", *row["warnings"] or ["no warnings"])
tp16, tp8 = compare.values()
assert len(tp16["warnings"]) == 1 and "tp=16 spans 2 nodes" in tp16["warnings"][0] and not tp8["warnings"]
assert tp16["TP comm (s)"] > 2 * tp8["TP comm (s)"] and tp16["MFU"] < tp8["MFU"]
pd.DataFrame(compare).T.drop(columns="warnings")

# %% [markdown]
# ## 5. Traffic per group
#
# `comms.step_collectives` lists every collective one rank issues in a training step (FSDP
# all-gathers and reduce-scatters, TP/SP collectives, pipeline sends...); `traffic_by_dim` sums them
# per group dimension, `link_traffic` per link tier. Here is Llama 3 70B on 64 H100s with `tp=8,
# pp=4` (`dp_shard=2`), the plan of notebook 1. Sizes follow nccl-tests: *bytes* is the buffer size
# S of each call, *wire bytes* what this GPU actually sends, S × the bus factor (next section).

# %%
llama70 = RunConfig(ModelSpec.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=8), ParallelPlan(tp=8, pp=4),
                    TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron"))
by_dim = traffic_by_dim(llama70)
traffic = pd.DataFrame([{"dim": d, "group size": t.group_size, "tier": t.tier, "calls": t.calls,
                         "bytes (GB)": t.bytes / GB, "wire bytes (GB)": t.wire_bytes / GB,
                         "time (s)": t.time_s, "exposed (s)": t.exposed_time_s}
                        for d, t in by_dim.items()]).set_index("dim")
per_tier = link_traffic(llama70)
print({tier: f"{b / GB:.1f} GB" for tier, b in per_tier.items()})
traffic.round(3)

# %% [markdown]
# TP moves by far the most bytes and all of them are exposed, but it stays on NVLink; FSDP's
# `dp_shard` pairs ({0, 8}, {1, 9}, ...) are one node apart, so they cross the network, with a
# fraction of the bytes and nearly all of it hidden behind compute. That is the Megatron placement
# rule in numbers.

# %%
assert by_dim["tp"].tier == "intra_node" and by_dim["pp"].tier == "inter_node"
assert by_dim["tp"].wire_bytes > 5 * by_dim["dp_shard_cp"].wire_bytes
assert by_dim["tp"].exposed_time_s == by_dim["tp"].time_s  # TP sits on the critical path
assert by_dim["dp_shard_cp"].exposed_time_s < 0.1 * by_dim["dp_shard_cp"].time_s  # FSDP overlaps compute
assert per_tier["intra_node"] > per_tier["inter_node"]
total_wire = sum(t.wire_bytes for t in by_dim.values())
assert abs(total_wire - sum(per_tier.values())) < 1e-6 * total_wire  # the same bytes, counted two ways

# %% [markdown]
# ## 6. nccl-tests' conventions: algorithm and bus bandwidth
#
# `nccl-tests` times one collective on a buffer of S bytes and reports **algbw = S / t** and
# **busbw = algbw × factor**, where the factor is the share of S that each rank must send with the
# best (ring or pairwise) algorithm. busbw is therefore comparable across group sizes and with the
# link's own bandwidth:
#
# | op | S is | factor |
# |---|---|---|
# | all_reduce | the buffer | 2 (n − 1) / n |
# | all_gather | the gathered output (n × input) | (n − 1) / n |
# | reduce_scatter | the input (n × output) | (n − 1) / n |
# | all_to_all | one rank's send buffer | (n − 1) / n |
# | send_recv | the message | 1 |
#
# The time model is alpha-beta: a ring all-reduce takes 2 (n − 1) α + 2 (n − 1)/n × S / B, with α the
# link latency and B its bandwidth per GPU. Small messages are latency-bound; large ones reach B. In
# busbw, an all-reduce and an all-gather over the same ranks coincide (the all-reduce is a
# reduce-scatter plus an all-gather, twice the steps for twice the bytes): that is what the factor is for.

# %%
factors = pd.DataFrame({op: {n: f(n) for n in (2, 4, 8, 64)} for op, f in BUS_FACTOR.items()})
factors.index.name = "n"
h100 = Cluster.preset("dgx-h100", nodes=8)
nvlink = h100.intra_node
S = 2**30
t_ar = collective_time("all_reduce", S, 8, h100, "intra_node")
algbw, busbw = S / t_ar, S / t_ar * BUS_FACTOR["all_reduce"](8)
print(f"all_reduce of 1 GiB over 8 GPUs on NVLink: {t_ar * 1e3:.2f} ms, algbw {algbw / GB:.0f} GB/s, "
      f"busbw {busbw / GB:.0f} GB/s (link: {nvlink.bandwidth_bytes_per_s / GB:.0f} GB/s)")
assert t_ar == 2 * 7 * nvlink.latency_s + 2 * 7 / 8 * S / nvlink.bandwidth_bytes_per_s
assert 0.99 < busbw / nvlink.bandwidth_bytes_per_s < 1.0
factors.round(3)

# %%
sizes = [2**k for k in range(10, 33)]  # 1 KiB .. 4 GiB
curves, series = [], {}
cases = [  # (label, op, group size, tier, ranks of the group per node, line)
    ("all_reduce, 8 GPUs, NVLink", "all_reduce", 8, "intra_node", None, "solid"),
    ("all_gather, 8 GPUs, NVLink", "all_gather", 8, "intra_node", None, "dashed"),
    ("all_reduce, 8 nodes x 1 GPU, network", "all_reduce", 8, "inter_node", 1, "solid"),
]
for label, op, n, tier, g, dash in cases:
    bus = [s / collective_time(op, s, n, h100, tier, gpus_per_node_in_group=g) * BUS_FACTOR[op](n) / GB for s in sizes]
    series[label] = bus
    curves.append(hv.Curve((sizes, bus), "message size (bytes)", "bus bandwidth (GB/s)", label=label).opts(
        line_dash=dash, line_width=2))
for bus, peak in ((series["all_reduce, 8 GPUs, NVLink"], 450), (series["all_reduce, 8 nodes x 1 GPU, network"], 50)):
    assert all(x < y for x, y in zip(bus, bus[1:])) and bus[-1] < peak and bus[-1] > 0.97 * peak
# with the bus factor, all-reduce and all-gather over the same ranks draw one curve: S/n per alpha step
ar, ag = series["all_reduce, 8 GPUs, NVLink"], series["all_gather, 8 GPUs, NVLink"]
assert all(abs(x - y) < 1e-9 * y for x, y in zip(ar, ag))
hv.Overlay(curves).opts(logx=True, logy=True, ylim=(0.05, 1000), width=820, height=340, legend_position="right",
                        toolbar=None, title="Predicted bus bandwidth vs message size (alpha-beta)")

# %% [markdown]
# ## 7. Hierarchical all-reduce across nodes
#
# A 64-rank data-parallel group on 8 nodes does not push every byte through the network. NCCL's
# rings and trees behave like a three-phase hierarchy, each phase on its own link, with g = 8 ranks
# per node and N = 8 nodes:
#
# 1. **reduce-scatter inside each node** (NVLink): every GPU ends with 1/g of the node's sum;
# 2. **all-reduce across nodes** of that S/g shard among the N GPUs with the same local index
#    (one NIC each, all g NICs of a node busy at once);
# 3. **all-gather inside each node** (NVLink).
#
# The network then carries 2 (N − 1)/N × S/g bytes per GPU instead of 2 (n − 1)/n × S: g times less.

# %%
def hierarchical_by_hand(S, g, N, c):
    return (collective_time("reduce_scatter", S, g, c, "intra_node")
            + collective_time("all_reduce", S / g, N, c, "inter_node")
            + collective_time("all_gather", S, g, c, "intra_node"))


rows = []
for S in (2**20, 2**24, 2**28, 2**30, 2**32):
    hier = collective_time("all_reduce", S, 64, h100, "inter_node", gpus_per_node_in_group=8)
    flat = collective_time("all_reduce", S, 64, h100, "inter_node", gpus_per_node_in_group=1)
    assert abs(hier - hierarchical_by_hand(S, 8, 8, h100)) < 1e-12
    rows.append({"S (MiB)": S / 2**20, "hierarchical (ms)": hier * 1e3,
                 "flat ring at network speed (ms)": flat * 1e3, "speed-up": flat / hier})
hier_table = pd.DataFrame(rows).set_index("S (MiB)")
assert hier_table["speed-up"].iloc[-1] > 4  # large buffers: ~g x fewer network bytes, plus NVLink phases
hier_table.round(2)

# %% [markdown]
# **Take-aways.** The mesh order puts TP on neighbouring ranks, hence inside a node; the slowest
# tier a group crosses sets its bandwidth; busbw is the number to compare with a link's datasheet;
# hierarchical collectives let data parallelism scale across nodes. The mesh view of the app
# (`widgets.MeshView`) shows all of this for any plan; `workbench mesh --plan "tp=8,pp=4"` prints it.
