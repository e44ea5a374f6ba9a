"""The lineage of a run: every input needed to reproduce it, written before the first step.

``lineage.json`` in the run directory (DESIGN.md) holds, each as plain JSON:

* ``data``: the source (:mod:`workbench.spec.data`), the SHA-256 and size of a data file (or of the
  built-in text as this Python carries it; a synthetic stream is fixed by its seed and length), the
  tokenizer's identity and the vocabulary the model reads it with;
* ``model``: its source (a preset name, or the Hugging Face config's path and SHA-256, or "custom")
  and the SHA-256 of the spec itself, so that two "custom" models compare by content;
* ``code``: the git revision of the source tree, whether it had uncommitted changes and the
  SHA-256 of ``git diff HEAD`` (tracked files) when it had;
* ``packages``: the versions that can change numbers: Python, torch, numpy, scipy, workbench, and
  CUDA, cuDNN and NCCL where torch has them (gloo is torch's own);
* ``cluster`` and ``prediction``: the cluster's name and SHA-256 (a calibration is part of it: its
  source and hash are named too) and the framework profile the prediction used, with its hash;
* ``determinism``: the seed, the deterministic flag and the settings that fix the order of the data.

:func:`diff_lineage` lists what differs between two lineages, leaf by leaf, so a comparison of
two runs says first whether they are comparable at all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from workbench.spec.config import RunConfig
from workbench.spec.data import BYTE_VOCAB, SYNTHETIC_TOKENS, TOKENIZERS, pydoc_corpus
from workbench.spec.model import ModelSpec

LINEAGE_FILE = "lineage.json"
HASH_CHUNK = 1 << 20
# Packages whose version can change a run's numbers (kernels, reductions, the fitter's solver).
RESULT_PACKAGES = ("torch", "numpy", "scipy", "workbench")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_json(value: Any) -> str:
    """The hash of a JSON value in canonical form (sorted keys, no spaces)."""
    return sha256_text(json.dumps(value, sort_keys=True, separators=(",", ":")))


def sha256_file(path: str | os.PathLike) -> tuple[str, int] | None:
    """(SHA-256, bytes) of a file, read in 1 MiB chunks; None where it cannot be read."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError:
        return None
    return digest.hexdigest(), size


def data_lineage(config: RunConfig) -> dict[str, Any]:
    train = config.train
    out: dict[str, Any] = {"dataset": train.dataset, "tokenizer": TOKENIZERS[train.dataset],
                           "vocab_size": config.model.vocab_size}
    if train.dataset in ("text", "bin"):
        path = Path(train.data_path or "")
        out["path"] = str(path.resolve())
        found = sha256_file(path)
        out["sha256"], out["bytes"] = found if found else (None, None)
    elif train.dataset == "pydoc":
        text = pydoc_corpus()
        out.update(sha256=sha256_text(text), bytes=len(text.encode("utf-8")), python=platform.python_version())
    else:  # synthetic: the seed and the length fix every token
        out.update(tokens=SYNTHETIC_TOKENS, seed=train.seed, vocab=min(config.model.vocab_size, BYTE_VOCAB))
    return out


def model_lineage(model: ModelSpec, hf_config: str | os.PathLike | None = None) -> dict[str, Any]:
    """Where the model came from, and the hash of what it is."""
    out: dict[str, Any] = {"name": model.name, "spec_sha256": sha256_json(model.to_dict())}
    if hf_config is not None:
        found = sha256_file(hf_config)
        out.update(source="hf_config", path=str(Path(hf_config).resolve()), sha256=found[0] if found else None)
    elif model.name in ModelSpec.presets() and ModelSpec.preset(model.name) == model:
        out["source"] = f"preset {model.name}"
    else:
        out["source"] = "custom"
    return out


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def code_lineage(source: str | os.PathLike | None = None) -> dict[str, Any]:
    """The git state of the tree that holds ``source`` (this package's by default): revision,
    uncommitted changes of tracked files (and the hash of their diff), untracked files counted."""
    here = Path(source) if source else Path(__file__).resolve().parent
    revision = _git(["rev-parse", "HEAD"], here)
    if revision is None:
        return {"git_revision": None, "dirty": None}
    status = _git(["status", "--porcelain", "--untracked-files=normal"], here) or ""
    tracked = [line for line in status.splitlines() if line and not line.startswith("??")]
    out: dict[str, Any] = {"git_revision": revision.strip(), "dirty": bool(tracked),
                           "untracked_files": sum(1 for line in status.splitlines() if line.startswith("??"))}
    if tracked:
        out["diff_sha256"] = sha256_text(_git(["diff", "HEAD"], here) or "")
    return out


def package_lineage() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in RESULT_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch  # optional here: a launcher without torch still writes a lineage
    except ImportError:
        return out
    out["cuda"] = torch.version.cuda
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    out["gloo"] = f"torch {torch.__version__}" if torch.distributed.is_gloo_available() else None
    return out


def build_lineage(config: RunConfig, *, hf_config: str | os.PathLike | None = None) -> dict[str, Any]:
    cluster = config.cluster.to_dict()
    calibration = cluster.get("calibration")
    profile = config.train.profile
    return {
        "data": data_lineage(config),
        "model": model_lineage(config.model, hf_config),
        "code": code_lineage(),
        "packages": package_lineage(),
        "cluster": {"name": config.cluster.name, "sha256": sha256_json(cluster),
                    "calibration": ({"source": calibration.get("source", ""), "sha256": sha256_json(calibration)}
                                    if calibration else None)},
        "prediction": {"framework": profile.name, "framework_sha256": sha256_json(profile.to_dict())},
        "determinism": {"seed": config.train.seed, "deterministic": config.train.deterministic},
    }


def write_lineage(run_dir: str | os.PathLike, lineage: Mapping[str, Any]) -> None:
    (Path(run_dir) / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True))


def read_lineage(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run's lineage, or None where it has none (a run from before lineages) or it is unreadable."""
    try:
        data = json.loads((Path(run_dir) / LINEAGE_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class LineageDifference:
    key: str  # "data.sha256", "code.dirty", ...
    a: Any
    b: Any

    def describe(self) -> str:
        return f"{self.key}: {_short(self.a)} -> {_short(self.b)}"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:12] + "…" if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k in sorted(value):
            yield from _leaves(value[k], f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def diff_lineage(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[LineageDifference]:
    """Every leaf that differs between two lineages (a leaf only one of them has reads None in the
    other), in key order."""
    left, right = dict(_leaves(a or {})), dict(_leaves(b or {}))
    return [LineageDifference(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right))
            if left.get(k) != right.get(k)]
