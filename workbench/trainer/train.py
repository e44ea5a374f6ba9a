"""The training loop: ``python -m workbench.trainer runs/<id>/config.json`` under torchrun.

One step, whatever the layout:

1. read this data-parallel rank's slice of the global batch (``data.BatchLoader``);
2. forward + backward over its micro-batches: gradient accumulation (pp = 1; each micro-batch
   loss is divided by their number) or a pipeline schedule (pp > 1, same scaling); with dropout,
   the model is told the step and each row's global sample index (the masks' keys);
3. finish the gradients that backward leaves partial (experts over their data-parallel ranks,
   tied embeddings over the first and last stage), then clip them by their global L2 norm (over
   every shard, stage and expert; a tied pair counted once);
4. AdamW step (warm-up then cosine decay to ``min_lr_ratio * lr``);
5. log the global mean loss (averaged over the data-parallel and context-parallel ranks) as a
   "step" event.

Precision: parameters, gradients and optimizer states are fp32 (the fp32 master); on CUDA with a
bf16 ``compute_dtype`` matmuls run in bf16 (FSDP2 MixedPrecisionPolicy with fp32 gradient
reduction, or autocast where no data-parallel wrapper casts). On CPU everything is fp32.

Deterministic mode (``train.deterministic``): ``torch.use_deterministic_algorithms(True)``,
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, cuDNN benchmarking off, fixed seeds. Same layout, seed and
data then give bit-identical losses across runs. Limits: only for the same layout and world size
(other layouts reduce in another order: equal to ~1e-6, not bitwise), the same hardware and
library versions; ops without a deterministic kernel raise instead of running. Cost: typically a
few percent on GPU (deterministic scatter/index_add kernels, no cuBLAS split-K autotuning); none
on CPU.

How a rank ends (its last event, run_end, with ``step`` = the next step to run, i.e. the steps
completed, whatever the status): "ok"; "stopped" (a guard fired: the ``guard`` event before it says
which and why, and rank 0 prints that line on stderr); "error" (it raised: an ``error`` event, one
line on stderr); "interrupted" (SIGTERM: from the launcher, from torchrun stopping the job, or the
parent-death signal when torchrun itself was killed: lifeline.py). A rank with no run_end was
killed outright (SIGKILL, the OOM killer, a lost node; or, in the rare case that its SIGTERM
handler could not run for 10 s, lifeline.py's watchdog).
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from workbench.spec.config import RunConfig
from workbench.spec.trainable import check_trainable
from workbench.rundir.events import Error, EventWriter, RunEnd, RunStart, Step
from workbench.trainer.checkpoint import Checkpointer, note_restart, restart_count
from workbench.trainer.console import say
from workbench.trainer.context_parallel import shard_sequence
from workbench.trainer.data import BatchLoader, load_tokens
from workbench.trainer.expert_parallel import reduce_expert_grads
from workbench.trainer.faults import Faults
from workbench.trainer.instrument import make_instrument
from workbench.trainer.lifeline import tie_to_parent, watch_parent
from workbench.trainer.mesh import Meshes, build_meshes, check_mesh
from workbench.trainer.parallelize import Parallelized, parallelize
from workbench.trainer.pipeline import (
    PipelineSchedule,
    build_schedule,
    build_stages,
    holds_first,
    holds_last,
    sum_tied_grads,
    tied_copies,
    tied_embedding_group,
)
from workbench.trainer.transformer import Transformer, build_model, materialize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PG_TIMEOUT_S = float(os.environ.get("WORKBENCH_PG_TIMEOUT_S", "300"))


# --------------------------------------------------------------------------- process group


def init_distributed() -> tuple[int, int, torch.device, str]:
    """Initialise the default process group from torchrun's environment (gloo on CPU, NCCL on
    CUDA), with a timeout so that a lost peer ends the job instead of hanging it."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                                **({"device_id": device} if backend == "nccl" else {}))
    return rank, world, device, backend


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


# --------------------------------------------------------------------------- optimisation


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio * lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(params: list[torch.nn.Parameter], config: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases). Fused on CUDA for plain tensors,
    foreach on CUDA for DTensors, the reference loop on CPU."""
    t = config.train
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        if any(isinstance(p, DTensor) for p in params):
            kw["foreach"] = True
        else:
            kw["fused"] = True
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.betas[0])
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=t.lr, betas=t.betas, eps=1e-8, **kw)


@torch.no_grad()
def settle_grad_placements(params: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements, once per step.

    Under tensor parallelism without FSDP, DTensor leaves some gradients in another layout than
    their parameter: the sequence-parallel norm weights' as Partial sums (each rank saw a slice of
    the tokens), the vocabulary-split embedding's whole. Left so, every optimizer op that reads
    them redistributes again (four all-reduces per norm weight per step with AdamW) and the
    embedding's gradient takes tp times its share of memory. Settling them here costs one
    all-reduce per Partial gradient (what workbench.predict.comms predicts) and a local slice for the rest.
    """
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group=None,
                   copies: set[int] | frozenset[int] = frozenset()) -> float:
    """Global L2 norm of all gradients, then scale them by min(1, max_norm / norm).

    DTensor gradients (FSDP, TP, EP shards) contribute their full norm: the shards' squared local
    norms are summed over the mesh dimensions they are partial on (replicated ones are counted
    once), with one all-reduce per (mesh, placements) kind and dimension, not one per gradient as
    ``full_tensor`` per norm would issue (a block has ~9 gradient tensors: hundreds of scalar
    collectives a step on a large model); pipeline stages hold disjoint parameters, so their
    squared norms are summed over the pp group. ``copies``: ids of parameters whose gradient
    duplicates another's (a tied output projection on the last stage): scaled, not counted."""
    settle_grad_placements(params)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    partial: dict[tuple, list[torch.Tensor]] = {}
    for g in (p.grad for p in params if p.grad is not None and id(p) not in copies):
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            # the local value of a norm partial over a mesh dimension is this shard's norm
            partial.setdefault((n.device_mesh, tuple(n.placements)), []).append(n.to_local().float() ** 2)
        else:
            total_sq += n * n
    for (mesh, placements), squares in partial.items():
        kind_sq = torch.stack(squares).sum()
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(kind_sq, group=mesh.get_group(dim))
        total_sq += kind_sq
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    norm = float(total_sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------- the trainer


@dataclass
class Trainer:
    """Everything one rank holds for a run: modules, optimizer, data and the step counter."""

    config: RunConfig
    rank: int
    device: torch.device
    meshes: Meshes
    modules: list[Transformer]
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    n_microbatches: int
    pipeline: PipelineSchedule | None = None  # when pp > 1
    dp_wrapped: bool = False  # a data-parallel wrapper casts and syncs gradients (Parallelized)
    tied_group: dist.ProcessGroup | None = None  # tied embeddings on two pipeline ranks: the pair's group
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def sample_indices(self) -> torch.Tensor:
        """Global sample indices (in the step's global batch) of this rank's rows."""
        local = self.loader.local_batch_size
        return torch.arange(local, device=self.device) + self.loader.dp_rank * local


def _positions_for_cp(trainer: "Trainer", tokens: torch.Tensor, targets: torch.Tensor):
    plan = trainer.config.plan
    if plan.cp == 1:
        return tokens, targets, None
    return shard_sequence(tokens, targets, trainer.meshes.local_rank("cp"), plan.cp)


def setup(config: RunConfig, rank: int, device: torch.device) -> Trainer:
    """Build the mesh, the (sharded, staged) model, the optimizer and the data loader."""
    plan, t = config.plan, config.train
    check_trainable(config)  # library callers too (main checks before the process group starts)
    set_determinism(t.seed, t.deterministic)
    meshes = build_meshes(plan, device.type)
    if dist.is_initialized():
        check_mesh(meshes, rank)
    compute = DTYPES[t.compute_dtype] if device.type == "cuda" else torch.float32
    meta = build_model(config.model, "meta", t.moe_capacity_factor, t.dropout_rate if t.dropout else 0.0, t.seed)
    n_micro = config.n_microbatches
    wrapped: list[Parallelized] = []

    def prepare(module: Transformer) -> Transformer:
        wrapped.append(parallelize(module, meshes, plan, t.recompute, compute))
        materialize(module, device, t.seed)
        for moe in module.moe_layers():
            moe.aux_loss_weight = t.moe_aux_loss_coeff / n_micro
        return module

    pipeline = None
    if plan.pp > 1:
        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return cross_entropy(logits, targets) / n_micro

        stages, modules = build_stages(meta, plan, meshes.local_rank("pp"), meshes.group("pp"), device, prepare)
        pipeline = build_schedule(plan, stages, n_micro, loss_fn)
    else:
        modules = [prepare(meta)]
    params = [p for m in modules for p in m.parameters()]
    optimizer = build_optimizer(params, config, device)
    tokens = load_tokens(t.dataset, t.data_path, config.model.vocab_size, t.seed)
    loader = BatchLoader(tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                         dp_rank=meshes.local_rank("dp"), dp_size=plan.dp, seed=t.seed)
    # every module of this rank is parallelised alike: the first one's wrapper says it for all
    return Trainer(config, rank, device, meshes, modules, optimizer, loader, n_micro, pipeline,
                   dp_wrapped=wrapped[0].casts_compute_dtype,
                   tied_group=tied_embedding_group(plan, config.model.tie_embeddings))


def _autocast(trainer: Trainer):
    t = trainer.config.train
    if trainer.device.type == "cuda" and t.compute_dtype != "fp32" and not trainer.dp_wrapped:
        return torch.autocast("cuda", dtype=DTYPES[t.compute_dtype])
    return torch.autocast(trainer.device.type, enabled=False)


def _loss_parallel(trainer: Trainer):
    if trainer.config.plan.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    import contextlib

    return contextlib.nullcontext()


def train_step(trainer: Trainer) -> dict[str, Any]:
    """One optimizer step; returns the metrics of the "step" event."""
    config, plan, t = trainer.config, trainer.config.plan, trainer.config.train
    step = trainer.step
    lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    tokens, targets = trainer.loader.next_batch()
    data_wait = time.perf_counter() - t0
    tokens, targets, positions = _positions_for_cp(trainer, tokens, targets)
    tokens, targets = tokens.to(trainer.device), targets.to(trainer.device)
    if positions is not None:
        positions = positions.to(trainer.device)
    local_loss = torch.zeros((), device=trainer.device)
    b, m = t.micro_batch_size, trainer.n_microbatches
    # Dropout masks are keyed by the step and each row's global sample index (transformer.py).
    samples = trainer.sample_indices() if t.dropout else None
    for module in trainer.modules:
        module.dropout_step = step
    with _autocast(trainer), _loss_parallel(trainer):
        if trainer.pipeline is not None:
            pp_rank = trainer.meshes.local_rank("pp")
            for module in trainer.modules:
                module.default_positions = positions
            losses: list[torch.Tensor] = []
            args = (tokens,) if holds_first(plan, pp_rank) else ()
            # Keyword tensors are split into micro-batches like the inputs and reach every stage.
            kwargs = {} if samples is None else {"samples": samples}
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # logits until the step ends (m x s x V values); the losses are all the step needs.
            if holds_last(plan, pp_rank):
                trainer.pipeline.schedule.step(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
                local_loss = torch.stack([_plain(x.detach()).float() for x in losses]).sum()
            else:
                trainer.pipeline.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            model = trainer.modules[0]
            for i in range(m):
                if trainer.dp_wrapped:
                    # Reduce gradients once, after the last micro-batch (same sum, less traffic).
                    model.set_requires_gradient_sync(i == m - 1)
                x, y = tokens[i * b : (i + 1) * b], targets[i * b : (i + 1) * b]
                rows = None if samples is None else samples[i * b : (i + 1) * b]
                loss = cross_entropy(model(x, positions, rows), y) / m
                loss.backward()
                local_loss += _plain(loss.detach()).float()
    if plan.ep > 1:
        for module in trainer.modules:
            reduce_expert_grads(module, trainer.meshes.expert_dp_group)
    if config.model.tie_embeddings and plan.pp > 1:
        settle_grad_placements(trainer.params)  # the pair's local shards must match before they are summed
        sum_tied_grads(trainer.modules, trainer.tied_group)
    grad_norm = clip_grad_norm(trainer.params, t.grad_clip, trainer.meshes.group("pp"), tied_copies(trainer.modules))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    # The loss lives on the last pipeline stage: sum it over pp, then average over dp x cp.
    if plan.pp > 1:
        dist.all_reduce(local_loss, group=trainer.meshes.group("pp"))
    if plan.dp * plan.cp > 1:
        dist.all_reduce(local_loss, group=trainer.meshes.group("dp_cp"))
        local_loss /= plan.dp * plan.cp
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    trainer.step += 1
    metrics: dict[str, Any] = dict(step=step, loss=float(local_loss), grad_norm=grad_norm, lr=lr,
                                   tokens=config.tokens_per_step, tokens_per_s=config.tokens_per_step / dt,
                                   step_time_s=dt, data_wait_s=data_wait)
    moes = [moe for module in trainer.modules for moe in module.moe_layers()]
    if moes:
        metrics["aux_loss"] = float(sum(float(moe.aux_loss) for moe in moes) / len(moes))
        metrics["tokens_per_expert"] = [moe.tokens_per_expert.tolist() for moe in moes]
    return metrics


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A loss value as a plain tensor (loss parallel makes it a replicated DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class Losses(list):
    """Per-step losses of this attempt, plus where it ended: ``final_step`` (the next step to
    run, counted from the start of the whole run, resumes included) and ``guard`` (the guard
    event that stopped it, or None)."""

    final_step: int = 0
    guard: Any = None


def run_training(config: RunConfig, writer: EventWriter | None = None, steps: int | None = None,
                 run_dir: str | Path | None = None, resume: bool = False, losses: Losses | None = None) -> Losses:
    """Train ``config`` in this process (one rank of an initialised job, or alone when the world
    size is 1); emit events to ``writer``; return the per-step losses. ``steps``: how many to run
    (default: up to ``config.train.steps_to_run``). With ``run_dir``, checkpoint into
    ``<run_dir>/checkpoints`` and, with ``resume``, first load the latest good one (checkpoint.py).
    ``losses``: the object to fill and return; its ``final_step`` is kept current as the run goes,
    so a caller that sees this function raise still knows the last step completed."""
    losses = Losses() if losses is None else losses
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != config.world_size:
        raise RuntimeError(f"the job has {world} processes but the config's world size is {config.world_size}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    trainer = setup(config, rank, device)
    faults = Faults.from_env()  # the recovery drill's and the tests' fault injection (faults.py)
    checkpointer = _checkpointer(trainer, writer, run_dir, resume, faults)
    losses.final_step = trainer.step  # > 0 after a resume
    if writer is not None:
        n_local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.params)
        writer.emit(RunStart(world_size=world, mesh=dict(config.plan.mesh_dims()),
                             coords=config.plan.rank_coords(rank), device=str(device),
                             backend=dist.get_backend() if dist.is_initialized() else "none",
                             n_params=config.model.n_params(), n_local_params=n_local, steps=config.train.steps,
                             step=trainer.step))
    instrument = make_instrument(trainer, writer)  # None: instrumentation off, or nowhere to write
    for _ in range(steps if steps is not None else max(0, config.train.steps_to_run - trainer.step)):
        faults.before_step(trainer)
        if instrument is not None:
            instrument.begin_step(trainer.step)
        metrics = train_step(trainer)
        losses.final_step = trainer.step
        guard = instrument.end_step(metrics) if instrument is not None else None
        losses.append(metrics["loss"])
        if writer is not None:
            writer.emit(Step(**metrics))
        if checkpointer is not None:
            checkpointer.after_step()
        if guard is not None:
            writer.emit(guard)  # a guard fired: stop cleanly (finish() below saves a final checkpoint)
            if rank == 0:
                say(f"[workbench] stopped by guard {guard.guard}: {guard.message}")
            losses.guard = guard
            break
    if instrument is not None:
        instrument.close()
    if checkpointer is not None:
        checkpointer.finish()
    return losses


def _checkpointer(trainer: Trainer, writer: EventWriter | None, run_dir: str | Path | None,
                  resume: bool, faults: Faults | None = None) -> Checkpointer | None:
    """Checkpoints need a run directory; resuming loads the latest good one into ``trainer``."""
    if run_dir is None:
        return None
    checkpointer = Checkpointer(run_dir, trainer, writer, faults)
    if resume:
        checkpointer.resume()
    return checkpointer


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


# A stopping job's ranks get their SIGTERM one after another: a rank whose peer has already
# exited can see the peer's socket close (gloo: "Connection reset by peer") a few milliseconds
# before its own signal. Such an error is the stop, not a failure, when the signal follows.
STOP_GRACE_S = 2.0
# How a peer's exit reads in a collective's error (gloo's TCP transport, NCCL's).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator")


def _stop_follows(error: BaseException, grace_s: float = STOP_GRACE_S) -> bool:
    """After a distributed error: True when this rank's own stop signal arrives within ``grace_s``
    (the SIGTERM handler raises KeyboardInterrupt inside the wait). A real failure waits
    ``grace_s`` longer before it is reported."""
    lost_peer = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in _PEER_LOST))
    if not lost_peer:
        return False
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
    except KeyboardInterrupt:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Entry point under torchrun: ``python -m workbench.trainer <run_dir>/config.json [--resume]``.

    ``--resume`` (or a torchrun restart: ``TORCHELASTIC_RESTART_COUNT > 0``) continues from the
    latest good checkpoint in ``<run_dir>/checkpoints``."""
    argv = sys.argv[1:] if argv is None else argv
    resume = "--resume" in argv or restart_count() > 0
    argv = [a for a in argv if a != "--resume"]
    if len(argv) != 1:
        print("usage: python -m workbench.trainer runs/<id>/config.json [--resume]", file=sys.stderr)
        return 2
    config_path = Path(argv[0])
    run_dir = config_path.parent
    rank = int(os.environ.get("RANK", "0"))
    # A stop (the launcher's or torchrun's SIGTERM, or the parent-death signal when torchrun itself
    # died) is an interruption, not an error: it ends the run with run_end "interrupted" at the last
    # completed step, which a later resume reports as such.
    signal.signal(signal.SIGTERM, _interrupt)
    if not tie_to_parent(signal.SIGTERM):  # already armed by __main__ under torchrun; here for library callers
        say(f"[workbench] rank {rank}: the process that started this rank has already exited; not starting")
        return 1
    watch_parent()
    writer = EventWriter(run_dir, rank)
    t_start = time.time()
    progress = Losses()  # run_training keeps progress.final_step current: the step an error ends at
    try:
        config = RunConfig.load(str(config_path))
        check_trainable(config)  # the launchers checked too; a hand-written config.json may not be
        if config.train.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        if resume:
            note_restart(run_dir, rank, writer)  # before this attempt logs anything
        init_distributed()
        losses = run_training(config, writer, run_dir=run_dir, resume=resume, losses=progress)
        status = "stopped" if losses.guard is not None else "ok"
        writer.emit(RunEnd(status=status, step=losses.final_step, elapsed_s=time.time() - t_start))
        writer.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    except BaseException as e:  # noqa: BLE001 - report everything, then die fast
        # One line (stderr, the error event): the traceback goes into the event's own field.
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        message = f"rank {rank}: {type(e).__name__}: {first}"
        interrupted = isinstance(e, KeyboardInterrupt) or _stop_follows(e)
        # The run is ending: a second stop signal (torchrun's SIGTERM after the launcher's, the
        # parent-death signal when torchrun exits first) must not interrupt the run_end below.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            if not interrupted:
                writer.emit(Error(error=message, traceback=traceback.format_exc()))
            writer.emit(RunEnd(status="interrupted" if interrupted else "error",
                               step=progress.final_step, elapsed_s=time.time() - t_start))
            writer.close()
        finally:
            say(f"[workbench] {message}")
            sys.stdout.flush()
            # Exit now, without tearing down the process group (that could wait on peers that are
            # blocked in a collective): torchrun sees the non-zero exit and stops the other ranks.
            os._exit(1)
