"""The planning views' data transforms, checked against the planning API, and the views' behaviour
without a browser (state changes, inline errors, the advisor filling the mesh)."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from workbench import (
    Cluster,
    ConfigError,
    ModelSpec,
    ParallelPlan,
    RunConfig,
    TrainSettings,
    estimate_memory,
    predict_step,
    simulate_schedule,
)
from workbench.predict.memory import COMPONENTS
from widgets import transforms as T


def config(model="llama3-8b", cluster="dgx-h100", nodes=2, precision="bf16-zero", train=None, **plan) -> RunConfig:
    t = TrainSettings(**(train or {"seq_len": 4096})).with_precision(precision)
    return RunConfig(ModelSpec.preset(model), Cluster.preset(cluster, nodes=nodes), ParallelPlan(**plan), t)


# ---------------------------------------------------------------------------- model sketch
@pytest.mark.parametrize("name", ModelSpec.presets())
def test_form_values_round_trip_every_preset(name):
    spec = ModelSpec.preset(name)
    checked = T.build_model(T.model_form_values(spec))
    assert checked.ok and checked.value == spec


def test_auto_fields_follow_their_sources():
    values = T.model_form_values(ModelSpec.preset("tiny"))
    assert values["head_dim"] == 0  # derived: shown as auto
    values["d_model"] = 128
    spec = T.build_model(values).value
    assert spec.head_dim == 128 // 4  # re-derived, not the stale 16


def test_model_summary_is_the_spec_s_numbers():
    spec = ModelSpec.preset("mixtral-8x7b")
    s = T.model_summary(spec, 4096)
    assert s["n_params"] == spec.n_params() == 46_702_792_704
    assert s["n_active_params"] == spec.n_active_params() < spec.n_params()
    assert s["flops_per_token"] == spec.flops_per_token(4096)


def test_latent_attention_round_trips_through_the_form():
    spec = ModelSpec.preset("deepseek-v3")
    values = T.model_form_values(spec)
    assert values["head_dim"] == 0 and values["kv_lora_rank"] == 512  # derived: nope + rope
    assert T.build_model(values).value == spec
    s = T.model_summary(spec, 4096)
    assert (s["n_mtp_params"], s["kv_cache_values_per_token"]) == (11_610_068_224, 576)
    values["kv_lora_rank"] = 0  # latent widths left without a latent: one line naming the field
    checked = T.build_model(values)
    assert checked.value is None and checked.field == "q_lora_rank"
    assert checked.error.startswith("q_lora_rank=1536 needs kv_lora_rank > 0")


def test_invalid_model_edit_gives_message_and_field_not_exception():
    values = T.model_form_values(ModelSpec.preset("llama3-8b"))
    values["n_kv_heads"] = 3
    checked = T.build_model(values)
    assert checked.value is None and checked.field == "n_kv_heads"
    assert checked.error.startswith("n_kv_heads=3 does not divide n_heads=32")
    values["n_kv_heads"] = None  # an emptied box
    checked = T.build_model(values)
    assert (checked.field, checked.error) == ("n_kv_heads", "n_kv_heads is empty: enter a number")
    values["n_kv_heads"], values["top_k"] = 8, 2  # top_k without experts
    assert T.build_model(values).field == "n_experts"


def test_hf_config_text_import():
    hf = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512, "vocab_size": 1000,
          "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "tie_word_embeddings": False}
    checked = T.parse_hf_config(json.dumps(hf).encode())
    assert checked.ok
    assert checked.value.n_params() == ModelSpec.from_hf_config(hf).n_params()
    assert checked.value.n_experts == 8 and checked.value.qk_norm
    bad = T.parse_hf_config('{"model_type": "llama",')
    assert bad.field == "hf_config" and "not valid JSON" in bad.error
    unsupported = T.parse_hf_config(json.dumps({**hf, "model_type": "bert"}))
    assert not unsupported.ok and "bert" in unsupported.error


def test_build_config_reports_the_field():
    m = ModelSpec.preset("llama3-8b")
    checked = T.build_config(m, "dgx-h100", 2, {"tp": 3}, {"seq_len": 4096}, "bf16-zero")
    assert (checked.value, checked.field, checked.error) == (None, "tp", "tp=3 does not divide n_heads=32")
    checked = T.build_config(m, "dgx-h100", 2, {"tp": 2, "pp": 2}, {"seq_len": 4096}, "bf16-zero")
    assert checked.ok and checked.value.plan.dp_shard == 4
    assert T.build_config(None, "dgx-h100", 1, {}, {}, "fp32").field == "model"
    assert T.build_config(m, "dgx-h100", None, {}, {}, "fp32").field == "nodes"


# ---------------------------------------------------------------------------- memory bill
def test_memory_bars_equal_the_bill():
    cfg = config(nodes=4, tp=2, pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
    bill = estimate_memory(cfg)
    bars = T.memory_bars(bill)
    peak = {r["component"]: r for r in bars["peak"]}
    assert list(peak) == list(COMPONENTS)
    for c in COMPONENTS:
        assert peak[c]["bytes"] == bill.components[c]
        assert peak[c]["value"] == pytest.approx(bill.components[c] / T.GiB)
    assert sum(r["bytes"] for r in bars["peak"]) == bill.peak_bytes
    assert {r["bar"] for r in bars["peak"]} == {f"rank {bill.most_loaded_rank}"}
    # per pipeline rank: 4 bars, each stacking exactly its RankMemory
    assert len(bars["stages"]) == 4 * len(COMPONENTS)
    for r in bill.per_stage:
        mine = [x for x in bars["stages"] if x["pp_rank"] == r.pp_rank]
        assert [x["component"] for x in mine] == list(COMPONENTS)
        assert sum(x["bytes"] for x in mine) == r.total_bytes
        assert mine[0]["bar"] == f"pp {r.pp_rank} · stages {r.stages[0]}, {r.stages[1]}"
    totals = [r.total_bytes for r in bill.per_stage]
    assert totals[0] == max(totals) == bill.peak_bytes  # the first stage holds the most in flight


def test_memory_summary_and_axis():
    cfg = config(nodes=1, precision="fp32", zero_stage=0)  # 8B x 16 bytes unsharded: 120 GiB > 80 GiB
    bill = estimate_memory(cfg)
    s = T.memory_summary(bill)
    fit = bill.fits()
    assert (s["fits"], s["peak_bytes"], s["headroom_bytes"]) == (fit.fits, fit.peak_bytes, fit.headroom_bytes)
    assert not s["fits"] and s["headroom_bytes"] < 0
    ax = T.memory_axis(bill)
    assert ax["unit_name"] == "GiB" and ax["show_hbm"] and ax["hbm"] == 80
    assert ax["ymax"] * T.GiB >= bill.peak_bytes
    tiny = estimate_memory(RunConfig(ModelSpec.preset("tiny"), Cluster.preset("local-cpu"), ParallelPlan(),
                                     TrainSettings(seq_len=256).with_precision("fp32")))
    ax = T.memory_axis(tiny)  # a few MiB against 4 GiB: zoom on the bill, say the line is off the chart
    assert ax["unit_name"] == "MiB" and not ax["show_hbm"]
    assert tiny.peak_bytes / T.MiB < ax["ymax"] < 1.2 * tiny.peak_bytes / T.MiB


def test_memory_update_latency():
    """Config change -> new bill -> bar data: the work of one update of the memory view. The aim is
    ~100 ms for the whole update; the transform is a small part of it."""
    from widgets.memory_view import BillChart, bill_chart_data
    from widgets.state import PlanState

    state = PlanState(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100", nodes=16, tp=8, pp=4,
                      pp_schedule="interleaved-1f1b", virtual_stages=2, seq_len=8192, precision="bf16-zero")
    assert state.config is not None, state.error
    peak_chart, stage_chart = BillChart("peak", 230, False), BillChart("stages", 700, True)
    transform, figures, full = [], [], []
    for i, recompute in enumerate(["none", "selective", "full"] * 4):
        t0 = time.perf_counter()
        state.recompute = recompute  # validation: RunConfig built again
        t1 = time.perf_counter()
        bill = estimate_memory(state.config)
        T.memory_bars(bill, T.memory_axis(bill)["unit"])
        T.memory_summary(bill)
        t2 = time.perf_counter()
        data = bill_chart_data(state.prediction)
        peak_chart.update(data["peak"], data["axis"])
        stage_chart.update(data["stages"], data["axis"], data["title"])
        t3 = time.perf_counter()
        transform.append(t2 - t1)
        figures.append(t3 - t2)
        full.append(t3 - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in (("transform", transform), ("figures", figures), ("full", full))}
    print(f"\nmemory view update, median ms: validate+prediction+bars {med['full']:.2f} "
          f"(bill+bars {med['transform']:.2f}, chart data replaced {med['figures']:.2f})")
    assert med["transform"] < 20
    assert med["full"] < 100
    # the chart shows the bill: 4 pipeline ranks, each stack summing to its total
    bill = estimate_memory(state.config)
    cols = stage_chart.source.data
    assert list(stage_chart.figure.x_range.factors) == [T.bar_label(r) for r in bill.per_stage]
    for i, r in enumerate(bill.per_stage):
        assert sum(cols[c][i] for c in COMPONENTS) == pytest.approx(r.total_bytes / T.GiB)
    assert peak_chart.hbm.location == 80


def test_memory_bars_cards_and_table_read_one_bill_in_a_notebook():
    """A notebook sees in-place Bokeh changes only when pushed: after a change no view of the
    memory bill may be left behind (the bars once kept the old bill while the cards showed the new)."""
    from bokeh.document import Document
    from panel.io.model import add_to_doc
    from widgets.memory_view import MemoryView
    from widgets.state import PlanState

    class Comm:  # what a Jupyter comm does with Panel's messages: keep them
        _comm, id = True, "test-comm"

        def __init__(self):
            self.sent = []

        def send(self, data=None, buffers=None):
            self.sent.append(data if data is not None else buffers)

    state = PlanState(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100", nodes=8, tp=8, pp=4, seq_len=8192)
    memory, comm, doc = MemoryView(state), Comm(), Document()
    add_to_doc(memory.panel().get_root(doc, comm), doc, hold=True)  # as a notebook cell renders it
    for change in ({"recompute": "full"}, {"nodes": 16}, {"seq_len": 4096}):  # nodes, seq_len: no widget echoes them
        before = len(comm.sent)
        state.param.update(**change)
        assert not doc.callbacks._held_events, f"{change}: changes left unsent to the notebook"
        assert any('"attr":"data"' in str(m) for m in comm.sent[before:])
        bill = state.prediction.bill
        cols = memory._stage_chart.source.data
        for i, r in enumerate(bill.per_stage):
            assert sum(cols[c][i] for c in COMPONENTS) * T.GiB == pytest.approx(r.total_bytes)
        peak = memory._peak_chart.source.data
        assert sum(peak[c][0] for c in COMPONENTS) * T.GiB == pytest.approx(bill.peak_bytes)
        assert f'data-testid="peak-memory">{T.format_bytes(bill.peak_bytes)}<' in MemoryView.summary_html(state.prediction)


def test_one_prediction_per_configuration_read_by_every_view(monkeypatch):
    import panel as pn

    import widgets.state as S
    from widgets import memory_view, mesh_view, pipeline_view
    from widgets.app import summary_html
    from widgets.ui import html_pane

    calls = {"predict_step": 0, "estimate_memory": 0, "step_collectives": 0, "simulate_schedule": 0}
    for name in calls:
        real = getattr(S, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(S, name, counted)
    S._cached_prediction.cache_clear()
    # no view predicts on its own: none imports the predictor's functions
    for mod in (memory_view, mesh_view, pipeline_view):
        for name in ("predict_step", "estimate_memory", "traffic_by_dim", "link_traffic", "step_collectives", "p2p_time"):
            assert not hasattr(mod, name), f"{mod.__name__} imports {name}"
    state = S.PlanState()
    views = [memory_view.MemoryView(state), mesh_view.MeshView(state), pipeline_view.PipelineView(state)]
    sidebar = html_pane(pn.bind(lambda cfg: summary_html(cfg, "", "m"), state.param.config))  # as create_app binds it
    for v in views:
        v.panel()
    for rendered in (views[0].panel(), views[1].panel(), sidebar):  # the Gantt's HoloViews render is slow: not here
        rendered.get_root()
    changes = [
        dict(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100", nodes=4, tp=4, pp=2, cp=2, dp_shard=2,
             pp_schedule="zbv", virtual_stages=2),
        dict(recompute="full"), dict(zero_stage=1), dict(seq_len=1024), dict(attention="eager"),
    ]
    for change in changes:
        before, config = dict(calls), state.config
        state.param.update(**change)
        assert state.config is not None and state.config != config, state.error
        assert {k: calls[k] - before[k] for k in calls} == {"predict_step": 1, "estimate_memory": 1,
                                                            "step_collectives": 1, "simulate_schedule": 1}, change
        pred = state.prediction
        assert pred.config is state.config and pred.step == predict_step(state.config)
        assert pred.bill == estimate_memory(state.config)
        head = T.step_headline(pred.step)
        assert f'data-testid="summary-step">{head["step"]}<' in sidebar.object
        assert f'data-testid="summary-bubble">{head["bubble"]}<' in sidebar.object
    before = dict(calls)
    state.zero_stage = 1  # the value it has: nothing new to predict
    state.tp = 4
    assert calls == before


def test_pipeline_tab_shows_the_plan_s_own_numbers():
    from widgets import PipelineView, PlanState
    from widgets.app import summary_html
    from widgets.pipeline_view import plan_pipeline_cards

    state = PlanState(model=ModelSpec.preset("llama3-70b"), cluster="dgx-h100", nodes=4, tp=4, pp=2, cp=2, dp_shard=2,
                      pp_schedule="zbv", virtual_stages=2)
    assert state.config is not None, state.error
    pipe = PipelineView(state)
    pipe.panel()
    # the same plan built here, without the app: predict_step's numbers are the tab's and the sidebar's
    ref = RunConfig(ModelSpec.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=4),
                    ParallelPlan(tp=4, pp=2, cp=2, dp_shard=2, pp_schedule="zbv", virtual_stages=2),
                    TrainSettings(seq_len=256).with_precision("bf16-megatron"))
    assert ref == state.config
    head = T.step_headline(predict_step(ref))
    cards_html, sidebar = plan_pipeline_cards(state.prediction), summary_html(state.config, "", "llama3-70b")
    for testid, key in (("plan-step", "step"), ("plan-bubble", "bubble")):
        assert f'data-testid="{testid}">{head[key]}<' in cards_html
    assert f'data-testid="summary-step">{head["step"]}<' in sidebar and f'">{head["bubble"]}<' in sidebar
    # the drawn timeline is the plan's schedule with its predicted stage times, shown without a click
    view = pipe._plan_view(state.prediction)
    sched = state.prediction.schedule
    assert (sched.schedule, sched.pp, sched.n_microbatches, sched.virtual_stages) == ("zbv", 2, ref.n_microbatches, 2)
    assert sched == simulate_schedule("zbv", 2, ref.n_microbatches, 2, stage_times=predict_step(ref).stage_times_s,
                                      p2p_time=state.prediction.p2p_time_s)
    import holoviews as hv
    drawn = [el for el in view[1].object if isinstance(el, hv.Rectangles)]
    assert sum(len(el) for el in drawn) == len(sched.actions)
    # the what-if below keeps its own inputs until started from the plan
    assert pipe.simulate().bubble_fraction == pytest.approx(3 / 11)
    assert pipe.use_plan() and pipe.stage_times == predict_step(ref).stage_times_s


def test_precision_follows_the_cluster_until_chosen():
    from widgets import MemoryView, PlanState

    state = PlanState()
    assert (state.precision, state.precision_follows_cluster) == ("fp32", True)
    memory = MemoryView(state)
    memory.panel()
    state.cluster = "dgx-h100"
    assert state.precision == "bf16-megatron" == state.config.train.precision
    assert "bf16-megatron: follows the cluster (dgx-h100)" in memory._precision_note.object
    assert not memory._follow.visible
    state.cluster = "local-cpu"
    assert state.precision == "fp32"
    state.precision = "bf16-zero"  # chosen: kept through cluster changes
    assert not state.precision_follows_cluster and memory._follow.visible
    state.cluster = "dgx-a100"
    assert state.precision == "bf16-zero" and "chosen here" in memory._precision_note.object
    memory._follow.clicks += 1  # "Follow the cluster"
    assert state.precision_follows_cluster and state.precision == "bf16-megatron"
    assert PlanState(cluster="dgx-h100").config.train.precision == "bf16-megatron"
    assert PlanState(cluster="dgx-h100", precision="fp32").config.train.precision == "fp32"


def test_attention_kernel_and_zero_without_data_parallelism_are_explained():
    from widgets import MemoryView, PlanState

    state = PlanState(model=ModelSpec.preset("llama3-8b"), cluster="dgx-h100", nodes=1, tp=8, seq_len=4096,
                      recompute="selective")
    assert state.config.plan.shard_degree == 1
    bills = []
    for z in (0, 1, 2, 3):
        state.zero_stage = z
        bills.append(state.prediction.bill.peak_bytes)
    assert len(set(bills)) == 1  # nothing to shard over
    page = MemoryView.summary_html(state.prediction)
    assert 'data-testid="zero-note"' in page and "no data parallelism" in page
    assert "selective recompute with flash attention" in page
    flash = state.prediction.bill.components["activations"]
    state.attention = "eager"
    assert state.config.train.attention == "eager"
    page = MemoryView.summary_html(state.prediction)
    assert "eager attention" in page and "scores" in page
    state.recompute = "none"
    assert state.prediction.bill.components["activations"] > flash  # eager keeps the s x s scores selective drops
    state.dp_shard, state.tp = 2, 4
    assert 'data-testid="zero-note"' not in MemoryView.summary_html(state.prediction)


# ---------------------------------------------------------------------------- mesh
def test_mesh_positions_and_colours_follow_the_plan():
    cfg = config(nodes=4, tp=2, pp=2, cp=2)  # dp_shard = 32 / 8 = 4
    plan, cluster = cfg.plan, cfg.cluster
    for dim in T.COLOR_DIMS:
        lay = T.mesh_layout(cluster, plan, dim)
        groups = plan.group_ranks(dim)
        assert lay.n_groups == len(groups)
        assert [g["rank"] for g in lay.gpus] == list(range(32))
        for g in lay.gpus:
            r = g["rank"]
            assert (g["node"], g["gpu"]) == divmod(r, 8)
            coords = plan.rank_coords(r)
            assert {k: g[k] for k in coords} == coords
            assert r in groups[g["group"]]
            assert g["color"] == T.PALETTE[g["group"] % len(T.PALETTE)]
        for members in groups:  # one colour per group
            assert len({lay.gpus[r]["color"] for r in members}) == 1
    lay = T.mesh_layout(cluster, plan, "tp")
    # geometry: nodes side by side, GPUs stacked in their node, every GPU inside its node's box
    for g in lay.gpus:
        box = lay.nodes[g["node"]]
        assert g["x"] == g["node"] * T.NODE_PITCH and g["y"] == -g["gpu"]
        assert box["x0"] < g["x"] < box["x1"] and box["y0"] < g["y"] < box["y1"]
    assert sum(1 for s in lay.links if s["tier"] == "intra_node") == 4
    assert sum(1 for s in lay.links if s["tier"] == "inter_node") == 4
    assert len(lay.switches) == 1 and not lay.warnings


def test_mesh_rows_and_warnings():
    cfg = config("gpt3-175b", nodes=20, tp=16, train={"seq_len": 2048})  # TP across 2 nodes: warned
    lay = T.mesh_layout(cfg.cluster, cfg.plan, "tp", nodes_per_row=16)
    assert len(lay.switches) == 2  # 16 + 4 nodes in two rows joined by a spine line
    assert lay.tiers["tp"] == "inter_node"
    assert len(lay.warnings) == 1 and lay.warnings[0].startswith("tp=16 spans 2 nodes")
    assert lay.gpus[16 * 8]["y"] < lay.gpus[0]["y"] - 8  # node 16 starts the second row


def test_traffic_tables_equal_comms():
    from workbench.predict.comms import link_traffic, step_collectives
    from widgets.state import PlanPrediction

    cfg = config(nodes=2, tp=2, pp=2)
    pred = PlanPrediction.of(cfg)
    crit = pred.step.critical_pp_rank
    rows = T.dim_traffic_rows(pred)
    ref = step_collectives(cfg, pp_rank=crit)
    assert {r["dim"] for r in rows} == {c.dim for c in ref}
    for r in rows:
        mine = [c for c in ref if c.dim == r["dim"]]
        assert r["wire_bytes"] == pytest.approx(sum(c.wire_bytes * c.count for c in mine))
        assert r["time_s"] == pytest.approx(sum(c.total_time_s for c in mine))
    tiers = {r["tier"]: r for r in T.tier_rows(pred)}
    lt = link_traffic(cfg, pp_rank=crit)
    assert tiers["inter_node"]["bytes"] == pytest.approx(lt["inter_node"]) and lt["inter_node"] > 0  # pipeline sends
    assert pred.link_bytes == pytest.approx(lt)
    assert sum(tiers["inter_node"]["by_dim"].values()) == pytest.approx(tiers["inter_node"]["bytes"])


@pytest.mark.parametrize("model,nodes,plan", [
    ("llama3-70b", 2, dict(tp=8, dp_shard=2)),  # the reported disagreement: FSDP exposed vs the breakdown
    ("llama3-70b", 4, dict(tp=4, pp=2, cp=2, dp_shard=2, pp_schedule="zbv", virtual_stages=2)),
    ("gpt3-175b", 2, dict(tp=16)),  # hierarchical TP across nodes
])
def test_mesh_traffic_is_the_step_prediction_s_and_adds_up(model, nodes, plan):
    from widgets.mesh_view import MeshView
    from widgets.state import PlanPrediction

    cfg = config(model, nodes=nodes, train={"seq_len": 2048}, **plan)
    pred = PlanPrediction.of(cfg)
    step = predict_step(cfg)
    assert pred.step == step  # the prediction is predict_step's, number for number
    groups = T.group_traffic_rows(pred)
    assert groups
    for g in groups:
        # a group's calls, bytes and time are the sums of its per-tier parts
        assert g["calls"] == sum(p["calls"] for p in g["parts"])
        assert g["wire_bytes"] == pytest.approx(sum(p["wire_bytes"] for p in g["parts"]))
        assert g["time_s"] == pytest.approx(sum(p["time_s"] for p in g["parts"]))
        # exposed is what the step breakdown charges the group (pipeline sends: inside the bubble)
        if g["dim"] == "pp":
            assert g["exposed_time_s"] is None
        else:
            assert g["exposed_time_s"] == step.breakdown.get(f"comm_{g['dim']}", 0.0)
    assert {f"comm_{g['dim']}" for g in groups if g["dim"] != "pp"} == {k for k in step.breakdown if k.startswith("comm_")}
    page = MeshView.info_html(pred, "tp")
    for g in groups:
        assert T.dim_words(g["dim"]) in page and g["dim"] + "<" not in page
        if g["exposed_time_s"] is not None:
            assert T.format_seconds(g["exposed_time_s"]) in page
    head = T.step_headline(step)
    assert f'data-testid="mesh-step">{head["step"]}<' in page and f'data-testid="mesh-bubble">{head["bubble"]}<' in page
    # bytes per tier: the groups' bytes split over the links, the same total
    tiers = T.tier_rows(pred)
    assert sum(r["bytes"] for r in tiers) == pytest.approx(sum(g["wire_bytes"] for g in groups))


def test_bad_mapping_overloads_the_network_links_it_crosses():
    from widgets.mesh_view import OVERLOAD_COLOR, mesh_figure
    from widgets.state import PlanPrediction

    pred = PlanPrediction.of(config("gpt3-175b", nodes=2, tp=16, train={"seq_len": 2048}))
    fig, lay = mesh_figure(pred, "tp")
    hot = T.overloaded_links(lay, pred)
    # both nodes' network links carry TP's inter-node bytes: the prediction's, per GPU and step
    assert sorted(h["node"] for h in hot) == [0, 1] and {h["tier"] for h in hot} == {"inter_node"}
    tp_net = sum(b * c.count for c in pred.collectives if c.dim == "tp" for t, b in c.wire_by_tier if t == "inter_node")
    assert tp_net > 0 and all(h["bytes"] == pytest.approx(tp_net) for h in hot)
    assert all(h["what"] == "tensor parallel" and h["label"].startswith("TP ") for h in hot)
    drawn = [el for el in fig if isinstance(el, __import__("holoviews").Segments) and "what" in el.dimensions("value", True)]
    assert len(drawn) == 1 and drawn[0].opts.get().kwargs["color"] == OVERLOAD_COLOR
    # a good mapping (TP inside a node) overloads nothing
    good = PlanPrediction.of(config("gpt3-175b", nodes=2, tp=8, train={"seq_len": 2048}))
    _, lay = mesh_figure(good, "tp")
    assert T.overloaded_links(lay, good) == []


def test_words_for_internal_names():
    assert T.dim_words("dp_shard_cp") == "data parallel (sharded) × context"
    assert T.dim_words("tp") == "tensor parallel" and T.dim_words("unknown") == "unknown"
    assert T.recompute_words("none") == "no recompute" and T.recompute_words("full") == "full recompute"
    assert T.tier_words("inter_node") == "network" and T.kind_words("W") == "backward (weight grad)"
    assert T.component_words("master_weights") == "master weights"
    assert set(T.RECOMPUTE_CHOICES.values()) == set(T.RECOMPUTE_WORDS)
    from workbench.spec.plan import GROUP_DIMS
    from workbench.predict.comms import EXPERT_DIMS
    assert set(GROUP_DIMS) | set(EXPERT_DIMS) <= set(T.DIM_WORDS)  # every group the predictor names has words


# ---------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("zbv", 4, 8, 2),
                                             ("gpipe", 2, 4, 1), ("dualpipev", 2, 4, 2)])
def test_gantt_rectangles_are_the_simulated_actions(schedule, pp, m, v):
    result = simulate_schedule(schedule, pp, m, v)
    rects = T.gantt_rects(result.actions)
    assert len(rects) == len(result.actions)
    for rect, a in zip(rects, result.actions):
        assert (rect["x0"], rect["x1"]) == (a.start, a.end)
        assert rect["y0"] < a.rank < rect["y1"] and rect["yc"] == a.rank
        assert (rect["stage"], rect["microbatch"], rect["kind"]) == (a.stage, a.microbatch, a.kind)
        assert rect["chunk"] == a.stage // pp
        assert rect["color"] == T.KIND_COLORS[a.kind]
        assert rect["label"] == (f"s{a.stage}·{a.microbatch}" if v > 1 else str(a.microbatch))
    assert T.bubble_fraction_of(result.actions) == pytest.approx(result.bubble_fraction)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("zero-bubble", 1),
                                        ("interleaved-1f1b", 4)])
def test_what_if_chunks_do_one_vth_of_the_work(schedule, v):
    from widgets.pipeline_view import PipelineView

    pipe = PipelineView(show_plan=False)
    pipe.param.update(schedule=schedule, pp=4, n_microbatches=8, virtual_stages=v)
    result = pipe.simulate()
    widths = {a.kind: set() for a in result.actions}
    for a in result.actions:
        widths[a.kind].add(round(a.end - a.start, 9))
    want = {"F": 1 / v, "B": 2 / v, "I": 1 / v, "W": 1 / v}
    assert {k: sorted(w) for k, w in widths.items()} == {k: [round(want[k], 9)] for k in widths}
    # every rank does F = 1, B = 2 per micro-batch whatever v: the same busy time as 1F1B
    assert max(result.busy_time) == pytest.approx(3 * 8)
    if v > 1:  # finer chunks fill the bubble: shorter than 1F1B, not longer (57 vs 33 units before)
        assert result.step_time < simulate_schedule("1f1b", 4, 8).step_time


def test_measured_actions_use_the_same_transform():
    measured = [  # two ranks, dicts as telemetry events carry them, with a wall-clock offset
        {"rank": 0, "stage": 0, "microbatch": 0, "kind": "F", "start": 100.0, "end": 101.0},
        {"rank": 1, "stage": 1, "microbatch": 0, "kind": "F", "start": 101.0, "end": 102.0},
        {"rank": 1, "stage": 1, "microbatch": 0, "kind": "B", "start": 102.0, "end": 104.0},
        {"rank": 0, "stage": 0, "microbatch": 0, "kind": "B", "start": 104.0, "end": 106.0},
    ]
    assert T.bubble_fraction_of(measured) == pytest.approx(1 - 6 / (2 * 6))
    assert T.gantt_rects(measured)[2]["x1"] == 104.0
    assert T.bubble_fraction_of([]) == 0.0


# ---------------------------------------------------------------------------- advisor
def test_advice_rows_and_plan_settings():
    from workbench import advise

    m, c = ModelSpec.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=2)
    advice = advise(m, c, TrainSettings(seq_len=4096).with_precision("bf16-zero"), top=5)
    rows = T.advice_rows(advice)
    assert [r["#"] for r in rows] == [1, 2, 3, 4, 5]
    for r, cand in zip(rows, advice):
        assert r["plan"] == cand.plan.describe()
        assert r["memory (GiB)"] == round(cand.memory.peak_bytes / T.GiB, 2)
        assert r["step (ms)"] == round(cand.prediction.step_time_s * 1e3, 1)
        assert r["MFU (%)"] == round(100 * cand.prediction.mfu, 1)
    s = T.plan_settings(advice[0])
    rebuilt = T.build_config(m, "dgx-h100", 2, {k: s[k] for k in T.PLAN_KEYS},
                             {k: s[k] for k in T.TRAIN_KEYS}, s["precision"])
    assert rebuilt.ok and rebuilt.value.plan == advice[0].plan and rebuilt.value.train == advice[0].train


# ---------------------------------------------------------------------------- views (no browser)
def test_views_share_state_and_show_errors_inline():
    from widgets import AdvisorView, MemoryView, MeshView, ModelSketch, PipelineView, PlanState

    state = PlanState()
    sketch, memory, mesh = ModelSketch(state), MemoryView(state), MeshView(state)
    for v in (sketch, memory, mesh):
        v.panel()
    assert state.config is not None and state.config.model == ModelSpec.preset("tiny")
    sketch.preset = "llama3-8b"
    assert state.model == ModelSpec.preset("llama3-8b") and sketch._editors["d_ff"].value == 14336
    # an invalid field: message under it, no model downstream, no exception
    sketch._editors["n_kv_heads"].value = 3
    slot = sketch._errors._slots["n_kv_heads"]
    assert slot.visible and "n_kv_heads=3 does not divide n_heads=32" in slot.object
    assert state.model is None and state.config is None and state.error.startswith("model: n_kv_heads=3")
    sketch._editors["n_kv_heads"].value = 8
    assert state.model == ModelSpec.preset("llama3-8b") and not slot.visible
    # a plan error shows next to tp in the mesh view, in the general alert of the memory view
    state.apply(cluster="dgx-h100", nodes=2, seq_len=4096)
    state.tp = 3
    assert mesh._errors._slots["tp"].visible and "tp=3 does not divide n_heads=32" in mesh._errors._slots["tp"].object
    assert memory._errors.general.visible
    assert "—" in MemoryView.summary_html(state.config)
    state.tp = 2
    assert not mesh._errors._slots["tp"].visible and state.config.plan.tp == 2
    # advisor -> mesh and memory
    adv = AdvisorView(state, top=20)
    adv.search()
    pick = next(i for i, c in enumerate(adv.advice) if c.plan.pp > 1)
    adv.choose(pick)
    chosen = adv.advice[pick]
    assert state.config.plan == chosen.plan and state.config.train == chosen.train
    assert chosen.plan.describe() in MeshView.info_html(state.config, "pp")
    assert T.format_bytes(chosen.memory.peak_bytes) in MemoryView.summary_html(state.config)
    # pipeline: the plan's schedule with its predicted stage times
    pipe = PipelineView(state)
    assert pipe.use_plan()
    res = pipe.simulate()
    pred = predict_step(state.config)
    assert (res.schedule, res.pp, res.n_microbatches) == (chosen.plan.pp_schedule, chosen.plan.pp,
                                                          state.config.n_microbatches)
    assert pipe.stage_times == tuple(pred.stage_times_s)


def test_framework_choice_reprices_the_bill_and_states_its_band():
    from workbench.predict.perf import describe_step
    from widgets import AdvisorView, MemoryView, MeshView, PlanState
    from widgets.app import summary_html

    state = PlanState(tp=2)  # tiny on local-cpu, tp=2 with sequence parallelism
    memory = MemoryView(state)
    memory.panel()
    assert state.config.plan.sequence_parallel and state.framework == "bundled"
    bundled = estimate_memory(state.config)
    page = MemoryView.summary_html(state.config)
    assert "uncalibrated, bundled profile" in page
    assert describe_step(predict_step(state.config).step_time_s, state.config.train.profile) in page
    # the control: megatron keeps the SP inputs of the QKV and MLP linears sharded, so fewer bytes
    memory.framework.select.value = "megatron"
    assert state.framework == "megatron" and state.config.train.profile.name == "megatron"
    megatron = estimate_memory(state.config)
    assert megatron.components["activations"] < bundled.components["activations"]
    assert megatron.peak_bytes < bundled.peak_bytes
    page = MemoryView.summary_html(state.config)
    assert "uncalibrated, megatron profile" in page and T.format_bytes(megatron.peak_bytes) in page
    assert "uncalibrated, megatron profile" in summary_html(state.config, "", "tiny")
    assert "megatron profile" in MeshView.info_html(state.config, "tp")
    # the advisor prices its plans under the chosen profile and its table's caption says so
    adv = AdvisorView(state, top=5)
    adv.panel()
    adv.search()
    assert adv.advice and all(c.config.train.profile.name == "megatron" for c in adv.advice)
    best = adv.advice[0]
    assert describe_step(best.prediction.step_time_s, best.config.train.profile) in adv._band.object
    adv.choose(0)
    assert state.config.train == best.train and state.framework == "megatron"


def test_fitted_profile_json_is_loaded_escaped_and_invalid_files_are_reported(tmp_path):
    import dataclasses

    from workbench.spec.framework import FRAMEWORKS, ErrorBand, FrameworkProfile
    from widgets import AdvisorView, MemoryView, MeshView, PlanState
    from widgets.app import summary_html

    state = PlanState(tp=2)
    memory, adv = MemoryView(state), AdvisorView(state, top=5)
    memory.panel(), adv.panel()
    # a calibration file, as `workbench calibrate --measured ... -o fit.json` writes it
    band = ErrorBand(step_error=0.03, p90_step_error=0.07, n_runs=70, method="leave-one-out (linearised)")
    fitted = dataclasses.replace(FRAMEWORKS["fsdp"], name="fsdp-fitted", band=band, fitted=("matmul",))
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"profile": fitted.to_dict(), "report": {}}))
    assert FrameworkProfile.load(path) == fitted
    assert memory.framework.load(path.read_bytes())
    assert state.framework == "fsdp-fitted" and state.config.train.profile == fitted
    assert "fsdp-fitted" in memory.framework.select.options
    want = "+/- 3%, fsdp-fitted profile, fitted on 70 runs (leave-one-out (linearised))"
    step = predict_step(state.config).step_time_s
    assert f"step {step:.3f} s ({want})" in MemoryView.summary_html(state.config)
    assert want in summary_html(state.config, "", "tiny")
    adv.search()
    assert want in adv._band.object and adv.advice[0].config.train.profile == fitted
    # the built-ins stay choosable; a loaded profile named as one gets its own choice
    state.framework = "bundled"
    assert state.config.train.profile.name == "bundled"
    state.framework = "fsdp-fitted"
    assert state.config.train.profile == fitted
    assert memory.framework.load(json.dumps({"name": "megatron", "band": dataclasses.asdict(band)}))
    assert state.framework == "megatron (loaded)" and state.config.train.profile.band == band

    # a name from a user's file reaches every view escaped
    evil = "<script>alert(1)</script>"
    assert memory.framework.load(json.dumps({"name": evil, "band": dataclasses.asdict(band)}))
    assert state.framework == evil and state.config is not None
    assert "&lt;script&gt;alert(1)&lt;/script&gt; profile" in memory.framework.note.object
    adv.search()
    for page in (MemoryView.summary_html(state.config), summary_html(state.config, "", "tiny"),
                 MeshView.info_html(state.config, "tp"), adv._band.object, memory.framework.note.object):
        assert "<script>" not in page and "&lt;script&gt;" in page

    # invalid files: the one-line ConfigError under the control, escaped; the choice is kept
    for text, message in [
        ("{not json", "framework profile is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "framework must be a JSON object, not list"),
        (json.dumps({"name": "x", "colour": 1}), "framework has unknown fields [&#x27;colour&#x27;]"),
        (json.dumps({"name": "x", "efficiency": {"matmul": "<b>"}}),
         "efficiency.matmul=&#x27;&lt;b&gt;&#x27; must be a finite number"),
        (json.dumps({"name": "x", "band": {"step_error": 0.1}}), "framework.band is missing p90_step_error"),
        (json.dumps({"name": "x", "in_stage_comm_exposed": [[1, 2, 3]]}), "must be an object of tier: share"),
    ]:
        assert not memory.framework.load(text)
        note = memory.framework.note.object
        assert 'data-testid="error-framework"' in note and message in note, note
        assert "\n" not in note and "Traceback" not in note and "<b>" not in note
        assert state.framework == evil and state.config is not None
    with pytest.raises(ConfigError) as err:
        state.load_profile("{}")
    assert err.value.field == "framework" and "is missing name" in str(err.value)


def test_pipeline_view_invalid_input_is_shown_not_raised():
    from widgets import PipelineView

    pipe = PipelineView()
    pipe.panel()
    # DualPipeV is defined only from 2 pp micro-batches (1F1B with m < pp is simulated: Megatron runs it)
    pipe.param.update(schedule="dualpipev", pp=4, n_microbatches=6, virtual_stages=2)
    view = pipe._view()
    slot = pipe._errors._slots["n_microbatches"]
    assert slot.visible and "n_microbatches=6 &lt; 4 x 2 = 8" in slot.object  # HTML-escaped
    assert "No timeline" in view.object
    pipe.param.update(schedule="1f1b", virtual_stages=1, n_microbatches=8)
    pipe._view()
    assert not slot.visible and pipe.simulate().bubble_fraction == pytest.approx(3 / 11)


def test_app_sessions_do_not_share_state_and_serving_is_local_unless_authenticated():
    from widgets import SECTIONS, create_app, serve

    a, b = create_app(), create_app()
    assert a.state is not b.state
    a.state.nodes = 3
    assert b.state.nodes == 1
    assert list(a.views) == [t for t, _ in SECTIONS] and len(SECTIONS) >= 9  # 1-5 planning, 6-8 run, 9 bandwidth, ...
    with pytest.raises(ConfigError) as err:
        serve(port=0, address="0.0.0.0")
    assert err.value.field == "address" and "requires authentication" in str(err.value)
