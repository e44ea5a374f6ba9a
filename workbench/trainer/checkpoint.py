"""Checkpoints you can trust: save, commit, verify, resume, reshard (torch.distributed.checkpoint).

What a checkpoint holds (one DCP state dict, every rank writing its own shards):

* ``model``, ``optim``: from ``get_state_dict`` (``torch.distributed.checkpoint.state_dict``),
  keyed by the *unsplit* model's parameter names, with the optimizer state flattened per
  parameter. FSDP2/TP shards are DTensors, so DCP records which slice each rank wrote and any
  other layout can read its own slices back: that is resharding (dp_shard=2 x tp=2 -> dp_shard=4;
  pp=2 -> dp_shard=2).
* ``train``: the step, the data position (``BatchLoader.state_dict``) and the learning-rate
  schedule's parameters (the trainer computes the LR from the step, so step + parameters *is*
  the scheduler state).
* beside the DCP files, ``rng-<r>.pt`` (each rank): its torch (CPU, and CUDA per device when
  present), Python and NumPy generator states as tensors and numbers (:func:`capture_rng`), written
  with ``torch.save`` and read with ``weights_only=True``;
* ``meta.json`` (rank 0): the RunConfig that produced it, the layout, the world size, the torch
  version.

Nothing in a checkpoint can run code when loaded (whoever can write a run directory could otherwise
make a resume run theirs, hashes notwithstanding): no full unpickling anywhere. The RNG files and DCP's non-tensor entries load
with ``weights_only=True``, DCP's ``.metadata`` with an unpickler restricted to DCP's own classes
(:mod:`workbench.trainer.safe_load`); a checkpoint holding anything else is rejected like a
corrupted one.

Layout on disk (DESIGN.md, the run directory; listed, committed and verified without torch by
:mod:`workbench.rundir.checkpoints`)::

    checkpoints/step-<n>.tmp/     while being written (never loaded; discarded at the next start)
    checkpoints/step-<n>/         committed: __<rank>_<i>.distcp, .metadata, rng-<rank>.pt, meta.json,
                                  hashes.json (sha256 and size of every file), COMMITTED (last)

Integrity. A checkpoint is visible only when complete: every rank writes into ``step-<n>.tmp``;
DCP's finish step (rank 0 writes ``.metadata`` after gathering every rank's write results) means
that when rank 0's save returns every file is on disk; rank 0 then writes ``meta.json``, hashes
every file into ``hashes.json``, writes the ``COMMITTED`` marker (which records the hash of
``hashes.json``), fsyncs, and renames the directory to ``step-<n>`` (atomic on POSIX). Loading
checks every hash, that DCP's ``.metadata`` loads and that every RNG file is plain generator state
(:func:`verify_checkpoint`); a truncated, corrupted or tampered checkpoint is reported in one line
(event ``checkpoint_rejected`` and stderr), renamed ``step-<n>.rejected``, and the previous good
one is used. Retention keeps the last ``checkpoint_keep`` committed checkpoints, deleting older ones only
after a newer one is committed.

A save that cannot be written (read-only or full disk): one line per rank (stderr, and a
``checkpoint`` event with phase "failed" and its ``reason``: the path and the cause), the partial
``step-<n>.tmp`` removed, and training continues from the same state (the last committed checkpoint
stays the one to resume from; the next interval tries again). A failed *final* save ends the run
with an error on every rank (:class:`CheckpointWriteError`: the work since the last checkpoint
would otherwise be lost without a word), run_end "error" at the last step.

Asynchronous saves (``checkpoint_async``): ``dcp.async_save`` copies the state to CPU memory
(``staged``), then writes it from a background thread over a dedicated gloo process group (so that
its collectives never interleave with training's on the default group); rank 0 commits from the
same background thread when the write is done. At most one save is in flight: the next one (and
the end of the run) waits for it. Events are emitted from the training thread (``poll``), because
the event writer is not thread-safe.

State that cannot be resharded, and what is done instead (also in the ``resume`` event's notes):

* data position: kept as the global batch index. ``data.py`` defines global batch ``s`` as windows
  ``s*G .. s*G+G-1`` of one seeded order, whatever the layout, and data-parallel rank ``r`` of
  ``D`` reads slice ``r`` of it; so another data-parallel degree reads the same global batches from
  the same index on (exact continuation). Another ``global_batch_size``, ``seq_len`` or seed would
  be another stream: refused with a ConfigError.
* RNG states: per rank, so they are restored only when the world size and the layout are the same;
  otherwise each rank is re-seeded from (seed, step, rank). The bundled trainer draws no random
  numbers after initialisation (its dropout masks are hashed from the seed, the step and each
  element's indices, not drawn), so this does not change the losses.
* schedule: the LR follows the *current* config from the restored step; a changed schedule is noted.

Recovery drill: under ``torchrun --max-restarts N`` a lost rank makes torchrun restart every rank;
the trainer sees ``TORCHELASTIC_RESTART_COUNT > 0`` and resumes from the latest good checkpoint.
:func:`note_restart` writes what the events of the previous attempt say (``fault``: killed,
error or interrupted, and the last step logged) and a ``restart`` event. The drill's fault
injection (``WORKBENCH_KILL_AT="<rank>:<step>"``, first attempt only) is :mod:`workbench.trainer.faults`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from workbench.spec.config import RunConfig
from workbench.spec.errors import ConfigError
from workbench.rundir import checkpoints as on_disk
from workbench.rundir.checkpoints import (HASHES, META, CommitInfo, apply_retention, checkpoint_bytes_on_disk,
                                          checkpoints_dir, commit_checkpoint, discard_incomplete, step_of)
from workbench.rundir.events import (Checkpoint, CheckpointRejected, EventWriter, Fault, Restart, Resume,
                                read_rank_events)
from workbench.trainer.console import say
from workbench.trainer.safe_load import SafeLoadPlanner, SafeReader, load_plain, load_problem, read_metadata_file

# One entry per parameter in the optimizer state (not per param group): param groups differ per
# pipeline stage, per-parameter entries do not.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# World size 1 saves and loads without a process group, by design: DCP need not say so every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------- the run directory
# Listing, committing, verifying and choosing checkpoints need no torch: workbench.rundir.checkpoints.
# Reading the torch files (DCP's .metadata, the RNG files) does: the check added here. Both are read
# without running code from them (safe_load.py), after their hashes were checked.


def dcp_metadata_problem(path: Path, hashes: dict[str, Any]) -> str | None:
    """None if DCP's ``.metadata`` loads (listed classes only) and every file it refers to is in
    ``hashes.json``."""
    try:
        md = read_metadata_file(path / ".metadata")
    except Exception as e:  # noqa: BLE001 - any failure to parse is a bad checkpoint
        return f".metadata does not load: {load_problem(e)}"
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None and rel not in hashes:
            return f".metadata refers to {rel}, which is not in {HASHES}"
    return None


def rng_files_problem(path: Path, hashes: dict[str, Any]) -> str | None:
    """None if every ``rng-<rank>.pt`` listed loads with ``weights_only=True`` as generator states."""
    for name in sorted(n for n in hashes if _RNG_NAME.match(n)):
        try:
            load_rng(path / name)
        except Exception as e:  # noqa: BLE001 - a file that is not plain generator state is a bad checkpoint
            return f"{name} is not plain generator state (loaded with weights_only=True): {load_problem(e)}"
    return None


def torch_files_problem(path: Path, hashes: dict[str, Any]) -> str | None:
    return dcp_metadata_problem(path, hashes) or rng_files_problem(path, hashes)


def verify_checkpoint(path: str | os.PathLike, full: bool = True) -> str | None:
    """:func:`workbench.rundir.checkpoints.verify_checkpoint` with the torch files checked too (DCP's
    ``.metadata`` loads and every file it refers to is listed; every RNG file loads as plain
    generator state): None if good, else the reason in one line."""
    return on_disk.verify_checkpoint(path, full, check_metadata=torch_files_problem)


def find_latest_good(run_dir: str | os.PathLike, on_reject: Callable[[int, Path, str, Path | None], None] | None = None,
                     move_rejected: bool = True) -> Path | None:
    """:func:`workbench.rundir.checkpoints.find_latest_good`, verifying with :func:`verify_checkpoint`."""
    return on_disk.find_latest_good(run_dir, on_reject, move_rejected, check_metadata=torch_files_problem)


# --------------------------------------------------------------------------- the training state


class StagesView(nn.Module):
    """This rank's pipeline stage modules seen as one module with the unsplit model's parameter
    names (``layers.<global index>``, ``tok_embeddings``, ``norm``, ``output``).

    ``get_state_dict`` takes one module and one optimizer; the optimizer spans every local stage.
    Registering the stages' own submodules here (not copies) gives state-dict keys that do not
    depend on the stage split, which is what lets DCP reshard pp=2 into pp=1."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for m in modules:
            for name, layer in m.layers.items():  # type: ignore[union-attr]
                self.layers[name] = layer
        for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
            owner = next((getattr(m, name) for m in modules if getattr(m, name, None) is not None), None)
            if owner is not None:
                setattr(self, name, owner)


def model_view(modules: list[nn.Module]) -> nn.Module:
    return modules[0] if len(modules) == 1 else StagesView(modules)


def _local_bytes(tree: Any) -> int:
    """Bytes this rank holds in a state dict (DTensors count their local shard)."""
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    if isinstance(tree, DTensor):
        t = tree.to_local()
        return t.numel() * t.element_size()
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return 0


RNG_FILE = "rng-{rank}.pt"
_RNG_NAME = re.compile(r"^rng-(\d+)\.pt$")


def rng_file(path: Path, rank: int) -> Path:
    return path / RNG_FILE.format(rank=rank)


def capture_rng() -> dict[str, Any]:
    """This process's generator states as tensors and numbers (``torch.save``-able and loadable
    with ``weights_only=True``; no pickled objects): torch CPU (and CUDA, per device), Python's
    ``random`` (version, 625 words, gauss_next) and NumPy's legacy global generator."""
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python_version": int(version),
                             "python_state": torch.tensor(words, dtype=torch.int64), "python_gauss_next": gauss_next}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state.update(numpy_name=str(name), numpy_keys=torch.from_numpy(keys.astype(np.int64)), numpy_pos=int(pos),
                 numpy_has_gauss=int(has_gauss), numpy_cached_gaussian=float(cached))
    return state


def decode_rng(state: Any) -> dict[str, Any]:
    """The generator states of a loaded ``rng-<rank>.pt``, checked and ready to set: ``torch``
    (uint8 tensor), ``cuda`` (list or None), ``python`` (the ``random.setstate`` tuple), ``numpy``
    (the ``set_state`` tuple, or None). Raises ValueError, in one line, on anything else."""
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a dict of generator states")

    def tensor(key: str, dtype: torch.dtype, n: int | None = None) -> torch.Tensor:
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or (n is not None and t.numel() != n):
            raise ValueError(f"{key} is not a 1-d {dtype} tensor" + (f" of {n} values" if n else ""))
        return t

    gauss = state.get("python_gauss_next")
    if gauss is not None and not isinstance(gauss, float):
        raise ValueError("python_gauss_next is neither None nor a float")
    words = tensor("python_state", torch.int64, 625)
    if int(words.min()) < 0 or int(words[:624].max()) >= 2**32 or int(words[624]) > 624:
        raise ValueError("python_state holds values outside a Mersenne Twister state")
    out: dict[str, Any] = {
        "torch": tensor("torch", torch.uint8),
        "python": (int(state.get("python_version", 3)), tuple(words.tolist()), gauss),
        "cuda": None, "numpy": None,
    }
    cuda = state.get("cuda")
    if cuda is not None:
        if not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
            raise ValueError("cuda is not a list of uint8 tensors")
        out["cuda"] = cuda
    if "numpy_keys" in state:
        keys = tensor("numpy_keys", torch.int64, 624)
        out["numpy"] = (str(state.get("numpy_name", "MT19937")), keys, int(state.get("numpy_pos", 0)),
                        int(state.get("numpy_has_gauss", 0)), float(state.get("numpy_cached_gaussian", 0.0)))
    return out


def save_rng(path: Path, rank: int) -> Path:
    target = rng_file(path, rank)
    torch.save(capture_rng(), target)
    return target


def load_rng(file: Path) -> dict[str, Any]:
    """A ``rng-<rank>.pt`` loaded with ``weights_only=True`` and checked (:func:`decode_rng`)."""
    return decode_rng(load_plain(file))


def restore_rng(states: dict[str, Any]) -> None:
    """Set this process's generators from :func:`load_rng`'s result."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    cuda = states["cuda"]
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if states["numpy"] is not None:
        import numpy as np

        name, keys, *rest = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Fresh, reproducible generator states when the saved ones do not map onto this job's ranks."""
    s = (seed * 1_000_003 + step * 7919 + rank) % (2**31)
    torch.manual_seed(s)
    random.seed(s)
    try:
        import numpy as np

        np.random.seed(s)
    except ImportError:
        pass


def schedule_state(config: RunConfig) -> dict[str, Any]:
    t = config.train
    return {"lr": t.lr, "warmup_steps": t.warmup_steps, "steps": t.steps, "min_lr_ratio": t.min_lr_ratio}


def training_state(trainer: Any) -> dict[str, Any]:
    """The state dict DCP saves (see the module docstring); tensors are the live ones (DCP copies
    them while writing; ``async_save`` copies them to CPU before returning)."""
    model_sd, optim_sd = get_state_dict(model_view(trainer.modules), trainer.optimizer, options=OPTIONS)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": trainer.step, "data": trainer.loader.state_dict(), "schedule": schedule_state(trainer.config)},
    }  # the generator states go beside, in rng-<rank>.pt (Checkpointer.save)


def checkpoint_meta(config: RunConfig, step: int, mode: str) -> dict[str, Any]:
    return {
        "step": step,
        "world_size": config.world_size,
        "plan": config.plan.describe(),
        "mesh": dict(config.plan.mesh_dims()),
        "config": config.to_dict(),
        "mode": mode,
        "torch": torch.__version__,
        "created": time.time(),
    }


# --------------------------------------------------------------------------- save and load


def _world() -> int:
    """Ranks taking part (1 outside an initialised job: DCP then saves and loads in one process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class _Pending:
    """An asynchronous save in flight."""

    step: int
    tmp: Path
    final: Path
    future: Future
    t0: float
    local_bytes: int
    committed: threading.Event = field(default_factory=threading.Event)
    commit: CommitInfo | None = None
    error: BaseException | None = None
    written_s: float = 0.0


class CheckpointWriteError(RuntimeError):
    """The final checkpoint of a run could not be written: the run ends with an error (one line:
    the checkpoint, the path and the cause)."""


def raise_if_stop(e: BaseException) -> None:
    """DCP catches every BaseException of every rank, a SIGTERM's KeyboardInterrupt included, and
    reports it as a CheckpointException: a stop inside a save must stay a stop, not become a
    failed write that training carries on after."""
    failures = getattr(e, "failures", None) or {}
    for wrapped in failures.values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise KeyboardInterrupt(f"stopped during a checkpoint save ({type(inner).__name__}: {inner})") from None


def one_line_cause(e: BaseException) -> str:
    """Why a write failed, in one line. DCP reports a failure on any rank to every rank as a
    CheckpointException whose text is every rank's traceback: its first failure is the cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda kv: kv[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {one_line_cause(inner)}"
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


class Checkpointer:
    """Saves and loads one rank's training state in ``<run_dir>/checkpoints`` (every rank makes one,
    at the same point: the constructor may create a process group).

    ``after_step()`` after every optimizer step (saves every ``checkpoint_every`` steps, emits the
    events of a finished asynchronous save), ``finish()`` at the end (final save, waits for the last
    write), ``resume()`` before the first step.

    A save that cannot be written (a read-only or full disk, ``checkpoints`` not a directory) is
    reported in one line per rank (stderr, and a ``checkpoint`` event with phase "failed" and a
    ``reason``), its ``step-<n>.tmp`` is removed, and training continues: the previous committed
    checkpoint stays the one to resume from, and the next interval tries again. The *final* save is
    different: a run whose end state is not saved has lost the work since the last checkpoint, so
    ``finish()`` raises :class:`CheckpointWriteError` on every rank (the run ends with an error).
    Every rank reaches the same verdict: the ranks agree (one all-reduce) after the part each rank
    writes alone, DCP reports a failed write to every rank, and ``finish()`` agrees again."""

    def __init__(self, run_dir: str | os.PathLike, trainer: Any, writer: EventWriter | None = None,
                 faults: Any = None):
        t = trainer.config.train
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(run_dir)
        self.trainer = trainer
        self.writer = writer
        self.faults = faults  # faults.Faults: the drills' injected write failures (None: none)
        self.rank = trainer.rank
        self.every = t.checkpoint_every
        self.keep = t.checkpoint_keep
        self.mode = "async" if t.checkpoint_async else "sync"
        self.last_saved: int | None = None
        self.failed: dict[int, str] = {}  # step -> why its save failed (this rank's view)
        self._finishing = False
        self._pending: _Pending | None = None
        self._pg = None
        if self.every and t.checkpoint_async and dist.is_initialized():
            # Background writes run collectives (plan, finish): give them their own group.
            self._pg = dist.new_group(backend="gloo")

    # ----------------------------------------------------------------- events
    def _emit(self, event: Any) -> None:
        if self.writer is not None:
            self.writer.emit(event)

    def _phase(self, phase: str, step: int, path: Path, nbytes: int = 0, duration_s: float = 0.0) -> None:
        self._emit(Checkpoint(phase=phase, step=step, path=str(path), bytes=int(nbytes),
                              duration_s=float(duration_s), mode=self.mode))

    # ----------------------------------------------------------------- saving
    def after_step(self) -> None:
        self.poll()
        if self.every and self.trainer.step % self.every == 0:
            self.save()

    def finish(self) -> None:
        """Save the final state (unless just saved) and wait until every save is committed; raise
        :class:`CheckpointWriteError` on every rank when that final save failed on any."""
        if not self.every:
            return
        self._finishing = True
        step = self.trainer.step
        if self.last_saved != step:
            self.save()
        self.wait()
        failed = self._failed_ranks(step in self.failed)
        if failed:
            why = self.failed.get(step) or f"rank {failed[0]} could not write its part (its own error says why)"
            raise CheckpointWriteError(f"the final checkpoint step-{step} was not saved: {why}")

    def save(self) -> None:
        """Checkpoint the state after ``trainer.step`` steps into ``checkpoints/step-<step>``; a
        failure is reported and the ``.tmp`` removed (see the class docstring)."""
        self.wait()  # at most one save in flight
        step = self.trainer.step
        tmp, final = self.root / f"step-{step}.tmp", self.root / f"step-{step}"
        self._phase("started", step, tmp)
        t0 = time.perf_counter()
        self.last_saved = step
        # This rank's own file first (its generator states), then agree: a rank that could not
        # write must not leave the others waiting in DCP's collectives.
        problem = None
        try:
            self._write_rng(tmp, step)
        except OSError as e:
            problem = f"{tmp}: {one_line_cause(e)}"
        failed = self._failed_ranks(problem is not None)
        if failed:
            self._failed(step, tmp, problem or f"{tmp}: rank {failed[0]} could not write its files")
            return
        state = training_state(self.trainer)
        nbytes = _local_bytes(state)
        if self.mode == "async":
            try:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg, no_dist=_world() == 1)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported in one line
                raise_if_stop(e)
                self._failed(step, tmp, f"{tmp}: {one_line_cause(e)}")
                return
            self._phase("staged", step, tmp, nbytes, time.perf_counter() - t0)  # copied to CPU
            pending = _Pending(step, tmp, final, future, t0, nbytes)
            meta = checkpoint_meta(self.trainer.config, step, self.mode)
            future.add_done_callback(lambda f: self._finish_write(pending, meta))
            self._pending = pending
            return
        self._phase("staged", step, tmp, nbytes, time.perf_counter() - t0)
        try:
            dcp.save(state, checkpoint_id=str(tmp), no_dist=_world() == 1)  # a failure reaches every rank
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported in one line
            raise_if_stop(e)
            self._failed(step, tmp, f"{tmp}: {one_line_cause(e)}")
            return
        self._phase("written", step, tmp, nbytes, time.perf_counter() - t0)
        if self.rank == 0:
            try:
                info = commit_checkpoint(tmp, final, checkpoint_meta(self.trainer.config, step, self.mode))
            except OSError as e:
                self._failed(step, tmp, f"commit of {tmp}: {one_line_cause(e)}")
                return
            self._after_commit(step, info)

    def _write_rng(self, tmp: Path, step: int) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        target = rng_file(tmp, self.rank)
        if self.faults is not None:
            self.faults.before_checkpoint_write(self.rank, step, target)
        save_rng(tmp, self.rank)

    def _failed_ranks(self, failed: bool) -> list[int]:
        """The ranks for which ``failed`` is true (every rank calls this at the same point)."""
        if not (dist.is_initialized() and _world() > 1):
            return [self.rank] if failed else []
        flags = torch.zeros(_world(), dtype=torch.int32, device=self.trainer.device)
        flags[dist.get_rank()] = int(failed)
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _failed(self, step: int, tmp: Path, reason: str) -> None:
        """A save that will not complete: remove its ``.tmp``, say why in one line (the stderr
        line only when training goes on: a final save's failure is the run's error line)."""
        shutil.rmtree(tmp, ignore_errors=True)
        self.failed[step] = reason
        final = (self._finishing and step == self.trainer.step) or step >= self.trainer.config.train.steps_to_run
        if not final:
            say(f"[workbench] rank {self.rank}: checkpoint step-{step} not saved: {reason}; "
                f"removed {tmp.name}, training continues")
        if self.writer is not None:
            self.writer.emit(kind="checkpoint", phase="failed", step=step, path=str(tmp), bytes=0,
                             duration_s=0.0, mode=self.mode, reason=reason, final=final)

    def _finish_write(self, pending: _Pending, meta: dict[str, Any]) -> None:
        """Background thread, when an async write is done: rank 0 commits. No events here."""
        try:
            pending.future.result()
            pending.written_s = time.perf_counter() - pending.t0
            if self.rank == 0:
                pending.commit = commit_checkpoint(pending.tmp, pending.final, meta)
        except BaseException as e:  # noqa: BLE001 - reported on the training thread by poll()
            pending.error = e
        finally:
            pending.committed.set()

    def poll(self) -> None:
        """Emit the events of a finished asynchronous save (non-blocking)."""
        p = self._pending
        if p is not None and p.committed.is_set():
            self._pending = None
            if p.error is not None:
                raise_if_stop(p.error)
                self._failed(p.step, p.tmp, f"{p.tmp}: {one_line_cause(p.error)}")
                return
            self._phase("written", p.step, p.tmp, p.local_bytes, p.written_s)
            if p.commit is not None:
                self._after_commit(p.step, p.commit)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        if self._pending is not None:
            self._pending.committed.wait()
            self.poll()

    def _after_commit(self, step: int, info: CommitInfo) -> None:
        self._phase("committed", step, info.path, info.bytes, info.duration_s)
        t0 = time.perf_counter()
        reason = verify_checkpoint(info.path, full=False)
        if reason is not None:
            raise RuntimeError(f"checkpoint {info.path} failed its check right after commit: {reason}")
        self._phase("verified", step, info.path, info.bytes, time.perf_counter() - t0)
        for old_step, path, size in apply_retention(self.run_dir, self.keep):
            self._phase("deleted", old_step, path, size)

    # ----------------------------------------------------------------- loading
    def resume(self, path: str | os.PathLike | None = None) -> int:
        """Load ``path``, or the latest good checkpoint of the run directory; return the step to
        continue from (0 when there is none). Rank 0 chooses (verifying hashes, reporting and
        setting aside bad ones); every rank loads the same one."""
        chosen: str | None = None
        if self.rank == 0:
            for p in discard_incomplete(self.run_dir):
                self._phase("discarded", step_of(p), p)
            t0 = time.perf_counter()
            if path is not None:  # asked for by name: no fallback
                reason = verify_checkpoint(path, full=True)
                if reason is not None:
                    raise RuntimeError(f"checkpoint {path} is not good: {reason}")
                good: Path | None = Path(path)
            else:
                good = find_latest_good(self.run_dir, self._report_reject)
            if good is not None:
                self._phase("verified", step_of(good), good, checkpoint_bytes_on_disk(good), time.perf_counter() - t0)
            chosen = str(good) if good is not None else None
        if dist.is_initialized() and _world() > 1:
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        if chosen is None:
            self._emit(Resume(step=0, path=None, notes=["no good checkpoint: starting at step 0"]))
            return 0
        return self.load(Path(chosen))

    def _report_reject(self, step: int, path: Path, reason: str, fallback: Path | None) -> None:
        then = f"falling back to {fallback.name}" if fallback is not None else "no good checkpoint left, starting at step 0"
        say(f"[workbench] checkpoint {path} rejected: {reason}; {then}")
        self._emit(CheckpointRejected(step=step, path=str(path), reason=reason,
                                      fallback=str(fallback) if fallback is not None else None))

    def load(self, path: Path) -> int:
        """Load a verified checkpoint into this rank's trainer (any layout: DCP reshards)."""
        trainer, config = self.trainer, self.trainer.config
        t0 = time.perf_counter()
        meta = json.loads((path / META).read_text())
        saved = RunConfig.from_dict(meta["config"])
        check_compatible(saved, config)
        same_layout = meta["world_size"] == config.world_size and saved.plan == config.plan
        view = model_view(trainer.modules)
        model_sd, optim_sd = get_state_dict(view, trainer.optimizer, options=OPTIONS)
        train_sd = {"step": 0, "data": trainer.loader.state_dict(), "schedule": schedule_state(saved)}
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "train": train_sd}
        try:
            # SafeReader, SafeLoadPlanner: nothing in the files is unpickled (safe_load.py)
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=_world() == 1)
            rng = load_rng(rng_file(path, self.rank)) if same_layout and rng_file(path, self.rank).exists() else None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line, not every rank's traceback
            raise_if_stop(e)
            raise RuntimeError(f"checkpoint {path} does not load: {one_line_cause(e)}") from None
        set_state_dict(view, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=OPTIONS)
        step = int(state["train"]["step"])
        trainer.step = step
        trainer.loader.load_state_dict(state["train"]["data"])
        notes = [f"model and optimizer: loaded from {meta['plan']} (world {meta['world_size']})"
                 + ("" if same_layout else f", resharded by DCP into {config.plan.describe()} (world {config.world_size})"),
                 f"data: resumed at global batch {trainer.loader.step}; the batch order does not depend on the layout"
                 + ("" if saved.plan.dp == config.plan.dp else f", so dp={config.plan.dp} ranks slice the same batches dp={saved.plan.dp} ranks did")]
        if rng is not None:
            restore_rng(rng)
            notes.append("rng: every rank's generator states restored")
        elif same_layout:  # saved before the generator states had files of their own
            reseed_rng(config.train.seed, step, self.rank)
            notes.append(f"rng: the checkpoint holds no {rng_file(path, self.rank).name}; ranks re-seeded from (seed, step={step}, rank)")
        else:
            reseed_rng(config.train.seed, step, self.rank)
            notes.append(f"rng: per-rank states do not map onto another layout; ranks re-seeded from (seed, step={step}, rank)")
        if state["train"]["schedule"] != schedule_state(config):
            notes.append(f"schedule: saved {state['train']['schedule']}, continuing with {schedule_state(config)}")
        self._phase("loaded", step, path, _local_bytes(state), time.perf_counter() - t0)
        self._emit(Resume(step=step, path=str(path), saved_plan=meta["plan"], saved_world_size=meta["world_size"],
                          resharded=not same_layout, notes=notes))
        self.last_saved = step
        return step


def check_compatible(saved: RunConfig, current: RunConfig) -> None:
    """Refuse, in one line, a checkpoint that another layout cannot continue exactly: another model,
    or another data stream (global batch size, sequence length, dataset, seed)."""
    if saved.model != current.model:
        raise ConfigError(f"the checkpoint was saved for model {saved.model.name!r} with other dimensions "
                          f"than this run's {current.model.name!r}", field="model")
    for name in ("global_batch_size", "seq_len", "dataset", "data_path", "seed", "optimizer"):
        a, b = getattr(saved.train, name), getattr(current.train, name)
        if a != b:
            raise ConfigError(f"the checkpoint has {name}={a!r}, this run {name}={b!r}: the data position "
                              f"(or optimizer state) would not mean the same thing", field=f"train.{name}", value=b)


# --------------------------------------------------------------------------- restarts and the drill


def note_restart(run_dir: str | os.PathLike, rank: int, writer: EventWriter) -> Fault | None:
    """At the start of a resumed attempt, before it logs anything: say how this rank's previous
    attempt ended (a ``fault`` event unless it ended "ok") and, under a torchrun restart, emit
    ``restart``. Returns the fault (None when the previous attempt ended cleanly or there was none)."""
    events = list(read_rank_events(run_dir, rank))
    starts = [i for i, e in enumerate(events) if e["kind"] == "run_start"]
    fault = None
    if starts:
        last = events[starts[-1]:]
        steps = [e["step"] for e in last if e["kind"] == "step"]
        ends = [e for e in last if e["kind"] == "run_end"]
        errors = [e for e in last if e["kind"] == "error"]
        last_step = max(steps) if steps else None
        if errors:
            fault = Fault(cause="error", attempt=len(starts) - 1, last_step=last_step, detail=errors[0].get("error", ""))
        elif ends and ends[-1].get("status") == "interrupted":
            fault = Fault(cause="interrupted", attempt=len(starts) - 1, last_step=last_step, detail="stopped by a signal")
        elif not ends:
            fault = Fault(cause="killed", attempt=len(starts) - 1, last_step=last_step,
                          detail="ended without a run_end or an error: killed (SIGKILL, OOM killer) or its node was lost")
        if fault is not None:
            writer.emit(fault)
    restarts = restart_count()
    if restarts > 0:
        max_r = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        writer.emit(Restart(attempt=restarts, max_restarts=int(max_r) if max_r else None))
    return fault


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt or outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
