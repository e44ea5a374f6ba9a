# %% [markdown]
# # 4 · Launching and watching a run
#
# Notebooks 1-3 *predicted*: memory, traffic, bubbles. This one *measures*. We launch the bundled
# trainer on this machine as a real `torch.distributed` job (gloo on the CPU), watch its events
# stream in, and lay the measurements beside the planner's predictions: the same names, the same
# units, so the comparison is a join.
#
# The pieces, in the order a run goes through them:
#
# | step | API | where |
# |---|---|---|
# | describe the job | `RunConfig` (model, cluster, plan, settings) | `workbench/spec/config.py` |
# | start it | `workbench.launch(config, backend="local")` → a `RunHandle` | `workbench/launch/handle.py` |
# | each node | a Jupyter kernel running an agent that starts `torchrun` | `workbench/launch/agent.py` |
# | each rank | `python -m workbench.launch.worker` → the trainer | `workbench/trainer/train.py` |
# | what it says | one JSON line per event in `events/rank-<r>.jsonl` | `workbench/rundir/events.py` |
# | predicted vs measured | `workbench.rundir.compare.compare_run(run_dir)` | `workbench/rundir/compare.py` |
#
# Everything runs on two CPU processes with a tiny model, so the run takes seconds.

# %%
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import holoviews as hv
import pandas as pd

import workbench
from workbench import Cluster, RunConfig, predict_step, simulate_schedule
from workbench.rundir.compare import compare_run
from workbench.predict.comms import p2p_time
from workbench.launch.local import config_from_cli
from workbench.predict.pipeline import schedule_order
from workbench.rundir import analysis
from workbench.rundir.events import COMMON_FIELDS, KINDS, find_gaps, read_events
from widgets.pipeline_view import gantt_figure
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks share two cores: no intra-op threads
RUN_ROOT = Path(tempfile.mkdtemp(prefix="workbench-nb04-"))

# %% [markdown]
# ## 1. A tiny job on two "nodes"
#
# `config_from_cli` builds the same RunConfig as `workbench train tiny pp=2 --steps 8`: the `tiny`
# model preset, a two-stage pipeline (`pp=2`, 1F1B), fp32. We then put each pipeline rank on its own
# *node* of the `local-cpu` cluster: the launcher starts one Jupyter kernel per node, each kernel
# starts its own `torchrun`, and the two meet at one c10d rendezvous, exactly as two machines would.
# A global batch of 8 sequences in micro-batches of 2 gives the pipeline *m* = 4 micro-batches.

# %%
STEPS = 8
base = config_from_cli("tiny", "pp=2", STEPS, seq_len=32, global_batch_size=8, lr=3e-3, seed=1)
config = RunConfig(base.model, Cluster.preset("local-cpu", nodes=2, gpus_per_node=1), base.plan, base.train)
m = config.n_microbatches
print(config.plan.describe(), f"| world {config.world_size} = {config.cluster.nodes} nodes x "
      f"{config.cluster.gpus_per_node} | m = {m} micro-batches | {config.model.name}: "
      f"{config.model.n_params():,} parameters")

# %%
assert config.world_size == config.cluster.nodes * config.cluster.gpus_per_node == 2
assert m == config.train.global_batch_size // config.train.micro_batch_size == 4

# %% [markdown]
# ## 2. Launch, and stream the events
#
# `workbench.launch` validates the config (a bad one raises `ConfigError` before anything starts),
# creates the **run directory**, starts the kernels and returns a `RunHandle` at once: the job runs
# in the background. `run.status()` says, per node and per rank, whether it is starting, running,
# finished, failed or stopped, and why. `run.events(timeout_s=...)` yields batches of events as they
# arrive, every rank's in `seq` order, and ends when the run has ended and every event is in.

# %%
t0 = time.perf_counter()
run = workbench.launch(config, backend="local", run_root=RUN_ROOT)
print(run)
print(run.status())

# %%
counts: dict[str, int] = {}
for batch in run.events(timeout_s=120):
    for e in batch:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        if e["kind"] == "step" and e["rank"] == 0:
            print(f"step {e['step']}: loss {e['loss']:.4f}  grad norm {e['grad_norm']:.3f}  "
                  f"{e['tokens_per_s']:,.0f} tok/s")
status = run.status()
print(f"\n{status}\n\nevents by kind: {counts}   ({time.perf_counter() - t0:.1f} s)")

# %%
assert status.state == "finished", status
assert all(r.state == "finished" and r.step == STEPS - 1 for r in status.ranks)
assert [n.state for n in status.nodes] == ["finished", "finished"]
# One step, pipeline, collectives event per rank per step; memory at the first steps; a start and an end.
assert counts["step"] == counts["pipeline"] == counts["collectives"] == STEPS * config.world_size
assert counts["run_start"] == counts["run_end"] == config.world_size

# %% [markdown]
# ## 3. The run directory and the event contract
#
# The run directory is the *only* thing the trainer, the launcher and the UI share (DESIGN.md):
#
# ```
# runs/<run-id>/
#   config.json            the RunConfig exactly as launched (RunConfig.load reads it back)
#   manifest.json          versions, git revision, hosts, devices, start time
#   launch/launch.json     how to reach the nodes' kernels again (workbench.open_run)
#   events/rank-<r>.jsonl  append-only telemetry, one JSON object per line
#   checkpoints/step-<n>/  (notebook 5)
# ```
#
# Every event carries `kind`, `rank`, `seq` (a per-rank counter from 0, so a reader can tell a
# missing line), `t` (wall-clock seconds) and `step` where it applies; each kind is a frozen
# dataclass in `workbench/rundir/events.py`, the one place the schema lives. Readers keep fields
# they do not know and skip a torn last line (a writer mid-write); writers never drop an event
# silently. Because the files are the truth, a driver that disconnects can reattach with
# `workbench.open_run(path)` and continue from what they hold.

# %%
print(sorted(p.relative_to(run.path).as_posix() for p in run.path.rglob("*") if p.is_file()))
events = read_events(run.path)
first_step = next(e for e in events if e["kind"] == "step")
print(json.dumps(first_step, indent=1)[:600])
assert RunConfig.load(str(run.path / "config.json")) == config  # the config round-trips exactly

# %%
assert all(all(k in e for k in COMMON_FIELDS) for e in events)
assert {e["kind"] for e in events} <= set(KINDS)
assert find_gaps(events) == {}  # every rank's seq runs 0, 1, 2, ... without a hole
for r in range(config.world_size):
    seqs = [e["seq"] for e in events if e["rank"] == r]
    assert sorted(seqs) == list(range(len(seqs)))
# The loss is the global mean: the same number on every rank.
loss = {r: [e["loss"] for e in events if e["kind"] == "step" and e["rank"] == r] for r in (0, 1)}
assert loss[0] == loss[1] and len(loss[0]) == STEPS

# %% [markdown]
# ## 4. The loss curve
#
# The tiny model learns a synthetic stream of token sequences; with a warm-up and a cosine decay the
# loss falls from about ln(vocabulary) (a uniform guess) within a few steps.

# %%
steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0]
curve = pd.DataFrame({"step": [e["step"] for e in steps], "loss": [e["loss"] for e in steps],
                      "grad norm": [e["grad_norm"] for e in steps], "lr": [e["lr"] for e in steps]})
hv.Curve(curve, "step", "loss").opts(width=600, height=260, title="loss (rank 0)", tools=["hover"]) * \
    hv.Scatter(curve, "step", "loss").opts(size=6)

# %%
assert curve["loss"].iloc[-1] < curve["loss"].iloc[0]
assert abs(curve["loss"].iloc[0] - math.log(config.model.vocab_size)) < 1.0  # starts near a uniform guess

# %% [markdown]
# ## 5. The measured pipeline, beside the simulated one
#
# Each pipeline rank logs, per step, its `schedule.step()` window and every action it ran:
# `[kind, stage, microbatch, start, end]` with F = forward, B = backward. We draw the last step as a
# Gantt chart, and beside it what `workbench.simulate_schedule` predicts twice: with the planner's
# stage times (its compute model of a GPU, so on a CPU the *scale* differs) and with the stage
# times measured in this run (the schedule model alone, which should reproduce the shape).
#
# Whatever the times, the **order** of the actions is the schedule's: 1F1B on rank 0 runs
# `F0 F1 B0 F2 B1 F3 B2 B3`, rank 1 alternates `F B` from the first micro-batch on.

# %%
pipe = [e for e in events if e["kind"] == "pipeline" and e["step"] == STEPS - 1]
origin = min(e["window"][0] for e in pipe)
measured = [{"rank": e["pp_rank"], "kind": k, "stage": s, "microbatch": mb, "start": a - origin, "end": b - origin}
            for e in pipe for k, s, mb, a, b in e["actions"]]
plan = config.plan
prediction = predict_step(config)
planned = simulate_schedule(plan.pp_schedule, plan.pp, m, plan.virtual_stages,
                            stage_times=prediction.stage_times_s, p2p_time=p2p_time(config))
st = analysis.stage_times(events)
replayed = simulate_schedule(plan.pp_schedule, plan.pp, m, plan.virtual_stages,
                             stage_times=[(st[s]["F"], st[s]["B"]) for s in range(plan.n_stages)])
span = max(a["end"] for a in measured)
hv.Layout([
    gantt_figure(measured, f"measured, step {STEPS - 1}: {span * 1e3:.1f} ms", "ms", 1e3, width=820),
    gantt_figure(replayed.actions, f"simulated with the measured stage times: {replayed.step_time * 1e3:.1f} ms, "
                 f"bubble {replayed.bubble_fraction:.1%}", "ms", 1e3, width=820),
    gantt_figure(planned.actions, f"simulated with the planner's (GPU) stage times: {planned.step_time * 1e3:.1f} ms, "
                 f"bubble {planned.bubble_fraction:.1%}", "ms", 1e3, width=820),
]).cols(1)

# %%
order = schedule_order(plan.pp_schedule, plan.pp, m, plan.virtual_stages)
for r in range(plan.pp):
    ran = [(a["kind"], a["stage"], a["microbatch"]) for a in sorted(measured, key=lambda a: a["start"]) if a["rank"] == r]
    assert ran == [tuple(op) for op in order[r]], (r, ran)  # the measured order is the simulated order
bubble = analysis.bubble_fraction(events)
print(f"bubble fraction: measured {bubble:.3f}, simulated with measured stage times "
      f"{replayed.bubble_fraction:.3f}, closed form (p-1)/(m+p-1) = {(plan.pp - 1) / (m + plan.pp - 1):.3f}")
assert 0 < bubble < 1 and 0 < replayed.bubble_fraction < 1

# %% [markdown]
# ## 6. Predicted vs measured
#
# `compare_run(run_dir)` reads the run directory alone (the run's `config.json` and its events), asks
# the planner for its predictions of that config and joins them with the measurements, row by row:
#
# * **memory** on the planner's most loaded rank: parameters, gradients and optimizer states are
#   counted from the real tensors' local shards, so on a CPU in fp32 they must equal the bill *to the
#   byte*; activations are the peak saved for backward, within a few per cent;
# * **pipeline**: the bubble fraction, planned and measured;
# * **collectives per step**: bytes and calls per (group, op), by the nccl-tests convention; here the
#   pipeline's sends and receives of activations and gradients, also exact;
# * **step time**: on a CPU this tests the plumbing, not the GPU compute model.

# %%
comparison = compare_run(run.path)
print(comparison.format())

# %%
for name in ("parameters", "gradients", "optimizer"):
    row = comparison.row("memory", name)
    assert row.measured == row.predicted > 0, row  # exact, to the byte
act = comparison.row("memory", "activations")
assert abs(act.error) < 0.10, act
comm = comparison.section("collectives per step")
assert comm and all(r.measured == r.predicted for r in comm), comm  # every collective's bytes and calls

# %% [markdown]
# ## 7. Stopping a run, and cleaning up
#
# `run.stop()` sends SIGTERM to every node's torchrun process group (SIGKILL after a timeout): the
# ranks write a `run_end` with status "interrupted" if they can, and the run's state becomes
# "stopped". `run.shutdown()` also ends the kernels; `run.close()` would instead only disconnect,
# leaving the job running for a later `workbench.open_run(path)`. Here a long run is stopped as soon
# as its third step is in.

# %%
long_run = workbench.launch(config_from_cli("tiny", "pp=2", 500, seq_len=32, global_batch_size=8, seed=1),
                            backend="local", run_root=RUN_ROOT)
seen = 0
for batch in long_run.events(timeout_s=120):
    seen = max([seen] + [e["step"] + 1 for e in batch if e["kind"] == "step" and e["rank"] == 0])
    if seen >= 3:
        break
stopped = long_run.stop()
print(stopped)
long_run.shutdown()
run.shutdown()

# %%
assert stopped.state == "stopped" and stopped.why == "stopped by the user", stopped
last = max(e["step"] for e in read_events(long_run.path) if e["kind"] == "step")
assert 2 <= last < 499  # it ran, and it did not run to the end
print(f"the long run stopped after step {last} of 500; this notebook took {time.perf_counter() - t0:.0f} s")
shutil.rmtree(RUN_ROOT)  # comment out to keep the run directories for a look (workbench.open_run)
