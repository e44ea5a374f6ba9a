"""Per-action timing of this rank's pipeline stages: every F/B/I/W, the window of ``schedule.step()``
and the time blocked in the schedule's point-to-point waits.

Built on ``torch.distributed.pipelining`` itself: the schedules call each stage's
``forward_one_chunk``, ``backward_one_chunk`` (``full_backward=False``: the input half, I) and
``backward_weight_one_chunk`` (W) and wait on their sends and receives through the module function
``schedules._wait_batch_p2p``; all are looked up at call time, so wrapping them times every action
without touching torch's code. On CUDA the stamps are CUDA events (read once, after the step), on
CPU ``time.perf_counter``.

Why not torch's own tools: the schedules label each action with ``torch.profiler.record_function``,
which records only while a ``torch.profiler`` session runs (it traces every op and kernel: too heavy
for every step, and the trace has to be parsed back into actions), and
``torch.distributed.pipelining._schedule_visualizer`` draws the *planned* order of actions, not
their measured times.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from workbench.trainer.memory_meter import SavedTensorMeter


class PipelineTimer:
    """Times every action of ``stages`` and the window of ``schedule.step()``; with an active
    ``meter``, also the bytes the first micro-batch's forwards save (``first_mb_saved``)."""

    KINDS = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}

    def __init__(self, schedule: Any, stages: list[PipelineStage], device: torch.device, meter: SavedTensorMeter):
        self.cuda = device.type == "cuda"
        self.actions: list[list[Any]] = []  # [kind, stage, mb, start, end] (perf seconds or events)
        self.window: list[Any] = [None, None]
        # Process CPU seconds at the window's ends (host clocks only): how much of the window this
        # rank was on a CPU, so a reader can tell a step another process preempted (see cpu_s).
        self.cpu: list[float] = [0.0, 0.0]
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
        original = getattr(schedules._wait_batch_p2p, "__wrapped__", schedules._wait_batch_p2p)
        timer = self

        def wait(work: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(work)
            finally:
                timer.wait_s += time.perf_counter() - t0

        wait.__wrapped__ = original  # type: ignore[attr-defined]
        self._restore = original
        schedules._wait_batch_p2p = wait

    def close(self) -> None:
        schedules._wait_batch_p2p = self._restore

    def _stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _wrap_stage(self, stage: PipelineStage) -> None:
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
            self.cpu[0] = time.process_time()
            self.window[0] = self._stamp()
            try:
                return fn(*args, **kwargs)
            finally:
                self.window[1] = self._stamp()
                self.cpu[1] = time.process_time()

        schedule.step = step

    def begin_step(self) -> None:
        self.first_mb_saved = 0

    def flush(self, offset: float) -> tuple[list[float], list[list[Any]], float, float, float | None]:
        """(window, actions, busy seconds, wait seconds, CPU seconds) in wall-clock seconds; clears
        the lists. CPU seconds are the process's CPU time inside the window, None on CUDA (where
        the actions run on the device and the host's CPU time says nothing about them)."""
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
        cpu = None if self.cuda else self.cpu[1] - self.cpu[0]
        return window, actions, busy, wait, cpu
