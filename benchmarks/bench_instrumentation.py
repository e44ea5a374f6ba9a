"""Overhead of the trainer's instrumentation: the tiny model's step time with it on and off.

One torchrun job (dp_shard=2 on CPU by default) runs the same config repeatedly, alternating
instrumentation off / on (interleaved repetitions, so that a machine that slows down or speeds up
affects both alike); each repetition trains ``--steps`` steps, the first ``--skip`` of which
are dropped. Prints the median step time of each and their ratio (aim: <= 1.03).

    python benchmarks/bench_instrumentation.py [--plan dp_shard=2] [--reps 6] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from workbench.launch.local import config_from_cli
    from workbench.rundir import EventWriter, create_run_dir
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    config = config_from_cli("tiny", args.plan, steps=args.steps, seq_len=args.seq_len)
    times: dict[str, list[float]] = {"off": [], "on": []}
    pairs: list[float] = []  # per repetition: median on / median off (adjacent runs, same load)
    root = Path(args.root)
    for rep in range(args.reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            os.environ["WORKBENCH_INSTRUMENT"] = "1" if mode == "on" else "0"
            run_id = f"{mode}-{rep}"
            if rank == 0:
                create_run_dir(config, root, run_id)
            dist.barrier()
            with EventWriter(root / run_id, rank) as writer:
                run_training(config, writer)
            if rank == 0:
                from workbench.rundir import read_rank_events

                steps = [e for e in read_rank_events(root / run_id, 0) if e["kind"] == "step"]
                times[mode] += [e["step_time_s"] for e in steps[args.skip:]]
                rep_times = [e["step_time_s"] for e in steps[args.skip:]]
                if mode == ("on" if rep % 2 == 0 else "off"):  # the second run of the pair
                    other = times["off" if mode == "on" else "on"][-len(rep_times):]
                    on_, off_ = (rep_times, other) if mode == "on" else (other, rep_times)
                    pairs.append(statistics.median(on_) / statistics.median(off_))
    if rank == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"plan {args.plan}, {args.reps} interleaved repetitions x {args.steps - args.skip} timed steps")
        print(f"instrumentation off: {off * 1e3:8.2f} ms/step (median of {len(times['off'])})")
        print(f"instrumentation on:  {on * 1e3:8.2f} ms/step (median of {len(times['on'])})")
        print(f"ratio on/off: {on / off:.3f}  (aim <= 1.03); median of per-repetition ratios "
              f"{statistics.median(pairs):.3f} (range {min(pairs):.3f}-{max(pairs):.3f})")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="dp_shard=2")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--root")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from workbench.spec.plan import ParallelPlan

    plan = ParallelPlan.parse(args.plan, dp_shard=1)
    world = plan.pp * plan.dp_replicate * plan.dp_shard * plan.cp * plan.tp
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", "--root", root, "--plan", args.plan, "--reps", str(args.reps), "--steps", str(args.steps),
               "--skip", str(args.skip), "--seq-len", str(args.seq_len)]
        t0 = time.time()
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-4000:])
        print(proc.stdout.strip())
        print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
