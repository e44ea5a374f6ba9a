# %% [markdown]
# # 5 · Checkpoints, resharding and recovery
#
# A large training job *will* fail: a GPU falls off the bus, a node reboots, the OOM killer strikes.
# What saves the weeks of compute already spent is the checkpoint, and it is only worth something if
# three things hold:
#
# 1. **it is complete or invisible**: a crash mid-save must never leave a half-written checkpoint
#    that a restart would load;
# 2. **it is verified when loaded**: a truncated or bit-flipped file is caught and an older good one
#    is used instead;
# 3. **it survives a change of layout**: after losing a node you may restart on fewer GPUs, or with
#    another plan; the saved state must be *resharded* into the new one, and training must continue
#    exactly where it stopped.
#
# The bundled trainer saves with `torch.distributed.checkpoint` (DCP): every rank writes its own
# shards, and the metadata records which slice of each *unsplit* tensor each file holds, so any
# other layout can read back its own slices (`workbench/trainer/checkpoint.py`); the directories
# around the shards are listed and verified without torch (`workbench.rundir.checkpoints`). We check
# each promise on a real two-process job, then run a **recovery drill** (a rank SIGKILLs itself,
# torchrun restarts the job, which resumes by itself) and finish with **how often** to checkpoint
# (Young 1974; Daly 2006).

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

from workbench.predict.cost import checkpoint_bytes, optimal_checkpoint_interval
from workbench.launch.local import config_from_cli, resume_local, train_local
from workbench.rundir import create_run_dir
from workbench.rundir.events import read_events
from workbench.rundir.checkpoints import list_checkpoints, verify_checkpoint
from workbench.trainer.transformer import build_model
import widgets

widgets.extension()  # Bokeh, Panel, HoloViews: inline, from the installed packages (offline)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks share two cores: no intra-op threads
ROOT = Path(tempfile.mkdtemp(prefix="workbench-nb05-"))
T0 = time.perf_counter()
RTOL = 1e-4  # another layout sums in another order: losses agree to ~1e-6, not bit for bit


def losses(run_dir: Path, rank: int = 0) -> list[dict]:
    """Rank 0's step events, in the order written (a resumed run repeats steps)."""
    return [e for e in read_events(run_dir) if e["kind"] == "step" and e["rank"] == rank]


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


# %% [markdown]
# ## 1. An uninterrupted run that checkpoints
#
# A two-stage pipeline (`pp=2`) of the tiny model, 6 steps, a checkpoint every 3 steps (and at the
# end). `deterministic=True` makes every reduction order fixed, so a resumed run can be compared
# with this one number for number. `train_local` is what `workbench train` calls: it creates the run
# directory, starts `torchrun` with one process per rank and streams one line per step, checkpoint,
# fault, restart and resume from the ranks' events.

# %%
STEPS, EVERY = 6, 3
SETTINGS = dict(seq_len=32, global_batch_size=8, warmup_steps=2, lr=3e-3, seed=1, deterministic=True)
config = config_from_cli("tiny", "pp=2", STEPS, checkpoint_every=EVERY, **SETTINGS)
code = train_local(config, run_root=ROOT, run_id="pp2", stream=print)
run_dir = ROOT / "pp2"
reference = [e["loss"] for e in losses(run_dir)]

# %%
assert code == 0
assert [s for s, _ in list_checkpoints(run_dir)] == [EVERY, STEPS]
assert len(reference) == STEPS and reference[-1] < reference[0]

# %% [markdown]
# ## 2. What a committed checkpoint looks like
#
# ```
# checkpoints/step-<n>.tmp/   while being written: never loaded, discarded at the next start
# checkpoints/step-<n>/       committed:
#     __<rank>_0.distcp       each rank's shards (DCP)
#     .metadata               DCP's index: which slice of which tensor is in which file
#     rng-<rank>.pt           each rank's random-generator states, as plain tensors (no pickle)
#     meta.json               the RunConfig, the layout, the world size, the torch version
#     hashes.json             SHA-256 and size of every file above
#     COMMITTED               written last; records the SHA-256 of hashes.json
# ```
#
# The save goes through phases, each an event: `started` → `staged` (the state dict is built; an
# asynchronous save copies it to CPU here and training goes on) → `written` (this rank's files are
# on disk) → `committed` (rank 0, once *every* rank has written: hashes, marker, fsync, then one
# atomic rename of `step-<n>.tmp` to `step-<n>`) → `verified`. A crash before the rename leaves only
# a `.tmp` directory, which is never loaded.
#
# What is saved: the model and the optimizer state, keyed by the **unsplit** model's parameter names
# (so a pipeline stage's parameters keep their full-model names), the step, the data position and
# each rank's random-generator states. Its size is the planner's `cost.checkpoint_bytes` (fp32
# parameters + Adam's two moments) plus one 4-byte step counter per parameter tensor.

# %%
step3 = run_dir / "checkpoints" / f"step-{EVERY}"
for p in sorted(step3.iterdir()):
    print(f"  {p.name:<16} {p.stat().st_size:>10,} B")
print("COMMITTED:", (step3 / "COMMITTED").read_text())
print("hashes.json:", json.dumps(json.loads((step3 / "hashes.json").read_text())["__0_0.distcp"]))
meta = json.loads((step3 / "meta.json").read_text())
print(f"meta.json: step {meta['step']}, plan {meta['plan']!r}, world {meta['world_size']}")
ck = events_of(run_dir, "checkpoint")
pd.DataFrame([{k: e[k] for k in ("rank", "step", "phase", "bytes", "duration_s", "mode")} for e in ck
              if e["step"] == EVERY])

# %%
assert verify_checkpoint(step3) is None  # marker, hashes, sizes, every SHA-256 (the trainer also loads .metadata)
names = {p.name for p in step3.iterdir()}
assert names == {".metadata", "COMMITTED", "hashes.json", "meta.json", "__0_0.distcp", "__1_0.distcp",
                 "rng-0.pt", "rng-1.pt"}
assert set(json.loads((step3 / "hashes.json").read_text())) == names - {"COMMITTED", "hashes.json"}
assert meta["step"] == EVERY and meta["world_size"] == 2
for rank, phases in ((0, ["started", "staged", "written", "committed", "verified"]), (1, ["started", "staged", "written"])):
    assert [e["phase"] for e in ck if e["rank"] == rank and e["step"] == EVERY] == phases
# Each pipeline rank stages only its own stage; together they are the whole model's state.
staged = sum(e["bytes"] for e in ck if e["phase"] == "staged" and e["step"] == EVERY)
n_tensors = len(list(build_model(config.model, "meta").parameters()))
print(f"staged {staged:,} B = checkpoint_bytes {checkpoint_bytes(config):,} B + 4 B x {n_tensors} step counters")
assert staged == checkpoint_bytes(config) + 4 * n_tensors

# %% [markdown]
# ## 3. A damaged checkpoint is rejected
#
# `verify_checkpoint(path)` returns `None` for a good checkpoint and otherwise the reason, in one
# line. We damage three copies of `step-6` the three classic ways: a flipped bit (silent corruption
# on disk or in transit), a truncated file (a full disk), a missing marker (a crash before the
# commit).

# %%
step6 = run_dir / "checkpoints" / f"step-{STEPS}"
damage = ROOT / "damaged"


def damaged_copy(name: str) -> Path:
    path = damage / name / f"step-{STEPS}"
    shutil.copytree(step6, path)
    return path


flipped = damaged_copy("bit-flip")
shard = flipped / "__0_0.distcp"
data = bytearray(shard.read_bytes())
data[len(data) // 2] ^= 0x01  # one bit, in the middle of rank 0's shards
shard.write_bytes(bytes(data))

truncated = damaged_copy("truncated")
with open(truncated / "__1_0.distcp", "r+b") as f:
    f.truncate(1000)

unmarked = damaged_copy("no-marker")
(unmarked / "COMMITTED").unlink()

reasons = {p.parent.name: verify_checkpoint(p) for p in (flipped, truncated, unmarked)}
for name, reason in reasons.items():
    print(f"{name:>10}: {reason}")

# %%
assert "SHA-256 differs" in reasons["bit-flip"]
assert "truncated" in reasons["truncated"]
assert "no COMMITTED marker" in reasons["no-marker"]
assert verify_checkpoint(step6) is None  # the original is untouched

# %% [markdown]
# ## 4. Resume under another layout: pp=2 → dp_shard=2
#
# Suppose the job must continue on a different plan: the same two processes, but as two
# data-parallel ranks with FSDP-sharded parameters instead of two pipeline stages. We make a new run
# directory whose `config.json` holds the new plan (the same model and data settings: another batch
# size or seed would be another data stream, and is refused), copy in the pp=2 run's checkpoints,
# replace `step-6` by the bit-flipped copy, and resume with `resume_local` (`workbench train
# --resume runs/<id>`).
#
# What we expect, and the stream shows: rank 0 verifies the newest checkpoint, **rejects** step-6
# (renamed `step-6.rejected`, kept for inspection), **falls back** to step-3, and every rank loads its
# own slices of it through DCP (**resharded**). The data loader continues at global batch 3: its
# batch order does not depend on the layout, so the two data-parallel ranks read the same batches
# the pipeline did. The `resume` event says, piece by piece, what was restored and what re-derived.

# %%
new_config = config_from_cli("tiny", "dp_shard=2", STEPS, checkpoint_every=EVERY, **SETTINGS)
resharded_dir = create_run_dir(new_config, ROOT, "dp2-resumed")
shutil.copytree(step3, resharded_dir / "checkpoints" / step3.name)
shutil.copytree(flipped, resharded_dir / "checkpoints" / step6.name)
lines: list[str] = []
code = resume_local(resharded_dir, stream=lambda line: (lines.append(line), print(line)))
resumed = [e["loss"] for e in losses(resharded_dir)]

# %%
resume_event = events_of(resharded_dir, "resume")[0]
print("\n".join(resume_event["notes"]))
diff = max(abs(a - b) / b for a, b in zip(resumed, reference[EVERY:]))
print(f"\nresumed dp_shard=2 steps {EVERY}..{STEPS - 1}: {[round(x, 6) for x in resumed]}")
print(f"uninterrupted pp=2 steps {EVERY}..{STEPS - 1}: {[round(x, 6) for x in reference[EVERY:]]}")
print(f"largest relative difference: {diff:.1e}")

# %%
assert code == 0
assert any("step-6 rejected" in line and "SHA-256" in line for line in lines)
assert f"resume at step {EVERY} from step-{EVERY} (resharded)" in lines
assert (resharded_dir / "checkpoints" / "step-6.rejected").is_dir()
assert len(events_of(resharded_dir, "checkpoint_rejected")) == 1
for e in events_of(resharded_dir, "resume"):  # every rank
    assert e["step"] == EVERY and e["resharded"] and e["saved_plan"].startswith("pp=2")
assert any(n.startswith(f"data: resumed at global batch {EVERY}") for n in resume_event["notes"])
assert len(resumed) == STEPS - EVERY and diff <= RTOL  # the loss continues as the uninterrupted run's

# %% [markdown]
# ## 5. The recovery drill
#
# The real thing: a rank dies without a trace mid-run. Under `torchrun --max-restarts=1`
# (`train_local(..., max_restarts=1)`) torchrun sees a worker die, stops the others and starts every
# rank again; the restarted trainer sees `TORCHELASTIC_RESTART_COUNT > 0` and resumes from the latest
# good checkpoint by itself. The test hook `WORKBENCH_KILL_AT="1:5"` makes rank 1 send itself
# SIGKILL at the start of step 5 on the first attempt: no handler runs, nothing is flushed, exactly
# like the OOM killer. We checkpoint every 2 steps, so step-4 is the newest good one.
#
# When a rank starts again it reads its own events of the previous attempt and writes what they
# say: a **fault** (`killed`: no `run_end` and no `error`; its last logged step), then a **restart**
# (attempt 1 of at most 1), then a **resume** (step 4, from step-4). Rank 0 has a fault too: it
# either raised when its peer vanished mid-collective (gloo: "Connection reset by peer", an
# `error`) or was stopped by torchrun first (`killed`); only rank 1's fault is the cause. The plan
# is dp_shard=2 for 6 steps with the same settings, so its whole loss curve must match the
# uninterrupted pp=2 run's.

# %%
KILL_RANK, KILL_STEP, DRILL_EVERY = 1, 5, 2
drill_config = config_from_cli("tiny", "dp_shard=2", STEPS, checkpoint_every=DRILL_EVERY, **SETTINGS)
code = train_local(drill_config, run_root=ROOT, run_id="drill", stream=print, max_restarts=1,
                   env={"WORKBENCH_KILL_AT": f"{KILL_RANK}:{KILL_STEP}", "WORKBENCH_PG_TIMEOUT_S": "60"})
drill_dir = ROOT / "drill"
drill_events = read_events(drill_dir)
pd.DataFrame([{k: e.get(k) for k in ("rank", "kind", "cause", "attempt", "last_step", "step", "path")}
              for e in drill_events if e["kind"] in ("fault", "restart", "resume")])

# %%
drill_steps = losses(drill_dir)
attempt = [0]
for prev, e in zip(drill_steps, drill_steps[1:]):  # a new attempt starts when the step goes back
    attempt.append(attempt[-1] + (e["step"] <= prev["step"]))
curve = pd.DataFrame({"step": [e["step"] for e in drill_steps], "loss": [e["loss"] for e in drill_steps],
                      "attempt": attempt})
last_good = (KILL_STEP // DRILL_EVERY) * DRILL_EVERY
hv.Overlay([
    hv.Curve((range(STEPS), reference), "step", "loss", label="uninterrupted pp=2").opts(color="#999999", line_width=4),
    hv.Curve((range(EVERY, STEPS), resumed), "step", "loss", label="dp_shard=2 resumed from step-3 (resharded)").opts(
        color="#0072B2", line_dash="dashed"),
    *[hv.Scatter(curve[curve.attempt == a], "step", "loss", label=f"drill, attempt {a}").opts(size=9 - 3 * a, color=c)
      for a, c in ((0, "#D55E00"), (1, "#009E73"))],
    hv.VLine(KILL_STEP - 0.5).opts(color="#D55E00", line_dash="dotted"),
    hv.Text(KILL_STEP - 0.45, max(reference), " rank 1 killed", halign="left").opts(text_font_size="9pt"),
]).opts(width=700, height=320, title="One loss curve, three ways to get it", legend_position="top_right")

# %%
assert code == 0
faults = [e for e in drill_events if e["kind"] == "fault" and e["rank"] == KILL_RANK]
assert len(faults) == 1 and faults[0]["cause"] == "killed" and faults[0]["attempt"] == 0
assert faults[0]["last_step"] == KILL_STEP - 1  # it died at the start of step 5
for rank in range(drill_config.world_size):
    mine = [e for e in drill_events if e["rank"] == rank]
    assert [(e["attempt"], e["max_restarts"]) for e in mine if e["kind"] == "restart"] == [(1, 1)]
    resumes = [e for e in mine if e["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == last_good and not resumes[0]["resharded"]
assert curve.attempt.max() == 1
first, second = curve[curve.attempt == 0], curve[curve.attempt == 1]
assert list(second.step) == list(range(last_good, STEPS))
# Step 4 ran twice: the same layout and the restored RNG states make it bit-identical.
assert first[first.step == last_good].loss.item() == second[second.step == last_good].loss.item()
final = curve.drop_duplicates("step", keep="last").loss.tolist()
assert len(final) == STEPS and max(abs(a - b) / b for a, b in zip(final, reference)) <= RTOL

# %% [markdown]
# ## 6. How often to checkpoint: Young and Daly
#
# Checkpointing every τ seconds of work costs δ (the time a save blocks training) each time; a failure
# (mean time between failures M of the whole job) loses on average the work since the last
# checkpoint, τ/2, plus the restart. Young (1974) minimised the first-order waste δ/τ + τ/(2M):
# **τ = √(2δM)**. Daly (2006) solved the exponential failure model, in which the expected wall time
# of a job is proportional to M·(e^((τ+δ)/M) − 1)/τ, and gave the higher-order optimum
#
# τ = √(2δM) · (1 + ⅓√(δ/2M) + (δ/2M)/9) − δ  (for δ < 2M),
#
# which is `workbench.predict.cost.optimal_checkpoint_interval(delta_s, mtbf_s)`. We check it against a
# numerical minimisation of Daly's model, and use our drill's own measured δ.

# %%
def daly_wall_time(tau: float, delta: float, mtbf: float) -> float:
    """Expected wall time per unit of work under exponential failures (restart time omitted)."""
    return (math.exp((tau + delta) / mtbf) - 1) / tau


def argmin(f, lo: float, hi: float, iters: int = 200) -> float:
    """Golden-section search of a unimodal f on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    for _ in range(iters):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if f(a) < f(b) else (a, hi)
    return (lo + hi) / 2


rows = []
for delta, mtbf, what in ((60.0, 4 * 3600.0, "60 s save, a failure every 4 h"),
                          (60.0, 3600.0, "60 s save, a failure every hour"),
                          (600.0, 3600.0, "10 min save, a failure every hour")):
    exact = argmin(lambda t: daly_wall_time(t, delta, mtbf), 1e-6, 10 * mtbf)
    rows.append({"case": what, "Young sqrt(2 delta M) (s)": math.sqrt(2 * delta * mtbf),
                 "Daly (s)": optimal_checkpoint_interval(delta, mtbf), "numerical optimum (s)": exact})
table = pd.DataFrame(rows).set_index("case")
table.round(1)

# %%
for _, r in table.iterrows():
    assert abs(r["Daly (s)"] / r["numerical optimum (s)"] - 1) < 1e-3  # Daly: the optimum to 0.1%
assert abs(table.iloc[0]["Young sqrt(2 delta M) (s)"] / table.iloc[0]["numerical optimum (s)"] - 1) < 0.05
assert table.iloc[2]["Young sqrt(2 delta M) (s)"] > 1.2 * table.iloc[2]["numerical optimum (s)"]  # Young overshoots when delta ~ M

# %% [markdown]
# Our drill's saves were synchronous: training waited from `started` to `committed` on rank 0. With
# that δ and a (pessimistic) failure every 10 minutes, how many steps apart should the checkpoints be?

# %%
ck = [e for e in drill_events if e["kind"] == "checkpoint" and e["rank"] == 0]
blocked = [next(c["t"] for c in ck if c["step"] == s and c["phase"] == "committed")
           - next(c["t"] for c in ck if c["step"] == s and c["phase"] == "started")
           for s in sorted({c["step"] for c in ck if c["phase"] == "committed"})]
delta = sorted(blocked)[len(blocked) // 2]
step_s = sorted(e["step_time_s"] for e in drill_steps)[len(drill_steps) // 2]
tau = optimal_checkpoint_interval(delta, 600.0)
print(f"measured delta = {delta * 1e3:.1f} ms per save, {step_s * 1e3:.0f} ms per step: "
      f"checkpoint every {tau:.1f} s, about {max(1, round(tau / step_s))} steps")
print(f"this notebook took {time.perf_counter() - T0:.0f} s")
assert 0 < delta < 10 and tau > delta
shutil.rmtree(ROOT)  # comment out to keep the run directories and their checkpoints for a look
