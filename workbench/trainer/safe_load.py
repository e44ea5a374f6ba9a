"""Reading a checkpoint without running code from it.

Whoever can write a run directory must not be able to make a resume run their code, and a file's
hash (``hashes.json``) does not help: whoever can replace the file can rewrite its hash too. So
nothing from a checkpoint is unpickled with the full pickle machinery, which calls whatever a
file names. Three kinds of file are read, each through the narrowest loader that reads it:

* tensors and plain data (this trainer's ``rng-<rank>.pt``, and the non-tensor entries of the DCP
  state dict: the step, the data position, the optimizer's hyper-parameters): ``torch.load(...,
  weights_only=True)``, which builds tensors, numbers, strings, lists, tuples and dicts only.
  DCP's own :class:`DefaultLoadPlanner` loads those entries with ``weights_only=False``:
  :class:`SafeLoadPlanner` is the same planner with the narrow loader;
* DCP's ``.metadata``, a plain pickle of DCP's own dataclasses (not a ``torch.save`` file, so
  ``weights_only`` does not apply): :class:`SafeReader` reads it with an unpickler that may build
  only the classes listed in :data:`METADATA_GLOBALS` (the standard library's "restricting
  globals" recipe); any other name in the file is refused, and the checkpoint with it;
* the shards themselves: DCP already reads them with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle  # only for the restricted Unpickler below: find_class refuses every unlisted name
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

# Everything a DCP .metadata pickle names (torch 2.4-2.13): DCP's metadata dataclasses, the
# filesystem's storage records, and how torch pickles sizes, dtypes, layouts and paths. Each is a
# plain constructor: building one runs no code chosen by the file.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),  # and every torch.dtype (below)
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file names something its loader may not build (one line: the file and the name)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointFile(f"names {module}.{name}, which a DCP .metadata file never holds")


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata``, built from the listed classes only (:class:`UnsafeCheckpointFile` else)."""
    with open(path, "rb") as f:
        md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointFile(f"holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's filesystem reader with :func:`read_metadata_file` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # raises on anything but plain data
        # Hand the vetted value to the parent (which places it in the state dict) re-serialised:
        # plain data saved and loaded again is the same value, and no private helper is needed.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


def load_plain(path: str | os.PathLike) -> Any:
    """A ``torch.save`` file of tensors and plain data, loaded on the CPU with ``weights_only``."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_problem(e: BaseException) -> str:
    """Why a file did not load, in one line. torch's weights_only message spans many lines and
    suggests allowlisting the refused name "if you trust" the file: only that name matters here."""
    refused = _REFUSED_GLOBAL.search(str(e))
    if refused:
        return f"{type(e).__name__}: it names {refused.group(1)}, which is not plain data"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


_REFUSED_GLOBAL = re.compile(r"Unsupported (?:global|operand)[^:]*: (?:GLOBAL )?(\S+)")
