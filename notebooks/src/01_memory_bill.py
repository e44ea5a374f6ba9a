# %% [markdown]
# # 1 · The memory bill
#
# Before a parallel plan is fast it has to *fit*. This notebook adds up what one GPU holds while it
# trains a transformer, term by term, with the formulas from the papers that introduced them:
#
# 1. **model states**: parameters, gradients, optimizer states, master weights, per precision recipe;
# 2. **ZeRO**: sharding those states over the data-parallel ranks (Rajbhandari et al. 2020,
#    *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*);
# 3. **activations**: what each layer saves for backward, and how tensor parallelism, sequence
#    parallelism and recomputation shrink it (Korthikanti et al. 2022, *Reducing Activation
#    Recomputation in Large Transformer Models*);
# 4. **the whole bill** of Llama 3 70B on 64 H100s, per pipeline rank;
# 5. **what fits**, and what to change when it does not.
#
# Everything is computed by `workbench` (`workbench/predict/memory.py`); bytes are bytes, GB are 10⁹ bytes
# (as the ZeRO paper counts) and GiB 2³⁰ (as `nvidia-smi` and the 80 GiB of an H100 count).

# %%
from dataclasses import replace

import holoviews as hv
import pandas as pd

from workbench import PRECISIONS, Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, estimate_memory
from workbench.predict.memory import COMPONENTS, activation_bytes_per_layer, model_state_bytes
from widgets.transforms import COMPONENT_COLORS
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
GB, GiB = 1e9, 2**30
STATES = ("parameters", "gradients", "optimizer", "master_weights")
state_colors = [COMPONENT_COLORS[c] for c in STATES]

# %% [markdown]
# ## 1. Model states: bytes per parameter
#
# A parameter costs memory four times over: the **parameter** the forward pass reads, its
# **gradient**, the **optimizer states** (Adam keeps two: the moving averages *m* and *v*) and, in
# mixed precision, an fp32 **master copy** that the optimizer updates (bf16 cannot accumulate small
# updates). `TrainSettings` names the five dtypes involved; the named recipes are the ones in use:
#
# | recipe | what it is | bytes / parameter with Adam |
# |---|---|---|
# | `fp32` | everything in fp32 | 4 + 4 + 8 = 16 |
# | `bf16-megatron` | Megatron-LM: bf16 weights, fp32 "main" gradients, fp32 master and states | 2 + 4 + 8 + 4 = 18 |
# | `bf16-zero` | the ZeRO paper's mixed-precision Adam: 2 + 2 + *K*, *K* = 12 | 2 + 2 + 8 + 4 = 16 |
# | `fsdp2-bf16` | FSDP2 `MixedPrecisionPolicy(bf16, reduce fp32)`: fp32 sharded weights *are* the master | 4 + 4 + 8 = 16 |
# | `bf16` | pure bf16, no master copy | 2 + 2 + 4 = 8 |
# | `float8-tensorwise`, `float8-rowwise` | torchao FP8 Linears over `fsdp2-bf16`'s dtypes | 4 + 4 + 8 = 16 |
# | `te-fp8` | Transformer Engine FP8 over `bf16-megatron`'s dtypes (+ 2 bytes of cached FP8 weights per Linear parameter, billed in buffers) | 2 + 4 + 8 + 4 = 18 |

# %%
recipes = {}
for name in PRECISIONS:
    train = TrainSettings().with_precision(name)
    recipes[name] = model_state_bytes(1, train, zero_stage=0, shard_degree=1)  # one parameter, no sharding
per_param = pd.DataFrame(recipes).T[list(STATES)]
per_param["total"] = per_param.sum(axis=1)
per_param

# %%
assert per_param["total"].to_dict() == {"fp32": 16, "bf16-megatron": 18, "bf16-zero": 16, "fsdp2-bf16": 16, "bf16": 8,
                                        "float8-tensorwise": 16, "float8-rowwise": 16, "te-fp8": 18}
assert per_param.loc["bf16-zero", ["optimizer", "master_weights"]].sum() == 12  # the ZeRO paper's K

# %%
hv.Bars(
    [(name, c, recipes[name][c]) for name in PRECISIONS for c in STATES], kdims=["recipe", "component"], vdims="bytes"
).opts(stacked=True, color=hv.Cycle(state_colors), width=640, height=300, legend_position="right",
       ylabel="bytes per parameter", title="Model states per parameter, by precision recipe", toolbar=None)

# %% [markdown]
# ## 2. ZeRO: shard the model states over data parallel
#
# Plain data parallelism replicates all of it on every rank. ZeRO (section 5.1 of the paper)
# partitions it over the *N_d* data-parallel ranks in three stages, for Ψ parameters and *K* bytes
# of optimizer state per parameter:
#
# | stage | sharded | bytes per GPU |
# |---|---|---|
# | 0 (DDP) | nothing | (2 + 2 + *K*) Ψ |
# | 1 | optimizer states (and master weights) | (2 + 2) Ψ + *K* Ψ / *N_d* |
# | 2 | + gradients | 2 Ψ + (2 + *K*) Ψ / *N_d* |
# | 3 (FSDP) | + parameters | (2 + 2 + *K*) Ψ / *N_d* |
#
# The paper's Figure 1 draws a 7.5B-parameter model on 64 GPUs: **120, 31.4, 16.6 and 1.9 GB**.

# %%
psi, n_d = 7.5e9, 64
zero_train = TrainSettings().with_precision("bf16-zero")
figure_1 = {f"stage {z}": model_state_bytes(psi, zero_train, z, n_d) for z in range(4)}
zero_table = pd.DataFrame(figure_1).T[list(STATES)] / GB
zero_table["total (GB)"] = zero_table.sum(axis=1)
zero_table.round(2)

# %%
assert [round(t, 1) for t in zero_table["total (GB)"]] == [120.0, 31.4, 16.6, 1.9]  # ZeRO, Figure 1

# %% [markdown]
# Stage 3 divides everything by *N_d*, so it keeps shrinking as the cluster grows; stages 1 and 2
# flatten out at the unsharded part (4Ψ and 2Ψ bytes). That floor is why large models need
# stage 3 (or tensor and pipeline parallelism, which split the model itself).

# %%
degrees = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
curves = []
for z in range(4):
    gb = [sum(model_state_bytes(psi, zero_train, z, n).values()) / GB for n in degrees]
    curves.append(hv.Curve((degrees, gb), "data-parallel ranks", "GB per GPU", label=f"ZeRO-{z}"))
    if z == 3:
        assert all(abs(g * n - gb[0]) < 1e-9 * gb[0] for g, n in zip(gb, degrees))  # exactly 1 / N_d
hv.Overlay(curves).opts(logx=True, logy=True, width=640, height=320, legend_position="right", toolbar=None,
                        title="Model states of a 7.5B model per GPU")

# %% [markdown]
# ## 3. Activations (Korthikanti et al. 2022)
#
# Backward needs what forward computed: every layer *saves* tensors. Section 4 of the paper counts
# them for one transformer layer with sequence length *s*, micro-batch *b*, hidden size *h*, *a*
# heads, 2-byte activations, 1-byte dropout masks, and *t*-way tensor parallelism:
#
# | setting | bytes per layer |
# |---|---|
# | no parallelism | *sbh* (34 + 5*as*/*h*) |
# | tensor parallel (TP) | *sbh* (10 + 24/*t* + 5*as*/(*ht*)) |
# | TP + sequence parallel (SP) | *sbh*/*t* (34 + 5*as*/*h*) |
# | TP + SP + selective recomputation | 34 *sbh*/*t* |
# | full recomputation | 2 *sbh* (only the layer's input) |
#
# The 5*as*/*h* term is the attention scores (softmax output, dropout mask and output: *a s² b*
# elements each); it dominates at long sequences. *Selective* recomputation drops exactly that term
# and recomputes the attention core in backward, which is cheap in FLOPs. Here are the numbers for
# a GPT-3 175B layer (*s* = 2048, *h* = 12288, *a* = 96, *t* = 8), against the formulas.

# %%
s, b, h, a, t = 2048, 1, 12288, 96, 8
gpt3_layer = ModelSpec(n_layers=1, d_model=h, n_heads=a, d_ff=4 * h, vocab_size=51200, activation="gelu",
                       norm="layernorm")
paper = TrainSettings(seq_len=s, micro_batch_size=b, attention="eager", dropout=True).with_precision("bf16-zero")
sbh = s * b * h
cases = [  # (setting, plan, recompute, the paper's formula)
    ("no parallelism", ParallelPlan(dp_shard=1), "none", sbh * (34 + 5 * a * s / h)),
    ("TP", ParallelPlan(tp=t, dp_shard=1, sequence_parallel=False), "none", sbh * (10 + 24 / t + 5 * a * s / (h * t))),
    ("TP + SP", ParallelPlan(tp=t, dp_shard=1), "none", sbh / t * (34 + 5 * a * s / h)),
    ("TP + SP + selective", ParallelPlan(tp=t, dp_shard=1), "selective", 34 * sbh / t),
    ("full recomputation", ParallelPlan(dp_shard=1), "full", 2 * sbh),
]
rows = []
for setting, plan, recompute, formula in cases:
    got = activation_bytes_per_layer(gpt3_layer, replace(paper, recompute=recompute), plan)
    rows.append({"setting": setting, "workbench (GB / layer)": got / GB, "paper (GB / layer)": formula / GB,
                 "96 layers (GB)": 96 * got / GB})
activations = pd.DataFrame(rows).set_index("setting")
activations.round(3)

# %%
for (setting, *_), row in zip(cases, rows):
    assert abs(row["workbench (GB / layer)"] - row["paper (GB / layer)"]) <= 1e-9 * row["paper (GB / layer)"], setting
# sequence parallelism divides *everything* by t; selective recomputation removes the 5as/h term
per_layer = activations["workbench (GB / layer)"]
ratio = per_layer["no parallelism"] / per_layer["TP + SP"]
assert abs(ratio - t) < 1e-9

# %%
hv.Bars(activations["96 layers (GB)"].reset_index(), "setting", "96 layers (GB)").opts(
    width=640, height=300, logy=True, ylim=(1, None), xrotation=20, toolbar=None, color="#009E73",
    title="Activations of GPT-3 175B's 96 layers, one micro-batch of 2048 tokens")

# %% [markdown]
# **FlashAttention** (Dao et al. 2022) never materialises the *s × s* scores: its backward
# recomputes them from Q, K, V and a 4-byte log-sum-exp per query and head. So with flash
# attention "selective recomputation" is what the kernel already does: the two differ only by that
# log-sum-exp, 4 *sba*/*t* bytes. (Modern recipes also drop dropout; `workbench` defaults to flash
# attention without dropout, and bills the paper's setting only when asked, as above.)

# %%
flash = activation_bytes_per_layer(gpt3_layer, replace(paper, attention="flash"), ParallelPlan(tp=t, dp_shard=1))
selective = activation_bytes_per_layer(gpt3_layer, replace(paper, recompute="selective"),
                                       ParallelPlan(tp=t, dp_shard=1))
print(f"flash + TP + SP: {flash / GB:.3f} GB per layer; selective: {selective / GB:.3f} GB")
assert flash - selective == 4 * s * b * a / t

# %% [markdown]
# ## 4. The whole bill: Llama 3 70B on 64 H100s
#
# 8 DGX H100 nodes (8 GPUs of 80 GiB each), `tp=8` inside each node, `pp=4` pipeline stages across
# nodes, which leaves `dp_shard = 64 / (8 × 4) = 2` data-parallel ranks sharding their states with
# ZeRO-3; sequences of 8192 tokens, selective recomputation, Megatron's precision. Besides the
# model states and activations the bill counts:
#
# * **activations × micro-batches in flight**: under 1F1B, pipeline rank *r* of *p* holds the
#   activations of *p − r* micro-batches at its peak (Narayanan et al. 2021), so the first stage is
#   the most loaded; the last stage also keeps the fp32 log-probabilities of a 128k vocabulary;
# * **buffers**: FSDP's unsharded layer in flight and the one prefetched, gradients before their
#   reduce-scatter, pipeline receive buffers, the sequence-parallel all-gather;
# * **overhead**: the CUDA context and the caching allocator's fragmentation (5%), explicit.

# %%
llama70 = ModelSpec.preset("llama3-70b")
cluster = Cluster.preset("dgx-h100", nodes=8)
train = TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron")
config = RunConfig(llama70, cluster, ParallelPlan(tp=8, pp=4), train)
bill = estimate_memory(config)
fit = bill.fits()

per_stage = pd.DataFrame({f"pp rank {r.pp_rank}": {c: r.components[c] / GiB for c in COMPONENTS}
                          for r in bill.per_stage})
per_stage.loc["total"] = per_stage.sum()
print(f"{config.plan.describe()}: {llama70.n_params() / 1e9:.1f}B parameters, {config.n_microbatches} micro-batches")
print(f"most loaded: rank {bill.most_loaded_rank}, {fit.peak_bytes / GiB:.1f} of {fit.hbm_bytes / GiB:.0f} GiB "
      f"({'fits' if fit else 'does not fit'}, headroom {fit.headroom_bytes / GiB:.1f} GiB)")
print("micro-batches in flight per pipeline rank:", [r.in_flight for r in bill.per_stage])
per_stage.round(2)

# %%
n = llama70.n_params()
states_gib = per_stage.loc[list(STATES)].sum()
# each rank holds 1/(tp x pp) of the model, ZeRO-3-sharded over 2 ranks: ~18 N / 64 bytes
assert abs(states_gib["pp rank 1"] * GiB / (18 * n / 64) - 1) < 0.05
assert [r.in_flight for r in bill.per_stage] == [(4,), (3,), (2,), (1,)]  # 1F1B: p - r
acts = per_stage.loc["activations"]
assert acts["pp rank 0"] > acts["pp rank 1"] > acts["pp rank 2"]
assert fit.fits and fit.headroom_bytes > 0

# %%
hbm_line = hv.HLine(fit.hbm_bytes / GiB).opts(color="#c62828", line_dash="dashed", line_width=2)
bars = hv.Bars(
    [(stage, c, per_stage.loc[c, stage]) for stage in per_stage.columns for c in COMPONENTS],
    kdims=["pipeline rank", "component"], vdims="GiB",
).opts(stacked=True, color=hv.Cycle([COMPONENT_COLORS[c] for c in COMPONENTS]), legend_position="right")
(bars * hbm_line).opts(width=700, height=360, toolbar=None, ylim=(0, 90),
                       title="Llama 3 70B, tp=8 pp=4 on 64 H100: memory per pipeline rank (dashed: 80 GiB)")

# %% [markdown]
# The app's memory view draws the same bill and lets you toggle recomputation, precision and the
# ZeRO stage (in JupyterLab the controls are live; here it renders once). It is fed by a
# `PlanState`, the object every view of the app shares.

# %%
state = widgets.PlanState(model=llama70, cluster="dgx-h100", nodes=8, tp=8, pp=4, seq_len=8192,
                          recompute="selective", precision="bf16-megatron")
assert state.config is not None and estimate_memory(state.config).peak_bytes == bill.peak_bytes
widgets.MemoryView(state)

# %% [markdown]
# ## 5. What fits
#
# The levers, from cheapest to dearest in step time: a smaller micro-batch (activations scale with
# *b*), a higher ZeRO stage (more communication, usually hidden), recomputation (selective costs
# little, full costs about a third more compute), then more model parallelism. Here is the same
# 70B plan over micro-batch sizes, recomputation and ZeRO stages.

# %%
grid = []
for zero in (1, 3):
    for recompute in ("none", "selective", "full"):
        for mbs in (1, 2, 4):
            t_ = TrainSettings(seq_len=8192, micro_batch_size=mbs, recompute=recompute).with_precision("bf16-megatron")
            bill_ = estimate_memory(RunConfig(llama70, cluster, ParallelPlan(tp=8, pp=4, zero_stage=zero), t_))
            grid.append({"zero": zero, "recompute": recompute, "mbs": mbs,
                         "peak (GiB)": bill_.peak_bytes / GiB, "fits": bool(bill_.fits())})
fits = pd.DataFrame(grid)
fits.pivot_table(index=["zero", "recompute"], columns="mbs", values="peak (GiB)", sort=False).round(1)

# %%
peak = fits.set_index(["zero", "recompute", "mbs"])["peak (GiB)"]
for zero in (1, 3):
    for recompute in ("none", "selective", "full"):
        assert peak[zero, recompute, 1] < peak[zero, recompute, 2] < peak[zero, recompute, 4]  # activations ∝ b
    for mbs in (1, 2, 4):
        assert peak[zero, "full", mbs] < peak[zero, "selective", mbs] <= peak[zero, "none", mbs]
        assert peak[3, "none", mbs] < peak[1, "none", mbs]  # ZeRO-3 shards the bf16 parameters too
assert fits["fits"].any() and not fits["fits"].all()
cells = fits.assign(setting=fits["recompute"] + ", zero " + fits["zero"].astype(str),
                    micro_batch=fits["mbs"].map(lambda x: f"mbs {x}"),
                    label=[f"{g:.0f}{'' if ok else ' ✗'}" for g, ok in zip(fits["peak (GiB)"], fits["fits"])])
hv.HeatMap(cells, kdims=["micro_batch", "setting"], vdims=["peak (GiB)"]).opts(
    cmap="RdYlGn_r", clim=(0, 160), colorbar=True, width=560, height=320, toolbar=None, tools=["hover"],
    xlabel="micro-batch size", title="Peak GiB per GPU (80 GiB available; ✗: does not fit)") * hv.Labels(
    cells, kdims=["micro_batch", "setting"], vdims="label").opts(text_font_size="10pt", text_color="black")

# %% [markdown]
# Two things to read off the grid: selective recomputation and none coincide, because with flash
# attention there are no attention scores left to drop (section 3); and only full recomputation
# lets a micro-batch of more than one 8192-token sequence fit this plan.
#
# And which models fit on one 8-GPU node with FSDP (ZeRO-3 over all 8), full recomputation and
# 4096-token sequences (2048 for GPT-3, whose learned position table has 2048 rows)? The model
# states alone are 18 bytes × parameters / 8: Llama 3 8B needs 18 GB of them, Llama 3 70B 159 GB,
# twice an H100, before a single activation.

# %%
one_node = Cluster.preset("dgx-h100", nodes=1)
fsdp8 = TrainSettings(seq_len=4096, recompute="full").with_precision("bf16-megatron")
presets = []
for name in ("llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llama3-70b", "gpt3-175b", "llama3-405b"):
    model = ModelSpec.preset(name)
    train = replace(fsdp8, seq_len=min(fsdp8.seq_len, model.max_seq_len))
    bill_ = estimate_memory(RunConfig(model, one_node, ParallelPlan(dp_shard=8, zero_stage=3), train))
    states = sum(bill_.components[c] for c in STATES)
    presets.append({"model": name, "parameters (B)": model.n_params() / 1e9, "states (GiB)": states / GiB,
                    "peak (GiB)": bill_.peak_bytes / GiB, "fits in 80 GiB": bool(bill_.fits())})
presets = pd.DataFrame(presets).set_index("model")
assert presets.loc["llama3-8b", "fits in 80 GiB"] and not presets.loc["llama3-70b", "fits in 80 GiB"]
presets.round(1)

# %% [markdown]
# **Take-aways.** Model states cost 16-18 bytes per parameter in mixed precision and shard with
# ZeRO; activations scale with *s b h* per layer and with the micro-batches a pipeline keeps in
# flight; tensor + sequence parallelism divide them by *t*, recomputation trades them for compute.
# Notebook 2 places the ranks on the machines; notebook 3 shows why the first pipeline stage holds
# the most; notebook 6 lets the advisor search all of this at once.
