# %% [markdown]
# # 3 · Pipeline schedules and their bubbles
#
# Pipeline parallelism cuts the layers into *stages*, one group of GPUs per stage, and streams
# *micro-batches* through them. A stage waits for its input in forward and for its output's gradient
# in backward, so at the start and the end of every step some stages sit idle: the **bubble**. The
# schedule (the order in which each rank runs its forwards and backwards) decides how big the bubble
# is and how many micro-batches' activations each stage must hold meanwhile.
#
# | schedule | source |
# |---|---|
# | `gpipe` | Huang et al. 2019, *GPipe*: all forwards, then all backwards |
# | `1f1b` | Narayanan et al. 2019 *PipeDream* / 2021 *PipeDream-2BW*, "PipeDream-Flush": one forward, one backward |
# | `interleaved-1f1b` | Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*: *v* stages per rank |
# | `zero-bubble` | Qi et al. 2024, *Zero Bubble Pipeline Parallelism*: backward split into input-gradient I and weight-gradient W, W fills the bubbles |
# | `zbv` | the same paper's V-shaped placement: rank *r* holds stages *r* and 2*p* − 1 − *r* |
# | `dualpipev` | DeepSeek-AI 2024, *DeepSeek-V3 Technical Report* (DualPipe), in its V form |
#
# `workbench.simulate_schedule` generates, for each rank, the same action order that
# `torch.distributed.pipelining` (torch 2.13) runs, and plays it against stage durations: an action
# starts when its rank is free and its inputs exist. Durations below are in units of one stage's
# forward (F = 1, B = 2, and I = W = 1 when the backward is split).

# %%
import holoviews as hv
import pandas as pd

from workbench import (
    Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, estimate_memory, predict_step, simulate_schedule,
)
from workbench.spec.plan import split_layers, split_layers_by_cost
from workbench.predict.pipeline import bubble_closed_form
from widgets.pipeline_view import gantt_figure
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
GiB = 2**30

# %% [markdown]
# ## 1. Six schedules, one workload
#
# Four pipeline ranks, eight micro-batches. To compare step times fairly every rank does the same
# work: the schedules with *v* = 2 stages per rank cut the model into 8 stages of half the layers,
# so each stage takes F = 1/2, B = 1. Every rank is busy 8 × 3 = 24 units; the rest of the step is
# bubble. Blue: forward, green: backward, orange / pink: the input- and weight-gradient halves of a
# split backward; the numbers are micro-batches.

# %%
p, m = 4, 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 2), ("dualpipev", 2)]
results = {}
for name, v in SCHEDULES:
    results[name] = simulate_schedule(name, p, m, v, stage_times=[(1 / v, 2 / v)] * (p * v))
summary = pd.DataFrame([{"schedule": name, "v": r.virtual_stages, "step": r.step_time,
                         "bubble fraction": r.bubble_fraction, "bubble / busy": r.bubble_ratio,
                         "peak in flight per rank": r.peak_in_flight_per_rank}
                        for name, r in results.items()]).set_index("schedule")
summary.round(4)

# %%
for r in results.values():
    assert all(abs(b - 3 * m) < 1e-9 for b in r.busy_time)  # the same work on every rank
bf = {name: r.bubble_fraction for name, r in results.items()}
assert abs(bf["gpipe"] - (p - 1) / (m + p - 1)) < 1e-12 and abs(bf["1f1b"] - (p - 1) / (m + p - 1)) < 1e-12
assert abs(results["interleaved-1f1b"].bubble_ratio - (p - 1) / (2 * m)) < 1e-12
assert bf["zero-bubble"] < bf["interleaved-1f1b"] < bf["1f1b"] and bf["zbv"] < bf["interleaved-1f1b"]

# %%
hv.Layout([gantt_figure(r.actions, f"{name}: step {r.step_time:g}, bubble {r.bubble_fraction:.1%}", width=880)
           for name, r in results.items()]).cols(1)

# %% [markdown]
# ## 2. Bubbles against the closed forms
#
# With equal stages (forward *f*, backward *b*), GPipe and 1F1B both take (*m* + *p* − 1)(*f* + *b*)
# for *m*(*f* + *b*) of work per rank, so the bubble is **(p − 1) / (m + p − 1)** of the step. The
# interleaved schedule's warm-up and cool-down run on stages *v* times shorter: its idle time
# relative to the busy time is **(p − 1) / (v m)** (Narayanan et al. 2021, section 2.2). More
# micro-batches shrink both; a bigger *v* shrinks the interleaved one at the price of *v* times
# more pipeline messages.

# %%
ms = [4, 8, 16, 32, 64]
rows = []
for mm in ms:
    one = simulate_schedule("1f1b", p, mm)
    inter = simulate_schedule("interleaved-1f1b", p, mm, 2, stage_times=[(0.5, 1.0)] * (2 * p))
    rows.append({"m": mm, "1F1B simulated": one.bubble_fraction, "(p-1)/(m+p-1)": bubble_closed_form("1f1b", p, mm),
                 "interleaved simulated (idle/busy)": inter.bubble_ratio,
                 "(p-1)/(v m)": bubble_closed_form("interleaved-1f1b", p, mm, 2)})
closed = pd.DataFrame(rows).set_index("m")
for row in rows:
    assert abs(row["1F1B simulated"] - (p - 1) / (row["m"] + p - 1)) < 1e-12
    assert abs(row["interleaved simulated (idle/busy)"] - (p - 1) / (2 * row["m"])) < 1e-12
closed.round(4)

# %%
hv.Overlay([
    hv.Curve((ms, closed["(p-1)/(m+p-1)"]), "micro-batches m", "bubble", label="(p-1)/(m+p-1)").opts(color="#0072B2"),
    hv.Scatter((ms, closed["1F1B simulated"]), "micro-batches m", "bubble", label="1F1B simulated").opts(
        color="#0072B2", size=9),
    hv.Curve((ms, closed["(p-1)/(v m)"]), "micro-batches m", "bubble", label="(p-1)/(v m), v=2").opts(color="#D55E00"),
    hv.Scatter((ms, closed["interleaved simulated (idle/busy)"]), "micro-batches m", "bubble",
               label="interleaved simulated").opts(color="#D55E00", size=9, marker="square"),
]).opts(logx=True, width=700, height=320, legend_position="right", toolbar=None,
        title=f"Bubble vs micro-batches, p = {p}")

# %% [markdown]
# ## 3. Micro-batches in flight, and what they cost in memory
#
# A micro-batch is *in flight* on a stage between its forward and the backward that consumes the
# saved activations. The peak decides the activation memory (notebook 1):
#
# * GPipe holds all **m**;
# * 1F1B holds **p − r** on rank *r*: its warm-up runs *p − r − 1* forwards before the first backward;
# * interleaved 1F1B holds **2 (p − r − 1) + (v − 1) p + 1** stage-micro-batches on rank *r*
#   (Megatron's warm-up plus one), each of 1/*v* of the rank's layers;
# * ZBV holds **2p** half-size stage-micro-batches on every rank: as much as 1F1B's rank 0, but
#   evenly spread.

# %%
flight = {name: simulate_schedule(name, p, m, v).peak_in_flight_per_rank for name, v in SCHEDULES}
assert flight["gpipe"] == (m,) * p
assert flight["1f1b"] == tuple(p - r for r in range(p))
assert flight["interleaved-1f1b"] == tuple(2 * (p - r - 1) + (2 - 1) * p + 1 for r in range(p))
assert flight["zbv"] == (2 * p,) * p
pd.DataFrame(flight, index=[f"rank {r}" for r in range(p)]).T

# %% [markdown]
# In bytes: Llama 3 8B on one 8-GPU node with `tp=2, pp=4`, 8 micro-batches of 4096 tokens. GPipe's
# first rank holds twice the activations of 1F1B's (8 micro-batches against 4); interleaved 1F1B
# holds 11 half-stages against 1F1B's 4 whole ones, 11/8 as much, for its smaller bubble.

# %%
llama8 = ModelSpec.preset("llama3-8b")
node = Cluster.preset("dgx-h100", nodes=1)
train8 = TrainSettings(seq_len=4096, global_batch_size=8).with_precision("bf16-megatron")
act = {}
for name, v in SCHEDULES:
    plan = ParallelPlan(tp=2, pp=p, pp_schedule=name, virtual_stages=v)
    bill = estimate_memory(RunConfig(llama8, node, plan, train8))
    act[name] = {f"pp rank {r.pp_rank}": r.components["activations"] / GiB for r in bill.per_stage}
act = pd.DataFrame(act).T
assert abs(act.loc["gpipe", "pp rank 0"] / act.loc["1f1b", "pp rank 0"] - 2) < 1e-6
assert abs(act.loc["interleaved-1f1b", "pp rank 0"] / act.loc["1f1b", "pp rank 0"] - 11 / 8) < 1e-6
act.round(2)

# %% [markdown]
# ## 4. Unequal stages: the slowest one sets the pace
#
# Real stages differ: the first holds the embedding, the last the output projection and the loss
# (for a 128k vocabulary, the size of two layers). Make stage 2 half as slow again as the others.
# For GPipe the step is exactly one pass through all stages plus *m* − 1 times the slowest:
# **Σ_s (f_s + b_s) + (m − 1)(max f + max b)**. 1F1B's steady state is paced by the slowest stage
# too: its step lies between *m* × the slowest stage's f + b and the GPipe figure. A 50% slower
# stage makes the whole pipeline ~30% slower, although it is one of four.

# %%
slow = [(1, 2), (1, 2), (1.5, 3), (1, 2)]
gpipe_slow = simulate_schedule("gpipe", p, m, stage_times=slow)
one_slow = simulate_schedule("1f1b", p, m, stage_times=slow)
one_even = simulate_schedule("1f1b", p, m)
gpipe_formula = sum(f + b for f, b in slow) + (m - 1) * (max(f for f, _ in slow) + max(b for _, b in slow))
print(f"GPipe: {gpipe_slow.step_time} (formula {gpipe_formula}); 1F1B: {one_slow.step_time} "
      f"(equal stages: {one_even.step_time}, +{one_slow.step_time / one_even.step_time - 1:.0%})")
assert gpipe_slow.step_time == gpipe_formula
assert m * 4.5 <= one_slow.step_time <= gpipe_formula
assert one_slow.step_time / one_even.step_time > 1.25
gantt_figure(one_slow.actions, "1F1B with stage 2 at 1.5x: ranks 0, 1 and 3 wait for it", width=880)

# %% [markdown]
# ## 5. Balancing the stages by cost
#
# `workbench.spec.plan.split_layers_by_cost` cuts the layers into contiguous stages that minimise the
# slowest stage's cost (the linear-partition problem, solved exactly by bisection on the
# bottleneck), charging the embedding to the first stage and the output layer to the last. Costs can
# be anything proportional to time; here, training FLOPs per token: 6 × parameters for each matmul
# plus the attention scores, 12 × *q_dim* × *s* per layer. Llama 3 8B's output projection
# (128256 × 4096) costs as much as two of its 32 layers, so an even split (8, 8, 8, 8) makes the last
# stage the slowest by a quarter.

# %%
s = 4096
layer_cost = 6 * llama8.layer_params(0).total + 12 * llama8.q_dim * s  # FLOPs per token of one block
output_cost = 6 * llama8.vocab_size * llama8.d_model  # the output projection
even = split_layers(llama8.n_layers, p)
balanced = split_layers_by_cost([layer_cost] * llama8.n_layers, p, embedding_cost=0.0, output_cost=output_cost)


def stage_costs(counts):
    return [c * layer_cost + (output_cost if i == len(counts) - 1 else 0) for i, c in enumerate(counts)]


print(f"output layer = {output_cost / layer_cost:.2f} layers; even split {even}, balanced {balanced}")
assert sum(balanced) == llama8.n_layers and max(stage_costs(balanced)) < max(stage_costs(even))
# exact: no contiguous split of the 32 layers into 4 stages has a smaller bottleneck (all 4495 of them)
L = llama8.n_layers
best = min(max(stage_costs((a, b - a, c - b, L - c)))
           for a in range(1, L) for b in range(a + 1, L) for c in range(b + 1, L))
assert max(stage_costs(balanced)) == best

# %% [markdown]
# The plan takes the split as `ParallelPlan(stage_layers=...)`; memory, communication and step time
# all read it. The step-time model (`predict_step`, notebook 6) puts a number on the gain:

# %%
rows = {}
for label, counts in (("even", None), ("balanced", balanced)):
    cfg = RunConfig(llama8, node, ParallelPlan(tp=2, pp=p, stage_layers=counts),
                    TrainSettings(seq_len=s, global_batch_size=16).with_precision("bf16-megatron"))
    pred = predict_step(cfg)
    rows[label] = {"layers per stage": cfg.plan.stage_layer_counts(llama8.n_layers),
                   "stage f+b (ms)": [round(1e3 * (f + b), 1) for f, b in pred.stage_times_s],
                   "step (s)": pred.step_time_s, "bubble": pred.bubble_fraction, "MFU": pred.mfu}
assert rows["balanced"]["step (s)"] < rows["even"]["step (s)"] and rows["balanced"]["MFU"] > rows["even"]["MFU"]
pd.DataFrame(rows).T

# %% [markdown]
# On real hardware the costs come from a measurement: `workbench train --balance-stages` (or
# `workbench.trainer.profile.balance_stages(config)`) times every block, the embedding and the
# output layer on one micro-batch and feeds the times to the same function.
#
# **Take-aways.** Bubbles shrink with more micro-batches (1F1B), more stages per rank (interleaved)
# or by moving weight-gradient work into them (zero-bubble, ZBV, DualPipeV); the price is activation
# memory (micro-batches in flight) or messages. The slowest stage sets the pace, so balance the
# stages by cost, not by layer count. The app's pipeline view (`widgets.PipelineView`) draws any of
# these, and puts a run's measured timeline beside the simulation.
