# %% [markdown]
# # 6 · Choosing a plan
#
# Notebooks 1-3 priced each ingredient of a plan: memory, communication, pipeline bubbles. This one
# puts them together the way practitioners do, along the **scaling order**:
#
# 1. **data parallel first**: it adds no work per GPU, only a gradient all-reduce that overlaps backward;
# 2. **shard** the optimizer states, then gradients, then parameters (ZeRO-1/2/3, Rajbhandari et al.
#    2020) when the replicas do not fit;
# 3. **tensor parallel inside a node** (Shoeybi et al. 2019): its collectives sit on the critical path
#    and need NVLink;
# 4. **pipeline parallel across nodes** (Narayanan et al. 2021): only point-to-point sends between
#    stages, at the price of a bubble;
# 5. **context parallel for long sequences** (ring attention: Liu et al. 2023; Megatron-Core CP):
#    split each sequence when its activations do not fit;
# 6. **expert parallel for MoE** (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): spread
#    the experts, and route tokens to them with all-to-alls.
#
# Then the **advisor** (`workbench.advise`) searches every valid combination, ranks those that fit
# by predicted throughput and explains the winner against its alternatives and against the naive
# baseline. We check the step-time model against **published MFU** (PaLM's convention, Chowdhery et
# al. 2022) and finish with what a run really **costs** once failures and checkpoints are counted
# (Young 1974; Daly 2006).

# %%
import math
from dataclasses import replace

import holoviews as hv
import pandas as pd

from workbench import (
    Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, advise, estimate_cost, estimate_memory, predict_step,
)
from workbench.predict.comms import traffic_by_dim
from workbench.predict.cost import optimal_checkpoint_interval
from workbench.predict.references import KORTHIKANTI_A100, MEGATRON_H100
from widgets.transforms import advice_rows
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
GiB = 2**30

# %% [markdown]
# ## 1. Climbing the ladder by hand: Llama 3 70B on 64 H100s
#
# 8 DGX H100 nodes, sequences of 8192 tokens, 512 sequences per step, Megatron's precision
# (18 bytes per parameter of model states), priced under the `megatron` framework profile
# (Megatron-LM's memory conventions: sequence-parallel inputs kept sharded, each micro-batch's
# logits dropped after its loss, gradients accumulated into sharded buffers). Each row adds one
# step of the scaling order. Under `framework="bundled"` the same plans cost more: the bundled
# trainer, like torch's pipelining runtime, keeps every micro-batch's logits and FSDP's unsharded
# gradients until the step ends (see `MemoryConventions` in `workbench/spec/framework.py`).

# %%
llama70 = ModelSpec.preset("llama3-70b")
cluster = Cluster.preset("dgx-h100", nodes=8)
train = TrainSettings(seq_len=8192, global_batch_size=512, framework="megatron").with_precision("bf16-megatron")
ladder = [
    ("plain data parallel", ParallelPlan(zero_stage=0), "none"),
    ("+ ZeRO-1", ParallelPlan(zero_stage=1), "none"),
    ("+ ZeRO-3 (FSDP)", ParallelPlan(zero_stage=3), "none"),
    ("ZeRO-3 + full recomputation", ParallelPlan(zero_stage=3), "full"),
    ("tp=8 in each node, ZeRO-3", ParallelPlan(tp=8, zero_stage=3), "none"),
    ("tp=8, pp=4 across nodes, ZeRO-1", ParallelPlan(tp=8, pp=4, zero_stage=1), "none"),
]
rows, preds = [], {}
for label, plan, recompute in ladder:
    cfg = RunConfig(llama70, cluster, plan, replace(train, recompute=recompute))
    bill, pred = estimate_memory(cfg), predict_step(cfg)
    preds[label] = pred
    rows.append({"step": label, "plan": cfg.plan.describe(), "recompute": recompute,
                 "peak (GiB)": bill.peak_bytes / GiB, "fits": bool(bill.fits()),
                 "step (s)": pred.step_time_s, "MFU": pred.mfu,
                 "biggest overhead": max((k for k in pred.breakdown if k != "compute"), key=pred.breakdown.get)})
ladder_table = pd.DataFrame(rows).set_index("step")
ladder_table.round(3)

# %% [markdown]
# Replicas need 1.4 TiB per GPU; ZeRO-1 and ZeRO-3 cut the model states by 64× where they apply, but
# 8192-token activations of 80 layers still do not fit. Full recomputation fits at the price of a
# recomputed forward (a third more compute); TP divides the activations by 8 instead, at the price of
# exposed NVLink collectives; PP across nodes divides the layers, at the price of a bubble. Which
# price is lowest is what a step-time model is for.

# %%
fits = ladder_table["fits"]
assert fits.tolist() == [False, False, False, True, True, True]  # only the last three rungs fit
peaks = ladder_table["peak (GiB)"].tolist()
assert peaks[0] > peaks[1] > peaks[2] > peaks[3]  # each rung of ZeRO, then recomputation, saves memory
full = preds["ZeRO-3 + full recomputation"].breakdown
assert 0.25 < full["recompute"] / full["compute"] < 0.4  # one more forward: ~1/3 of forward + backward
best_rung = ladder_table[ladder_table["fits"]]["MFU"].idxmax()
print(f"the fastest rung that fits: {best_rung} ({ladder_table.loc[best_rung, 'MFU']:.1%} MFU)")

# %% [markdown]
# ## 2. The advisor
#
# `advise(model, cluster, train)` enumerates the degrees (TP within the node, PP, CP, EP, data
# parallel and HSDP), schedules and virtual stages, micro-batch sizes, ZeRO stages and
# recomputation; drops what does not fit (a cheaper setting that fits dominates a dearer one, so the
# search prunes); predicts the rest; and returns the top plans with their explanation, beside the
# **baseline**: plain data parallel over every GPU, "just add devices". (It takes a few seconds.)

# %%
advice = advise(llama70, cluster, train, top=5)
print("baseline:", advice.baseline.reason)
stats = advice.stats
print(f"searched {stats['plans']} plans; {stats['too_big']} too big, {stats['predicted']} predicted\n")
print("why #1:\n  " + "\n  ".join(advice[0].explanation))
pd.DataFrame(advice_rows(advice)).set_index("#")

# %%
assert not advice.baseline.fits and "GiB per GPU" in advice.baseline.reason
speeds = [c.prediction.tokens_per_s for c in advice]
assert speeds == sorted(speeds, reverse=True)
for c in advice:
    assert c.memory.fits() and c.plan.tp <= cluster.gpus_per_node  # TP never leaves the node
# nothing we built by hand beats the search
assert all(p.tokens_per_s <= speeds[0] * (1 + 1e-9) for label, p in preds.items() if fits[label])

# %% [markdown]
# When the replicas *do* fit, the scaling order says: stay with data parallelism. A 1.5B-parameter
# Llama-style model on one node: the advisor keeps TP and PP at 1 (they would only add
# communication and bubbles) and shards just the optimizer states.

# %%
small = ModelSpec(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256, name="llama-1.5b")
small_advice = advise(small, Cluster.preset("dgx-h100", nodes=1),
                      TrainSettings(seq_len=4096, global_batch_size=64).with_precision("bf16-megatron"), top=3)
print(f"{small.n_params() / 1e9:.2f}B parameters; baseline: {small_advice.baseline.reason}; "
      f"best: {small_advice[0].summary()}\n  " + "\n  ".join(small_advice[0].explanation))
assert small_advice.baseline.fits and small_advice.gain_over_baseline() >= 1.0
assert small_advice[0].plan.tp == 1 and small_advice[0].plan.pp == 1

# %% [markdown]
# ## 3. Long sequences: context parallelism
#
# Activations grow with the sequence length *s* and attention FLOPs with *s²*. At 128k tokens one
# sequence of Llama 3 8B does not fit a GPU even with `tp=8` and full recomputation: the fp32
# log-probabilities of 131072 tokens over a 128256-token vocabulary alone take 4 *s V* = 67 GB, and
# their gradient as much. Context parallelism splits each sequence over `cp` ranks (ring attention:
# each rank keeps *s/cp* tokens, queries included, and passes K/V blocks around the ring), which
# divides every per-token tensor by `cp`.

# %%
llama8 = ModelSpec.preset("llama3-8b")
long_train = TrainSettings(seq_len=131072, global_batch_size=16).with_precision("bf16-megatron")
two_nodes = Cluster.preset("dgx-h100", nodes=2)
long_advice = advise(llama8, two_nodes, long_train, top=3)
no_cp = RunConfig(llama8, two_nodes, ParallelPlan(tp=8, zero_stage=3), replace(long_train, recompute="full"))
print(f"tp=8, no CP, full recomputation: {estimate_memory(no_cp).peak_bytes / GiB:.0f} GiB per GPU")
print("best:", long_advice[0].summary())
assert not estimate_memory(no_cp).fits()
assert long_advice and all(c.plan.cp > 1 for c in long_advice)
pd.DataFrame(advice_rows(long_advice)).set_index("#")

# %% [markdown]
# ## 4. Mixture of experts: expert parallelism
#
# Mixtral 8×7B has 47B parameters but each token passes through 13B of them (2 of 8 experts).
# Expert parallelism gives each rank of an `ep` group a different subset of the experts: their weight
# memory divides by `ep`, and tokens travel to their experts and back in two all-to-alls per layer.
# With ZeRO-1 the optimizer states were already sharded over the 4 data-parallel ranks; EP only
# re-partitions them (half the experts per rank, sharded over half as many ranks), so that column
# does not move: EP pays off where ZeRO does not reach, the unsharded weights and their gradients.

# %%
mixtral = ModelSpec.preset("mixtral-8x7b")
moe_train = TrainSettings(seq_len=4096, global_batch_size=128).with_precision("bf16-megatron")
ep_rows = []
for ep in (1, 2, 4):
    cfg = RunConfig(mixtral, two_nodes, ParallelPlan(tp=2, pp=2, ep=ep, zero_stage=1), moe_train)
    bill, by_dim = estimate_memory(cfg), traffic_by_dim(cfg)
    ep_rows.append({"ep": ep, "parameters (GiB)": bill.components["parameters"] / GiB,
                    "optimizer (GiB)": bill.components["optimizer"] / GiB,
                    "all-to-all GB per step": by_dim["ep"].wire_bytes / 1e9 if "ep" in by_dim else 0.0,
                    "step (s)": predict_step(cfg, memory=bill).step_time_s})
ep_table = pd.DataFrame(ep_rows).set_index("ep")
params = ep_table["parameters (GiB)"]
assert params[1] > params[2] > params[4] and ep_table.loc[1, "all-to-all GB per step"] == 0
assert ep_table.loc[2, "all-to-all GB per step"] > 0
opt = ep_table["optimizer (GiB)"]
assert abs(opt[4] / opt[1] - 1) < 1e-3
moe_advice = advise(mixtral, two_nodes, moe_train, top=10)  # with 8 % of HBM kept free, EP plans rank 6-8
print("best:", moe_advice[0].summary())
assert any(c.plan.ep > 1 for c in moe_advice)
ep_table.round(3)

# %% [markdown]
# ## 5. Is the step-time model right? Published MFU
#
# Model FLOPs utilisation (PaLM, appendix B) = model FLOPs per token (6 N + 12 L h s) × tokens per
# second / (GPUs × peak FLOP/s); recomputation does not count. `workbench.predict.references` holds
# published runs: Megatron-Core's GPT rows on H100 (NVIDIA's Megatron-Core performance table) and
# Korthikanti et al.'s 22B GPT on 8 A100s. The model is physical (GEMM and attention efficiencies,
# HBM traffic, alpha-beta collectives, simulated pipelines; constants documented in
# `workbench/predict/perf.py`), not fitted per row; it lands within 5 MFU points of each.

# %%
ref_rows = []
for row in MEGATRON_H100 + KORTHIKANTI_A100:
    pred = predict_step(row.config)
    ref_rows.append({"run": row.label, "plan": row.config.plan.describe(), "GPUs": row.config.world_size,
                     "published MFU": row.mfu, "predicted MFU": pred.mfu,
                     "published step (s)": row.step_time_s, "predicted step (s)": pred.step_time_s})
refs = pd.DataFrame(ref_rows).set_index("run")
for name, r in refs.iterrows():
    if not math.isnan(r["published MFU"]):
        assert abs(r["predicted MFU"] - r["published MFU"]) <= 0.05, name
    if not math.isnan(r["published step (s)"]):
        assert abs(r["predicted step (s)"] / r["published step (s)"] - 1) <= 0.15, name
refs.round(3)

# %%
with_mfu = refs.dropna(subset=["published MFU"])
diag = [0.3, 0.6]
(hv.Area((diag, [d - 0.05 for d in diag], [d + 0.05 for d in diag]), "published MFU", ["predicted MFU", "upper"],
         label="±5 points").opts(color="#d9e6f2", line_alpha=0)
 * hv.Curve((diag, diag), "published MFU", "predicted MFU").opts(color="#777777", line_dash="dashed")
 * hv.Scatter(with_mfu.reset_index(), "published MFU", ["predicted MFU", "run"]).opts(
     size=11, color="#0072B2", tools=["hover"])
 * hv.Labels(with_mfu.reset_index(), ["published MFU", "predicted MFU"], "run").opts(
     text_font_size="8pt", yoffset=0.012)
 ).opts(width=520, height=420, xlim=(0.3, 0.6), ylim=(0.3, 0.6), toolbar=None, show_legend=False,
        title="Predicted vs published MFU")

# %% [markdown]
# ## 6. What a run costs: failures, checkpoints and goodput
#
# Hardware fails. Llama 3's pre-training saw 419 unexpected interruptions in 54 days on 16,384 H100s
# (Dubey et al. 2024, section 3.3.4): one per node every ~264 days, so a job on N nodes fails every
# M = 264 days / N. Each failure costs a restart, reading the last checkpoint back and the work done
# since it was written. Checkpointing every τ seconds of work costs δ each time (the blocking part of
# a save: all of it when synchronous, the copy to host memory when asynchronous). The expected waste
# is δ/τ + (τ/2 + restart + restore)/M, minimised by **Young's interval τ = √(2δM)** (Young 1974) with
# **Daly's higher-order correction** (Daly 2006); goodput = 1 − waste.
#
# `estimate_cost(config, tokens)` puts it together: Llama 3 70B on 15T tokens (its real budget), with
# `tp=8, pp=4`, on 8 to 2048 nodes, with asynchronous and synchronous checkpoints.

# %%
costs = []
for nodes in (8, 32, 128, 512, 2048):
    c = Cluster.preset("dgx-h100", nodes=nodes)
    dp = c.world_size // 32
    t = TrainSettings(seq_len=8192, global_batch_size=16 * dp, recompute="selective").with_precision("bf16-megatron")
    cfg = RunConfig(llama70, c, ParallelPlan(tp=8, pp=4, zero_stage=1), t)
    pred = predict_step(cfg)
    for asynchronous in (True, False):
        est = estimate_cost(cfg, tokens=15e12, asynchronous=asynchronous, prediction=pred)
        costs.append({"nodes": nodes, "GPUs": c.world_size, "checkpoints": "async" if asynchronous else "sync",
                      "job MTBF (h)": est.job_mtbf_s / 3600, "blocking save (s)": est.blocking_save_s,
                      "interval (min)": est.checkpoint_interval_s / 60, "goodput": est.goodput,
                      "wall (days)": est.effective_wall_s / 86400, "GPU-hours (M)": est.gpu_hours / 1e6,
                      "checkpoint (TB)": est.checkpoint_bytes / 1e12})
cost_table = pd.DataFrame(costs)
cost_table.round(3)

# %%
for mode in ("async", "sync"):
    g = cost_table[cost_table["checkpoints"] == mode]["goodput"].tolist()
    assert all(a > b for a, b in zip(g, g[1:])), mode  # more nodes, more failures: lower goodput
sync_, async_ = (cost_table[cost_table["checkpoints"] == m].set_index("nodes") for m in ("sync", "async"))
assert (sync_["goodput"] < async_["goodput"]).all()
assert abs(cost_table["checkpoint (TB)"].iloc[0] - 12 * llama70.n_params() / 1e12) < 1e-9  # fp32 master + Adam m, v

# Young/Daly: close to sqrt(2 delta M) when delta << M, and a minimum of the waste
delta, mtbf = 60.0, 12 * 3600.0
tau = optimal_checkpoint_interval(delta, mtbf)
waste = lambda t: delta / t + t / 2 / mtbf  # noqa: E731  (the part of the waste that depends on tau)
young = math.sqrt(2 * delta * mtbf)
assert abs(tau / young - 1) < 0.05
assert waste(tau) < min(waste(0.5 * tau), waste(2 * tau))
print(f"delta = 60 s, M = 12 h: checkpoint every {tau / 60:.1f} min (Young's first order: {young / 60:.1f} min)")

# %%
hv.Overlay([
    hv.Curve(cost_table[cost_table["checkpoints"] == mode], "GPUs", "goodput", label=f"{mode} checkpoints").opts(
        line_width=2)
    * hv.Scatter(cost_table[cost_table["checkpoints"] == mode], "GPUs", "goodput").opts(size=7)
    for mode in ("async", "sync")
]).opts(logx=True, width=640, height=320, legend_position="bottom_left", toolbar=None,
        title="Llama 3 70B, 15T tokens: goodput vs cluster size (Young/Daly interval)")

# %% [markdown]
# **Take-aways.** Walk the scaling order, but let a model price each step: the cheapest fix for
# memory depends on the model, the sequence and the cluster. The advisor searches thousands of
# plans in seconds and says why its winner wins; its step-time model stays within 5 MFU points of
# published runs. At scale the plan is not the whole cost: failures grow with the node count,
# and asynchronous checkpoints at the Young/Daly interval keep the goodput up. In the app the
# advisor view (`widgets.AdvisorView`) runs the same search and fills the mesh with the plan you
# pick; `workbench plan --model llama3-70b --cluster dgx-h100 --nodes 8 --seq 8192` prints it.
