"""Fit a framework profile to measured runs: ``fit_framework(measurements, base="megatron")``.

A user who measured a few runs on their own cluster makes the planner fit them. The fit moves a
profile's free constants (:data:`PARAMETERS`), each within bounds that keep it physical, to
minimise the log-ratio of predicted to measured throughput (and peak memory, for the allocator's
share) by robust least squares (``scipy.optimize.least_squares``, soft-L1 loss: one odd run
cannot drag every constant). A constant the measurements cannot see (no TP in any run: no TP
overlap to learn) keeps the base profile's value: only constants whose effect on the predictions
exceeds :data:`MIN_SENSITIVITY` are fitted.

How good is the fit on runs it did not see? :func:`fit_framework` puts a leave-one-out band on the
profile (``profile.band``): each run predicted by the fit of the others, refitted exactly for up
to :data:`EXACT_LOO_RUNS` runs, else from the linearised fit (the PRESS residual
``r_i / (1 - h_ii)`` of the fit's Jacobian, the standard shortcut). :func:`cross_validate`
refits k times on (k-1)/k of the runs and predicts the rest: the honest figure to quote.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from workbench.spec.errors import check_instance, require
from workbench.spec.framework import ErrorBand, FrameworkProfile, TIERS, resolve_framework
from workbench.predict.measurements import Measurement
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step
from workbench.predict.stats import percentile, spearman


@dataclass(frozen=True)
class Parameter:
    """One fittable constant of a profile, with the bounds that keep it physical."""

    name: str
    lower: float
    upper: float
    why: str
    get: Callable[[FrameworkProfile], float]
    set: Callable[[FrameworkProfile, float], FrameworkProfile]
    memory: bool = False  # a memory constant: fitted on peak memory, not on time


def _eff(name: str, lower: float, upper: float, why: str) -> Parameter:
    return Parameter(name, lower, upper, why, lambda p: getattr(p.efficiency, name),
                     lambda p, v: replace(p, efficiency=replace(p.efficiency, **{name: v})))


def _tier(attr: str, tier: str, why: str) -> Parameter:
    def set_(p: FrameworkProfile, v: float) -> FrameworkProfile:
        shares = dict(getattr(p, attr))
        shares[tier] = v
        return replace(p, **{attr: tuple(shares.items())})

    short = "in_stage_exposed" if attr == "in_stage_comm_exposed" else "overlapped_exposed"
    return Parameter(f"{short}.{tier}", 0.0, 1.0, why, lambda p: dict(getattr(p, attr))[tier], set_)


PARAMETERS: tuple[Parameter, ...] = (
    _eff("matmul", 0.2, 0.95, "large-GEMM share of dense peak: cuBLAS reaches 0.7-0.8, nothing exceeds 0.95"),
    _eff("gemm_half_dim", 8.0, 2048.0, "GEMM size at half rate: tile and wave quantisation, tens to a few thousand"),
    _eff("attention", 0.05, 0.9, "flash attention's share of peak: FA1 ~0.2, FA2 ~0.35, FA3 ~0.75"),
    _eff("memory", 0.3, 0.95, "element-wise kernels' share of HBM bandwidth"),
    _eff("launch_overhead_s_per_layer", 0.0, 5e-3, "host and launch cost of one block's forward"),
    _eff("overhead_s_per_microbatch", 0.0, 2.0, "host-side fixed cost of a micro-batch on a stage"),
    _eff("overhead_s_per_collective", 0.0, 10e-3, "host-side cost of issuing one collective call"),
    *(_tier("in_stage_comm_exposed", t, f"share of {t} TP/CP/EP time left exposed") for t in TIERS[:2]),
    *(_tier("overlapped_comm_exposed", t, f"share of {t} FSDP/DP time exposed despite overlap") for t in TIERS[:2]),
    Parameter("allocator_fragmentation", 0.0, 0.5, "reserved over allocated, less 1: 0.03-0.10 in PyTorch LLM runs",
              lambda p: p.memory.allocator_fragmentation,
              lambda p, v: replace(p, memory=replace(p.memory, allocator_fragmentation=v)), memory=True),
)
BY_NAME = {p.name: p for p in PARAMETERS}
MIN_SENSITIVITY = 1e-3  # |d log(prediction)| over a parameter's range, below which it is not fitted
EXACT_LOO_RUNS = 24  # up to this many runs, leave-one-out refits exactly
SOFT_L1_SCALE = 0.05  # residuals (log ratios) above ~5 % count linearly, not squared
# The solver stops when a step changes the cost, the constants or the gradient by less than this
# (relative). scipy's default, 1e-8, is far below what runs measured to ~1 % can resolve: with
# about as many free constants as runs the cost is flat along some direction, and the solver
# walked it until max_nfev (9 MPT runs, 9 constants: 129 s to fit and leave-one-out; at 1e-6,
# 16 s, and the 5-fold errors on all 70 runs are equal to 7 digits).
SOLVER_TOL = 1e-6


# ---------------------------------------------------------------------------- predictions
def _priced(m: Measurement, profile: FrameworkProfile):
    config = m.config
    if config.train.framework is profile:
        return config
    return config.with_framework(profile)


def _log_ratios(measurements: Sequence[Measurement], profile: FrameworkProfile, memory: bool) -> np.ndarray:
    out = []
    for m in measurements:
        config = _priced(m, profile)
        if memory:
            out.append(math.log(estimate_memory(config).peak_bytes / m.peak_memory_bytes))
        else:
            out.append(math.log(predict_step(config).tokens_per_s_per_gpu / m.measured_tokens_per_s_per_gpu))
    return np.asarray(out)


def _apply(profile: FrameworkProfile, params: Sequence[Parameter], x: Sequence[float]) -> FrameworkProfile:
    for p, v in zip(params, x):
        profile = p.set(profile, float(v))
    return profile


def _sensitive(measurements: Sequence[Measurement], base: FrameworkProfile, params: Sequence[Parameter],
               memory: bool) -> list[Parameter]:
    """The parameters whose range moves some prediction by more than MIN_SENSITIVITY."""
    if not measurements:
        return []
    r0 = _log_ratios(measurements, base, memory)
    keep = []
    for p in params:
        for probe in (p.lower + 0.25 * (p.upper - p.lower), p.lower + 0.75 * (p.upper - p.lower)):
            if np.max(np.abs(_log_ratios(measurements, p.set(base, probe), memory) - r0)) > MIN_SENSITIVITY:
                keep.append(p)
                break
    return keep


@dataclass(frozen=True)
class _Solved:
    profile: FrameworkProfile
    params: tuple[Parameter, ...]
    residuals: np.ndarray  # log(predicted / measured) at the optimum
    jacobian: np.ndarray | None


def _solve(measurements: Sequence[Measurement], base: FrameworkProfile, params: Sequence[Parameter],
           memory: bool, x0: Sequence[float] | None = None) -> _Solved:
    if not params or not measurements:
        return _Solved(base, tuple(params), _log_ratios(measurements, base, memory), None)
    # scipy is imported when a fit runs, not with the planner: `import workbench` stays light.
    from scipy.optimize import least_squares

    lower = np.array([p.lower for p in params])
    upper = np.array([p.upper for p in params])
    start = np.clip(np.array(x0 if x0 is not None else [p.get(base) for p in params], dtype=float), lower, upper)
    scale = upper - lower  # solve in [0, 1] per parameter: constants of very different magnitudes

    def residuals(u: np.ndarray) -> np.ndarray:
        return _log_ratios(measurements, _apply(base, params, lower + u * scale), memory)

    sol = least_squares(residuals, (start - lower) / scale, bounds=(0.0, 1.0), loss="soft_l1",
                        f_scale=SOFT_L1_SCALE, diff_step=1e-3, max_nfev=200 * len(params),
                        ftol=SOLVER_TOL, xtol=SOLVER_TOL, gtol=SOLVER_TOL)
    x = lower + sol.x * scale
    return _Solved(_apply(base, params, x), tuple(params), sol.fun, sol.jac)


# ---------------------------------------------------------------------------- reports
@dataclass(frozen=True)
class FitRow:
    label: str
    quantity: str  # "tokens/s/GPU" or "peak memory"
    measured: float
    base: float  # predicted by the base profile
    fitted: float  # predicted by the fitted profile
    held_out: float | None  # predicted by a fit that did not see this run

    @property
    def error(self) -> float:
        return self.fitted / self.measured - 1

    @property
    def held_out_error(self) -> float | None:
        return None if self.held_out is None else self.held_out / self.measured - 1


def error_stats(errors: Iterable[float]) -> dict[str, float]:
    """Median and 90th percentile of |error|, and the median signed error."""
    errs = list(errors)
    if not errs:
        return {"n": 0.0, "median_abs_error": math.nan, "p90_abs_error": math.nan, "median_error": math.nan}
    a = sorted(abs(e) for e in errs)
    return {"n": float(len(errs)), "median_abs_error": percentile(a, 50), "p90_abs_error": percentile(a, 90),
            "median_error": percentile(sorted(errs), 50)}


@dataclass(frozen=True)
class FitReport:
    """What :func:`fit_report` fitted, and how well: per run and in summary."""

    profile: FrameworkProfile
    base: FrameworkProfile
    values: dict[str, tuple[float, float]]  # fitted parameter -> (base value, fitted value)
    rows: tuple[FitRow, ...]
    method: str  # how the held-out predictions were made

    def stats(self, quantity: str = "tokens/s/GPU", held_out: bool = True) -> dict[str, float]:
        rows = [r for r in self.rows if r.quantity == quantity]
        return error_stats((r.held_out_error if held_out else r.error) for r in rows
                           if (r.held_out is not None or not held_out))

    def format(self) -> str:
        lines = [f"fitted profile {self.profile.name!r} from base {self.base.name!r}:"]
        for name, (b, f) in self.values.items():
            lines.append(f"  {name:<32} {b:>12.4g} -> {f:<12.4g} [{BY_NAME[name].lower:g}, {BY_NAME[name].upper:g}]")
        if not self.values:
            lines.append("  (no constant the runs can see: the base profile is kept)")
        lines.append(f"{'run':<60}{'quantity':>14}{'measured':>12}{'base':>9}{'fitted':>9}{'held out':>10}")
        for r in self.rows:
            held = f"{r.held_out_error:+.1%}" if r.held_out_error is not None else "-"
            lines.append(f"{r.label[:59]:<60}{r.quantity:>14}{r.measured:>12,.4g}{r.base / r.measured - 1:>+9.1%}"
                         f"{r.error:>+9.1%}{held:>10}")
        for q in ("tokens/s/GPU", "peak memory"):
            s, f = self.stats(q), self.stats(q, held_out=False)
            if s["n"] or f["n"]:
                lines.append(f"{q}: in-sample median |error| {f['median_abs_error']:.1%}; {self.method}: median "
                             f"{s['median_abs_error']:.1%}, p90 {s['p90_abs_error']:.1%} over {s['n']:.0f} runs")
        return "\n".join(lines)


def _split(measurements: Iterable[Measurement]) -> tuple[list[Measurement], list[Measurement]]:
    require(not isinstance(measurements, (str, bytes, Mapping)) and isinstance(measurements, Iterable),
            f"measurements={type(measurements).__name__} must be a list of Measurement", field="measurements")
    ms = list(measurements)
    for m in ms:
        check_instance("measurement", m, Measurement)
    time_rows = [m for m in ms if m.measured_tokens_per_s_per_gpu is not None]
    memory_rows = [m for m in ms if m.peak_memory_bytes is not None]
    return time_rows, memory_rows


def _resolve_params(names: Iterable[str] | None) -> list[Parameter]:
    if names is None:
        return list(PARAMETERS)
    out = []
    require(not isinstance(names, str), f"params={names!r} must be a list of names", field="params", value=names)
    for n in names:
        require(isinstance(n, str) and n in BY_NAME, f"fit parameter {n!r} is not one of {', '.join(BY_NAME)}", field="params", value=n)
        out.append(BY_NAME[n])
    return out


def _fit(time_rows, memory_rows, base, params) -> tuple[_Solved, _Solved]:
    time_params = _sensitive(time_rows, base, [p for p in params if not p.memory], memory=False)
    mem_params = _sensitive(memory_rows, base, [p for p in params if p.memory], memory=True)
    t = _solve(time_rows, base, time_params, memory=False)
    mm = _solve(memory_rows, t.profile, mem_params, memory=True)
    return t, mm


def _held_out(rows: Sequence[Measurement], base: FrameworkProfile, solved: _Solved, memory: bool) -> tuple[list[float | None], str]:
    """log(prediction / measured) of every run by a fit that did not see it."""
    n = len(rows)
    if not solved.params or n < 2:
        return list(solved.residuals), "no fitted constant (base profile)"
    if n <= EXACT_LOO_RUNS:
        start = [p.get(solved.profile) for p in solved.params]
        out: list[float | None] = []
        for i in range(n):
            rest = [m for j, m in enumerate(rows) if j != i]
            fit = _solve(rest, base, solved.params, memory, x0=start)
            out.append(float(_log_ratios([rows[i]], fit.profile, memory)[0]))
        return out, "leave-one-out"
    # PRESS: the linearised leave-one-out residual of a least-squares fit
    jac = solved.jacobian
    hat = jac @ np.linalg.pinv(jac.T @ jac) @ jac.T
    lev = np.clip(np.diag(hat), 0.0, 0.99)
    return list(solved.residuals / (1 - lev)), "leave-one-out (linearised)"


def fit_report(measurements: Iterable[Measurement], base: "str | FrameworkProfile" = "megatron",
               params: Iterable[str] | None = None, name: str | None = None) -> FitReport:
    """Fit ``base``'s constants to the measurements; report every run's base, fitted and
    held-out prediction. ``params``: the names of :data:`PARAMETERS` to free (default: all the
    runs can see)."""
    base_profile = resolve_framework(base)
    time_rows, memory_rows = _split(measurements)
    require(len(time_rows) + len(memory_rows) >= 2, "fitting a profile needs at least 2 measured runs",
            field="measured")
    t, mm = _fit(time_rows, memory_rows, base_profile, _resolve_params(params))
    fitted = replace(mm.profile, name=name or f"{base_profile.name}-fitted",
                     description=f"{base_profile.name} refitted to {len(time_rows) + len(memory_rows)} measured runs",
                     fitted=tuple(p.name for p in t.params + mm.params), band=None)
    held_t, method = _held_out(time_rows, base_profile, t, memory=False)
    held_m, _ = _held_out(memory_rows, t.profile, mm, memory=True)
    rows = []
    for ms, held, memory in ((time_rows, held_t, False), (memory_rows, held_m, True)):
        base_r = _log_ratios(ms, base_profile, memory)
        fit_r = _log_ratios(ms, fitted, memory)
        for m, b, f, h in zip(ms, base_r, fit_r, held):
            measured = float(m.peak_memory_bytes if memory else m.measured_tokens_per_s_per_gpu)
            rows.append(FitRow(m.label, "peak memory" if memory else "tokens/s/GPU", measured,
                               measured * math.exp(b), measured * math.exp(f),
                               None if h is None else measured * math.exp(h)))
    values = {p.name: (p.get(base_profile), p.get(fitted)) for p in t.params + mm.params}
    report = FitReport(fitted, base_profile, values, tuple(rows), method)
    s = report.stats()
    if s["n"]:
        mem = report.stats("peak memory")
        band = ErrorBand(step_error=s["median_abs_error"], p90_step_error=s["p90_abs_error"], n_runs=int(s["n"]),
                         method=method, memory_error=mem["median_abs_error"] if mem["n"] else None)
        report = replace(report, profile=replace(fitted, band=band))
    return report


def fit_framework(measurements: Iterable[Measurement], base: "str | FrameworkProfile" = "megatron",
                  params: Iterable[str] | None = None, name: str | None = None) -> FrameworkProfile:
    """The ``base`` profile refitted to ``measurements``, with its leave-one-out error band
    (see the module docstring; :func:`fit_report` has the per-run detail)."""
    return fit_report(measurements, base, params, name).profile


# ---------------------------------------------------------------------------- k-fold
@dataclass(frozen=True)
class CrossValidation:
    """Every run predicted by a profile fitted on the other folds."""

    k: int
    rows: tuple[tuple[str, float, float], ...]  # (label, measured, held-out prediction) tokens/s/GPU
    profiles: tuple[FrameworkProfile, ...]

    @property
    def errors(self) -> list[float]:
        return [p / m - 1 for _, m, p in self.rows]

    @property
    def stats(self) -> dict[str, float]:
        from_errors = error_stats(self.errors)
        from_errors["spearman"] = spearman([p for *_, p in self.rows], [m for _, m, _ in self.rows])
        return from_errors

    def band(self) -> ErrorBand:
        s = self.stats
        return ErrorBand(s["median_abs_error"], s["p90_abs_error"], len(self.rows), f"{self.k}-fold")


def cross_validate(measurements: Iterable[Measurement], base: "str | FrameworkProfile" = "megatron", k: int = 5,
                   seed: int = 0, params: Iterable[str] | None = None) -> CrossValidation:
    """k-fold cross-validation of :func:`fit_framework` on throughput: the runs shuffled with
    ``seed`` into k folds; each fold predicted by the profile fitted on the other k - 1."""
    base_profile = resolve_framework(base)
    time_rows, _ = _split(measurements)
    require(isinstance(k, int) and 2 <= k <= len(time_rows),
            f"k={k!r} folds need 2 <= k <= the {len(time_rows)} runs with a measured throughput", field="k", value=k)
    order = list(range(len(time_rows)))
    random.Random(seed).shuffle(order)
    folds = [order[i::k] for i in range(k)]
    chosen = _resolve_params(params)
    rows: list[tuple[str, float, float]] = []
    profiles = []
    for fold in folds:
        held = set(fold)
        train_rows = [m for i, m in enumerate(time_rows) if i not in held]
        t, _ = _fit(train_rows, [], base_profile, chosen)
        profiles.append(t.profile)
        for i in fold:
            m = time_rows[i]
            pred = predict_step(_priced(m, t.profile)).tokens_per_s_per_gpu
            rows.append((m.label, m.measured_tokens_per_s_per_gpu, pred))
    return CrossValidation(k, tuple(rows), tuple(profiles))


__all__ = ["PARAMETERS", "CrossValidation", "FitReport", "FitRow", "cross_validate", "error_stats", "fit_framework",
           "fit_report"]
