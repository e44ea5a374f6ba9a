"""Measured runs, and the planner's predictions checked against them.

A :class:`Measurement` is a RunConfig with what a real run measured (tokens/s per GPU, step time,
peak memory). :func:`load_measurements` reads a CSV of them; :func:`validate` predicts every row
and reports the errors: median and 90th percentile of the relative error, and the Spearman rank
correlation (does the planner order the runs as the cluster did?). ``workbench validate`` prints
it; without ``--measured`` it reads the published tables that ship in ``predict/data/``
(see its README for their provenance).

The CSV columns (one run a row; empty cells are unset):

* the model: ``model`` (a preset), or ``hf_config`` (a path), or its shape as ModelSpec fields
  (``n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, position, max_seq_len, norm,
  activation, tie_embeddings, linear_bias, ...``); ``params_published`` (optional) is checked
  against the shape's parameter count;
* where: ``gpu`` (a GPU name: its cluster preset) or ``cluster`` (a preset or a JSON file), and
  ``n_gpus``;
* the plan as a string (``plan``: ``"dp_shard=64,zero=3"``, ``"tp=8,pp=4"``);
* ``seq_len, micro_batch_size, global_batch_size, recompute, precision`` (a recipe);
* measured: ``tokens_per_s_per_gpu`` and/or ``step_time_s``, optionally ``peak_memory_gib``;
* ``framework``: the profile the row is priced under (a name of
  :data:`~workbench.spec.framework.FRAMEWORKS` or a profile ``.json``; empty: the caller's, else
  ``bundled``);
* ``label, source, notes``: kept with the row.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from workbench.spec.config import RunConfig, build_run_config
from workbench.spec.errors import ConfigError, check_instance, require
from workbench.spec.files import read_user_text
from workbench.spec.framework import FrameworkProfile, resolve_framework
from workbench.spec.model import ModelSpec
from workbench.predict.perf import mfu, predict_step
from workbench.predict.stats import percentile, spearman

DATA = Path(__file__).resolve().parent / "data"
PUBLISHED = (DATA / "mpt-h100-bf16.csv",)
# torchtitan's tables (bf16 and float8; peak memory and throughput): their H100s are power-capped at
# 500 W, which the datasheet peaks do not model, so they stay out of PUBLISHED (``workbench
# validate``'s throughput check); tests/test_measurements.py checks them (data/README.md).
PUBLISHED_MEMORY = (DATA / "torchtitan.csv",)
GiB = float(1 << 30)
MAX_CSV_BYTES = 16 << 20  # a table of runs is kilobytes; refuse to read a device or a huge file

_MODEL_FIELDS = {f.name: f for f in fields(ModelSpec)}
_TRAIN_COLUMNS = ("seq_len", "micro_batch_size", "global_batch_size", "recompute")


@dataclass(frozen=True)
class Measurement:
    """What a real run of ``config`` measured. At least one value is given; ``mfu`` is a published
    MFU by the planner's convention (:func:`~workbench.predict.perf.mfu`), for reports that give
    no throughput."""

    config: RunConfig
    tokens_per_s_per_gpu: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None
    mfu: float | None = None
    label: str = ""
    framework: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        check_instance("config", self.config, RunConfig)
        given = {k: v for k, v in (("tokens_per_s_per_gpu", self.tokens_per_s_per_gpu),
                                   ("step_time_s", self.step_time_s),
                                   ("peak_memory_bytes", self.peak_memory_bytes), ("mfu", self.mfu))
                 if v is not None}
        require(bool(given), "a measurement needs tokens_per_s_per_gpu, step_time_s, peak_memory_bytes or mfu",
                field="tokens_per_s_per_gpu")
        for name, value in given.items():
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0,
                    f"{name}={value!r} must be a positive number", field=name, value=value)

    @property
    def measured_tokens_per_s_per_gpu(self) -> float | None:
        """Tokens/s per GPU, from the step time or the MFU when only that was published."""
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_s_per_gpu
        step = self.step_time_s
        if step is None and self.mfu is not None:
            step = mfu(self.config, 1.0) / self.mfu  # MFU is inversely proportional to the step time
        if step is not None:
            return self.config.tokens_per_step / step / self.config.world_size
        return None


def _value(name: str, text: str, row: int) -> Any:
    """A CSV cell as the type of the ModelSpec field ``name``."""
    kind = str(_MODEL_FIELDS[name].type)
    try:
        if "bool" in kind:
            if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "yes", "1")
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
    except ValueError:
        raise ConfigError(f"row {row}: {name}={text!r} is not a {kind}", field=name, value=text) from None
    return text


def _number(r: dict[str, str], name: str, row: int, kind: type = float) -> Any:
    text = (r.get(name) or "").strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"row {row}: {name}={text!r} is not a number", field=name, value=text) from None


def measurement_from_row(r: dict[str, str], row: int, framework: "str | FrameworkProfile | None" = None,
                         base: "str | os.PathLike | None" = None) -> Measurement:
    """One CSV row (as :class:`csv.DictReader` gives it) -> Measurement, by the one RunConfig
    builder, priced under ``framework`` if given, else the row's ``framework`` column. A relative
    ``cluster`` JSON path that is not found from the working directory is read from ``base`` (the
    table's directory, so a table can ship its cluster beside it). Raises :class:`ConfigError`
    naming the row and the field."""
    r = {k: (v or "").strip() for k, v in r.items() if k is not None}
    cluster = r.get("cluster", "")
    if base is not None and cluster.endswith(".json") and not os.path.isabs(cluster) and not os.path.exists(cluster):
        beside = Path(base) / cluster
        if beside.is_file():
            r["cluster"] = str(beside)
    shape = {k: _value(k, v, row) for k, v in r.items() if k in _MODEL_FIELDS and k != "name" and v}
    label = r.get("label", "")
    try:
        if r.get("model"):
            model: str | ModelSpec = r["model"]
        elif r.get("hf_config"):
            model = ModelSpec.from_hf_config(r["hf_config"])
        else:
            model = ModelSpec.from_dict({"name": label.split(" ")[0] if label else "", **shape})
        published = _number(r, "params_published", row, int)
        if published is not None and isinstance(model, ModelSpec):
            require(model.n_params() == published,
                    f"the shape gives {model.n_params():,} parameters, the table {published:,}",
                    field="params_published", value=published)
        train = {k: (_number(r, k, row, int) if k != "recompute" else r[k]) for k in _TRAIN_COLUMNS if r.get(k)}
        profile = framework if framework is not None else (r.get("framework") or None)
        if profile is not None:
            train["framework"] = resolve_framework(profile)
        config = build_run_config(model, cluster=r.get("cluster") or None, gpu=r.get("gpu") or None,
                                  gpus=_number(r, "n_gpus", row, int), plan=r.get("plan", ""),
                                  precision=r.get("precision") or None, **train)
        memory = _number(r, "peak_memory_gib", row)
        return Measurement(config, tokens_per_s_per_gpu=_number(r, "tokens_per_s_per_gpu", row),
                           step_time_s=_number(r, "step_time_s", row),
                           peak_memory_bytes=int(memory * GiB) if memory is not None else None,
                           label=label or f"row {row}", framework=config.train.profile.name, source=r.get("source", ""))
    except ConfigError as err:
        if str(err).startswith(f"row {row}:"):
            raise
        raise ConfigError(f"row {row} ({label or 'unlabelled'}): {err}", field=err.field, value=err.value) from None


def load_measurements(path: str | os.PathLike, framework: "str | FrameworkProfile | None" = None) -> list[Measurement]:
    """Every row of a measurements CSV (see the module docstring for the columns), priced under
    ``framework`` when given (else each row's own column)."""
    text = read_user_text(path, "measured", MAX_CSV_BYTES)
    try:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as err:  # a NUL byte, a field past csv's size limit
        raise ConfigError(f"measured={str(path)!r} is not a CSV table ({err})", field="measured") from None
    require(bool(rows), f"measured={str(path)!r} holds no rows under a header line", field="measured",
            value=str(path))
    return [measurement_from_row(r, i, framework, Path(path).parent) for i, r in enumerate(rows, start=1)]


def published_measurements(framework: "str | FrameworkProfile | None" = None) -> list[Measurement]:
    """The published tables that ship with the project (``predict/data/``)."""
    return [m for p in PUBLISHED for m in load_measurements(p, framework)]


def published_memory_measurements(framework: "str | FrameworkProfile | None" = None) -> list[Measurement]:
    """The published peak-memory tables that ship with the project (``predict/data/``, see its
    README): the rows with a measured ``peak_memory_bytes``, to check the memory bill against."""
    return [m for m in published_torchtitan_measurements(framework) if m.peak_memory_bytes is not None]


def published_torchtitan_measurements(framework: "str | FrameworkProfile | None" = None) -> list[Measurement]:
    """Every row of the torchtitan tables that ship with the project (bf16 and float8; peak memory
    and/or throughput, see ``predict/data/README.md``)."""
    return [m for p in PUBLISHED_MEMORY for m in load_measurements(p, framework)]


def priced_under(measurement: Measurement, framework: "str | FrameworkProfile") -> Measurement:
    """The same measurement, its config priced under another framework profile."""
    config = measurement.config
    train = replace(config.train, framework=resolve_framework(framework))
    return replace(measurement, config=replace(config, train=train), framework=train.profile.name)


# ---------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class ValidationRow:
    label: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: (predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Validation:
    """Predicted next to measured tokens/s per GPU for every measurement."""

    rows: tuple[ValidationRow, ...]
    stats: dict[str, float] = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"{'run':<64}{'predicted':>11}{'measured':>11}{'error':>9}"]
        for r in self.rows:
            lines.append(f"{r.label[:63]:<64}{r.predicted:>11,.0f}{r.measured:>11,.0f}{r.error:>+9.1%}")
        s = self.stats
        lines.append("")
        lines.append(f"tokens/s per GPU over {s['n']:.0f} runs: median |error| {s['median_abs_error']:.1%}, "
                     f"p90 {s['p90_abs_error']:.1%}, median error {s['median_error']:+.1%}, "
                     f"Spearman {s['spearman']:.2f}")
        return "\n".join(lines)


def validate(measurements: Iterable[Measurement]) -> Validation:
    """Predict every measurement's throughput (:func:`~workbench.predict.perf.predict_step`) and
    report the errors against what was measured."""
    rows = []
    for m in measurements:
        measured = m.measured_tokens_per_s_per_gpu
        if measured is None:
            continue
        rows.append(ValidationRow(m.label, predict_step(m.config).tokens_per_s_per_gpu, measured))
    require(len(rows) >= 2, "validate needs at least 2 runs with a measured throughput", field="measured")
    abs_err = sorted(abs(r.error) for r in rows)
    err = sorted(r.error for r in rows)
    stats = {
        "n": float(len(rows)),
        "median_abs_error": percentile(abs_err, 50),
        "p90_abs_error": percentile(abs_err, 90),
        "median_error": percentile(err, 50),
        "spearman": spearman([r.predicted for r in rows], [r.measured for r in rows]),
    }
    return Validation(tuple(rows), stats)

