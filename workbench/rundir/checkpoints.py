"""Checkpoint directories on disk, without torch: list, commit, verify, choose, retain.

The trainer (``workbench/trainer/checkpoint.py``) writes the shards with
``torch.distributed.checkpoint`` and leaves the rest to this module, which the launchers, the
notebooks and the UI can use to look at a run's checkpoints without importing torch::

    checkpoints/step-<n>.tmp/     while being written (never loaded; discarded at the next start)
    checkpoints/step-<n>/         committed: __<rank>_<i>.distcp, .metadata, rng-<rank>.pt, meta.json,
                                  hashes.json (sha256 and size of every file), COMMITTED (last)
    checkpoints/step-<n>.rejected a checkpoint that failed verification, kept for inspection

A save that fails (disk full, read-only) leaves nothing: the trainer removes its ``.tmp`` and
reports a ``checkpoint`` event with phase "failed" (workbench/trainer/checkpoint.py).

:func:`commit_checkpoint` makes a complete ``.tmp`` directory visible (meta.json, hashes, marker,
fsync, one atomic rename); :func:`verify_checkpoint` says why a checkpoint is not good, in one line;
:func:`find_latest_good` picks the newest good one and sets the bad ones aside.

DCP's ``.metadata`` (a pickle of torch classes) and the RNG files (``torch.save``) need torch to
read, safely: the checks here cover the marker, the hashes, every file's size and (``full``) every
SHA-256, and take the check of the torch files as an optional ``check_metadata`` callable, which the
trainer passes (and which runs only after the hashes matched).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

CHECKPOINTS = "checkpoints"
MARKER = "COMMITTED"
HASHES = "hashes.json"
META = "meta.json"
_COMMITTED_NAME = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 1 << 20

# (checkpoint path, its hashes.json) -> None if the DCP metadata is consistent, else the reason
MetadataCheck = Callable[[Path, dict[str, Any]], "str | None"]


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed-looking checkpoints ``(step, path)``, oldest first (``.tmp``/``.rejected`` excluded;
    whether they are *good* is :func:`verify_checkpoint`'s business)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _COMMITTED_NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def step_of(path: Path) -> int:
    """The step of ``step-<n>`` (also ``.tmp``, ``.rejected``), -1 for another name."""
    m = re.match(r"^step-(\d+)", path.name)
    return int(m.group(1)) if m else -1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class CommitInfo:
    path: Path
    bytes: int  # every file of the checkpoint
    n_files: int
    duration_s: float


def commit_checkpoint(tmp: Path, final: Path, meta: dict[str, Any]) -> CommitInfo:
    """Make the complete checkpoint in ``tmp`` visible as ``final`` (rank 0, after every rank wrote).

    Order matters: ``meta.json``, then the hashes of every file, then the marker (naming the hash of
    ``hashes.json``), each fsynced, then one atomic rename. A crash at any point leaves either a
    ``.tmp`` directory (ignored, discarded later) or a complete ``step-<n>``."""
    t0 = time.perf_counter()
    _write_synced(tmp / META, json.dumps(meta, indent=2))
    hashes = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file() and p.name not in (HASHES, MARKER):
            hashes[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    hashes_text = json.dumps(hashes, indent=1, sort_keys=True)
    _write_synced(tmp / HASHES, hashes_text)
    marker = {"step": meta.get("step"), "hashes_sha256": hashlib.sha256(hashes_text.encode()).hexdigest()}
    _write_synced(tmp / MARKER, json.dumps(marker))
    _fsync_dir(tmp)
    aside = None
    if final.exists():  # the same step saved again (a run resumed from an older checkpoint)
        aside = final.with_name(f"{final.name}.replaced-{os.getpid()}")
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return CommitInfo(final, checkpoint_bytes_on_disk(final), len(hashes) + 2, time.perf_counter() - t0)


def verify_checkpoint(path: str | os.PathLike, full: bool = True,
                      check_metadata: MetadataCheck | None = None) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else the reason, in one line.

    ``full=False`` checks the structure only (marker, hashes file, every file present with its
    recorded size, a ``.metadata`` listed, and ``check_metadata`` if given): cheap, used right after
    a save. ``full=True`` also recomputes every SHA-256: used before loading."""
    path = Path(path)
    if not path.is_dir():
        return "no such checkpoint directory"
    if not (path / MARKER).exists():
        return f"no {MARKER} marker: the write never completed"
    try:
        marker = json.loads((path / MARKER).read_text())
        hashes_text = (path / HASHES).read_text()
        hashes = json.loads(hashes_text)
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} or {HASHES}: {e}"
    if hashlib.sha256(hashes_text.encode()).hexdigest() != marker.get("hashes_sha256"):
        return f"{HASHES} does not match the hash recorded in {MARKER}"
    for name, rec in hashes.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != rec["bytes"]:
            return f"{name} is truncated or overwritten: {size} bytes, {rec['bytes']} recorded"
    if ".metadata" not in hashes:
        return "no DCP .metadata file"
    if full:  # the hashes before any file is parsed: a corrupted file is reported as corrupted
        for name, rec in hashes.items():
            if sha256_file(path / name) != rec["sha256"]:
                return f"{name} is corrupted: its SHA-256 differs from the one recorded at commit"
    if check_metadata is not None:
        reason = check_metadata(path, hashes)
        if reason is not None:
            return reason
    return None


def checkpoint_bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def reject(path: Path) -> Path:
    """Move a bad checkpoint out of the way (kept for inspection as ``step-<n>.rejected``)."""
    target = path.with_name(path.name + ".rejected")
    i = 1
    while target.exists():
        target = path.with_name(f"{path.name}.rejected-{i}")
        i += 1
    os.rename(path, target)
    return target


def find_latest_good(run_dir: str | os.PathLike, on_reject: Callable[[int, Path, str, Path | None], None] | None = None,
                     move_rejected: bool = True, check_metadata: MetadataCheck | None = None) -> Path | None:
    """The newest committed checkpoint that passes :func:`verify_checkpoint`, or None.

    Each bad one is reported through ``on_reject(step, path, reason, fallback)`` and (by default)
    renamed ``.rejected``, so that it is never considered again and its step can be saved anew."""
    bad: list[tuple[int, Path, str]] = []
    good = None
    for step, path in reversed(list_checkpoints(run_dir)):
        reason = verify_checkpoint(path, full=True, check_metadata=check_metadata)
        if reason is None:
            good = path
            break
        bad.append((step, path, reason))
    for step, path, reason in bad:
        if on_reject is not None:
            on_reject(step, path, reason, good)
        if move_rejected:
            reject(path)
    return good


def apply_retention(run_dir: str | os.PathLike, keep: int) -> list[tuple[int, Path, int]]:
    """Delete all but the newest ``keep`` committed checkpoints; return ``(step, path, bytes)`` deleted.

    Called only after a commit, so the newest is always a complete one."""
    deleted = []
    for step, path in list_checkpoints(run_dir)[:-keep]:
        size = checkpoint_bytes_on_disk(path)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append((step, path, size))
    return deleted


def discard_incomplete(run_dir: str | os.PathLike) -> list[Path]:
    """Remove ``step-<n>.tmp`` directories left by a save that never committed (rank 0, at start,
    when no save can be in flight)."""
    root = checkpoints_dir(run_dir)
    out = []
    if root.is_dir():
        for p in root.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
            out.append(p)
    return out
