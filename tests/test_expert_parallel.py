"""Expert parallel: the trainer's MoE layer with experts sharded over EP ranks gives the outputs
and (after reduce_expert_grads) the gradients of the unsharded layer run on all ranks' tokens.

One torchrun job of 4 gloo processes checks ep=2 (EP groups {0,1}, {2,3}; expert-data-parallel
groups {0,2}, {1,3}: the ep x dp_shard layout) and ep=4, with a router skewed so that the
all-to-all splits are uneven (and some are empty); then the same job trains dp_shard=4 x ep=2,
and a job of 2 trains ep=2, against the single-process losses (torchrun through tests/dist.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist import LOSS_SETTINGS, max_rel_diff, run_torchrun
from dist import make_config as _make_config
from workbench.spec.errors import ConfigError
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.trainer.expert_parallel import (
    apply_ep,
    expert_data_parallel_ranks,
    expert_params,
    local_expert_range,
    reduce_expert_grads,
)

WORLD = 4
SEED = 5
TOKENS = 24  # per rank


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _spec() -> ModelSpec:
    return ModelSpec(n_layers=1, d_model=16, n_heads=2, vocab_size=32, n_experts=4, top_k=2, moe_d_ff=24,
                     n_shared_experts=1, name="tiny-moe")


# ---------------------------------------------------------------------- no processes
def test_expert_groups_follow_the_plan() -> None:
    plan = ParallelPlan(dp_shard=4, ep=2).resolve(4)
    assert plan.group_ranks("ep") == [[0, 1], [2, 3]]
    assert expert_data_parallel_ranks(plan) == [[0, 2], [1, 3]]
    # EP borrows from dp_shard x cp; TP peers never share an expert-data-parallel group.
    plan = ParallelPlan(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=2).resolve(16)
    groups = expert_data_parallel_ranks(plan)
    assert sorted(len(g) for g in groups) == [4] * 4  # 16 ranks in groups of dp_replicate x dp_shard x cp / ep
    for g in groups:
        coords = [plan.rank_coords(r) for r in g]
        assert len({(c["tp"], c["pp"], c["ep"]) for c in coords}) == 1
    no_rep = expert_data_parallel_ranks(plan, include_replicate=False)
    assert sorted(len(g) for g in no_rep) == [2] * 8
    assert local_expert_range(8, 1, 4) == (2, 4)
    with pytest.raises(ConfigError, match="ep=3 does not divide n_experts=8"):
        local_expert_range(8, 0, 3)


# ---------------------------------------------------------------------- multi-rank
def _skew_router(model: torch.nn.Module, u: torch.Tensor) -> None:
    """Make the router prefer experts 0 and 1 for tokens along +u, 2 and 3 along -u."""
    gate = model.layers["0"].moe.router.gate.weight
    with torch.no_grad():
        gate[0] += 3 * u
        gate[1] += 2 * u
        gate[2] -= 2 * u
        gate[3] -= 3 * u


def _ep_case(rank: int, ep_group, edp_group, n_ranks: int) -> dict[str, float]:
    from workbench.trainer.transformer import build_model, materialize

    spec = _spec()
    ref = materialize(build_model(spec, device="cpu"), "cpu", seed=SEED)
    model = build_model(spec, device="meta")
    apply_ep(model, ep_group)
    materialize(model, "cpu", seed=SEED)  # init_weights fills each rank's DTensor shard
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)

    g = torch.Generator().manual_seed(11)
    u = torch.nn.functional.normalize(torch.randn(spec.d_model, generator=g), dim=0)
    for m in (ref, model):
        _skew_router(m, u)
    # Every rank's tokens: rank r leans towards +u, -u or neither, so loads differ per rank too.
    lean = torch.tensor([2.0, 1.0, -2.0, 0.0])[:n_ranks]
    x_all = torch.randn(n_ranks, TOKENS, spec.d_model, generator=g) + lean[:, None, None] * u
    w_all = torch.randn(n_ranks, TOKENS, spec.d_model, generator=g)

    errs: dict[str, float] = {}
    ref_moe, moe = ref.layers["0"].moe, model.layers["0"].moe
    lo, hi = local_expert_range(spec.n_experts, ep_rank, ep)
    local_w1 = moe.experts.w1.to_local()
    errs["init w1 slice"] = rel_err(local_w1, ref_moe.experts.w1[lo:hi])
    # The shards add up to the unsharded parameter count.
    numel = torch.tensor([sum(p.to_local().numel() for p in expert_params(model))])
    dist.all_reduce(numel, group=ep_group)
    errs["numel mismatch"] = float(numel.item() != sum(p.numel() for p in expert_params(ref)))

    # Reference: the unsharded layer on every rank's tokens at once; objective = mean over ranks.
    x_ref = x_all.reshape(1, n_ranks * TOKENS, -1).clone().requires_grad_()
    out_ref = ref_moe(x_ref).reshape(n_ranks, TOKENS, -1)
    ((out_ref * w_all).sum() / n_ranks).backward()

    x = x_all[rank][None].clone().requires_grad_()
    out = moe(x)
    (out[0] * w_all[rank]).sum().backward()
    reduce_expert_grads(model, edp_group)

    errs["out"] = rel_err(out[0], out_ref[rank].detach())
    errs["dx"] = rel_err(x.grad[0] / n_ranks, x_ref.grad[0].reshape(n_ranks, TOKENS, -1)[rank])
    for name in ("w1", "w2", "w3"):
        local_grad = getattr(moe.experts, name).grad.to_local()
        errs[f"grad {name}"] = rel_err(local_grad, getattr(ref_moe.experts, name).grad[lo:hi])
    for name, p in moe.named_parameters():  # dense weights: the mean FSDP/DDP would take
        if "experts." in name and "shared" not in name:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        errs[f"grad {name}"] = rel_err(grad / n_ranks, dict(ref_moe.named_parameters())[name].grad)

    # Recorded load: my local experts processed what every EP rank routed to them.
    counts = ref_moe.tokens_per_expert.new_zeros(spec.n_experts)
    for r in dist.get_process_group_ranks(ep_group):  # reference counts of my EP group's tokens
        routed = ref_moe.router(x_all[r])[2].reshape(-1)
        counts += torch.bincount(routed, minlength=spec.n_experts)
    errs["tokens_received mismatch"] = float(not torch.equal(moe.experts.tokens_received, counts[lo:hi]))
    # The skew did its job: this rank's routing is uneven, and on some rank a split is empty.
    sent = moe.tokens_per_expert
    errs["uneven"] = float(sent.max().item() > 2 * sent.min().item())
    errs["empty split"] = float(sent.min().item() == 0)
    return errs


def ep_checks(rank: int) -> dict[str, dict[str, float]]:
    """The MoE layer under ep=2 and ep=4 on a world of 4 (dp_shard=4)."""
    results = {}
    for ep in (2, 4):
        plan = ParallelPlan(dp_shard=WORLD, ep=ep).resolve(WORLD)
        # Every rank creates every group, in the same order (new_group's contract).
        ep_groups = {tuple(g): dist.new_group(g) for g in plan.group_ranks("ep")}
        edp_groups = {tuple(g): dist.new_group(g) for g in expert_data_parallel_ranks(plan)}
        mine = lambda groups: next(pg for ranks, pg in groups.items() if rank in ranks)  # noqa: E731
        results[f"ep={ep}"] = _ep_case(rank, mine(ep_groups), mine(edp_groups), WORLD)
    return results


# ---------------------------------------------------------------------- whole training runs
STEPS = LOSS_SETTINGS["steps"]
RTOL = 1e-4
MODEL = "tiny-moe"


def make_config(plan_text: str, world: int):
    """The settings of tests/test_trainer_layouts.py (fp32, pydoc corpus, 10 steps), MoE model."""
    return _make_config(plan_text, world, MODEL)


def run_worker(out_dir: str, items: list[str]) -> None:
    """One rank of a torchrun job. Item "moe": the layer checks (world size 4); any other item: a
    training layout. Rank 0 writes each item's result to ``out_dir/<n>.json`` as soon as it has it,
    so that a failing training run does not hide the layer checks."""
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    torch.set_num_threads(1)
    for n, item in enumerate(items):
        if item == "moe":
            result: object = [None] * world
            dist.all_gather_object(result, ep_checks(rank))
        else:
            result = run_training(make_config(item, world))
        if rank == 0:
            Path(out_dir, f"{n}.json").write_text(json.dumps({"item": item, "result": result}))


class Job:
    """A finished torchrun job and what its rank 0 wrote."""

    def __init__(self, world: int, items: list[str], out_dir: Path):
        # not check=True: what rank 0 wrote before a failure still counts (see get)
        self.proc = run_torchrun("test_expert_parallel:run_worker", world, [str(out_dir), items], timeout=300,
                                 check=False)
        self.results = {}
        for f in out_dir.glob("*.json"):
            data = json.loads(f.read_text())
            self.results[data["item"]] = data["result"]

    def get(self, item: str):
        assert item in self.results, f"job failed before {item!r}:\n" + self.proc.stdout[-3000:] + self.proc.stderr[-6000:]
        return self.results[item]


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Job:
    """One torchrun job of 4 ranks: the layer checks, then ep x dp_shard training, with experts
    over half the world and over all of it (one job: a world-2 job of its own cost 14 s of start-up)."""
    return Job(WORLD, ["moe", "dp_shard=4,ep=2", "dp_shard=4,ep=4"], tmp_path_factory.mktemp("ep4"))


@pytest.fixture(scope="module")
def reference(reference_losses) -> list[float]:
    return reference_losses(MODEL)


@pytest.mark.multiprocess
def test_expert_parallel_equals_unsharded_moe(world4: Job) -> None:
    worst: dict[str, float] = {}
    for per_rank in world4.get("moe"):
        for case, errs in per_rank.items():
            for what, err in errs.items():
                worst[f"{case} {what}"] = max(worst.get(f"{case} {what}", 0.0), err)
    print("\nmax relative errors:\n" + "\n".join(f"  {k}: {v:.2e}" for k, v in sorted(worst.items())))
    assert len(worst) == 2 * 14
    for key, err in worst.items():
        if key.endswith(("uneven", "empty split")):
            assert err == 1.0, f"{key}: the router skew did not make the splits uneven"
        elif key.endswith("mismatch"):
            assert err == 0.0, key
        else:
            assert err < 1e-5, f"{key}: relative error {err:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, layout", [(4, "dp_shard=4,ep=2"), (4, "dp_shard=4,ep=4")])
def test_training_losses_equal_single_process(world: int, layout: str, reference, world4: Job, tmp_path) -> None:
    losses = world4.get(layout) if world == WORLD else Job(world, [layout], tmp_path).get(layout)
    diff = max_rel_diff(losses, reference)
    print(f"\n{layout}: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert reference[-1] < reference[0] - 0.1
    assert diff <= RTOL, f"{layout}: {losses} vs {reference}"

