"""The advisor's full search for llama3-70b on 128 nodes of 8 H100 at seq 8192 (aim: < 2 s).

    python benchmarks/bench_advisor.py

Prints, side by side: the figures recorded before the search pruned by its bound (they cannot be
rerun: that code is gone, and the memory and time models have moved since), the exhaustive search
as it runs today (``_advise(..., prune=False)``: every slot searched, as before) and ``advise``.
Rows: estimate_memory calls/s (bench_memory's plan), memory bills estimated, predictions, the
wall and CPU seconds of one advise (median of 3 after a first, cold one; the CPU time is the
steadier figure on a shared machine) and bills per second. It also checks that the pruned and the
exhaustive search give the same answer. Since issue 14 the search keeps the advisor's default
headroom (8 % of HBM free on every GPU) and compares every plan at the one global batch (1024
here); the line ``inputs`` says what the answer was computed for.
"""

from __future__ import annotations

import statistics
import time

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.predict.advisor import _advise, advise
from workbench.predict.memory import estimate_memory

# Measured on this 2-core shared machine with the advisor before pruning (and the memory and time
# models of that day); advise: median of 3 runs (6.67, 5.21, 5.07 s).
BEFORE = {"estimate_memory calls/s": 7820.0, "bills estimated": 6168, "predicted": 808, "advise wall s": 5.21,
          "advise CPU s": None, "bills/s": 6168 / 5.21, "slots pruned": 0}


def rate(fn, seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(50):
            fn()
        n += 50
    return n / elapsed


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def answer(advice) -> list:
    return [(c.config, c.prediction, c.memory.peak_bytes, c.explanation) for c in advice]


def main() -> None:
    model = ModelSpec.preset("llama3-70b")
    cluster = Cluster.preset("dgx-h100", nodes=128)
    train = TrainSettings(seq_len=8192, global_batch_size=1024).with_precision("bf16-megatron")

    # bench_memory's plan, so the rate compares with it: tp=8 pp=4 dp_shard=2 on 64 H100
    small = RunConfig(model, Cluster.preset("dgx-h100", nodes=8), ParallelPlan(tp=8, pp=4, dp_shard=2),
                      TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron"))
    bill_rate = rate(lambda: estimate_memory(small))

    cold, _, _ = timed(lambda: advise(model, cluster, train, top=10))  # pipeline schedules simulated, cached
    runs = [timed(lambda: advise(model, cluster, train, top=10)) for _ in range(3)]
    wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    pruned = runs[-1][2]
    ex_wall, ex_cpu, exhaustive = timed(lambda: _advise(model, cluster, train, top=10, prune=False))

    rows = {
        "estimate_memory calls/s": (bill_rate, bill_rate),
        "bills estimated": (exhaustive.stats["plans"], pruned.stats["plans"]),
        "predicted": (exhaustive.stats["predicted"], pruned.stats["predicted"]),
        "advise wall s": (ex_wall, wall),
        "advise CPU s": (ex_cpu, cpu),
        "bills/s": (exhaustive.stats["plans"] / ex_wall, pruned.stats["plans"] / wall),
        "slots pruned": (exhaustive.stats["pruned"], pruned.stats["pruned"]),
    }

    def cell(v) -> str:
        if v is None:
            return "-"
        return f"{v:,.2f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}"

    print("advise(llama3-70b, 128 x dgx-h100, seq 8192, gbs 1024, top=10)")
    print(f"  {'':24s} {'before (recorded)':>18s} {'exhaustive (now)':>18s} {'advise (now)':>14s}")
    for name, (ex, now) in rows.items():
        print(f"  {name:24s} {cell(BEFORE[name]):>18s} {cell(ex):>18s} {cell(now):>14s}")
    print(f"  advise wall s, runs: {', '.join(f'{r[0]:.2f}' for r in runs)} (first, cold: {cold:.2f})")
    same = answer(pruned) == answer(exhaustive) and pruned.rejections == exhaustive.rejections
    print(f"  same answer as the exhaustive search: {'yes' if same else 'NO'}")
    print(f"  inputs: {pruned.inputs.describe()}")
    print(f"  best: {pruned[0].summary()}")


if __name__ == "__main__":
    main()
