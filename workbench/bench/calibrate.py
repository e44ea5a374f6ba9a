"""Calibration: fit the planner's alpha-beta model and FLOP/s to benchmark results.

For every (link tier, collective) the measured median times are fitted to the model that
:func:`workbench.predict.comms.collective_time` evaluates with a calibration::

    t(S, n) = alpha + S x factor(n) / B        factor = BUS_FACTOR[op], B = bus bandwidth

which is linear in (alpha, 1/B) with regressor x = S x factor(n). Rows of every group size that
crosses the tier are fitted together, so one alpha and one B serve all of them. The latency of a
ring grows with n (2 (n-1) alpha for an all-reduce), which a single alpha cannot follow: where one
tier was measured with several group sizes (``n`` in :func:`format_fit` lists them), expect the
small sizes of the smaller groups to be overestimated and those of the larger underestimated.

The fit is in *relative* terms (:func:`fit_alpha_beta`): an ordinary least-squares fit would be
decided by the largest messages alone (their times are 10^5 x the small ones'), leaving the
latency floor of small messages to chance; in relative terms every size counts the same, as in a
log-space fit, yet each step stays a closed-form weighted linear fit, with Huber weights against
outlier sizes. Both parameters are kept physical: alpha >= 0 and B > 0 (a negative alpha is
refitted with alpha = 0).
The fit error is reported as the RMS and the largest |predicted / measured - 1| over the rows.
A (tier, collective) whose times do not grow with the size (on a busy CPU the send/recv of every
size measured once at a ~4 ms floor up to 4 MiB) cannot be fitted: by default the calibration
raises (a caller may measure again); with ``skip_unfit=True`` that series is left out, the
cluster's previous figure for it kept, and the report says so (``skipped``), rather than the whole
calibration failing on one series (it still raises when nothing at all could be fitted).

Achieved FLOP/s per dtype come from the matmul benchmark: total FLOPs / total time over a forward
pass's GEMMs (:meth:`ComputeResults.flops_per_s`). Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from workbench.spec.cluster import Calibration, Cluster, LinkCalibration
from workbench.predict.comms import BUS_FACTOR, collective_time
from workbench.spec.errors import ConfigError, require
from workbench.rundir.benchmarks import CommsResults, CommsRow, ComputeResults, Results, load_results

HUBER = 0.25  # |log(fit / measured)| beyond which a point's weight falls off (see fit_alpha_beta)


@dataclass(frozen=True)
class LinkFit:
    """The fitted alpha-beta model of one collective on one tier, and how well it fits."""

    tier: str
    op: str
    latency_s: float  # alpha
    bandwidth_bytes_per_s: float  # B, bus bandwidth
    rms_rel_error: float  # sqrt(mean((t_fit / t - 1)^2)) over the rows fitted
    max_rel_error: float
    points: int
    group_sizes: tuple[int, ...]
    min_bytes: int
    max_bytes: int

    def predict(self, x: float) -> float:
        """Seconds for x = S x factor(n) bytes."""
        return self.latency_s + x / self.bandwidth_bytes_per_s

    def link_calibration(self) -> LinkCalibration:
        return LinkCalibration(bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s)


def _weighted_fit(x: Sequence[float], t: Sequence[float], w: Sequence[float]) -> tuple[float, float]:
    """(alpha, b = 1/B) minimising sum w_i (alpha + b x_i - t_i)^2, with alpha >= 0.

    Normal equations: [sum w, sum w x; sum w x, sum w x^2] [alpha; b] = [sum w t; sum w x t]."""
    sw = sum(w)
    swx = sum(wi * xi for wi, xi in zip(w, x))
    swxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    swt = sum(wi * ti for wi, ti in zip(w, t))
    swxt = sum(wi * xi * ti for wi, xi, ti in zip(w, x, t))
    det = sw * swxx - swx * swx
    require(det > 0, "a fit needs at least two distinct sizes", field="sizes")
    alpha = (swxx * swt - swx * swxt) / det
    b = (sw * swxt - swx * swt) / det
    if alpha < 0:  # the latency floor is below resolution: fit the bandwidth alone
        alpha, b = 0.0, swxt / swxx
    return alpha, b


def fit_alpha_beta(x: Sequence[float], t: Sequence[float], iterations: int = 20,
                   huber: float = HUBER) -> tuple[float, float]:
    """(alpha, B) of t = alpha + x / B fitted in relative terms, with alpha >= 0 and B > 0.

    Iteratively reweighted least squares, every pass a closed-form weighted linear fit:

    1. weights 1 / t_i^2: least squares of the relative error (fit - t) / t. That measure is
       lopsided (a time measured 2x too high counts -50 %, one 2x too low +100 %);
    2. then weights 1 / (t_i fit_i): each residual measured against the geometric mean of fit and
       measurement, symmetric like a log-space fit (to first order it *is* sum log(fit / t)^2),
       times Huber's weight min(1, huber / |log(fit_i / t_i)|): points further off than ``huber``
       (~25 %) count in proportion to their error instead of its square, so the few sizes a busy
       machine slowed down (the median of a size can double) do not drag the line for all others.

    Exact data are recovered exactly (every residual is 0). Raises ConfigError when the times do
    not grow with x (all sizes sit on the latency floor: benchmark larger messages)."""
    require(len(x) == len(t) and len(x) >= 2, f"a fit needs >= 2 points of (x, t), got {len(x)}", field="points",
            value=len(x))
    require(all(ti > 0 for ti in t), "measured times must be > 0", field="times")
    alpha, b = _weighted_fit(x, t, [1.0 / ti**2 for ti in t])
    for _ in range(iterations):
        if b <= 0:
            break
        w = []
        for xi, ti in zip(x, t):
            fit = alpha + b * xi
            r = abs(math.log(fit / ti))
            w.append(min(1.0, huber / r) / (ti * fit) if r > 0 else 1.0 / (ti * fit))
        alpha, b = _weighted_fit(x, t, w)
    require(b > 0, f"times do not grow with message size up to {max(x):.0f} bytes on the wire: all sizes sit on "
            "the latency floor; benchmark larger messages", field="sizes", value=max(x))
    return alpha, 1.0 / b


def _x(row: CommsRow) -> float:
    return row.size_bytes * BUS_FACTOR[row.op](row.group_size)


def fit_link(rows: Sequence[CommsRow]) -> LinkFit:
    """Fit the rows of one (tier, op)."""
    tier, op = rows[0].tier, rows[0].op
    require(all(r.tier == tier and r.op == op for r in rows), "fit_link takes the rows of one (tier, op)",
            field="rows")
    x = [_x(r) for r in rows]
    t = [r.time_median_s for r in rows]
    alpha, bw = fit_alpha_beta(x, t)
    errors = [(alpha + xi / bw) / ti - 1 for xi, ti in zip(x, t)]
    return LinkFit(tier, op, alpha, bw, math.sqrt(sum(e * e for e in errors) / len(errors)),
                   max(abs(e) for e in errors), len(rows), tuple(sorted({r.group_size for r in rows})),
                   min(r.size_bytes for r in rows), max(r.size_bytes for r in rows))


@dataclass(frozen=True)
class CalibrationReport:
    """The calibrated cluster and the fits behind it."""

    cluster: Cluster
    links: tuple[LinkFit, ...]
    flops_per_s: Mapping[str, float]
    sources: tuple[str, ...]
    skipped: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (tier, op) not fitted: why

    @property
    def rms_rel_error(self) -> float:
        """RMS relative error over every fitted row (each fit weighted by its rows)."""
        n = sum(f.points for f in self.links)
        return math.sqrt(sum(f.rms_rel_error**2 * f.points for f in self.links) / n) if n else 0.0

    @property
    def max_rel_error(self) -> float:
        return max((f.max_rel_error for f in self.links), default=0.0)


def _as_results(item: Results | str | os.PathLike) -> tuple[Results, str]:
    if isinstance(item, (CommsResults, ComputeResults)):
        return item, f"{item.kind} results"
    return load_results(item), str(Path(item))


def calibration_report(results: Iterable[Results | str | os.PathLike], cluster: Cluster | None = None,
                       select: Callable[[CommsRow], bool] | None = None,
                       skip_unfit: bool = False) -> CalibrationReport:
    """Fit every (tier, collective) of the comms results and the FLOP/s of the compute results.

    ``cluster`` defaults to the cluster of the first comms results; its existing calibration is
    kept where nothing new was measured. ``select`` keeps only some rows for the fit (e.g. every
    other size, to test the fit on the rest). ``skip_unfit``: a (tier, collective) that cannot be
    fitted is reported in ``skipped`` and left out instead of raising (see the module docstring)."""
    loaded = [_as_results(r) for r in results]
    require(len(loaded) > 0, "calibrate needs at least one results file", field="results")
    comms = [r for r, _ in loaded if isinstance(r, CommsResults)]
    compute = [r for r, _ in loaded if isinstance(r, ComputeResults)]
    if cluster is None:
        require(len(comms) > 0, "calibrate needs a comms results file or an explicit cluster", field="cluster")
        cluster = comms[0].cluster
    rows = [row for r in comms for row in r.rows if select is None or select(row)]
    by_key: dict[tuple[str, str], list[CommsRow]] = {}
    for row in rows:
        by_key.setdefault((row.tier, row.op), []).append(row)
    fitted, skipped = [], {}
    for key, rs in sorted(by_key.items()):
        try:
            fitted.append(fit_link(rs))
        except ConfigError as err:  # this series only: the others still calibrate the cluster
            if not skip_unfit:
                raise
            skipped[key] = str(err)
    if skipped and not fitted and not compute:
        raise ConfigError("no collective could be fitted: " + "; ".join(f"{t} {op}: {why}" for (t, op), why in
                                                                        skipped.items()), field="results")
    fits = tuple(fitted)
    flops: dict[str, float] = {}
    for c in compute:  # later files win: pass the newest last
        flops.update(c.flops_per_s())

    old = cluster.calibration or Calibration()
    links = {t: dict(cs) for t, cs in old.links.items()}
    for f in fits:
        links.setdefault(f.tier, {})[f.op] = f.link_calibration()
    sources = tuple(s for _, s in loaded)
    n_rows = sum(f.points for f in fits)
    note = f"workbench calibrate: {', '.join(sources)}"
    if fits:
        rms = math.sqrt(sum(f.rms_rel_error**2 * f.points for f in fits) / n_rows)
        note += f"; {len(fits)} link fits over {n_rows} rows, RMS relative error {rms:.1%}"
    if skipped:
        note += f"; not fitted (previous figures kept): {', '.join(f'{t} {op}' for t, op in skipped)}"
    calibration = Calibration(links=links, flops_per_s={**old.flops_per_s, **flops}, source=note)
    return CalibrationReport(replace(cluster, calibration=calibration), fits, flops, sources, skipped)


def calibrate(results: Iterable[Results | str | os.PathLike], cluster: Cluster | None = None,
              select: Callable[[CommsRow], bool] | None = None, skip_unfit: bool = False) -> Cluster:
    """The measured cluster with ``calibration`` fitted to ``results`` (comms.json and compute.json
    files, run directories, or loaded results); write it with ``Cluster.to_json``."""
    return calibration_report(results, cluster, select, skip_unfit).cluster


def predict_row(cluster: Cluster, row: CommsRow) -> float:
    """The planner's time for a measured row: :func:`workbench.predict.comms.collective_time` over a flat
    group of the row's size on the row's tier (what the benchmark ran)."""
    return collective_time(row.op, row.size_bytes, row.group_size, cluster, row.tier)


def prediction_errors(cluster: Cluster, rows: Iterable[CommsRow]) -> list[tuple[CommsRow, float, float]]:
    """(row, predicted seconds, predicted / measured median - 1) for each row."""
    out = []
    for row in rows:
        p = predict_row(cluster, row)
        out.append((row, p, p / row.time_median_s - 1))
    return out


def format_fit(report: CalibrationReport) -> str:
    """One line per fitted (tier, collective): alpha, B, the fit error, and the FLOP/s."""
    lines = [f"#{'tier':>11} {'collective':>15} {'n':>6} {'sizes (B)':>17} {'alpha (us)':>11} {'busbw (GB/s)':>13} "
             f"{'rms err':>8} {'max err':>8}"]
    for f in report.links:
        sizes = f"{f.min_bytes}..{f.max_bytes}"
        lines.append(f"{f.tier:>12} {f.op:>15} {','.join(map(str, f.group_sizes)):>6} {sizes:>17} "
                     f"{f.latency_s * 1e6:>11.2f} {f.bandwidth_bytes_per_s / 1e9:>13.3f} "
                     f"{f.rms_rel_error:>8.1%} {f.max_rel_error:>8.1%}")
    if report.links:
        lines.append(f"# all fits: RMS relative error {report.rms_rel_error:.1%}, largest {report.max_rel_error:.1%}")
    for (tier, op), why in report.skipped.items():
        lines.append(f"# not fitted: {tier} {op} ({why}); the cluster's previous figure is kept")
    for dtype, v in report.flops_per_s.items():
        lines.append(f"# achieved matmul {dtype}: {v / 1e12:.4f} TFLOP/s")
    return "\n".join(lines)


__all__ = [
    "CalibrationReport",
    "LinkFit",
    "calibrate",
    "calibration_report",
    "fit_alpha_beta",
    "fit_link",
    "format_fit",
    "predict_row",
    "prediction_errors",
]
