"""Every collective this rank calls, with the planner's names: op, group dimension, bytes, times.

Two hook points cover them all:

* the c10d Python API (``torch.distributed.all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ``all_to_all_single``, ``isend``/``irecv``...): FSDP2 and
  ``replicate`` (gradients, parameters), pipelining and the ring attention (point-to-point),
  expert parallelism (all-to-all), the trainer's own loss and norm reductions;
* the functional collectives (``torch.distributed._functional_collectives``): what DTensor calls
  when it redistributes (tensor and sequence parallelism, loss parallel, ``full_tensor``).

Both are module attributes that their callers look up at call time, so replacing them with a
recording wrapper (:func:`install_collective_hooks`) sees every call without touching torch's code;
the wrappers are installed once per process and call straight through unless a
:class:`CollectiveRecorder` is active (:func:`activate`). A call's process group is mapped to the
plan's group dimension by comparing its ranks with ``ParallelPlan.group_ranks``; its size follows
the nccl-tests convention of :mod:`workbench.predict.comms` (all-gather: the output,
reduce-scatter: the input, ...). Asynchronous calls' end times are when completion was observed (a
future's callback, or the caller's ``wait``).

Why not ``torch.distributed.tensor.debug.CommDebugMode``: it is a ``TorchDispatchMode`` (Python on
every op of the step, DTensor ops included) that *counts* calls per op and module: no bytes, no
durations, no process group to map to a plan dimension; and its registry holds the functional and
c10d collectives but no send/recv, so pipeline and ring-attention traffic would be missing. Nor
``torch.profiler``: it times the communication kernels but traces every op and kernel, too heavy
to leave on every step, and its trace names no group dimension.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

from workbench.predict.comms import BUS_FACTOR, EXPERT_DIMS, group_members
from workbench.spec.config import RunConfig
from workbench.spec.plan import GROUP_DIMS
from workbench.trainer.memory_meter import local_nbytes as _nbytes

# When several group dimensions have the same ranks, name the call after the first of these.
DIM_PREFERENCE = ("tp", "cp", "ep", "pp", "dp_shard_cp", "dp_cp", "dp", "dp_shard", "dp_replicate", "efsdp", "edp")

_ACTIVE: "CollectiveRecorder | None" = None  # the recorder the wrappers report to


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# name -> (op, bytes of S by nccl-tests from (args, kwargs), group position, async position, p2p direction)
_C10D: dict[str, tuple[str, Callable[[tuple, dict], int], int, int | None, str | None]] = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, 3, None),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")), 2, 3, None),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")), 2, 3, None),
    "all_gather": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 1, "tensor")) * len(_arg(a, k, 0, "tensor_list")), 2, 3, None),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input")), 3, 4, None),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input")), 3, 4, None),
    "reduce_scatter": ("reduce_scatter", lambda a, k: sum(_nbytes(x) for x in _arg(a, k, 1, "input_list")), 3, 4, None),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input")), 4, 5, None),
    "all_to_all": ("all_to_all", lambda a, k: sum(_nbytes(x) for x in _arg(a, k, 1, "input_tensor_list")), 2, 3, None),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, 3, None),
    "isend": ("send_recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, -1, "send"),
    "irecv": ("send_recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, -1, "recv"),
    "send": ("send_recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, None, "send"),
    "recv": ("send_recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2, None, "recv"),
}
# functional collectives (DTensor): name -> (op, bytes of S, group position)
_FUNCOL: dict[str, tuple[str, Callable[[tuple, dict, int], int], int]] = {
    "all_reduce": ("all_reduce", lambda a, k, n: _nbytes(a[0]), 2),
    "all_gather_single": ("all_gather", lambda a, k, n: _nbytes(a[0]) * n, 2),
    "all_gather_tensor": ("all_gather", lambda a, k, n: _nbytes(a[0]) * n, 2),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k, n: _nbytes(a[0]), 3),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k, n: _nbytes(a[0]), 3),
    "all_to_all_single": ("all_to_all", lambda a, k, n: _nbytes(a[0]), 3),
    "broadcast": ("broadcast", lambda a, k, n: _nbytes(a[0]), 2),
}
_ORIGINALS: dict[tuple[str, str], Callable] = {}


class _TimedWork:
    """A point-to-point Work whose ``wait()`` stamps the call's end (gloo's p2p works have no
    future to hook); everything else is delegated."""

    def __init__(self, work: Any, record: list):
        self._work, self._record = work, record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._record[4] is None:
            self._record[4] = time.perf_counter()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _c10d_wrapper(name: str, fn: Callable) -> Callable:
    op, size_of, group_pos, async_pos, direction = _C10D[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is None or rec.suspended:
            return fn(*args, **kwargs)
        tensor = _arg(args, kwargs, 0, "tensor")
        numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
        record = [op, _arg(args, kwargs, group_pos, "group"), size_of(args, kwargs), time.perf_counter(), None,
                  "c10d", direction, numel == 1, rec.phase]
        out = fn(*args, **kwargs)
        is_async = async_pos == -1 or (async_pos is not None and _arg(args, kwargs, async_pos, "async_op", False))
        if not is_async or out is None:
            record[4] = time.perf_counter()
        else:
            out = rec.watch(out, record, p2p=direction is not None)
        rec.calls.append(record)
        return out

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", name)
    return wrapper


def _funcol_wrapper(name: str, fn: Callable) -> Callable:
    op, size_of, group_pos = _FUNCOL[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is None or rec.suspended:
            return fn(*args, **kwargs)
        group = _arg(args, kwargs, group_pos, "group")
        group_name = funcol._resolve_group_name(group)
        n = rec.group_size(group_name)
        record = [op, group_name, size_of(args, kwargs, n), time.perf_counter(), None, "functional", None,
                  args[0].numel() == 1, rec.phase]
        out = fn(*args, **kwargs)
        # DTensor uses the result right away in nearly every case: waiting here times the call
        # and changes no result (a later wait on a completed tensor returns at once).
        if isinstance(out, funcol.AsyncCollectiveTensor):
            torch.ops._c10d_functional.wait_tensor(out.elem)
        record[4] = time.perf_counter()
        rec.calls.append(record)
        return out

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install_collective_hooks() -> None:
    """Replace the collective entry points by recording wrappers (once per process)."""
    if _ORIGINALS:
        return
    for name in _C10D:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped = _c10d_wrapper(name, fn)
        _ORIGINALS[("c10d", name)] = fn
        # Both namespaces: callers use ``dist.x``; c10d's own checks (P2POp, batch_isend_irecv)
        # compare against its module globals, which must be the same object.
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    for name in _FUNCOL:
        fn = getattr(funcol, name, None)
        if fn is None:
            continue
        _ORIGINALS[("funcol", name)] = fn
        setattr(funcol, name, _funcol_wrapper(name, fn))


def uninstall_collective_hooks() -> None:
    for (where, name), fn in _ORIGINALS.items():
        module = c10d if where == "c10d" else funcol
        wrapped = getattr(module, name)
        setattr(module, name, fn)
        if where == "c10d" and getattr(dist, name, None) is wrapped:
            setattr(dist, name, fn)
    _ORIGINALS.clear()


class CollectiveRecorder:
    """Collects this rank's calls; maps their groups to the plan's dimensions when flushed."""

    def __init__(self, config: RunConfig, rank: int):
        self.config, self.rank = config, rank
        self.calls: list[list[Any]] = []
        self.suspended = False
        self.phase = "compute"
        self._ranks: dict[Any, tuple[int, ...]] = {}
        self._dims = _dims_by_ranks(config, rank)

    def watch(self, work: Any, record: list, p2p: bool) -> Any:
        """Stamp the end of an asynchronous call when it completes."""
        try:
            fut = work.get_future()
        except (RuntimeError, AttributeError, NotImplementedError):
            fut = None
        if fut is not None:
            def done(_: Any) -> None:
                if record[4] is None:
                    record[4] = time.perf_counter()

            fut.add_done_callback(done)
            return work
        # No future (gloo point-to-point): time it from the caller's wait(). Only p2p works are
        # proxied: FSDP checks its all-gather works' type.
        return _TimedWork(work, record) if p2p else work

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        key = group if group is not None else "__world__"
        ranks = self._ranks.get(key)
        if ranks is None:
            if isinstance(group, str):
                group = c10d._resolve_process_group(group)
            ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
            self._ranks[key] = ranks
        return ranks

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls made inside are not recorded (the instrument's own bookkeeping collectives)."""
        self.suspended = True
        try:
            yield
        finally:
            self.suspended = False

    def group_size(self, group: Any) -> int:
        return len(self.group_ranks(group))

    def flush(self, offset: float) -> list[dict[str, Any]]:
        """The calls of the step as event dicts (wall-clock times); clears the list."""
        out = []
        for op, group, nbytes, t0, t1, api, direction, scalar, phase in self.calls:
            ranks = self.group_ranks(group)
            n = len(ranks)
            dur = (t1 - t0) if t1 is not None else None
            factor = BUS_FACTOR[op](n) if op in BUS_FACTOR else 1.0
            algbw = nbytes / dur if dur else None
            call = {"op": op, "dim": self._dims.get(ranks, "world" if n == dist.get_world_size() else "other"),
                    "group": list(ranks), "n": n, "bytes": nbytes, "wire_bytes": nbytes * factor,
                    "start": t0 + offset, "end": (t1 + offset) if t1 is not None else None,
                    "algbw": algbw, "busbw": algbw * factor if algbw is not None else None,
                    "api": api, "scalar": scalar, "phase": phase}
            if direction:
                call["dir"] = direction
            out.append(call)
        self.calls = []
        return out


def _dims_by_ranks(config: RunConfig, rank: int) -> dict[tuple[int, ...], str]:
    """This rank's group of every plan dimension, keyed by its sorted ranks (preferred name wins)."""
    plan = config.plan
    out: dict[tuple[int, ...], str] = {}
    for dim in DIM_PREFERENCE:
        if dim in EXPERT_DIMS:
            if plan.ep == 1:
                continue
            groups = group_members(plan, dim)
        elif dim in GROUP_DIMS:
            if dim == "dp" and plan.cp > 1:
                continue
            groups = plan.group_ranks(dim)
        else:
            continue
        for g in groups:
            if rank in g and len(g) > 1:
                out.setdefault(tuple(sorted(g)), dim)
    return out


def activate(recorder: CollectiveRecorder) -> None:
    """Install the wrappers (once per process) and send every call to ``recorder``."""
    global _ACTIVE
    install_collective_hooks()
    _ACTIVE = recorder


def deactivate(recorder: CollectiveRecorder) -> None:
    """Stop recording into ``recorder`` (the wrappers stay, calling straight through)."""
    global _ACTIVE
    if _ACTIVE is recorder:
        _ACTIVE = None
