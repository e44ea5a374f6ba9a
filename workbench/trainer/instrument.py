"""Instrumentation of the bundled trainer: measure what the planner predicts, with the planner's names.

One :class:`Instrument` per rank, made by :func:`make_instrument` after ``setup``; the training loop
calls ``begin_step`` / ``end_step`` around each step. Per step and rank it writes (events.py):

* ``collectives``: every collective call, wherever it comes from. Two hook points cover them all:

  - the c10d Python API (``torch.distributed.all_reduce``, ``all_gather_single``,
    ``reduce_scatter_single``, ``all_to_all_single``, ``isend``/``irecv``...): FSDP2 and
    ``replicate`` (gradients, parameters), pipelining and the ring attention (point-to-point),
    expert parallelism (all-to-all), the trainer's own loss and norm reductions;
  - the functional collectives (``torch.distributed._functional_collectives``): what DTensor calls
    when it redistributes (tensor and sequence parallelism, loss parallel, ``full_tensor``).

  Both are module attributes that their callers look up at call time, so replacing them with a
  recording wrapper sees every call without touching torch's code; the wrappers are installed
  once per process and call straight through when no instrument is active. A call's process
  group is mapped to the plan's group dimension by comparing its ranks with
  ``ParallelPlan.group_ranks``; its size follows the nccl-tests convention of
  :mod:`workbench.predict.comms` (all-gather: the output, reduce-scatter: the input, ...).
* ``pipeline``: every F/B/I/W action of every stage this rank holds (wrapping the stage's
  ``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``), its p2p transfers,
  and the measured bubble ``1 - busy / window`` of ``schedule.step()``. On CUDA with CUDA events.
* ``memory``: parameter, gradient and optimizer-state bytes of the real local shards (optimizer
  hooks see the gradients just before ``step()`` and the states just after), the peak of bytes
  saved for backward (``torch.autograd.graph.saved_tensors_hooks``: each storage counted once,
  parameters excluded, released when backward unpacks it), the CUDA allocator's peaks.
* ``step_stats`` (rank 0, when the throughput guard gathers every rank's step time): slowest
  rank, p50/p95/max. Without it, every rank's own "step" event carries its step time and
  :func:`workbench.rundir.analysis.stragglers` computes the same from the events.
* ``guard``: a guard of TrainSettings fired (:meth:`Instrument.end_step` returns it).

Cost control: the saved-tensor hooks run a little Python per saved tensor, so activations are
measured on :data:`ACTIVATION_STEPS` and every :data:`ACTIVATION_EVERY`-th step only; the rest is a
few timestamps per call and one line per kind per step. ``benchmarks/bench_instrumentation.py``
measures the overhead. ``WORKBENCH_INSTRUMENT=0`` (or ``train.instrument=False``) turns it all off.

Not measured: activations inside recomputed regions (activation checkpointing installs its own
saved-tensor hooks, which take precedence: a fully recomputed block shows as ~0); asynchronous
calls' end times are when completion was observed (a future's callback, or the caller's ``wait``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from workbench.predict.comms import BUS_FACTOR, EXPERT_DIMS, group_members
from workbench.spec.config import RunConfig
from workbench.spec.plan import GROUP_DIMS
from workbench.rundir.events import Collectives, EventWriter, Guard, Memory, PipelineStep, StepStats

ENV_SWITCH = "WORKBENCH_INSTRUMENT"  # "0": off whatever the config says
ENV_INJECT = "WORKBENCH_INJECT"  # tests: "nan:<step>" or "spike:<step>" (see _inject)
ACTIVATION_STEPS = (0, 1)
ACTIVATION_EVERY = 10
GUARD_WARMUP_STEPS = 2  # throughput guard: the first steps include one-off setup work
SPIKE_HISTORY = 5  # grad-spike guard: previous steps needed before it judges
SPIKE_WINDOW = 20
# When several group dimensions have the same ranks, name the call after the first of these.
DIM_PREFERENCE = ("tp", "cp", "ep", "pp", "dp_shard_cp", "dp_cp", "dp", "dp_shard", "dp_replicate", "efsdp", "edp")

_ACTIVE: "CollectiveRecorder | None" = None  # the recorder the wrappers report to


def enabled(config: RunConfig) -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and getattr(config.train, "instrument", True)


# --------------------------------------------------------------------------- collectives


def _nbytes(t: torch.Tensor) -> int:
    if hasattr(t, "_local_tensor"):
        t = t._local_tensor  # DTensor: the local buffer is what travels
    return t.numel() * t.element_size()


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
    from torch.distributed import _functional_collectives as funcol

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
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

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
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

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
                from torch.distributed import distributed_c10d as c10d

                group = c10d._resolve_process_group(group)
            ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
            self._ranks[key] = ranks
        return ranks

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


# --------------------------------------------------------------------------- activations


class SavedTensorMeter:
    """Bytes saved for backward, live and peak: ``torch.autograd.graph.saved_tensors_hooks``.

    pack: count a saved tensor's storage once (several ops often save the same tensor, and views
    share a storage), skip parameters (leaves that require grad: weights are not activations);
    unpack (backward uses it, then frees it): release the storage when its last saver is done."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.first_microbatch = 0  # set by the pipeline wrapper / the caller
        self._refs: dict[int, list[int]] = {}
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        if t.requires_grad and t.is_leaf or isinstance(t, nn.Parameter):
            return t
        base = t._base
        if base is not None and base.requires_grad and base.is_leaf:
            return t  # a view of a weight (linear saves weight.t()): not an activation
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        local = getattr(local, "elem", local)  # AsyncCollectiveTensor: the tensor inside
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            # a wrapper without real storage: count the tensor itself
            key, nbytes = id(local), local.numel() * local.element_size()
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [nbytes, 1]
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[1] += 1
        return (key, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        key, t = packed
        entry = self._refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.live -= entry[0]
                del self._refs[key]
        return t

    def start(self) -> None:
        self.live = self.peak = 0
        self._refs.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    @property
    def active(self) -> bool:
        return self._ctx is not None


# --------------------------------------------------------------------------- pipeline


class PipelineTimer:
    """Times every action of this rank's pipeline stages and the window of ``schedule.step()``."""

    KINDS = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}

    def __init__(self, schedule: Any, stages: list, device: torch.device, meter: SavedTensorMeter):
        self.cuda = device.type == "cuda"
        self.actions: list[list[Any]] = []  # [kind, stage, mb, start, end] (perf seconds or events)
        self.window: list[Any] = [None, None]
        self.meter = meter
        self.first_mb_saved = 0
        self.wait_s = 0.0  # blocked in pipeline p2p waits this step: the dependency bubble
        for stage in stages:
            self._wrap_stage(stage)
        self._wrap_step(schedule)
        self._wrap_waits()

    def _wrap_waits(self) -> None:
        """Time the schedules' waits on their sends/receives (``schedules._wait_batch_p2p``, a
        module function they look up at call time): the time a rank is blocked on a neighbour."""
        from torch.distributed.pipelining import schedules

        original = getattr(schedules._wait_batch_p2p, "__wrapped__", schedules._wait_batch_p2p)
        timer = self

        def wait(work: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(work)
            finally:
                timer.wait_s += time.perf_counter() - t0

        wait.__wrapped__ = original  # type: ignore[attr-defined]
        self._restore = (schedules, original)
        schedules._wait_batch_p2p = wait

    def close(self) -> None:
        module, original = self._restore
        module._wait_batch_p2p = original

    def _stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _wrap_stage(self, stage: Any) -> None:
        index = stage.stage_index

        def wrap(method_name: str) -> None:
            fn = getattr(stage, method_name)

            def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                if method_name == "backward_one_chunk":
                    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                    kind = "B" if full else "I"
                else:
                    kind = self.KINDS[method_name]
                before = self.meter.live if self.meter.active else 0
                t0 = self._stamp()
                out = fn(chunk_id, *args, **kwargs)
                self.actions.append([kind, index, chunk_id, t0, self._stamp()])
                if kind == "F" and chunk_id == 0 and self.meter.active:
                    self.first_mb_saved += self.meter.live - before
                return out

            setattr(stage, method_name, timed)

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            wrap(name)

    def _wrap_step(self, schedule: Any) -> None:
        fn = schedule.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.window[0] = self._stamp()
            try:
                return fn(*args, **kwargs)
            finally:
                self.window[1] = self._stamp()

        schedule.step = step

    def flush(self, offset: float) -> tuple[list[float], list[list[Any]], float]:
        """(window, actions, busy seconds) in wall-clock seconds; clears the lists."""
        if self.cuda:
            torch.cuda.synchronize()
            base_ev = self.window[0]
            base = time.perf_counter() + offset - base_ev.elapsed_time(self.window[1]) / 1e3
            conv = lambda ev: base + base_ev.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            conv = lambda t: t + offset  # noqa: E731
        window = [conv(self.window[0]), conv(self.window[1])]
        actions = [[k, s, mb, conv(a), conv(b)] for k, s, mb, a, b in self.actions]
        busy = sum(a[4] - a[3] for a in actions)
        self.actions = []
        wait, self.wait_s = self.wait_s, 0.0
        return window, actions, busy, wait


# --------------------------------------------------------------------------- the instrument


def local_bytes(tensors: Any) -> int:
    return sum(_nbytes(t) for t in tensors if t is not None)


class Instrument:
    """Measurements and guards of one rank (see the module docstring)."""

    def __init__(self, trainer: Any, writer: EventWriter | None):
        self.trainer = trainer
        self.config: RunConfig = trainer.config
        self.rank = trainer.rank
        self.writer = writer
        self.device = trainer.device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self.recorder = CollectiveRecorder(self.config, self.rank) if dist.is_initialized() else None
        self.meter = SavedTensorMeter()
        self.pipeline: PipelineTimer | None = None
        if trainer.schedule is not None:
            stages = getattr(trainer.schedule, "workbench_stages", None) or _stages_of(trainer.schedule)
            self.pipeline = PipelineTimer(trainer.schedule, stages, self.device, self.meter)
        self.param_bytes = local_bytes(trainer.params)
        self.grad_bytes = 0
        self.optim_bytes = 0
        self.grad_norms: list[float] = []
        self._step = 0
        self._t0 = 0.0
        self._hooks = [trainer.optimizer.register_step_pre_hook(self._before_optimizer),
                       trainer.optimizer.register_step_post_hook(self._after_optimizer)]
        global _ACTIVE
        if self.recorder is not None:
            install_collective_hooks()
            _ACTIVE = self.recorder

    # optimizer hooks: gradients exist just before step(), states just after
    def _before_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.grad_bytes = local_bytes(p.grad for group in optimizer.param_groups for p in group["params"])
        if self.recorder is not None:
            self.recorder.phase = "step"

    def _after_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        total = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                n = _nbytes(p) // max(1, p.element_size())
                for value in optimizer.state.get(p, {}).values():
                    # per-parameter states (Adam's m and v); not the scalar step counter
                    if isinstance(value, torch.Tensor) and value.numel() > 1 and _nbytes(value) // value.element_size() == n:
                        total += _nbytes(value)
        self.optim_bytes = total

    def begin_step(self, step: int) -> None:
        self._step = step
        _inject(self.trainer, step)
        if self.recorder is not None:
            self.recorder.phase = "compute"
        if step in ACTIVATION_STEPS or step % ACTIVATION_EVERY == 0:
            self.meter.start()
        if self.pipeline is not None:
            self.pipeline.first_mb_saved = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()

    def end_step(self, metrics: dict[str, Any]) -> Guard | None:
        """Write this step's measurements; add MFU to ``metrics``; return a fired guard or None."""
        measured_activations = self.meter.active
        self.meter.stop()
        step = self._step
        config = self.config
        step_time = float(metrics["step_time_s"])
        # Every rank writes its own step time (its "step" event): analysis.stragglers reads them
        # all. Gathering them here costs a collective per step, so only the throughput guard,
        # whose verdict every rank must share, does it.
        gather = self.world > 1 and getattr(config.train, "guard_min_tokens_per_s", 0.0) > 0
        times = self._gather_step_times(step_time) if gather else [step_time]
        slowest = max(times)
        tokens_per_s = config.tokens_per_step / slowest  # the job runs at its slowest rank's pace
        metrics["mfu"] = mfu(config, slowest)
        w = self.writer
        if w is not None:
            calls = self.recorder.flush(self.offset) if self.recorder is not None else []
            if self.recorder is not None:
                w.emit(Collectives(step=step, calls=calls))
            if self.pipeline is not None:
                window, actions, busy, wait = self.pipeline.flush(self.offset)
                span = window[1] - window[0]
                p2p = [[c.get("dir"), c["bytes"], c["start"], c["end"]] for c in calls if c["dim"] == "pp"
                       and c["op"] == "send_recv"]
                w.emit(PipelineStep(step=step, pp_rank=self.trainer.meshes.local_rank("pp"), window=window,
                                    busy_s=busy, bubble_fraction=max(0.0, 1 - busy / span) if span > 0 else 0.0,
                                    actions=actions, p2p=p2p, wait_s=wait,
                                    timing="cuda_events" if self.device.type == "cuda" else "wall"))
            if measured_activations:
                per_mb = self.pipeline.first_mb_saved if self.pipeline is not None else 0
                cuda = self.device.type == "cuda"
                w.emit(Memory(step=step, parameters=self.param_bytes, gradients=self.grad_bytes,
                              optimizer=self.optim_bytes, activations=self.meter.peak,
                              activations_per_microbatch=per_mb,
                              cuda_peak_allocated=torch.cuda.max_memory_allocated(self.device) if cuda else None,
                              cuda_peak_reserved=torch.cuda.max_memory_reserved(self.device) if cuda else None))
            if self.rank == 0 and len(times) == self.world:
                ordered = sorted(times)
                w.emit(StepStats(step=step, step_time_s=times, slowest_rank=times.index(slowest),
                                 p50_s=statistics.median(ordered), p95_s=_percentile(ordered, 0.95),
                                 max_s=slowest, min_s=ordered[0]))
        guard = check_guards(config, step, metrics, tokens_per_s, self.grad_norms)
        self.grad_norms.append(float(metrics["grad_norm"]))
        return guard  # the loop writes it after the step's own event, then stops

    def _gather_step_times(self, step_time: float) -> list[float]:
        """Every rank's step time (one all-gather of a float, not recorded as the run's traffic)."""
        if self.world == 1:
            return [step_time]
        local = torch.tensor([step_time], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world, dtype=torch.float64, device=self.device)
        if self.recorder is not None:
            self.recorder.suspended = True
        try:
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, local)
        finally:
            if self.recorder is not None:
                self.recorder.suspended = False
        return [float(x) for x in out.tolist()]

    def close(self) -> None:
        global _ACTIVE
        self.meter.stop()
        if self.pipeline is not None:
            self.pipeline.close()
        for h in self._hooks:
            h.remove()
        if _ACTIVE is self.recorder:
            _ACTIVE = None


def _stages_of(schedule: Any) -> list:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else []
    return list(stages)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def mfu(config: RunConfig, step_time_s: float) -> float:
    """Model FLOPs utilisation by the planner's convention (workbench.predict.perf): PaLM's model FLOPs
    per token ``6 N + 12 L h s`` x tokens per step / (step time x GPUs x dense peak of the compute
    dtype class: fp32 runs against the fp32 peak, the rest against bf16's)."""
    train = config.train
    flops = config.model.flops_per_token(train.seq_len) * config.tokens_per_step
    peak = config.cluster.gpu.peak_flops("fp32" if train.compute_dtype == "fp32" else "bf16")
    return flops / (step_time_s * config.world_size * peak)


# --------------------------------------------------------------------------- guards


def check_guards(config: RunConfig, step: int, metrics: dict[str, Any], tokens_per_s: float,
                 history: list[float]) -> Guard | None:
    """The first guard of ``config.train`` that this step trips, or None. Every input is the same
    on every rank (global loss and norm, the slowest rank's throughput), so all ranks agree."""
    t = config.train
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if getattr(t, "guard_nonfinite", False) and not (math.isfinite(loss) and math.isfinite(norm)):
        what = "loss" if not math.isfinite(loss) else "grad_norm"
        value = loss if what == "loss" else norm
        return Guard(step=step, guard="nonfinite", value=value, threshold=0.0,
                     message=f"{what}={value} is not finite at step {step}")
    k = getattr(t, "guard_grad_spike", 0.0)
    if k and len(history) >= SPIKE_HISTORY:
        median = statistics.median(history[-SPIKE_WINDOW:])
        if norm > k * median:
            return Guard(step=step, guard="grad_spike", value=norm, threshold=k * median,
                         message=f"grad_norm={norm:.4g} > {k} x running median {median:.4g} at step {step}")
    floor = getattr(t, "guard_min_tokens_per_s", 0.0)
    if floor and step >= GUARD_WARMUP_STEPS and tokens_per_s < floor:
        return Guard(step=step, guard="min_tokens_per_s", value=tokens_per_s, threshold=floor,
                     message=f"tokens/s={tokens_per_s:.1f} < floor {floor} at step {step}")
    return None


@torch.no_grad()
def _inject(trainer: Any, step: int) -> None:
    """Test hook (``WORKBENCH_INJECT=nan:<step>`` or ``spike:<step>``): before step ``step``, make
    one parameter NaN (the loss becomes non-finite) or scale the output projection by 100 (its
    input gradients, hence the gradient norm, grow ~100x)."""
    spec = os.environ.get(ENV_INJECT)
    if not spec:
        return
    what, at = spec.split(":")
    if int(at) != step:
        return
    for module in trainer.modules:
        if what == "nan":
            p = next(module.parameters())
            (p._local_tensor if hasattr(p, "_local_tensor") else p).fill_(float("nan"))
            return
        if what == "spike" and getattr(module, "output", None) is not None:
            w = module.output.weight
            (w._local_tensor if hasattr(w, "_local_tensor") else w).mul_(100.0)


def make_instrument(trainer: Any, writer: EventWriter | None) -> Instrument | None:
    """The instrument of this rank, or None when instrumentation is off or there is no event
    writer (library calls such as the layout tests measure nothing)."""
    return Instrument(trainer, writer) if writer is not None and enabled(trainer.config) else None
