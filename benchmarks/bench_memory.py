"""Calls per second of estimate_memory for llama3-70b under a 3-D plan (aim: >= 5,000/s).

    python benchmarks/bench_memory.py

Also times building and validating the RunConfig, which the advisor pays for every candidate.
"""

from __future__ import annotations

import time

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.predict.memory import estimate_memory


def rate(fn, seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(200):
            fn()
        n += 200
    return n / elapsed


def main() -> None:
    model = ModelSpec.preset("llama3-70b")
    cluster = Cluster.preset("dgx-h100", nodes=8)
    train = TrainSettings(seq_len=8192, recompute="selective").with_precision("bf16-megatron")
    plan = ParallelPlan(tp=8, pp=4, dp_shard=2)
    config = RunConfig(model, cluster, plan, train)
    bill_rate = rate(lambda: estimate_memory(config))
    build_rate = rate(lambda: estimate_memory(RunConfig(model, cluster, plan, train)))
    print(f"estimate_memory, llama3-70b, tp=8 pp=4 dp_shard=2 on 64 H100: {bill_rate:,.0f} calls/s")
    print(f"RunConfig(...) + validation + estimate_memory:              {build_rate:,.0f} calls/s")
    print(f"ratio (bill alone / with config build): {bill_rate / build_rate:.2f}")


if __name__ == "__main__":
    main()
