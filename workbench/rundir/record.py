"""The run directory (DESIGN.md): ``runs/<run-id>/`` with ``config.json``, ``manifest.json`` and
``events/``. The contract between trainer, launcher and UI: they share nothing else."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.spec.config import RunConfig
from workbench.rundir.events import read_events


def new_run_id(config: RunConfig) -> str:
    """``20250101-120000-tiny-dp_shard=2`` style: sortable by time, readable."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    label = config.plan.describe().split(" ")[0].replace(",", "_")
    return f"{stamp}-{config.model.name or 'model'}-{label}"


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


def create_run_dir(config: RunConfig, root: str | os.PathLike = "runs", run_id: str | None = None) -> Path:
    """Make ``<root>/<run_id>/`` with ``config.json``, ``manifest.json`` and an empty ``events/``."""
    run_id = run_id or new_run_id(config)
    path = Path(root) / run_id
    path.mkdir(parents=True, exist_ok=False)
    (path / "events").mkdir()
    (path / "config.json").write_text(config.to_json())
    (path / "manifest.json").write_text(json.dumps(build_manifest(config), indent=2))
    return path


@dataclass(frozen=True)
class RunRecord:
    """A run directory on disk, read back (a live run you control is a
    :class:`~workbench.launch.handle.RunHandle`)."""

    path: Path
    config: RunConfig
    manifest: dict[str, Any]

    def events(self, since: dict[int, int] | None = None) -> list[dict[str, Any]]:
        return read_events(self.path, since)

    def steps(self) -> list[dict[str, Any]]:
        """Step events of rank 0 (every rank logs the same global loss)."""
        return [e for e in self.events() if e["kind"] == "step" and e["rank"] == 0]


def load_run(path: str | os.PathLike) -> RunRecord:
    path = Path(path)
    config = RunConfig.load(str(path / "config.json"))
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    return RunRecord(path=path, config=config, manifest=manifest)
