"""The advisor's full search for llama3-70b on 128 nodes of 8 H100 at seq 8192 (aim: < 2 s).

    python benchmarks/bench_advisor.py

Prints the wall time of the search beside the time of one estimate_memory + predict_step, so
the ratio (how many full evaluations the search costs) is comparable across noisy machines.
"""

from __future__ import annotations

import time

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.predict.advisor import advise
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step


def main() -> None:
    model = ModelSpec.preset("llama3-70b")
    cluster = Cluster.preset("dgx-h100", nodes=128)
    train = TrainSettings(seq_len=8192, global_batch_size=1024).with_precision("bf16-megatron")
    cfg = RunConfig(model, cluster, ParallelPlan(tp=8, pp=4), train)
    predict_step(cfg)  # warm caches shared by both measurements
    start = time.perf_counter()
    for _ in range(20):
        predict_step(cfg, memory=estimate_memory(cfg))
    one = (time.perf_counter() - start) / 20
    times = []
    for _ in range(3):
        start = time.perf_counter()
        advice = advise(model, cluster, train, top=10)
        times.append(time.perf_counter() - start)
    best = min(times)
    print(f"advise(llama3-70b, 128 x dgx-h100, seq 8192, gbs 1024): best of 3 {best:.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in times)})")
    print(f"  searched {advice.stats['plans']} plans, {advice.stats['too_big']} too big, {advice.stats['predicted']} predicted")
    print(f"  one full evaluation (bill + prediction): {one * 1e3:.2f} ms; search / evaluation = {best / one:.0f}")
    print(f"  best: {advice[0].summary()}")


if __name__ == "__main__":
    main()
