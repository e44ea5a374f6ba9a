"""What the launchers check before any process starts and before a run directory is made.

Each check raises :class:`~workbench.spec.errors.ConfigError` (one line naming the field, the
value and the rule). What the RunConfig's own validation cannot know is here: the machine's files
(a data path that does not exist), the launcher's options (``max_restarts``), the run directories
on disk (a run id already taken, a run directory that is damaged or still running, a resume whose
config no longer matches what the run recorded). The order in ``workbench train`` is: build and
check everything, and only then create or rewrite anything on disk.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.spec.config import RunConfig
from workbench.spec.errors import ConfigError, check_int, require
from workbench.spec.model import ModelSpec
from workbench.spec.trainable import check_trainable
from workbench.rundir.checkpoints import META, list_checkpoints
from workbench.rundir.events import read_events
from workbench.rundir.record import check_run_id

# TrainSettings fields a resume may change; every other field is the run's own (its checkpoints,
# data position and events mean something only for the config they were made with).
RESUMABLE_FIELDS = ("steps", "checkpoint_every", "checkpoint_keep", "checkpoint_async")
_DAMAGED = (OSError, UnicodeDecodeError, TypeError, KeyError, AttributeError, IndexError, ValueError)


def load_run_config(run_dir: str | os.PathLike, field: str = "run_dir") -> RunConfig:
    """The RunConfig of a run directory, or a ConfigError that says why there is none (not a run
    directory, a damaged config.json), never a FileNotFoundError, TypeError or KeyError."""
    text = os.fspath(run_dir) if isinstance(run_dir, (str, os.PathLike)) else None
    require(bool(text and text.strip()), f"{field}={run_dir!r} is not a run directory (give its path)",
            field=field, value=run_dir)
    path = Path(text)
    require((path / "config.json").is_file(), f"{field}={text!r} is not a run directory (no config.json)",
            field=field, value=text)
    return load_config_file(path / "config.json", field)


def load_config_file(path: str | os.PathLike, field: str = "config") -> RunConfig:
    """A RunConfig JSON file; a missing or damaged one is a ConfigError naming the file."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    require(bool(text and text.strip()), f"{field}={path!r} is not a RunConfig file", field=field, value=path)
    require(Path(text).is_file(), f"{field}={text!r} does not exist (a RunConfig JSON file)", field=field, value=text)
    try:
        return RunConfig.load(text)
    except ConfigError as e:
        raise ConfigError(f"{text}: {e}", field=e.field or field, value=e.value) from None
    except _DAMAGED as e:  # JSON of the wrong shape: a list, a string where a dict belongs...
        raise ConfigError(f"{text} is damaged ({type(e).__name__}: {e})", field=field, value=text) from None


def check_max_restarts(max_restarts: Any) -> None:
    check_int("max_restarts", max_restarts, minimum=0, maximum=1000)


def check_data_path(config: RunConfig, base: Path | None = None) -> None:
    """``dataset`` text or bin reads ``data_path``: it must be a file (relative paths from
    ``base``, default the current directory: where torchrun and its ranks start)."""
    t = config.train
    if t.dataset not in ("text", "bin") or not t.data_path:
        return
    path = Path(t.data_path)
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        kind = "a UTF-8 text file" if t.dataset == "text" else "a flat uint16 .bin file"
        raise ConfigError(f"data_path={t.data_path!r} {what} (dataset={t.dataset!r} reads {kind})",
                          field="data_path", value=t.data_path)


def check_launch(config: RunConfig, max_restarts: int = 0) -> None:
    """Everything about a job that can be checked before its processes start."""
    require(isinstance(config, RunConfig), f"config={type(config).__name__} is not a RunConfig", field="config")
    check_trainable(config)
    check_max_restarts(max_restarts)
    check_data_path(config)


def check_run_id_free(run_root: str | os.PathLike, run_id: str | None) -> None:
    """A new run's directory must not exist yet: a second job with the run id of an existing (or
    live) run is refused before it starts, in one line."""
    if run_id is None:
        return
    path = Path(run_root) / check_run_id(run_id)  # a name first: "../x" must not be looked up
    if path.exists():
        live = job_pids(path)
        state = f", and it is running (pid {live[0]})" if live else ""
        raise ConfigError(f"run_id={run_id!r}: {path} exists already{state}; pick another run id, "
                          f"or continue that run with --resume {path}", field="run_id", value=run_id)


def job_pids(run_dir: str | os.PathLike) -> list[int]:
    """Live processes of this run: torchrun and ranks, whose command line names its config.json
    (the launchers pass it as an absolute path; a zombie has an empty command line)."""
    target = str((Path(run_dir) / "config.json").resolve())
    me = os.getpid()
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if target.encode() in argv:
            out.append(int(name))
    return sorted(out)


# ---------------------------------------------------------------------------- resume


def resumed_config(config: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """``config`` with the fields a resume may change replaced (validated as a new RunConfig)."""
    unknown = sorted(set(changes) - set(RESUMABLE_FIELDS))
    require(not unknown, f"a resume cannot change {', '.join(unknown)}: the run continues as it was launched "
                         f"(a resume may change {', '.join(RESUMABLE_FIELDS)})", field=unknown[0] if unknown else None)
    if not changes:
        return config
    return replace(config, train=replace(config.train, **changes))


def _latest_checkpoint_meta(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            meta = json.loads((path / META).read_text())
        except _DAMAGED:
            continue  # the trainer's verification rejects it and falls back to an older one
        if isinstance(meta, dict):
            return path, meta
    return None


def check_resume(run_dir: Path, before: RunConfig, after: RunConfig) -> None:
    """A resume of ``run_dir`` (``before``: its config.json, ``after``: with the resume's changes):
    not while it runs, the model the run recorded (its checkpoints' and its first run_start's),
    steps not below the checkpoint it resumes from."""
    live = job_pids(run_dir)
    require(not live, f"resume={str(run_dir)!r} is running (pid {live[0] if live else ''}): stop it first",
            field="resume", value=str(run_dir))
    latest = _latest_checkpoint_meta(run_dir)
    if latest is not None:
        path, meta = latest
        try:
            saved = ModelSpec.from_dict(meta["config"]["model"])
        except (ConfigError, *_DAMAGED):
            saved = None  # damaged metadata: the trainer rejects that checkpoint
        if saved is not None and saved != after.model:
            raise ConfigError(f"config.json's model {after.model.name!r} is not the model {path.name} was saved "
                              f"for ({saved.name!r}, other dimensions): a resume continues the same model",
                              field="model", value=after.model.name)
        step = int(meta.get("step", 0) or 0)
        require(after.train.steps >= step, f"steps={after.train.steps} is below step {step} of the checkpoint the "
                                           f"resume starts from ({path.name}): give steps >= {step}",
                field="steps", value=after.train.steps)
    starts = [e for e in read_events(run_dir) if e.get("kind") == "run_start" and "n_params" in e]
    if starts and int(starts[0]["n_params"]) != after.model.n_params():
        raise ConfigError(f"config.json's model {after.model.name!r} has {after.model.n_params():,} parameters, the run "
                          f"started with {int(starts[0]['n_params']):,}: a resume continues the same model",
                          field="model", value=after.model.name)


def record_resume(run_dir: Path, before: RunConfig, after: RunConfig) -> dict[str, list[Any]]:
    """Rewrite config.json with the resume's changes, after noting them in the manifest
    (``resumes``: time and ``{field: [before, after]}``), so the launched values stay on record.
    Both files are replaced atomically. Returns the changes."""
    changed = {f: [getattr(before.train, f), getattr(after.train, f)] for f in RESUMABLE_FIELDS
               if getattr(before.train, f) != getattr(after.train, f)}
    if not changed:
        return changed
    manifest_path = run_dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    except _DAMAGED:
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    manifest.setdefault("resumes", []).append(
        {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(), "changed": changed})
    _replace_file(manifest_path, json.dumps(manifest, indent=2))
    _replace_file(run_dir / "config.json", after.to_json())
    return changed


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
