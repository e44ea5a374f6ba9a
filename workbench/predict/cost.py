"""What a run really costs: ``estimate_cost(config, tokens) -> CostEstimate``.

GPU-hours and wall time for a token budget at the predicted step time; the checkpoint's size and
the storage its retention needs; and the *effective* throughput once failures are counted.

Failures: a job on N nodes fails every ``M = node_mtbf_s / N`` seconds on average (independent
node failures; ``Cluster.node_mtbf_s`` defaults to Llama 3's observed rate). Each failure costs the
restart (re-scheduling, process-group setup, ``restart_s``), reading the last checkpoint back, and
the work done since it was written (on average half an interval). Checkpointing every ``tau``
seconds of work costs ``delta`` seconds each time (the part of the save that blocks training: all
of it when synchronous, the copy to host memory when asynchronous). The interval that minimises
the waste is Young's ``sqrt(2 delta M)`` with Daly's correction (Daly 2006, "A higher order
estimate of the optimum checkpoint interval for restart dumps", eq. 37):
``tau = sqrt(2 delta M) * (1 + sqrt(delta / (2M)) / 3 + delta / (9 * 2M)) - delta`` for delta < 2M.
The waste fraction is ``delta / tau + (tau / 2 + restart + restore) / M``; goodput = 1 - waste.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.spec.config import DTYPE_BYTES, RunConfig
from workbench.spec.errors import check_instance, check_int, check_positive
from workbench.predict.perf import StepPrediction, predict_step


@dataclass(frozen=True)
class CostEstimate:
    tokens: float
    steps: int
    step_time_s: float
    ideal_wall_s: float  # no failures, no checkpoints
    gpu_hours: float  # at the effective wall time
    checkpoint_bytes: int  # one checkpoint: model + optimizer (+ master) states, whole model
    storage_bytes: int  # retention x checkpoint_bytes
    save_s: float  # writing one checkpoint
    blocking_save_s: float  # the part of the save that stalls training
    restore_s: float
    job_mtbf_s: float
    checkpoint_interval_s: float  # Young/Daly optimum (or the one given)
    expected_failures: float
    lost_s: float  # expected time lost to failures and checkpoints over the run
    goodput: float  # useful fraction of the wall time
    effective_wall_s: float
    effective_tokens_per_s: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def checkpoint_bytes(config: RunConfig) -> int:
    """Bytes of one full checkpoint: parameters (the fp32 master copy when there is one, else the
    parameters as stored) and the optimizer states; gradients are not saved."""
    t = config.train
    n = config.model.n_params()
    weights = DTYPE_BYTES[t.master_dtype] if t.master_dtype else DTYPE_BYTES[t.param_dtype]
    return n * (weights + t.optimizer_states * DTYPE_BYTES[t.optim_dtype])


def optimal_checkpoint_interval(delta_s: float, mtbf_s: float) -> float:
    """Young/Daly: seconds of work between checkpoints that minimise the expected waste."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def estimate_cost(
    config: RunConfig,
    tokens: float,
    *,
    retention: int = 3,
    write_bytes_per_s_per_node: float = 2e9,
    read_bytes_per_s_per_node: float = 4e9,
    host_copy_bytes_per_s_per_gpu: float = 20e9,
    asynchronous: bool = True,
    restart_s: float = 300.0,
    checkpoint_interval_s: float | None = None,
    prediction: StepPrediction | None = None,
) -> CostEstimate:
    """GPU-hours, wall time, checkpoint storage and goodput of training ``config`` on ``tokens``.

    Storage figures are per node of a parallel file system (every node writes its shards);
    ``asynchronous`` checkpoints (torch.distributed.checkpoint's ``async_save``) block training
    only while the GPU shards are copied to host memory.
    """
    check_instance("config", config, RunConfig)
    check_positive("tokens", tokens)
    check_int("retention", retention)
    for name, rate in (("write_bytes_per_s_per_node", write_bytes_per_s_per_node),
                       ("read_bytes_per_s_per_node", read_bytes_per_s_per_node),
                       ("host_copy_bytes_per_s_per_gpu", host_copy_bytes_per_s_per_gpu)):
        check_positive(name, rate)
    check_positive("restart_s", restart_s, allow_zero=True)
    if checkpoint_interval_s is not None:
        check_positive("checkpoint_interval_s", checkpoint_interval_s)
    pred = prediction or predict_step(config)
    nodes = config.cluster.nodes
    steps = math.ceil(tokens / config.tokens_per_step)
    ideal = steps * pred.step_time_s
    size = checkpoint_bytes(config)
    save = size / (write_bytes_per_s_per_node * nodes)
    blocking = size / (host_copy_bytes_per_s_per_gpu * config.world_size) if asynchronous else save
    restore = size / (read_bytes_per_s_per_node * nodes)
    mtbf = config.cluster.node_mtbf_s / nodes
    tau = checkpoint_interval_s or optimal_checkpoint_interval(blocking, mtbf)
    waste = blocking / tau + (tau / 2 + restart_s + restore) / mtbf
    goodput = max(0.0, 1.0 - waste)
    effective = ideal / goodput if goodput > 0 else math.inf
    return CostEstimate(
        tokens=tokens,
        steps=steps,
        step_time_s=pred.step_time_s,
        ideal_wall_s=ideal,
        gpu_hours=effective * config.world_size / 3600,
        checkpoint_bytes=size,
        storage_bytes=size * retention,
        save_s=save,
        blocking_save_s=blocking,
        restore_s=restore,
        job_mtbf_s=mtbf,
        checkpoint_interval_s=tau,
        expected_failures=effective / mtbf,
        lost_s=effective - ideal,
        goodput=goodput,
        effective_wall_s=effective,
        effective_tokens_per_s=tokens / effective if effective > 0 else 0.0,
    )
