"""Measure this machine as a 4-rank cluster and calibrate the planner to it (issue 8).

    python benchmarks/bench_cluster.py [--plan tp=2,dp_shard=2] [--max-bytes 16777216] [--out runs]

Runs the collective benchmark under torchrun (gloo on CPU: 4 ranks standing for the local-cpu
preset's 2 nodes of 2; NCCL when there are 4 GPUs), the matmul benchmark of the ``tiny`` model,
and the calibration; prints the bandwidth table, the fit per (tier, collective), and how well a fit
on the even sizes of the ladder predicts the odd ones; writes ``calibrated.json`` beside the
results.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from workbench.bench import calibration_report, format_fit, run_compute_benchmark
from workbench.launch.benchmark import run_comms_benchmark
from workbench.rundir.benchmarks import format_table, size_ladder
from workbench.bench.calibrate import prediction_errors
from workbench.spec.cluster import Cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="tp=2,dp_shard=2")
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()

    cluster = Cluster.preset("local-cpu", nodes=2)
    sizes = size_ladder(args.max_bytes)
    comms = run_comms_benchmark(cluster, args.plan, args.out, sizes=sizes)
    run_dir = Path(comms.path).parent
    compute = run_compute_benchmark(args.model, out_path=run_dir / "compute.json")
    print(format_table(comms))
    print()
    print(format_table(compute))

    report = calibration_report([run_dir / "comms.json", run_dir / "compute.json"])
    (run_dir / "calibrated.json").write_text(report.cluster.to_json())
    print("\n# calibration on every size")
    print(format_fit(report))

    held = set(sizes[1::2])  # odd rungs: every one inside the range of the even rungs
    half = calibration_report([comms], select=lambda r: r.requested_bytes not in held)
    errors = prediction_errors(half.cluster, [r for r in comms.rows if r.requested_bytes in held])
    by_key: dict[tuple[str, str], list[float]] = {}
    for row, _, err in errors:
        by_key.setdefault((row.tier, row.op), []).append(abs(err))
    print("\n# fitted on the even sizes, predicting the odd ones (median / largest |predicted / measured - 1|)")
    for (tier, op), errs in sorted(by_key.items()):
        print(f"{tier:>12} {op:>15}  {statistics.median(errs):6.1%}  {max(errs):6.1%}")
    all_errs = [abs(e) for *_, e in errors]
    print(f"# held-back sizes: median {statistics.median(all_errs):.1%}, largest {max(all_errs):.1%}, "
          f"{sum(e <= 0.25 for e in all_errs)} of {len(all_errs)} within 25%")
    print(f"\nwrote {run_dir / 'calibrated.json'}")


if __name__ == "__main__":
    main()
