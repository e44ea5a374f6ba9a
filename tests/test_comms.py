"""The communication model: nccl-tests conventions, alpha-beta times, and what a step issues."""

from __future__ import annotations

import math
import time

import pytest

from workbench import Calibration, Cluster, ConfigError, ModelSpec, ParallelPlan, RunConfig, TrainSettings
from workbench.spec.cluster import LinkCalibration
from workbench.predict.comms import (
    BUS_FACTOR,
    collective_time,
    link_traffic,
    p2p_time,
    step_collectives,
    traffic_by_dim,
)

GiB = 1 << 30
BF16 = TrainSettings().with_precision("bf16-zero")  # compute, grad, param dtypes all 2 bytes


def run(model: str | ModelSpec, plan: str, nodes: int = 1, cluster: str = "dgx-h100", **train) -> RunConfig:
    spec = ModelSpec.preset(model) if isinstance(model, str) else model
    settings = BF16.__class__(**{**BF16.to_dict(), **train})
    return RunConfig(spec, Cluster.preset(cluster, nodes=nodes), ParallelPlan.parse(plan), settings)


def total(config: RunConfig, dim: str, pp_rank: int | None = None, op: str | None = None, phase: str | None = None) -> int:
    return sum(
        c.total_bytes
        for c in step_collectives(config, pp_rank)
        if c.dim == dim and (op is None or c.op == op) and (phase is None or c.phase == phase)
    )


# ---------------------------------------------------------------------------- conventions
def test_bus_factors_follow_nccl_tests():
    assert BUS_FACTOR["all_reduce"](8) == pytest.approx(1.75)
    assert BUS_FACTOR["all_gather"](8) == pytest.approx(0.875)
    assert BUS_FACTOR["reduce_scatter"](4) == pytest.approx(0.75)
    assert BUS_FACTOR["all_to_all"](2) == pytest.approx(0.5)
    assert BUS_FACTOR["send_recv"](2) == 1.0
    assert BUS_FACTOR["all_reduce"](1) == 0.0


def test_nvlink_all_reduce_of_8_gpus_matches_hand_computation():
    h100 = Cluster.preset("dgx-h100")
    # 2 (n-1) alpha + 2 (n-1)/n S / B = 14 x 3 us + 1.75 x 2^30 B / 450 GB/s
    expected = 14 * 3e-6 + 1.75 * 2**30 / 450e9
    assert expected == pytest.approx(4.217663e-3, rel=1e-6)
    assert collective_time("all_reduce", GiB, 8, h100, "intra_node") == pytest.approx(expected, rel=1e-9)
    # all-gather: half the steps and half the bytes of an all-reduce
    assert collective_time("all_gather", GiB, 8, h100, "intra_node") == pytest.approx(7 * 3e-6 + 0.875 * 2**30 / 450e9)
    assert collective_time("send_recv", GiB, 2, h100, "inter_node") == pytest.approx(5e-6 + 2**30 / 50e9)
    assert collective_time("all_reduce", GiB, 1, h100, "intra_node") == 0.0


def test_two_node_all_reduce_is_hierarchical():
    h100 = Cluster.preset("dgx-h100", nodes=2)
    # intra reduce-scatter (7 a + 7/8 S / 450G) + inter all-reduce of S/8 over 2 nodes
    # (2 a' + 2 x 1/2 x S/8 / 50G) + intra all-gather (7 a + 7/8 S / 450G)
    hier = 14 * 3e-6 + 1.75 * 2**30 / 450e9 + 2 * 5e-6 + 2**30 / 8 / 50e9
    assert hier == pytest.approx(6.912017e-3, rel=1e-6)
    got = collective_time("all_reduce", GiB, 16, h100, "inter_node", gpus_per_node_in_group=8)
    assert got == pytest.approx(hier, rel=1e-9)
    # a flat ring over the network (one rank per node) would take 30 a' + 1.875 S / 50G
    flat = collective_time("all_reduce", GiB, 16, h100, "inter_node")
    assert flat == pytest.approx(30 * 5e-6 + 1.875 * 2**30 / 50e9)
    assert flat > 5 * got


def test_bad_collective_arguments_name_the_field():
    h100 = Cluster.preset("dgx-h100")
    with pytest.raises(ConfigError) as err:
        collective_time("broadcast", GiB, 8, h100, "intra_node")
    assert err.value.field == "op" and "broadcast" in str(err.value)
    with pytest.raises(ConfigError) as err:
        collective_time("all_reduce", -1, 8, h100, "intra_node")
    assert err.value.field == "size_bytes"
    with pytest.raises(ConfigError):
        collective_time("all_reduce", GiB, 8, h100, "backplane")


def test_calibration_replaces_the_datasheet():
    cal = Calibration(links={
        "intra_node": {"all_reduce": LinkCalibration(360e9, 20e-6), "all_gather": LinkCalibration(300e9, 15e-6)},
        "inter_node": {"all_reduce": LinkCalibration(40e9, 30e-6)},
    })
    h100 = Cluster.preset("dgx-h100", nodes=2, calibration=cal)
    # t = latency + S x factor(n) / busbw
    assert collective_time("all_reduce", GiB, 8, h100, "intra_node") == pytest.approx(20e-6 + 1.75 * 2**30 / 360e9)
    # the spanning group was measured as a whole: its calibration replaces the hierarchical model
    assert collective_time("all_reduce", GiB, 16, h100, "inter_node", gpus_per_node_in_group=8) == pytest.approx(
        30e-6 + 1.875 * 2**30 / 40e9
    )
    # not calibrated: datasheet
    assert collective_time("reduce_scatter", GiB, 8, h100, "intra_node") == pytest.approx(7 * 3e-6 + 0.875 * 2**30 / 450e9)
    # and step_collectives uses it
    config = RunConfig(ModelSpec.preset("llama3-8b"), h100, ParallelPlan.parse("tp=8"), BF16)
    ag = next(c for c in step_collectives(config) if c.dim == "tp" and c.op == "all_gather")
    assert ag.time_s == pytest.approx(15e-6 + 0.875 * ag.size_bytes / 300e9)
    assert ag.busbw == pytest.approx(ag.algbw * 0.875)


# ---------------------------------------------------------------------------- a step
def test_a_single_gpu_issues_no_collectives():
    config = RunConfig(
        ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", gpus_per_node=1), ParallelPlan(), BF16
    )
    assert step_collectives(config) == []
    assert traffic_by_dim(config) == {}
    assert sum(link_traffic(config).values()) == 0


@pytest.mark.parametrize("precision, per_param", [("bf16-zero", 2 + 2 + 2), ("fsdp2-bf16", 2 + 2 + 4)])
def test_fsdp_zero3_moves_three_copies_of_the_stage_weights_per_microbatch(precision, per_param):
    model = ModelSpec.preset("llama3-8b")
    # 16 GPUs, pp=2: stage 0 = embedding + 16 blocks, stage 1 = 16 blocks + final norm + output
    config = RunConfig(model, Cluster.preset("dgx-h100", nodes=2), ParallelPlan.parse("pp=2,dp_shard=8"),
                       TrainSettings(global_batch_size=32).with_precision(precision))
    m = config.n_microbatches
    assert m == 4
    block = model.layer_params(0).total
    stage0 = model.embedding_params + 16 * block
    stage1 = 16 * block + model.output_params
    assert stage0 + stage1 == model.n_params()
    # As the bundled trainer runs it (measured: tests/test_compare.py): under 1F1B with p = 2,
    # m = 4 a zero-3 block is all-gathered 5 times (pipelining keeps parameters unsharded after
    # backward), the root (embedding / output) once; one reduce-scatter per unit per step.
    e, g = 2, per_param - 4
    assert total(config, "dp_shard_cp", 0) == e * (model.embedding_params + 5 * 16 * block) + g * stage0
    assert total(config, "dp_shard_cp", 1) == e * (model.output_params + 5 * 16 * block) + g * stage1
    assert total(config, "dp_shard_cp", 1, op="reduce_scatter") == g * stage1
    # exactly one exposed all-gather and one exposed reduce-scatter per step
    exposed = [c for c in step_collectives(config, 0) if c.dim == "dp_shard_cp" and not c.overlapped]
    assert sorted((c.op, c.count) for c in exposed) == [("all_gather", 1), ("reduce_scatter", 1)]
    assert all("embedding" in c.purpose for c in exposed)


def test_zero_stages_trade_all_gathers_for_memory():
    model = ModelSpec.preset("llama3-8b")
    n = model.n_params()

    def fsdp(zero: int, dim: str = "dp_shard_cp") -> int:
        config = run(model, f"dp_shard=8,zero={zero}", global_batch_size=32)
        assert config.n_microbatches == 4
        return total(config, dim)

    root = model.embedding_params + model.output_params  # one FSDP unit, never resharded after forward
    blocks = n - root
    # m = 4 forward (and zero 3: backward) all-gathers; one reduce-scatter per step (bundled trainer)
    assert fsdp(3) == 2 * (8 * blocks + 4 * root) + 2 * n
    assert fsdp(2) == 2 * 4 * n + 2 * n  # parameters kept from forward to backward
    assert fsdp(1) == 2 * 2 * n  # reduce-scatter + all-gather of updated weights, once per step
    assert fsdp(0, "dp") == 2 * n  # DDP: one all-reduce of the gradients per step
    assert fsdp(0, "dp_shard_cp") == 0


def test_hsdp_all_reduces_the_gradient_shards_across_nodes():
    model = ModelSpec.preset("llama3-8b")
    config = run(model, "dp_replicate=2,dp_shard=8", nodes=2, global_batch_size=16)
    rep = [c for c in step_collectives(config) if c.dim == "dp_replicate"]
    assert {c.op for c in rep} == {"all_reduce"} and {c.tier for c in rep} == {"inter_node"}
    assert sum(c.total_bytes for c in rep) == pytest.approx(2 * model.n_params() / 8, rel=1e-6)
    fsdp = [c for c in step_collectives(config) if c.dim == "dp_shard_cp"]
    assert {c.tier for c in fsdp} == {"intra_node"}


def test_tp_bytes_scale_with_layers_and_microbatches_and_vanish_without_tp():
    def tp_bytes(n_layers: int, gbs: int, tp: int = 4) -> int:
        model = ModelSpec(n_layers=n_layers, d_model=1024, n_heads=16, n_kv_heads=8, vocab_size=32000)
        return total(run(model, f"tp={tp}", nodes=1, seq_len=2048, micro_batch_size=1, global_batch_size=gbs), "tp")

    act = 2048 * 1024 * 2  # T x d_model x bf16
    norm = 1024 * 2  # SP: a norm weight's gradient all-reduced once per step (2 per block + final)
    # 8 GPUs = tp 4 x dp 2: a global batch of 4 is m = 2 micro-batches per rank
    # per block per micro-batch: 2 all-gathers + 2 reduce-scatters forward, the same backward
    assert tp_bytes(8, 4) - tp_bytes(4, 4) == 2 * 4 * 8 * act + 2 * 4 * norm
    # embedding (reduce-scatter + all-gather), output layer (all-gather + reduce-scatter), logits
    assert tp_bytes(4, 4) == 2 * (8 * 4 * act + 4 * act + 2048 * 32000 * 2) + 9 * norm
    assert tp_bytes(4, 8) - 9 * norm == 2 * (tp_bytes(4, 4) - 9 * norm)
    assert tp_bytes(4, 8, tp=1) == 0


def test_tp_without_sequence_parallel_all_reduces_and_full_recompute_repeats_forward():
    model = ModelSpec.preset("llama3-8b")
    act = 4096 * 4096 * 2
    no_sp = run(model, "tp=8,sequence_parallel=false,loss_parallel=true", seq_len=4096)
    blocks = [c for c in step_collectives(no_sp) if c.dim == "tp" and "linear" in c.purpose]
    assert {c.op for c in blocks} == {"all_reduce"}
    assert sum(c.total_bytes for c in blocks) == 4 * 32 * act
    sp = run(model, "tp=8", seq_len=4096)
    full = run(model, "tp=8", seq_len=4096, recompute="full")
    # forward's 2 all-gathers + 2 reduce-scatters per block come again in backward
    assert total(full, "tp", phase="backward") - total(sp, "tp", phase="backward") == 4 * 32 * act
    assert total(full, "tp", phase="forward") == total(sp, "tp", phase="forward")


def test_doubling_seq_len_doubles_activation_traffic_not_weight_traffic():
    # tp, pp, cp, ep and FSDP all at once: 32 GPUs = pp 2 x dp_shard 4 x cp 2 x tp 2, ep 4
    def config(seq: int) -> RunConfig:
        return run("mixtral-8x7b", "pp=2,dp_shard=4,cp=2,tp=2,ep=4", nodes=4, seq_len=seq, global_batch_size=16)

    short, long_ = config(4096), config(8192)
    assert short.n_microbatches == long_.n_microbatches == 4
    for rank in (0, 1):
        a, b = traffic_by_dim(short, rank), traffic_by_dim(long_, rank)
        assert {"tp", "pp", "cp", "ep", "dp_shard_cp", "efsdp"} <= set(a)
        norms = [c for c in step_collectives(short, rank) if "norm-weight" in c.purpose]  # not per token
        assert norms == [c for c in step_collectives(long_, rank) if "norm-weight" in c.purpose]
        for dim in ("tp", "pp", "cp", "ep"):
            fixed = sum(c.total_bytes for c in norms if c.dim == dim)
            assert b[dim].bytes - fixed == 2 * (a[dim].bytes - fixed), dim
        for dim in ("dp_shard_cp", "efsdp"):
            assert b[dim].bytes == a[dim].bytes, dim
    # experts: 8 / (ep 4 x tp 2) = 1 expert's TP half per rank, FSDP-sharded over 8 / 4 = 2 ranks
    efsdp = traffic_by_dim(short, 0)["efsdp"]
    assert efsdp.group_size == 2
    model = short.model
    expert_local = model.layer_params(0).experts / 8
    # 1F1B, p = 2, m = 4: 5 all-gathers per block (pipelining keeps them unsharded after backward)
    # and one reduce-scatter per step
    assert efsdp.bytes == pytest.approx((5 + 1) * 16 * 2 * expert_local, rel=1e-6)


def test_cp_ring_and_ep_all_to_all_sizes():
    model = ModelSpec.preset("mixtral-8x7b")
    config = run(model, "cp=4,dp_shard=2,ep=8", seq_len=8192, global_batch_size=2)
    m, tokens = config.n_microbatches, 8192 // 4
    assert m == 1
    cs = step_collectives(config)
    kv = [c for c in cs if c.dim == "cp" and "K, V" in c.purpose and "dK" not in c.purpose]
    assert {c.size_bytes for c in kv} == {tokens * model.kv_dim * 2 * 2}
    assert sum(c.count for c in kv) == 2 * 3 * 32 * m  # cp-1 hops forward, again in backward
    dkv = [c for c in cs if c.dim == "cp" and "dK" in c.purpose]
    assert sum(c.count for c in dkv) == 4 * 32 * m and dkv[0].size_bytes == tokens * model.kv_dim * 2 * 4
    assert all(c.op == "send_recv" and c.overlapped for c in kv + dkv)
    a2a = [c for c in cs if c.dim == "ep"]
    assert {c.size_bytes for c in a2a} == {tokens * 2 * model.d_model * 2}  # T top_k d e
    assert sum(c.count for c in a2a) == 4 * 32 * m and not any(c.overlapped for c in a2a)


def test_pipeline_sends_skip_the_first_and_last_stage_and_the_bottom_of_a_v():
    model = ModelSpec.preset("llama3-8b")
    boundary = 4096 * 4096 * 2
    flat = run(model, "pp=4,dp_shard=2", seq_len=4096, global_batch_size=16)
    m = flat.n_microbatches
    assert m == 8
    assert total(flat, "pp", 0, phase="forward") == m * boundary and total(flat, "pp", 0, phase="backward") == 0
    assert total(flat, "pp", 3, phase="forward") == 0 and total(flat, "pp", 3, phase="backward") == m * boundary
    assert total(flat, "pp", 1) == 2 * m * boundary
    # interleaved, rank 0 holds stages 0 and 2: sends 0->1 and 2->3 forward, 2->1 backward
    inter = run(model, "pp=2,v=2,schedule=interleaved-1f1b,dp_shard=4", seq_len=4096, global_batch_size=16)
    m = inter.n_microbatches
    assert total(inter, "pp", 0, phase="forward") == 2 * m * boundary
    assert total(inter, "pp", 0, phase="backward") == m * boundary
    # ZBV, rank 1 holds stages 1 and 2: the 1 -> 2 hop stays on the rank
    zbv = run(model, "pp=2,v=2,schedule=zbv,dp_shard=4", seq_len=4096, global_batch_size=16)
    assert total(zbv, "pp", 1, phase="forward") == m * boundary
    assert total(zbv, "pp", 1, phase="backward") == m * boundary
    # with TP and sequence parallelism each TP rank sends its 1/tp of the sequence
    sp = run(model, "pp=2,tp=8", nodes=2, seq_len=4096, global_batch_size=4)
    assert {c.size_bytes for c in step_collectives(sp) if c.dim == "pp"} == {boundary // 8}
    assert p2p_time(sp) == pytest.approx(5e-6 + boundary / 8 / 50e9)


def test_tp_across_nodes_pays_the_network():
    model = ModelSpec.preset("gpt3-175b")  # 96 heads, full multi-head attention: tp=16 divides them

    def tp_ag(cluster: Cluster, tp: int):
        config = RunConfig(model, cluster, ParallelPlan(tp=tp), BF16.__class__(**{**BF16.to_dict(), "seq_len": 2048}))
        return next(c for c in step_collectives(config) if c.dim == "tp" and c.op == "all_gather")

    # One GPU per node: every ring hop crosses the network; time grows by NVLink / network = 9
    fast = tp_ag(Cluster.preset("dgx-h100", nodes=1, gpus_per_node=2), 2)
    slow = tp_ag(Cluster.preset("dgx-h100", nodes=2, gpus_per_node=1), 2)
    assert (fast.tier, slow.tier) == ("intra_node", "inter_node")
    assert slow.time_s / fast.time_s > 8.5
    assert (slow.time_s - 5e-6) / (fast.time_s - 3e-6) == pytest.approx(450 / 50)  # less the latencies
    # tp=16 on two DGX nodes: hierarchical, intra all-gather of S plus inter all-gather of S/8
    span = tp_ag(Cluster.preset("dgx-h100", nodes=2), 16)
    s = span.size_bytes
    assert span.tier == "inter_node"
    assert span.time_s == pytest.approx(7 * 3e-6 + 7 / 8 * s / 450e9 + 5e-6 + 1 / 2 * s / 8 / 50e9)
    one_node = tp_ag(Cluster.preset("dgx-h100", nodes=1, gpus_per_node=16), 16)
    # the 8 NICs of a node carry S/8 each: slower than all-NVLink, far from the 9x of a flat ring
    assert 1.2 < span.time_s / one_node.time_s < 2
    # and the wire bytes split between the tiers
    assert dict(span.wire_by_tier) == pytest.approx({"intra_node": 7 / 8 * s, "inter_node": s / 16})


def test_wire_bytes_add_up_and_link_traffic_splits_them():
    config = run("mixtral-8x7b", "pp=2,dp_shard=4,cp=2,tp=2,ep=4", nodes=4, seq_len=4096, global_batch_size=16)
    cs = step_collectives(config)
    for c in cs:
        assert sum(b for _, b in c.wire_by_tier) == pytest.approx(c.wire_bytes), c
    links = link_traffic(config)
    assert sum(links.values()) == pytest.approx(sum(c.wire_bytes * c.count for c in cs))
    assert links["intra_node"] > 0 and links["inter_node"] > 0


def test_llama3_70b_tp8_pp4_on_four_dgx_nodes(capsys):
    config = run("llama3-70b", "tp=8,pp=4", nodes=4, seq_len=8192)
    model = config.model
    m = config.n_microbatches
    assert m == 8
    traffic = traffic_by_dim(config)
    assert set(traffic) == {"tp", "pp"}  # no data parallelism left: 32 = 8 x 4
    tp, pp = traffic["tp"], traffic["pp"]
    assert (tp.tier, tp.group_size, pp.tier, pp.group_size) == ("intra_node", 8, "inter_node", 4)
    act = 8192 * model.d_model * 2
    # busiest rank: the last stage (20 blocks, output layer, logits all-gather)
    norms = (2 * 20 + 1) * model.d_model * 2  # SP norm-weight gradients, once per step
    assert tp.bytes == m * (8 * 20 * act + 2 * act + 8192 * model.vocab_size * 2) + norms
    assert pp.bytes == m * act // 8
    assert tp.exposed_time_s == tp.time_s and 0.2 < tp.time_s < 1.0  # ~0.4 s of exposed TP per step
    links = link_traffic(config)
    assert links["intra_node"] > 100 * links["inter_node"] > 0
    with capsys.disabled():
        print()
        for t in traffic.values():
            print(f"  {t.dim:4s} n={t.group_size} {t.tier:10s} {t.calls:5d} calls {t.bytes / 1e9:8.2f} GB "
                  f"wire {t.wire_bytes / 1e9:8.2f} GB  {t.time_s * 1e3:7.1f} ms (exposed {t.exposed_time_s * 1e3:7.1f} ms)")
        print("  per GPU per step:", {k: f"{v / 1e9:.2f} GB" for k, v in links.items()})


def test_step_collectives_is_fast_enough_for_the_advisor():
    config = run("llama3-70b", "tp=8,pp=4", nodes=4, seq_len=8192)
    step_collectives(config)  # warm the caches
    best = math.inf
    for _ in range(50):
        t0 = time.perf_counter()
        step_collectives(config)
        best = min(best, time.perf_counter() - t0)
    assert best < 1e-3, best


def test_group_shapes_agree_with_the_plan_mesh():
    from workbench import LinkSpec
    from workbench.predict.comms import _shape_by_listing, _progression, group_members, group_shape
    from workbench.spec.plan import group_tier

    spine = LinkSpec("spine", 25e9, 8e-6)
    clusters = [Cluster.preset("dgx-h100", nodes=8), Cluster.preset("dgx-h100", nodes=8, nodes_per_leaf=2, spine=spine),
                Cluster.preset("dgx-h100", nodes=16, gpus_per_node=4, nodes_per_leaf=3, spine=spine)]
    plans = ["tp=8", "tp=2,cp=2,ep=4,dp_replicate=2", "pp=4,tp=4,ep=2", "pp=2,cp=4,ep=8", "tp=4,dp_replicate=4,ep=2",
             "pp=8,dp_replicate=2,ep=4", "tp=16,ep=2"]
    for cluster in clusters:
        for text in plans:
            plan = ParallelPlan.parse(text).resolve(cluster.world_size)
            for dim in ("tp", "cp", "pp", "dp_replicate", "dp_shard_cp", "dp_cp", "ep", "efsdp", "edp"):
                members = group_members(plan, dim)
                if dim not in ("efsdp", "edp"):
                    assert sorted(members) == sorted(plan.group_ranks(dim)), (text, dim)
                    if plan.degree(dim) > 1:
                        assert group_shape(plan, dim, cluster)[1] == group_tier(plan, dim, cluster), (text, dim)
                else:  # ranks that hold the same experts: same ep index, pp and tp
                    assert sorted(r for g in members for r in g) == list(range(cluster.world_size))
                    for g in members:
                        assert len({(c["ep"], c["pp"], c["tp"]) for c in map(plan.rank_coords, g)}) == 1
                stride, n = _progression(plan, dim)
                fast = group_shape(plan, dim, cluster)[1:]
                assert fast == _shape_by_listing(stride, n, cluster.world_size, cluster.gpus_per_node,
                                                 cluster.nodes_per_leaf), (cluster.nodes_per_leaf, text, dim)
