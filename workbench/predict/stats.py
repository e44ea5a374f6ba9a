"""The statistics predictions and measurements are summarised with, written once: the percentile
the trainer's guards, the benchmarks, the run analysis, the UI and the validation all report with,
and the rank correlation that says whether the planner orders runs as a cluster did."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from workbench.spec.errors import require


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (q in [0, 100]) by linear interpolation between the closest ranks
    (numpy's default), so p50 is the median. The one percentile of the project: the trainer's
    guards, the benchmarks, the analysis and the UI all report with it."""
    v = sorted(values)
    if not v:
        raise ValueError("percentile of no values")
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their ranks (as Spearman's rho needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    require(len(a) == len(b) and len(a) >= 2, "spearman needs two series of >= 2 equal-length values", field="values")
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else 0.0
