"""Instrumentation of the bundled trainer: measure what the planner predicts, with the planner's names.

One :class:`Instrument` per rank, made by :func:`make_instrument` after ``setup``; the training loop
calls ``begin_step`` / ``end_step`` around each step. It composes the meters and writes, per step
and rank (events.py):

* ``collectives``: every collective call, its op, group dimension, bytes and times
  (:mod:`.comm_meter`);
* ``pipeline``: every F/B/I/W action of every stage this rank holds, its p2p transfers, and the
  measured bubble ``1 - busy / window`` of ``schedule.step()`` (:mod:`.pipeline_timer`);
* ``memory``: parameter, gradient and optimizer-state bytes of the real local shards (optimizer
  hooks see the gradients just before ``step()`` and the states just after), the peak of bytes
  saved for backward, the CUDA allocator's peaks (:mod:`.memory_meter`);
* ``step_stats`` (rank 0, when the throughput guard gathers every rank's step time): slowest
  rank, p50/p95/max. Without it, every rank's own "step" event carries its step time and
  :func:`workbench.rundir.analysis.stragglers` computes the same from the events;
* ``guard``: a guard of TrainSettings fired (:mod:`.guards`; :meth:`Instrument.end_step` returns it).

It also adds the step's MFU (:func:`workbench.predict.perf.mfu`, the planner's definition) to the
step's metrics.

Cost control: the saved-tensor hooks run a little Python per saved tensor, so activations are
measured on :data:`ACTIVATION_STEPS` and every :data:`ACTIVATION_EVERY`-th step only; the rest is a
few timestamps per call and one line per kind per step. ``benchmarks/bench_instrumentation.py``
measures the overhead. ``WORKBENCH_INSTRUMENT=0`` (or ``train.instrument=False``) turns it all off.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from workbench.predict.perf import mfu
from workbench.spec.config import RunConfig
from workbench.predict.stats import percentile
from workbench.rundir.events import Collectives, EventWriter, Guard, Memory, PipelineStep, StepStats
from workbench.trainer import comm_meter
from workbench.trainer.comm_meter import CollectiveRecorder
from workbench.trainer.guards import check_guards
from workbench.trainer.memory_meter import SavedTensorMeter, gradient_bytes, local_bytes, optimizer_state_bytes
from workbench.trainer.pipeline_timer import PipelineTimer

ENV_SWITCH = "WORKBENCH_INSTRUMENT"  # "0": off whatever the config says
ACTIVATION_STEPS = (0, 1)
ACTIVATION_EVERY = 10


def enabled(config: RunConfig) -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and getattr(config.train, "instrument", True)


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
        if trainer.pipeline is not None:
            self.pipeline = PipelineTimer(trainer.pipeline.schedule, trainer.pipeline.stages, self.device, self.meter)
        self.param_bytes = local_bytes(trainer.params)
        self.grad_bytes = 0
        self.optim_bytes = 0
        self.grad_norms: list[float] = []
        self._step = 0
        self._t0 = 0.0
        self._hooks = [trainer.optimizer.register_step_pre_hook(self._before_optimizer),
                       trainer.optimizer.register_step_post_hook(self._after_optimizer)]
        if self.recorder is not None:
            comm_meter.activate(self.recorder)

    # optimizer hooks: gradients exist just before step(), states just after
    def _before_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.grad_bytes = gradient_bytes(optimizer)
        if self.recorder is not None:
            self.recorder.phase = "step"

    def _after_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.optim_bytes = optimizer_state_bytes(optimizer)

    def begin_step(self, step: int) -> None:
        self._step = step
        if self.recorder is not None:
            self.recorder.phase = "compute"
        if step in ACTIVATION_STEPS or step % ACTIVATION_EVERY == 0:
            self.meter.start()
        if self.pipeline is not None:
            self.pipeline.begin_step()
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
        if self.writer is not None:
            self._write(step, times, measured_activations)
        guard = check_guards(config, step, metrics, tokens_per_s, self.grad_norms)
        self.grad_norms.append(float(metrics["grad_norm"]))
        return guard  # the loop writes it after the step's own event, then stops

    def _write(self, step: int, times: list[float], measured_activations: bool) -> None:
        w = self.writer
        assert w is not None
        calls = self.recorder.flush(self.offset) if self.recorder is not None else []
        if self.recorder is not None:
            w.emit(Collectives(step=step, calls=calls))
        if self.pipeline is not None:
            window, actions, busy, wait, cpu = self.pipeline.flush(self.offset)
            span = window[1] - window[0]
            p2p = [[c.get("dir"), c["bytes"], c["start"], c["end"]] for c in calls if c["dim"] == "pp"
                   and c["op"] == "send_recv"]
            w.emit(PipelineStep(step=step, pp_rank=self.trainer.meshes.local_rank("pp"), window=window,
                                busy_s=busy, bubble_fraction=max(0.0, 1 - busy / span) if span > 0 else 0.0,
                                actions=actions, p2p=p2p, wait_s=wait, cpu_s=cpu,
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
            slowest = max(times)
            w.emit(StepStats(step=step, step_time_s=times, slowest_rank=times.index(slowest),
                             p50_s=percentile(times, 50), p95_s=percentile(times, 95),
                             max_s=slowest, min_s=min(times)))

    def _gather_step_times(self, step_time: float) -> list[float]:
        """Every rank's step time (one all-gather of a float, not recorded as the run's traffic)."""
        if self.world == 1:
            return [step_time]
        local = torch.tensor([step_time], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world, dtype=torch.float64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if self.recorder is not None:
            with self.recorder.paused():
                gather(out, local)
        else:
            gather(out, local)
        return [float(x) for x in out.tolist()]

    def close(self) -> None:
        self.meter.stop()
        if self.pipeline is not None:
            self.pipeline.close()
        for h in self._hooks:
            h.remove()
        if self.recorder is not None:
            comm_meter.deactivate(self.recorder)


def make_instrument(trainer: Any, writer: EventWriter | None) -> Instrument | None:
    """The instrument of this rank, or None when instrumentation is off or there is no event
    writer (library calls such as the layout tests measure nothing)."""
    return Instrument(trainer, writer) if writer is not None and enabled(trainer.config) else None
