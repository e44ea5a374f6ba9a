"""The run directory (DESIGN.md): ``runs/<run-id>/`` with ``config.json``, ``manifest.json`` and
``events/``. The contract between trainer, launcher and UI: they share nothing else."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.spec.config import RunConfig
from workbench.spec.errors import ConfigError, require
from workbench.rundir.events import ReadReport, open_regular, os_reason, read_events
from workbench.rundir.lineage import build_lineage, write_lineage


# A run id is a name, one path component: no separators, no "..", nothing a shell or a URL reads
# specially. The first character is alphanumeric so that an id is never an option ("-x") or hidden.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}")


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is a valid run name, else :class:`ConfigError` saying the rule."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id) or ".." in run_id:
        raise ConfigError(f"run_id={run_id!r} is not a run name: 1-200 of A-Z a-z 0-9 . _ = + -, starting with a "
                          "letter or digit, no '..' (a run id names one folder under the runs directory)",
                          field="run_id", value=run_id)
    return run_id


def new_run_id(config: RunConfig) -> str:
    """``20250101-120000-tiny-dp_shard=2`` style: sortable by time, readable. A model's name from
    a Hugging Face config ("meta-llama/Llama-3-8B") has its separators replaced."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    label = config.plan.describe().split(" ")[0].replace(",", "_")
    name = re.sub(r"[^A-Za-z0-9._=+-]+", "-", config.model.name or "model").replace("..", "-")[:80]
    return check_run_id(f"{stamp}-{name}-{label}")


def _git_revision() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def workbench_version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written)."""
    try:
        return importlib.metadata.version("workbench")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _torch_info() -> tuple[str | None, list[str]]:
    """torch version and device names, without importing torch when it is not installed."""
    try:
        import torch  # optional here: the launcher and the UI write manifests without torch
    except ImportError:
        return None, []
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return torch.__version__, devices or [f"cpu ({os.cpu_count()} cores)"]


def build_manifest(config: RunConfig) -> dict[str, Any]:
    torch_version, devices = _torch_info()
    return {
        "python": platform.python_version(),
        "torch": torch_version,
        "workbench": workbench_version(),
        "git_revision": _git_revision(),
        "hostname": socket.gethostname(),
        "hosts": [socket.gethostname()],
        "devices": devices,
        "world_size": config.world_size,
        "mesh": {name: size for name, size in config.plan.mesh_dims()},
        "plan": config.plan.describe(),
        "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "argv": sys.argv,
    }


def create_run_dir(config: RunConfig, root: str | os.PathLike = "runs", run_id: str | None = None, *,
                   hf_config: str | os.PathLike | None = None, manifest_extra: dict[str, Any] | None = None) -> Path:
    """Make ``<root>/<run_id>/`` with ``config.json``, ``manifest.json``, ``lineage.json``
    (:mod:`workbench.rundir.lineage`; ``hf_config``: the file the model was imported from) and an
    empty ``events/``; ``manifest_extra`` joins the manifest (a baseline's ``baseline_of``). A ``run_id`` that is not a name (:func:`check_run_id`) or already exists
    under ``root`` is a :class:`ConfigError`: a run directory is never shared by two runs."""
    run_id = new_run_id(config) if run_id is None else check_run_id(run_id)
    path = Path(root) / run_id
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        path.mkdir()
    except FileExistsError:
        raise ConfigError(f"run_id={run_id!r} already exists in {str(root)!r} (a live or finished run; "
                          "resume it with --resume, or choose another --run-id)", field="run_id",
                          value=run_id) from None
    except OSError as err:
        raise ConfigError(f"runs={str(root)!r}: cannot create the run directory ({err.strerror or err})",
                          field="runs", value=str(root)) from None
    (path / "events").mkdir()
    (path / "config.json").write_text(config.to_json())
    (path / "manifest.json").write_text(json.dumps(build_manifest(config) | dict(manifest_extra or {}), indent=2))
    write_lineage(path, build_lineage(config, hf_config=hf_config))
    return path


def record_allocation(run_dir: Path, allocation: dict[str, Any]) -> None:
    """Append a scheduler's allocation (``{"scheduler": "slurm", "job_id": ..., "nodelist": ...}``)
    to ``manifest.json``'s ``allocations``, with the time it was granted; a resume with a new
    allocation adds one more. The manifest is replaced atomically."""
    path = Path(run_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, UnicodeDecodeError, ValueError):
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    manifest.setdefault("allocations", []).append(
        dict(allocation, time=_dt.datetime.now(_dt.timezone.utc).isoformat()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunRecord:
    """A run directory on disk, read back (a live run you control is a
    :class:`~workbench.launch.handle.RunHandle`)."""

    path: Path
    config: RunConfig
    manifest: dict[str, Any]
    prediction: dict[str, Any] = field(default_factory=dict)  # prediction.json, where the run has one

    def events(self, since: dict[int, int] | None = None, report: ReadReport | None = None) -> list[dict[str, Any]]:
        """The valid events of every events file (``report`` learns what was skipped)."""
        return read_events(self.path, since, report)

    def steps(self) -> list[dict[str, Any]]:
        """Step events of rank 0 (every rank logs the same global loss)."""
        return [e for e in self.events() if e["kind"] == "step" and e["rank"] == 0]

    def checked_events(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The valid events of the run's own ranks, and one note per thing the reading left out or
        found missing: lines skipped and files not read (per file), events of ranks the run does
        not have, ranks with no events at all ("rank 1: no events"). compare says these."""
        report = ReadReport()
        events = read_events(self.path, report=report)
        world = self.config.world_size
        notes = report.notes()
        foreign = sorted({e["rank"] for e in events if e["rank"] >= world})
        if foreign:
            notes.append(f"{ranks_text(foreign)}: events ignored, the run has {world} rank{'s' if world != 1 else ''}")
            events = [e for e in events if e["rank"] < world]
        silent = sorted(set(range(world)) - {e["rank"] for e in events})
        if silent:
            notes.append(f"{ranks_text(silent)}: no events")
        return events, notes


def ranks_text(ranks: list[int], most: int = 8) -> str:
    """``[1]`` -> "rank 1"; ``[0, 1, 2, 5]`` -> "ranks 0-2, 5" (the first ``most`` runs of ranks)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    if len(runs) > most:
        text += f", ... ({len(ranks)} in all)"
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


MAX_JSON_BYTES = 16 * 2**20  # config, manifest and prediction are kilobytes: more is not a run's file


def _shown(path: Path) -> str:
    text = str(path)
    return text if text.isprintable() else ascii(text)


def read_json_object(path: Path, required: bool = True) -> dict[str, Any] | None:
    """The JSON object in the run directory's file ``path``: a regular file of at most
    :data:`MAX_JSON_BYTES` holding one JSON object (None: absent and not ``required``). Anything
    else is a ConfigError naming the file and the rule. JSON only: nothing is unpickled."""
    shown = _shown(path)
    try:
        f = open_regular(path)
    except FileNotFoundError:
        if not required:
            return None
        raise ConfigError(f"{shown} is missing: not a run directory", field=path.name, value=str(path)) from None
    except OSError as e:
        raise ConfigError(f"{shown} cannot be read: {os_reason(e)}", field=path.name, value=str(path)) from None
    try:
        with f:
            too_large = os.fstat(f.fileno()).st_size > MAX_JSON_BYTES  # refused without reading it
            raw = b"" if too_large else f.read(MAX_JSON_BYTES + 1)  # capped: it may grow meanwhile
    except OSError as e:
        raise ConfigError(f"{shown} cannot be read: {os_reason(e)}", field=path.name, value=str(path)) from None
    if too_large or len(raw) > MAX_JSON_BYTES:
        raise ConfigError(f"{shown} is larger than {MAX_JSON_BYTES} bytes, too large for a run directory's JSON file",
                          field=path.name, value=str(path))
    try:
        data = json.loads(raw.decode("utf-8"))  # UTF-8, as written: not json's guess of UTF-16/32
    except UnicodeDecodeError:
        raise ConfigError(f"{shown} is not UTF-8 text", field=path.name, value=str(path)) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{shown} is not valid JSON ({e.msg} at line {e.lineno})", field=path.name,
                          value=str(path)) from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits, nesting too deep
        raise ConfigError(f"{shown} is not valid JSON ({type(e).__name__})", field=path.name, value=str(path)) from None
    if type(data) is not dict:
        kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise ConfigError(f"{shown} must hold a JSON object, not {kind}", field=path.name, value=str(path))
    return data


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def load_run(path: str | os.PathLike) -> RunRecord:
    """The run directory at ``path`` read back: config.json (required), manifest.json and
    prediction.json (where present), each through :func:`read_json_object`. A damaged one is a
    ConfigError naming the file and the rule; the events are read when asked for."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{_shown(path)} is not a run directory (not a directory)", field="run_dir", value=str(path))
    config_path = path / "config.json"
    data = read_json_object(config_path)
    try:
        config = RunConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{_shown(config_path)}: {_one_line(e)}", field=e.field, value=e.value) from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        # the spec's own checks raise ConfigError; this is the net under them, at the file's edge
        raise ConfigError(f"{_shown(config_path)} is not a valid run config ({type(e).__name__}: {_one_line(e)})",
                          field="config", value=str(config_path)) from None
    manifest = read_json_object(path / "manifest.json", required=False) or {}
    prediction = read_json_object(path / "prediction.json", required=False) or {}
    return RunRecord(path=path, config=config, manifest=manifest, prediction=prediction)


def check_runs_root(path: str, field: str = "runs") -> None:
    """``--runs``: a writable directory, or a name whose folder exists (made at the first launch);
    ConfigError naming the rule otherwise (as ``workbench serve --runs`` checks it)."""
    require(bool(path.strip()), f"{field}={path!r} is empty; give the directory runs go under", field=field,
            value=path)
    if os.path.exists(path):
        require(os.path.isdir(path), f"{field}={path!r} is not a directory", field=field, value=path)
        require(os.access(path, os.W_OK | os.X_OK), f"{field}={path!r} is not writable", field=field, value=path)
        return
    parent = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(parent), f"{field}={path!r} does not exist, nor does its folder {parent!r}", field=field,
            value=path)
