"""Context parallel: load-balanced sharding, and ring attention equal to full causal attention.

The multi-rank checks run in one set of 4 gloo processes (torch.multiprocessing spawn): the CP
group of all 4 ranks and the two CP groups {0, 1}, {2, 3} of size 2, so one start-up serves all.
Then whole training runs of the bundled trainer (torchrun through tests/dist.py): cp=2 and
cp=2 x tp=2 give the single-process losses. Latent attention's values are narrower than its keys:
the ring pads them (a case without processes, and a latent-attention model case in the job).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import LOSS_SETTINGS, make_config, max_rel_diff, run_torchrun
from workbench.spec.errors import ConfigError
from workbench.trainer.context_parallel import (
    apply_cp,
    chunk_ids,
    gather_sequence,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

WORLD = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (a relative error that a near-zero entry cannot inflate)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------------- sharding (no processes)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_sequence_takes_chunks_i_and_mirror(cp: int) -> None:
    S = 8 * cp
    tokens = torch.arange(2 * S).reshape(2, S)  # token value = its position (+ S in row 1)
    targets = tokens + 1000
    c = S // (2 * cp)
    locals_ = []
    for r in range(cp):
        tl, gl, pos = shard_sequence(tokens, targets, r, cp)
        a, b = chunk_ids(r, cp)
        assert (a, b) == (r, 2 * cp - 1 - r)
        want = list(range(a * c, (a + 1) * c)) + list(range(b * c, (b + 1) * c))
        assert pos.tolist() == want
        assert tl[0].tolist() == want and tl[1].tolist() == [S + w for w in want]
        assert torch.equal(gl, tl + 1000)
        locals_.append(tl)
    assert torch.equal(unshard_sequence(locals_), tokens)
    # Balanced causal work: every rank's queries see the same number of keys.
    work = [sum(p + 1 for p in shard_sequence(tokens, None, r, cp)[2].tolist()) for r in range(cp)]
    assert len(set(work)) == 1


def test_shard_sequence_rejects_indivisible_length() -> None:
    with pytest.raises(ConfigError, match=r"seq_len=12 is not divisible by 2 x cp = 8") as e:
        shard_sequence(torch.zeros(1, 12, dtype=torch.long), None, 0, 4)
    assert e.value.field == "cp"
    with pytest.raises(ConfigError, match="cp_rank=2"):
        chunk_ids(2, 2)


def test_ring_attention_without_process_group_is_causal_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    out = ring_attention(q, k, v, None)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(out, ref) < 1e-6
    with pytest.raises(ConfigError, match="n_kv_heads=3 does not divide n_heads=4"):
        ring_attention(q, torch.zeros(2, 3, 6, 8), torch.zeros(2, 3, 6, 8))


def test_ring_attention_takes_values_of_another_width() -> None:
    g = torch.Generator().manual_seed(1)
    for dv in (4, 12):  # latent attention: v_head_dim narrower (or wider) than qk_nope + qk_rope
        q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
        k = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
        v = torch.randn(2, 4, 6, dv, generator=g, requires_grad=True)
        out = ring_attention(q, k, v, None)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.shape == (2, 4, 6, dv) and rel_err(out, ref) < 1e-6
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for got, want in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))):
            assert rel_err(got, want) < 1e-5


# ---------------------------------------------------------------------- multi-rank
def _ring_case(cp_rank: int, cp: int, group, dtype: torch.dtype, n_heads: int, n_kv: int) -> dict[str, float]:
    """Ring attention on this rank's shard vs full causal attention (fp64) on the whole sequence."""
    B, S, D = 2, 8 * cp, 8
    g = torch.Generator().manual_seed(1234 + cp)  # same full tensors on every rank
    q = torch.randn(B, n_heads, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_kv, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, n_heads, S, D, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ref.backward(dout)

    _, _, pos = shard_sequence(torch.zeros(1, S), None, cp_rank, cp)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(2, pos)

    ql, kl, vl = (local(t).to(dtype).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, group)
    out.backward(local(dout).to(dtype))
    errs = {
        "out": rel_err(out, local(ref)),
        "dq": rel_err(ql.grad, local(ref_in[0].grad)),
        "dk": rel_err(kl.grad, local(ref_in[1].grad)),
        "dv": rel_err(vl.grad, local(ref_in[2].grad)),
    }
    # The gathered output is the full output in token order.
    errs["gathered"] = rel_err(gather_sequence(out.detach(), group, dim=2), ref)
    return errs


def _tiny_spec():
    from workbench.spec.model import ModelSpec

    return ModelSpec(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, name="tiny-cp")


def _tiny_mla_spec():
    from workbench.spec.model import ModelSpec

    return ModelSpec(n_layers=2, d_model=32, n_heads=4, vocab_size=64, q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, name="tiny-mla-cp")


def _model_case(cp_rank: int, cp: int, group, spec=None) -> dict[str, float]:
    """The trainer's Transformer with apply_cp: same logits and (CP-averaged) gradients."""
    from workbench.trainer.transformer import build_model, materialize

    torch.manual_seed(0)
    ref_model = materialize(build_model(spec or _tiny_spec(), device="cpu"), "cpu", seed=7)
    cp_model = apply_cp(copy.deepcopy(ref_model), group)
    B, S = 2, 8 * cp
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, 64, (B, S), generator=g)
    targets = torch.randint(0, 64, (B, S), generator=g)

    logits = ref_model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    tl, gl, pos = shard_sequence(tokens, targets, cp_rank, cp)
    local_logits = cp_model(tl, pos)
    F.cross_entropy(local_logits.flatten(0, 1), gl.flatten()).backward()
    errs = {"logits": rel_err(gather_sequence(local_logits.detach(), group, dim=1), logits)}
    worst = 0.0
    for (name, p_ref), (_, p_cp) in zip(ref_model.named_parameters(), cp_model.named_parameters()):
        grad = p_cp.grad.clone()
        dist.all_reduce(grad, group=group)  # what FSDP over dp_shard x cp does (mean of local means)
        worst = max(worst, rel_err(grad / cp, p_ref.grad))
    errs["param_grads"] = worst
    return errs


def ring_checks(rank: int) -> dict[str, dict[str, float]]:
    """All ring-attention cases on a world of 4: cp=4 (everyone) and cp=2 (pairs {0,1}, {2,3})."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results = {}
    for cp, group, cp_rank in ((4, dist.group.WORLD, rank), (2, pair, rank % 2)):
        for dtype in (torch.float64, torch.float32):
            for n_heads, n_kv in ((4, 2), (2, 2), (4, 1)):
                key = f"cp={cp} {str(dtype)[6:]} heads={n_heads}/{n_kv}"
                results[key] = _ring_case(cp_rank, cp, group, dtype, n_heads, n_kv)
        results[f"cp={cp} model"] = _model_case(cp_rank, cp, group)
        results[f"cp={cp} latent-attention model"] = _model_case(cp_rank, cp, group, _tiny_mla_spec())
    return results


# ---------------------------------------------------------------------- whole training runs
# make_config (tests/dist.py): the settings of tests/test_trainer_layouts.py (fp32, pydoc corpus, 10 steps)
STEPS = LOSS_SETTINGS["steps"]
RTOL = 1e-4


def run_worker(out_path: str, model: str, layouts: list[str]) -> None:
    """One rank of a torchrun job: the ring checks (a "ring" item, world size 4), then train each
    layout; rank 0 writes {"ring": [per-rank errors], layout: losses}."""
    from workbench.trainer.train import init_distributed, run_training

    rank, world, _, _ = init_distributed()
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for item in layouts:
        if item == "ring":
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, ring_checks(rank))
            results["ring"] = gathered
        else:
            results[item] = run_training(make_config(item, world, model))
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def run_job(world: int, model: str, layouts: list[str], tmp_path: Path) -> dict:
    out = tmp_path / f"losses-{world}.json"
    run_torchrun("test_context_parallel:run_worker", world, [str(out), model, layouts], timeout=300)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(reference_losses) -> list[float]:
    return reference_losses("tiny")


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    """One torchrun job of 4 ranks: the ring checks, then cp=2 x tp=2 and cp=2 x dp_shard=2 training
    runs (in one job: a world-2 job of its own for plain CP cost 15 s of start-up in CI)."""
    return run_job(WORLD, "tiny", ["ring", "cp=2,tp=2", "cp=2,dp_shard=2"], tmp_path_factory.mktemp("cp4"))


@pytest.mark.multiprocess
def test_ring_attention_equals_full_attention(world4) -> None:
    worst: dict[str, float] = {}
    for per_rank in world4["ring"]:
        for case, errs in per_rank.items():
            for what, err in errs.items():
                worst[f"{case} {what}"] = max(worst.get(f"{case} {what}", 0.0), err)
    print("\nmax relative errors:\n" + "\n".join(f"  {k}: {v:.2e}" for k, v in sorted(worst.items())))
    assert len(worst) == 2 * (2 * 3 * 5 + 2 + 2)
    for key, err in worst.items():
        # fp64: the algorithm is exact up to rounding; fp32: 1e-5 relative (fp32 eps is 1.2e-7, the
        # merges and the ring's dK/dV accumulation add a few dozen roundings). The model cases are
        # fp32 too: a whole forward and backward of the trainer's Transformer.
        tol = 1e-12 if "float64" in key else 1e-5
        assert err < tol, f"{key}: relative error {err:.2e} >= {tol}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, layout", [(4, "cp=2,tp=2"), (4, "cp=2,dp_shard=2")])
def test_training_losses_equal_single_process(world: int, layout: str, reference, world4, tmp_path) -> None:
    losses = world4[layout] if world == WORLD else run_job(world, "tiny", [layout], tmp_path)[layout]
    diff = max_rel_diff(losses, reference)
    print(f"\n{layout}: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert reference[-1] < reference[0] - 0.1  # the run learns, so equal losses mean something
    assert diff <= RTOL, f"{layout}: {losses} vs {reference}"

