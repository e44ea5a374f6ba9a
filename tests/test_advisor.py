"""The plan advisor and the cost of a run."""

import math

import pytest

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.predict import advisor
from workbench.predict.advisor import advise
from workbench.predict.cost import estimate_cost, optimal_checkpoint_interval
from workbench.predict.memory import estimate_memory
from workbench.predict.perf import predict_step

TRAIN = TrainSettings(seq_len=4096, global_batch_size=256).with_precision("bf16-megatron")


@pytest.fixture(scope="module")
def llama8b_advice():
    return advise(ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=2), TRAIN, top=5)


def test_candidates_fit_and_are_ranked(llama8b_advice):
    a = llama8b_advice
    assert len(a) == 5
    speeds = [c.prediction.tokens_per_s for c in a]
    assert speeds == sorted(speeds, reverse=True)
    for i, c in enumerate(a):
        assert c.rank == i + 1
        assert c.memory.fits()
        # each candidate carries its own bill and prediction, recomputable from its config
        assert c.memory.peak_bytes == estimate_memory(c.config).peak_bytes
        assert c.prediction.step_time_s == pytest.approx(predict_step(c.config).step_time_s)
        assert c.plan.tp <= 8  # never across nodes
        assert c.explanation


def test_no_valid_fitting_plan_beats_the_winner(llama8b_advice):
    """Spot-check the search: hand-picked valid plans are not faster than the advisor's best."""
    best = llama8b_advice[0].prediction.tokens_per_s
    model, cluster = ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=2)
    for plan in (ParallelPlan(tp=1, zero_stage=3), ParallelPlan(tp=2, zero_stage=1), ParallelPlan(tp=8, pp=2, zero_stage=1),
                 ParallelPlan(tp=4, zero_stage=2)):
        cfg = RunConfig(model, cluster, plan, TRAIN)
        if estimate_memory(cfg).fits():
            assert predict_step(cfg).tokens_per_s <= best * (1 + 1e-9)


def test_baseline_is_plain_data_parallel(llama8b_advice):
    b = llama8b_advice.baseline
    assert b.config.plan.dp_shard == 16 and b.config.plan.zero_stage == 0 and b.config.plan.tp == 1
    # an 8B model with Adam in bf16-megatron needs 18 x 8.03e9 bytes of states: no fit on 80 GB
    assert not b.fits and "does not fit" not in b.reason and "GiB per GPU" in b.reason
    assert llama8b_advice.gain_over_baseline() is None


def test_small_model_baseline_fits_and_gain_is_reported():
    model = ModelSpec(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, name="gpt2-small")
    advice = advise(model, Cluster.preset("dgx-h100", nodes=1), TrainSettings(seq_len=1024, global_batch_size=64), top=3)
    assert advice.baseline.fits
    assert advice.gain_over_baseline() >= 1.0
    assert "plain data parallel" in advice[0].explanation[0]


def test_explanations_follow_the_scaling_order():
    advice = advise(ModelSpec.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=4),
                    TrainSettings(seq_len=4096, global_batch_size=64).with_precision("bf16-megatron"), top=3)
    text = "\n".join(advice[0].explanation)
    assert advice[0].plan.tp > 1 or advice[0].plan.pp > 1  # 70B never fits by data parallel alone on 32 GPUs
    if advice[0].plan.tp > 1:
        assert "inside the 8-GPU NVLink domain" in text
    assert "memory" in text and "time:" in text


def test_moe_search_uses_expert_parallel():
    advice = advise(ModelSpec.preset("mixtral-8x7b"), Cluster.preset("dgx-h100", nodes=2),
                    TrainSettings(seq_len=4096, global_batch_size=64).with_precision("bf16-megatron"), top=10)
    assert advice, "some plan must fit"
    assert any(c.plan.ep > 1 for c in advice)


# ---------------------------------------------------------------------------- pruning by the bound
GPT2 = ModelSpec(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, name="gpt2-small")
# (model, cluster, train, top): dense and MoE, a profile of its own, eager attention with dropout,
# a batch resolved from the plan (global_batch_size=0)
SEARCHES = {
    "gpt2": (GPT2, Cluster.preset("dgx-h100", nodes=1), TrainSettings(seq_len=1024, global_batch_size=64), 3),
    "mixtral": (ModelSpec.preset("mixtral-8x7b"), Cluster.preset("dgx-h100", nodes=2),
                TrainSettings(seq_len=4096, global_batch_size=64).with_precision("bf16-megatron"), 10),
    "llama3-8b-eager-megatron": (ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=4),
                                 TrainSettings(seq_len=2048, global_batch_size=128, attention="eager", dropout=True,
                                               framework="megatron").with_precision("bf16-zero"), 10),
    "llama3-8b-gbs0": (ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=8),
                       TrainSettings(seq_len=8192).with_precision("bf16-megatron"), 5),
}


def _answer(advice):
    return ([(c.rank, c.config, c.prediction, c.memory.peak_bytes, c.explanation) for c in advice],
            advice.baseline.reason, advice.gain_over_baseline(), list(advice.rejections.items()))


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_pruned_search_gives_the_exhaustive_answer(name):
    """The bound only skips plans that cannot change the answer: same plans, predictions,
    explanations (whose alternatives may lie outside the front runners) and rejections."""
    model, cluster, train, top = SEARCHES[name]
    pruned = advise(model, cluster, train, top=top)
    exhaustive = advisor._advise(model, cluster, train, top=top, prune=False)
    assert _answer(pruned) == _answer(exhaustive)
    assert exhaustive.stats["pruned"] == 0
    assert pruned.stats["pruned"] > 0 and pruned.stats["predicted"] < exhaustive.stats["predicted"]


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_step_floor_is_under_every_screened_prediction(name):
    model, cluster, train, top = SEARCHES[name]
    candidates = advisor._search(advisor._Search(model, cluster, train, prune=False), top)
    assert candidates
    for c in candidates:
        screened = predict_step(c.config, memory=c.memory, simulate=False).step_time_s
        # the bound holds for the candidate's recomputation and every cheaper one
        for recompute in advisor.RECOMPUTE_ORDER[: advisor.RECOMPUTE_ORDER.index(c.train.recompute) + 1]:
            for bubble in (False, True):
                assert advisor._step_floor(c.config, recompute, bubble) <= screened, (c.summary(), recompute, bubble)


def test_a_broken_bound_falls_back_to_the_exhaustive_search(monkeypatch):
    model, cluster, train, top = SEARCHES["gpt2"]
    exhaustive = advisor._advise(model, cluster, train, top=top, prune=False)
    real = advisor._step_floor
    monkeypatch.setattr(advisor, "_step_floor", lambda *a, **k: 100 * real(*a, **k))  # no longer a lower bound
    with pytest.warns(RuntimeWarning, match="bound"):
        advice = advise(model, cluster, train, top=top)
    assert _answer(advice) == _answer(exhaustive) and advice.stats["pruned"] == 0


# ---------------------------------------------------------------------------- cost
def test_young_daly_interval():
    delta, mtbf = 60.0, 24 * 3600.0
    tau = optimal_checkpoint_interval(delta, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * delta * mtbf), rel=0.05)  # first order is Young's
    waste = lambda t: delta / t + t / 2 / mtbf  # noqa: E731
    assert waste(tau) <= min(waste(tau * 0.8), waste(tau * 1.25))


def test_estimate_cost_adds_up():
    cfg = RunConfig(ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=8), ParallelPlan(tp=2), TRAIN)
    cost = estimate_cost(cfg, tokens=1e12)
    pred = predict_step(cfg)
    assert cost.steps == math.ceil(1e12 / (256 * 4096))
    assert cost.ideal_wall_s == pytest.approx(cost.steps * pred.step_time_s)
    assert 0 < cost.goodput < 1
    assert cost.effective_wall_s == pytest.approx(cost.ideal_wall_s / cost.goodput)
    assert cost.gpu_hours == pytest.approx(cost.effective_wall_s * 64 / 3600)
    # Adam with fp32 master weights: 4 + 8 bytes per parameter; keep-last-3
    assert cost.checkpoint_bytes == 12 * 8_030_261_248
    assert cost.storage_bytes == 3 * cost.checkpoint_bytes
    assert cost.job_mtbf_s == pytest.approx(cfg.cluster.node_mtbf_s / 8)
    # synchronous checkpoints block longer and lower the goodput
    sync = estimate_cost(cfg, tokens=1e12, asynchronous=False)
    assert sync.blocking_save_s > cost.blocking_save_s and sync.goodput < cost.goodput
    # more nodes: failures more often
    big = RunConfig(cfg.model, Cluster.preset("dgx-h100", nodes=512), ParallelPlan(tp=2), TrainSettings(
        seq_len=4096, global_batch_size=4096).with_precision("bf16-megatron"))
    assert estimate_cost(big, tokens=1e12).goodput < cost.goodput
