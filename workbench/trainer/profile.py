"""Balanced pipeline stages: measure each layer's time, then split the stages by it.

A short profiling run on one process times forward + backward of every block on one micro-batch
(and of the embedding and of the output layer with the loss), medians over a few repetitions.
:func:`balance_stages` feeds the costs to :func:`workbench.spec.plan.split_layers_by_cost` and returns
the RunConfig with ``plan.stage_layers`` set: the planner (memory, comms, schedule) and the
trainer (pipeline.py splits by ``plan.stage_layer_counts``) then read the same split.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from workbench.spec.config import RunConfig
from workbench.spec.plan import split_layers_by_cost
from workbench.trainer.transformer import build_model, materialize


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of forward + backward for one micro-batch."""

    layers: tuple[float, ...]
    embedding: float
    output: float


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_layer_costs(config: RunConfig, repeats: int = 3, device: str = "cpu") -> LayerCosts:
    """Time every block, the embedding and the output layer on one micro-batch of ``config``."""
    spec, t = config.model, config.train
    torch.manual_seed(t.seed)
    model = materialize(build_model(spec, "meta", t.moe_capacity_factor), device, t.seed)
    b, s = t.micro_batch_size, t.seq_len
    tokens = torch.randint(0, spec.vocab_size, (b, s), device=device)
    positions = torch.arange(s, device=device)
    hidden = torch.randn(b, s, spec.d_model, device=device)

    def run_embedding() -> None:
        model.zero_grad(set_to_none=True)
        h = model.tok_embeddings(tokens)
        if model.pos_embeddings is not None:
            h = h + model.pos_embeddings(positions)
        h.sum().backward()

    def run_block(block) -> None:
        x = hidden.detach().requires_grad_(True)
        block(x, positions).sum().backward()

    def run_output() -> None:
        x = hidden.detach().requires_grad_(True)
        logits = model.output(model.norm(x))
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    layers = tuple(_timed(lambda blk=blk: run_block(blk), repeats) for blk in model.layers.values())
    return LayerCosts(layers, _timed(run_embedding, repeats), _timed(run_output, repeats))


def balance_stages(config: RunConfig, costs: LayerCosts | None = None) -> RunConfig:
    """``config`` with its pipeline stages split by measured layer costs (unchanged if pp = 1)."""
    if config.plan.pp == 1:
        return config
    costs = costs or profile_layer_costs(config)
    counts = split_layers_by_cost(costs.layers, config.plan.n_stages, costs.embedding, costs.output)
    return RunConfig(config.model, config.cluster, replace(config.plan, stage_layers=counts), config.train)
