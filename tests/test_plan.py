"""ParallelPlan: validation with the arithmetic spelled out, the rank <-> mesh mapping, placement."""

import itertools

import pytest

from workbench import Cluster, ConfigError, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.spec.plan import MESH_DIMS, split_layers

H100 = Cluster.preset("dgx-h100", nodes=4)


def test_dp_shard_takes_the_rest():
    assert ParallelPlan(tp=8, pp=2).resolve(32).dp_shard == 2


def test_rank_coords_tp_innermost_and_inverse():
    plan = ParallelPlan(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert plan.world_size == 32
    assert plan.rank_coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "ep": 0}
    assert plan.rank_coords(1)["tp"] == 1
    assert plan.rank_coords(2)["cp"] == 1
    assert plan.rank_coords(4)["dp_shard"] == 1
    assert plan.rank_coords(8)["dp_replicate"] == 1
    assert plan.rank_coords(16)["pp"] == 1
    for r in range(32):
        assert plan.coords_rank(plan.rank_coords(r)) == r


def test_group_ranks_partition_the_world():
    plan = ParallelPlan(pp=2, dp_shard=2, cp=2, tp=2, ep=2)
    for dim in ("pp", "dp_shard", "cp", "tp", "ep", "dp", "dp_shard_cp", "dp_cp"):
        groups = plan.group_ranks(dim)
        assert sorted(itertools.chain(*groups)) == list(range(16)), dim
        assert all(len(g) == plan.degree(dim) for g in groups), dim
    assert plan.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert plan.group_ranks("pp")[0] == [0, 8]
    # EP borrows the innermost ep ranks of dp_shard x cp: same tp coordinate, neighbouring cp
    assert plan.group_ranks("ep")[0] == [0, 2]
    # within a group only the grouped coordinates change
    for g in plan.group_ranks("dp_shard_cp"):
        coords = [plan.rank_coords(r) for r in g]
        for d in ("pp", "dp_replicate", "tp"):
            assert len({c[d] for c in coords}) == 1


def test_mesh_dims_drop_degree_one():
    assert ParallelPlan(pp=2, dp_shard=4, tp=2).mesh_dims() == (("pp", 2), ("dp_shard", 4), ("tp", 2))
    assert [d for d, _ in ParallelPlan(dp_shard=1).mesh_dims()] == []
    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_placement_tiers_and_warnings():
    inside = ParallelPlan(tp=8, pp=4).placement(H100)
    assert inside.tiers == {"tp": "intra_node", "pp": "inter_node"}
    assert inside.warnings == ()
    assert inside.node_of(9) == 1 and inside.gpu_of(9) == 1
    crossing = ParallelPlan(tp=16, pp=2).placement(H100)
    assert crossing.tiers["tp"] == "inter_node"
    assert crossing.warnings == (
        "tp=16 spans 2 nodes: its all-reduces cross the network at 50 GB/s per GPU instead of NVLink at 450 GB/s",
    )


def test_two_tier_network():
    cl = Cluster.preset("dgx-h100", nodes=4, nodes_per_leaf=2, spine=Cluster.preset("dgx-h100").inter_node)
    pl = ParallelPlan(tp=8, dp_shard=4).placement(cl)
    assert pl.tiers["dp_shard"] == "inter_leaf"
    pl2 = ParallelPlan(tp=8, dp_shard=2, pp=2).placement(cl)
    assert pl2.tiers["dp_shard"] == "inter_node"


def test_split_layers():
    assert split_layers(80, 4) == (20, 20, 20, 20)
    assert split_layers(10, 4) == (2, 3, 3, 2)
    assert sum(split_layers(126, 16)) == 126


def test_stages_of_rank():
    assert ParallelPlan(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2).stages_of_rank(1) == (1, 5)
    assert ParallelPlan(pp=4, pp_schedule="zbv", virtual_stages=2).stages_of_rank(1) == (1, 6)


def test_parse():
    p = ParallelPlan.parse("dp=2, tp=2, pp=2, schedule=gpipe, sequence_parallel=false")
    assert (p.dp_shard, p.tp, p.pp, p.pp_schedule, p.sequence_parallel) == (2, 2, 2, "gpipe", False)
    with pytest.raises(ConfigError, match="plan has no field 'tq'"):
        ParallelPlan.parse("tq=2")
    with pytest.raises(ConfigError, match="tp='x' must be an integer"):
        ParallelPlan.parse("tp=x")


def run(plan, model="llama3-8b", cluster=H100, **train):
    return RunConfig(ModelSpec.preset(model), cluster, plan, TrainSettings(**{"seq_len": 4096, **train}))


@pytest.mark.parametrize(
    "plan,train,message",
    [
        (ParallelPlan(tp=3), {}, "tp=3 does not divide n_heads=32"),
        (ParallelPlan(tp=16, dp_shard=2), {}, "tp=16 does not divide n_kv_heads=8"),
        (ParallelPlan(tp=8, dp_shard=3), {}, "pp x dp_replicate x dp_shard x cp x tp = 1 x 1 x 3 x 1 x 8 = 24 differs from the world size 32"),
        (ParallelPlan(tp=8, pp=3), {}, "world size 32 is not divisible by pp x dp_replicate x cp x tp = 3 x 1 x 1 x 8 = 24"),
        (ParallelPlan(pp=4, tp=8, pp_schedule="1f1b", virtual_stages=2), {}, "virtual_stages=2 needs an interleaved schedule"),
        (ParallelPlan(pp=4, tp=8, pp_schedule="zbv"), {}, "virtual_stages=1 must be 2"),
        (ParallelPlan(cp=2, tp=8), {"seq_len": 4098}, "seq_len=4098 is not divisible by 2 x cp = 4"),
        (ParallelPlan(cp=2, tp=8), {"seq_len": 4104}, r"seq_len / cp = 4104 / 2 = 2052 is not divisible by tp=8"),
        (ParallelPlan(ep=2, tp=8), {}, "ep=2 needs an MoE model"),
        (ParallelPlan(tp=8), {"global_batch_size": 6}, "global_batch_size=6 is not divisible by micro_batch_size x dp = 1 x 4 = 4"),
        (ParallelPlan(pp=2, tp=8, stage_layers=(10, 10)), {}, "stage_layers=[10, 10] must give 2 stages"),
    ],
)
def test_validation_spells_out_the_rule(plan, train, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        run(plan, **train)


def test_schedule_torch_refuses_is_planned_with_a_note_and_refused_by_the_trainer():
    """1F1B with fewer micro-batches than stages: torch's Schedule1F1B refuses it, Megatron runs it.
    The planner accepts and notes it; the bundled trainer (torch's schedules) refuses it."""
    from workbench.spec.config import plan_notes
    from workbench.spec.trainable import check_trainable

    cfg = run(ParallelPlan(pp=4, tp=8, pp_schedule="1f1b"), global_batch_size=2)
    assert cfg.n_microbatches == 2
    assert any("n_microbatches >= pp" in note for note in plan_notes(cfg))
    with pytest.raises(ConfigError, match="n_microbatches >= pp"):
        check_trainable(cfg)


def test_expert_parallel_rules():
    cl = Cluster.preset("dgx-h100")
    with pytest.raises(ConfigError, match="ep=3 does not divide n_experts=8"):
        RunConfig(ModelSpec.preset("mixtral-8x7b"), cl, ParallelPlan(ep=3), TrainSettings())
    with pytest.raises(ConfigError, match=r"ep=8 does not divide dp_shard x cp = 4 x 1 = 4"):
        RunConfig(ModelSpec.preset("mixtral-8x7b"), cl, ParallelPlan(ep=8, tp=2), TrainSettings())


def test_run_config_json_round_trip():
    cfg = run(ParallelPlan(tp=8, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2), global_batch_size=16)
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.n_microbatches == 8


def test_split_layers_by_cost_balances_the_bottleneck():
    from workbench.spec.plan import split_layers_by_cost

    # equal blocks, no extras: even split
    assert split_layers_by_cost([1.0] * 8, 4) == (2, 2, 2, 2)
    # an expensive output layer (big vocabulary) pushes blocks off the last stage
    assert split_layers_by_cost([1.0] * 8, 2, output_cost=2.0) == (5, 3)
    assert split_layers_by_cost([1.0] * 8, 2, embedding_cost=2.0) == (3, 5)
    # brute force: the split minimises the slowest stage over every contiguous split
    import itertools

    costs, emb, out = [3, 1, 4, 1, 5, 9, 2, 6], 2.0, 3.0
    best = min(
        max(sum(costs[a:b]) + (emb if i == 0 else 0) + (out if i == 2 else 0)
            for i, (a, b) in enumerate(zip((0, x, y), (x, y, 8))))
        for x, y in itertools.combinations(range(1, 8), 2)
    )
    got = split_layers_by_cost(costs, 3, emb, out)
    bounds = [0, got[0], got[0] + got[1], 8]
    worst = max(sum(costs[bounds[i]:bounds[i + 1]]) + (emb if i == 0 else 0) + (out if i == 2 else 0) for i in range(3))
    assert sum(got) == 8 and min(got) >= 1 and worst == best
    with pytest.raises(ConfigError, match="3 layers cannot fill 4 stages"):
        split_layers_by_cost([1, 1, 1], 4)
