"""The loop on this machine: calibrate, fit, then predict bundled-trainer runs on CPU it never saw.

1. Calibrate, the way the CLI does it, into a temporary folder: ``workbench bench compute`` (the
   tiny and tiny-moe GEMMs, one thread: the trainer's ranks run one each), ``workbench bench
   comms --nodes 1 --backend torchrun`` (world 2, gloo), then :func:`workbench.bench.calibration_report`.
2. Run the bundled trainer with torchrun (OMP_NUM_THREADS=1, instrumented, one job per world
   size, its layouts one after the other), ``--reps`` times, for the *fit* layouts (tp=1,
   dp_shard=2, pp=2 on tiny) and the *held-out* ones (tp=2, pp=2 x dp_shard=2, cp=2 on tiny;
   dp_shard=2 x ep=2 on tiny-moe). A run's step time is the median over the steps after
   ``--skip`` of the slowest rank's; of the repetitions the fastest is kept (the planner predicts
   an unloaded machine; another job on the 2 cores stretches whole runs 2-3x).
3. Fit the bundled profile's fixed costs to the fit layouts alone
   (:func:`workbench.predict.fit.fit_report`): ``launch_overhead_s_per_layer`` (eager PyTorch on
   CPU: a block's forward is tens of ops of ~10 us, not ~100 us of GPU launches) and
   ``overhead_s_per_microbatch`` and ``overhead_s_per_collective`` (the host's cost of issuing a
   call: DTensor dispatch, FSDP2's copy-in and copy-out, on top of the calibrated wire time).
4. Predict every layout on the calibrated cluster under the fitted profile and print predicted
   next to measured; then median and p90 |error| over the held-out layouts, and the pp=2 bubble
   predicted (the schedule simulation fed the planner's stage times, as ``workbench compare``
   shows it) against measured.

``--variants`` then prints a table of the trainer's per-call collective times against the
calibration, and the held-out errors under each correction this benchmark found (cumulative,
refitted each time, see :data:`PATCH`): what further changes to workbench/predict would do.

    python benchmarks/bench_cpu_loop.py [--reps 3] [--steps 16] [--skip 3] [--keep DIR] [--reuse DIR] [--variants]

``--keep DIR`` keeps the calibration and the runs (and measures only what DIR lacks);
``--reuse DIR`` re-reads them without measuring. ~4 minutes on 2 cores with 3 repetitions.
Timing priority: the jobs run in a session of their own whose autogroup is at nice -20
(:func:`_timing_priority`), so another session's busy processes take a core only while a rank waits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# (model preset, plan text): the fit layouts, then those the fit never sees
FIT = [("tiny", "tp=1"), ("tiny", "dp_shard=2"), ("tiny", "pp=2")]
HELD_OUT = [("tiny", "tp=2"), ("tiny", "pp=2,dp_shard=2"), ("tiny", "cp=2"), ("tiny-moe", "dp_shard=2,ep=2")]
# seq 64, micro-batch 2 (the CLI's defaults), 8 sequences a step: 4 micro-batches per rank at dp=1
SETTINGS = dict(seq_len=64, micro_batch_size=2, global_batch_size=8, lr=3e-4, seed=1)


def run_id(model: str, text: str) -> str:
    return f"{model}-{text.replace(',', '_').replace('=', '')}"


def make_config(model: str, text: str, steps: int):
    from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings

    plan = ParallelPlan.parse(text, dp_shard=1)
    world = plan.pp * plan.dp_replicate * plan.dp_shard * plan.cp * plan.tp
    cluster = Cluster.preset("local-cpu", nodes=max(1, world // 2), gpus_per_node=min(world, 2))
    train = TrainSettings(steps=steps, warmup_steps=1, **SETTINGS).with_precision("fp32")
    return RunConfig(ModelSpec.preset(model), cluster, plan, train)


def world_of(text: str) -> int:
    from workbench import ParallelPlan

    p = ParallelPlan.parse(text, dp_shard=1)
    return p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp


# ---------------------------------------------------------------------------- measuring
def _timing_priority() -> None:
    """In the job's first process (its ranks inherit it): the highest CPU priority permitted, so
    that other jobs on the shared machine take a core only while a rank waits.

    Linux's autogroup scheduling (``kernel.sched_autogroup_enabled``, on here) shares the CPU
    fairly between *sessions* first: a nice value only ranks processes within their session, so
    tests/dist.py's ``setpriority(-20)`` in a new session weighs nothing against another
    session's busy processes (a spinning loop at nice -20 measured 0.50 of a core next to two
    nice-0 jobs). The weight of a session is its autogroup's nice (``/proc/self/autogroup``):
    here a session of its own at -20, so that this job's priority covers only this job."""
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-20")
    except OSError:
        pass
    for nice in (-20, -10, -5, 0):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            return
        except OSError:
            continue


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                WORKBENCH_PG_TIMEOUT_S="120")


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=timeout,
                              preexec_fn=_timing_priority, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {code}:\n" + log.read_text()[-3000:])


def calibrate_here(root: Path, max_bytes: int) -> list[Path]:
    """``workbench bench compute`` for both models and ``workbench bench comms`` for world 2; the
    result files (compute first: ``calibrate`` lets later compute files win, tiny's goes last)."""
    wb = [sys.executable, "-m", "workbench.cli"]
    files = []
    for model in ("tiny-moe", "tiny"):
        out = root / f"compute-{model}.json"
        _run(wb + ["bench", "compute", "--model", model, "-o", str(out)], root / f"compute-{model}.log", 300)
        files.append(out)
    _run(wb + ["bench", "comms", "--nodes", "1", "--backend", "torchrun", "--max-bytes", str(max_bytes),
               "--runs", str(root / "bench")], root / "comms.log", 300)
    files += sorted((root / "bench").glob("*/comms.json"))
    return files


def worker(root: str, layouts: list[list[str]], steps: int) -> None:
    """One rank of a torchrun job: every layout in turn, each into its own run directory."""
    import torch.distributed as dist

    from workbench.rundir import EventWriter, create_run_dir
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    for model, text in layouts:
        config = make_config(model, text, steps)
        rid = run_id(model, text)
        if rank == 0:
            create_run_dir(config, root, rid)
        if world > 1:
            dist.barrier()
        t0, cpu0 = time.time(), time.process_time()
        with EventWriter(Path(root) / rid, rank) as writer:
            run_training(config, writer)
        # CPU time over wall time: ~1 on a core of its own, less where it waited on a peer or
        # another process took its core
        share = round((time.process_time() - cpu0) / (time.time() - t0), 3)
        shares: list = [share] * world
        if world > 1:
            dist.all_gather_object(shares, share)
        if rank == 0:
            (Path(root) / rid / "cpu_share.json").write_text(json.dumps(shares))
            print(f"{model} {text}: {time.time() - t0:.1f} s, cpu/wall per rank {shares}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def train_here(root: Path, layouts: list[tuple[str, str]], steps: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, text in layouts:
        by_world.setdefault(world_of(text), []).append((model, text))
    for world, todo in sorted(by_world.items()):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(Path(__file__).resolve()), "--worker", str(root), json.dumps(todo), "--steps", str(steps)]
        t0 = time.time()
        _run(cmd, root / f"train-world{world}.log", 900)
        print(f"# trained world {world}: {', '.join(f'{m} {t}' for m, t in todo)} ({time.time() - t0:.0f} s)",
              flush=True)


def measured(run_dir: Path, skip: int) -> dict[str, Any]:
    """Median over the steps >= ``skip`` of the slowest rank's step time; the bubble as
    ``workbench compare`` measures it; the config."""
    from workbench.rundir import analysis, load_run

    run = load_run(run_dir)
    events = run.events()
    times = analysis.step_times(events)
    steps = [max(ts) for s, ts in sorted(times.items()) if s >= skip and ts]
    share = run_dir / "cpu_share.json"
    out = {"config": run.config, "step_s": statistics.median(steps), "steps": len(steps),
           "spread": (min(steps), max(steps)), "events": events,
           "cpu_share": min(json.loads(share.read_text())) if share.exists() else None}
    if run.config.plan.pp > 1:
        out["bubble"] = analysis.bubble_fraction(events)
        out["stage_times"] = analysis.stage_times(events)
    return out


# ---------------------------------------------------------------------------- predicting
def sized(cluster, config):
    """The calibrated cluster as big as the run's. The runs' "nodes" are processes of this one
    host: every tier is the same loopback, so the intra-node calibration serves them all."""
    cal = cluster.calibration
    if cal is not None and "intra_node" in cal.links:
        links = {t: cal.links["intra_node"] for t in ("intra_node", "inter_node", "inter_leaf")}
        cal = dataclasses.replace(cal, links=links)
    return dataclasses.replace(cluster, nodes=config.cluster.nodes, gpus_per_node=config.cluster.gpus_per_node,
                               calibration=cal)


def priced(config, cluster, profile="bundled"):
    """``config`` on the calibrated cluster, priced under ``profile``."""
    return dataclasses.replace(config, cluster=sized(cluster, config),
                               train=dataclasses.replace(config.train, framework=profile))


def predict(config, cluster, profile="bundled") -> dict[str, Any]:
    """Step time, and for a pipeline the bubble as ``workbench compare`` predicts it (the
    schedule simulation fed the planner's stage times and p2p time)."""
    from workbench.predict.comms import p2p_time
    from workbench.predict.perf import predict_step
    from workbench.predict.pipeline import simulate_schedule

    cfg = priced(config, cluster, profile)
    p = predict_step(cfg)
    out = {"step_s": p.step_time_s, "prediction": p}
    if PATCH["timeshare"]:  # more ranks than cores: each runs at cores / ranks of a core
        out["step_s"] *= max(1.0, cfg.world_size / (os.cpu_count() or 1))
    if cfg.plan.pp > 1:
        plan = cfg.plan
        sim = simulate_schedule(plan.pp_schedule, plan.pp, cfg.n_microbatches, plan.virtual_stages,
                                stage_times=p.stage_times_s, p2p_time=p2p_time(cfg))
        out["bubble"] = sim.bubble_fraction
    return out


FIT_PARAMS = ("launch_overhead_s_per_layer", "overhead_s_per_microbatch", "overhead_s_per_collective")


def cpu_base():
    """The bundled profile as a CPU runs it: nothing overlaps communication. A gloo transfer is
    the work of the very core that would compute beside it (one core per rank), so FSDP's gathers
    and reduce-scatters and DDP's all-reduces are all exposed, as the trainer's pipeline timer
    shows them (measured: with them taken as hidden, held-out errors were twice as large)."""
    from workbench.spec.framework import FRAMEWORKS, TIERS

    return dataclasses.replace(FRAMEWORKS["bundled"], name="bundled-cpu-base",
                               overlapped_comm_exposed=tuple((t, 1.0) for t in TIERS))


def fit_profile(runs: list[dict[str, Any]], cluster, base=None, params=FIT_PARAMS):
    """The ``base`` profile's fixed costs refitted to ``runs`` (measured step times) by
    :func:`workbench.predict.fit.fit_framework`: the per-layer overhead of a block's forward
    (eager PyTorch on CPU: tens of ops of ~10 us each, not 100 us of GPU launches) and the
    per-micro-batch overhead (the micro-batch loop's Python, the loss, autograd's start)."""
    from workbench.predict.fit import fit_report
    from workbench.predict.measurements import Measurement

    base = cpu_base() if base is None else base
    ms = [Measurement(priced(r["config"], cluster, base), step_time_s=r["step_s"], label=r["label"]) for r in runs]
    report = fit_report(ms, base=base, params=list(params), name="bundled-cpu")
    values = ", ".join(f"{k} {v[1] * 1e3:.3g} ms" if "overhead" in k else f"{k} {v[1]:.3g}"
                       for k, v in report.values.items())
    return report.profile, f"fit_framework on {len(ms)} runs: {values}"


# ---------------------------------------------------------------------------- corrections (monkeypatched)
# What a further change to workbench/predict would do, emulated here without editing it (the flat
# GEMM rate under a calibration and the per-call host cost are built in since; the trainer's
# grad-norm now issues one all-reduce per kind of shard, not one per gradient):
#   timeshare: 4 ranks on 2 cores run at half speed (the planner gives every rank a device).
PATCH: dict[str, Any] = {"timeshare": False}


# ---------------------------------------------------------------------------- report
def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def table(runs: dict[tuple[str, str], dict[str, Any]], cluster, profile, title: str = "") -> dict[str, float]:
    """Print the layouts' predicted and measured step times; return the held-out summary."""
    if title:
        print(f"\n## {title}")
    print(f"{'set':<9} {'model':<9} {'layout':<16} {'predicted s':>11} {'measured s':>10} {'error':>8}  "
          f"{'reps: median s':>18}  {'cpu/wall':>8}")
    held, bubble = [], None
    for key, r in runs.items():
        p = predict(r["config"], cluster, profile)
        err = (r["step_s"] - p["step_s"]) / p["step_s"]  # as workbench compare: (measured - predicted) / predicted
        kind = "fit" if key in FIT else "held-out"
        if kind == "held-out":
            held.append(abs(err))
        reps = ",".join(f"{x:.3f}" for x in r["reps"])
        share = f"{r['cpu_share']:.2f}" if r.get("cpu_share") is not None else "-"
        note = "  (4 ranks on 2 cores)" if r["config"].world_size > (os.cpu_count() or 1) else ""
        print(f"{kind:<9} {key[0]:<9} {key[1]:<16} {p['step_s']:>11.4f} {r['step_s']:>10.4f} {err:>+8.1%}  "
              f"{reps:>18}  {share:>8}{note}")
        if r["config"].plan.pp > 1 and r["config"].world_size == 2 and r.get("bubble") is not None:
            bubble = (key, p["bubble"], r["bubble"])
    out = {"median": _p(held, 0.5), "p90": _p(held, 0.9)}
    print(f"held-out |error|: median {out['median']:.1%}, p90 {out['p90']:.1%}  (aim: median <= 25%)")
    if bubble:
        key, pb, mb = bubble
        out["bubble_pt"] = (mb - pb) * 100
        print(f"bubble {key[0]} {key[1]}: predicted {pb:.3f}, measured {mb:.3f} ({(mb - pb) * 100:+.1f} pt; "
              f"aim within 5 pt)")
    return out


def call_costs(runs, cluster) -> None:
    """Per collective (op) of each world-2 run: calls per step, the trainer's measured time per call
    (the comm meter: issue to completion on rank 0, medians over the timed steps) against the
    calibrated alpha-beta time of that call, and the scalar bookkeeping calls."""
    from workbench.predict.comms import collective_time

    print("\n## one collective in the trainer vs the calibration (rank 0, ms per call)")
    print(f"{'layout':<26} {'op':<15} {'calls':>6} {'bytes':>9} {'measured':>9} {'calibrated':>10}")
    for key, r in runs.items():
        if r["config"].world_size != 2:
            continue
        by_op: dict[tuple[str, bool], list] = {}
        for e in r["events"]:
            if e.get("kind") != "collectives" or e.get("rank") != 0 or e["step"] < 1:
                continue
            for c in e["calls"]:
                if c.get("end") is None or c.get("dir") == "recv":
                    continue
                by_op.setdefault((c["op"], bool(c.get("scalar"))), []).append((c["end"] - c["start"], c["bytes"],
                                                                              e["step"]))
        for (op, scalar), calls in sorted(by_op.items()):
            steps = len({s for *_, s in calls})
            size = statistics.median(b for _, b, _ in calls)
            cal = collective_time(op, size, 2, sized(cluster, r["config"]), "intra_node")
            name = f"{op} (scalar)" if scalar else op
            print(f"{key[0] + ' ' + key[1]:<26} {name:<15} {len(calls) / steps:>6.0f} {size:>9.0f} "
                  f"{statistics.median(t for t, _, _ in calls) * 1e3:>9.2f} {cal * 1e3:>10.2f}")


def variants(runs, cluster) -> None:
    """The correction still outside the planner, refitted on the fit layouts: the held-out errors
    it would give."""
    fit_runs = [runs[k] for k in FIT if k in runs]
    try:
        PATCH.update(timeshare=True)
        prof, how = fit_profile(fit_runs, cluster)
        s = table(runs, cluster, prof, title=f"+ ranks time-share the cores; {how}")
    finally:
        PATCH.update(timeshare=False)
    print(f"\n## summary with time-sharing: held-out median {s['median']:.1%}, p90 {s['p90']:.1%}, "
          f"pp=2 bubble {s.get('bubble_pt', float('nan')):+.1f} pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=3, help="steps dropped before the medians")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every layout (the fastest is kept)")
    ap.add_argument("--max-bytes", type=int, default=4 << 20, help="largest message of the comms benchmark")
    ap.add_argument("--keep", default=None, help="keep calibration and runs in this folder (what it has is reused)")
    ap.add_argument("--reuse", default=None, help="re-read a --keep folder instead of measuring")
    ap.add_argument("--variants", action="store_true", help="also print the held-out errors under the fixes")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("layouts", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.layouts), args.steps)
        return
    sys.path.insert(0, str(REPO))
    from workbench.bench import calibration_report, format_fit

    t_start = time.time()
    tmp = None
    if args.reuse:
        root = Path(args.reuse)
    elif args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="cpu-loop-")
        root = Path(tmp.name)
    if not args.reuse:  # measure what the folder lacks (all of it, but for a --keep folder again)
        if not list((root / "bench").glob("*/comms.json")):
            calibrate_here(root, args.max_bytes)
            print(f"# calibrated ({time.time() - t_start:.0f} s)", flush=True)
        for rep in range(args.reps):
            where = root / "runs" / f"rep{rep}"
            todo = [k for k in FIT + HELD_OUT if not (where / run_id(*k) / "config.json").exists()]
            if todo:
                train_here(where, todo, args.steps)
    # compute-tiny-moe.json sorts before compute-tiny.json: tiny's rate is the one kept (later files win)
    files = sorted(root.glob("compute-*.json")) + sorted((root / "bench").glob("*/comms.json"))
    report = calibration_report(files, skip_unfit=True)
    print(format_fit(report))
    cluster = report.cluster
    runs = {}
    for key in FIT + HELD_OUT:
        reps = [measured(d, args.skip) for d in sorted((root / "runs").glob(f"rep*/{run_id(*key)}"))
                if (d / "config.json").exists()]
        if reps:
            # the least disturbed repetition: the planner predicts an unloaded machine
            best = min(reps, key=lambda r: r["step_s"])
            runs[key] = dict(best, reps=[r["step_s"] for r in reps], label=f"{key[0]} {key[1]}")
    profile, how = fit_profile([runs[k] for k in FIT if k in runs], cluster)
    print(f"# {how}")
    if tmp is None:  # for compare_run(run, cluster=Cluster.from_json(...), framework="<dir>/bundled-cpu.json")
        (root / "cluster.json").write_text(cluster.to_json())
        profile.save(root / "bundled-cpu.json")
    table(runs, cluster, profile, title="predicted vs measured step time on this CPU (bundled profile refitted; "
          f"measured: median of steps {args.skip}..{args.steps - 1}, the fastest of {args.reps} repetitions)")
    if args.variants:
        call_costs(runs, cluster)
        variants(runs, cluster)
    print(f"# total {time.time() - t_start:.0f} s" + (f"; kept in {root}" if tmp is None else ""))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
