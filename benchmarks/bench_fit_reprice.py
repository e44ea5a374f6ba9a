"""How long the fitter takes to price a measured run under a new profile: a full ``replace`` of the
RunConfig (every check again) against ``RunConfig.with_framework`` (nothing that could differ is
checked again), each followed by the prediction the fitter makes. Side by side in one run.

    python benchmarks/bench_fit_reprice.py [repeats]

Then the same for a whole fit (``fit_framework`` on every fourth published MPT run), with the
fitter's repricing swapped for the full ``replace``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from workbench.predict.measurements import published_measurements
from workbench.predict.perf import predict_step
from workbench.spec.framework import FRAMEWORKS


def main(repeats: int = 3) -> None:
    rows = published_measurements("fsdp")[::4]
    profiles = [replace(FRAMEWORKS["fsdp"], name=f"p{i}") for i in range(40)]

    def by_replace() -> None:
        for p in profiles:
            for m in rows:
                predict_step(replace(m.config, train=replace(m.config.train, framework=p)))

    def by_with_framework() -> None:
        for p in profiles:
            for m in rows:
                predict_step(m.config.with_framework(p))

    times = {}
    for name, fn in (("replace", by_replace), ("with_framework", by_with_framework)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times[name] = best
        print(f"{name:>15}: {best * 1e3 / (len(rows) * len(profiles)):.2f} ms per repriced prediction (best of {repeats})")
    print(f"speed-up: {times['replace'] / times['with_framework']:.2f}x")

    import workbench.predict.fit as fit

    def priced_by_replace(m, profile):
        c = m.config
        return c if c.train.framework is profile else replace(c, train=replace(c.train, framework=profile))

    fits = {}
    for name, priced in (("replace", priced_by_replace), ("with_framework", fit._priced)):
        original, fit._priced = fit._priced, priced
        try:
            t0 = time.perf_counter()
            fit.fit_framework(rows, base="fsdp")
            fits[name] = time.perf_counter() - t0
        finally:
            fit._priced = original
        print(f"{name:>15}: fit_framework on {len(rows)} runs in {fits[name]:.1f} s")
    print(f"speed-up of the fit: {fits['replace'] / fits['with_framework']:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
