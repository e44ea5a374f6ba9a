"""The same numbers everywhere, in a real headless Chromium: one served app, one plan, every tab.

Set llama3-70b on 4 DGX H100 nodes with tp=4, pp=2, cp=2, dp_shard=2 and the zero-bubble V
schedule (v=2); the sidebar's step and bubble, the Pipeline tab's and the Mesh tab's are the
same strings, and they are ``predict_step``'s for that RunConfig built here. The Mesh tab's
exposed time per group is the step breakdown's. Recompute "full" on the Memory tab: the bars
(Bokeh's own data, read from the page) reach the cards' peak. Then gpt3-175b with tp=16 on
2 x 8 H100: the network links TP crosses are drawn overloaded, labelled with the prediction's bytes.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from browser.helpers import CHROMIUM, open_app, screenshot, tab, text_of, wait_until
from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, estimate_memory, predict_step
from widgets import transforms as T

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]

PLAN = dict(tp=4, pp=2, cp=2, dp_shard=2, pp_schedule="zbv", virtual_stages=2)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

# Every glyph renderer of the page's Bokeh document: its glyph type, line colour and data.
GLYPHS_JS = """() => {
  const out = [];
  for (const doc of Bokeh.documents) {
    for (const m of doc._all_models.values()) {
      if (m.type !== "GlyphRenderer") continue;
      const data = {};
      for (const [k, v] of Object.entries(m.data_source.data)) data[k] = Array.from(v);
      let color = null;
      try { color = m.glyph.line_color; } catch (e) { color = null; }
      if (color !== null && typeof color === "object" && "value" in color) color = color.value;
      out.push({glyph: m.glyph.type, line_color: typeof color === "string" ? color : JSON.stringify(color), data});
    }
  }
  return out;
}"""


def reference(model: str, nodes: int, **plan) -> RunConfig:
    """The app's plan built without the app: its defaults (seq_len 256, mbs 1) and the cluster's precision."""
    return RunConfig(ModelSpec.preset(model), Cluster.preset("dgx-h100", nodes=nodes), ParallelPlan(**plan),
                     TrainSettings(seq_len=256).with_precision("bf16-megatron"))


def to_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*(-?[\d.,]+)\s*(B|KiB|MiB|GiB)\s*", text)
    assert m, f"not a byte count: {text!r}"
    return float(m.group(1).replace(",", "")) * UNITS[m.group(2)]


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True).locator("visible=true")
    box.fill(str(value))
    box.press("Enter")
    time.sleep(0.15)


def select(page, value: str) -> None:
    page.locator(f"select:has(option[value='{value}'])").locator("visible=true").select_option(value)
    time.sleep(0.15)


def table_rows(page, testid: str) -> list[list[str]]:
    rows = page.get_by_test_id(testid).locator("visible=true").first.locator("tr")
    return [[c.strip() for c in rows.nth(i).inner_text().split("\t")] for i in range(rows.count())]


def glyphs(page) -> list[dict]:
    return page.evaluate(GLYPHS_JS)


@pytest.fixture(scope="module")
def app_page(app_url, chromium_browser):
    with open_app(chromium_browser, app_url) as off:  # the session's app and Chromium (conftest)
        yield off
        errors = list(off.errors)
    assert not errors, errors


def test_one_plan_reads_the_same_in_every_tab(app_page):
    page = app_page.page
    t0 = time.monotonic()
    select(page, "llama3-70b")
    wait_until(page, "summary-model", lambda s: s == "llama3-70b", 30)
    tab(page, "3 · Mesh")
    # in an order whose steps on the way are invalid (cheap to show) until the last makes the plan
    set_number(page, "dp (sharded), -1 = rest", PLAN["dp_shard"])
    for name in ("tp", "pp", "cp"):
        set_number(page, name, PLAN[name])
    select(page, "zbv")
    set_number(page, "virtual stages per rank", PLAN["virtual_stages"])
    select(page, "dgx-h100")
    set_number(page, "nodes", 4)
    cfg = reference("llama3-70b", 4, **PLAN)
    wait_until(page, "summary-plan", lambda s: s == cfg.plan.describe(), 30)

    step = predict_step(cfg)
    head = T.step_headline(step)
    # the sidebar
    assert text_of(page, "summary-step") == head["step"]
    assert text_of(page, "summary-bubble") == head["bubble"]
    # the mesh: the same step and bubble, and each group's exposed time is the step breakdown's
    assert wait_until(page, "mesh-step", lambda s: s == head["step"], 20) == head["step"]
    assert text_of(page, "mesh-bubble") == head["bubble"]
    rows = {r[0]: r for r in table_rows(page, "traffic-by-group")[1:]}
    comm = {k[len("comm_"):]: v for k, v in step.breakdown.items() if k.startswith("comm_")}
    assert comm
    for dim, exposed in comm.items():
        assert rows[T.dim_words(dim)][6] == T.format_seconds(exposed), (dim, rows[T.dim_words(dim)])
    assert "dp_shard_cp" not in page.get_by_test_id("traffic-by-group").locator("visible=true").first.inner_text()
    time.sleep(1.0)  # the cluster picture is a canvas: let it draw before the screenshot
    screenshot(page, "numbers-01-mesh-llama3-70b-zbv-traffic-is-the-step-breakdown")
    # the pipeline tab: the plan's own pipeline, without pressing anything
    tab(page, "5 · Pipeline")
    assert wait_until(page, "plan-step", lambda s: s == head["step"], 30) == head["step"]
    assert text_of(page, "plan-bubble") == head["bubble"]
    drawn = [g for g in glyphs(page) if "microbatch" in g["data"] and "kind_name" in g["data"]]
    n_plan = sum(len(g["data"]["x0"]) for g in drawn)
    assert n_plan >= 3 * cfg.n_microbatches * 2 * 2  # F, I, W of every micro-batch, 2 chunks, 2 ranks (+ what-if)
    time.sleep(1.0)
    screenshot(page, "numbers-02-pipeline-the-plan-s-own-zbv-pipeline-and-what-if")
    print(f"\nsame numbers in three places: {time.monotonic() - t0:.1f} s (step {head['step']}, bubble {head['bubble']})")


def test_memory_bars_follow_the_cards(app_page):
    page = app_page.page
    tab(page, "2 · Memory")
    before = wait_until(page, "peak-memory", lambda s: s.endswith("B"), 20)
    page.get_by_role("button", name="full", exact=True).locator("visible=true").click()
    full = reference("llama3-70b", 4, **PLAN).replace(train=TrainSettings(seq_len=256, recompute="full")
                                                      .with_precision("bf16-megatron"))
    want = T.format_bytes(estimate_memory(full).peak_bytes)
    peak = wait_until(page, "peak-memory", lambda s: s == want, 20)
    assert peak != before
    deadline = time.monotonic() + 10
    while True:  # the bars' data arrives in its own message: poll the page's Bokeh sources
        bars = [g["data"] for g in glyphs(page) if g["glyph"] == "VBar" and "activations" in g["data"]]
        peak_bar = next((d for d in bars if len(d["bar"]) == 1), None)
        unit = UNITS[peak_bar["unit"][0]] if peak_bar and peak_bar["unit"] else 0
        total = sum(peak_bar[c][0] for c in T.COMPONENT_COLORS) * unit if unit else 0
        if abs(total - to_bytes(peak)) < 0.01 * UNITS["GiB"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert total == pytest.approx(estimate_memory(full).peak_bytes, rel=1e-6)
    assert T.format_bytes(total) == peak
    stage_bars = next(d for d in bars if len(d["bar"]) > 1)
    assert len(stage_bars["bar"]) == 2  # pp = 2: one bar per pipeline rank
    assert "precision-source" in page.get_by_test_id("precision-source").locator("visible=true").first.evaluate(
        "e => e.dataset.testid")
    assert text_of(page, "precision-source") == "bf16-megatron: follows the cluster (dgx-h100)"
    screenshot(page, "numbers-03-memory-full-recompute-bars-equal-cards")


def test_tp_across_nodes_overloads_the_network_links(app_page):
    from widgets.mesh_view import OVERLOAD_COLOR
    from widgets.state import PlanPrediction

    page = app_page.page
    tab(page, "1 · Model")
    select(page, "gpt3-175b")
    wait_until(page, "summary-model", lambda s: s == "gpt3-175b", 30)
    tab(page, "3 · Mesh")
    set_number(page, "nodes", 2)  # invalid on the way (cheap to show) until the schedule is 1F1B again
    for name, value in (("tp", 16), ("pp", 1), ("cp", 1)):
        set_number(page, name, value)
    set_number(page, "dp (sharded), -1 = rest", -1)
    set_number(page, "virtual stages per rank", 1)
    select(page, "1f1b")
    cfg = reference("gpt3-175b", 2, tp=16)
    cfg = cfg.replace(train=TrainSettings(seq_len=256, recompute="full").with_precision("bf16-megatron"))  # from the memory test
    wait_until(page, "summary-plan", lambda s: s == "tp=16", 30)
    assert text_of(page, "summary-step") == T.step_headline(predict_step(cfg))["step"]
    page.get_by_test_id("mesh-warning").locator("visible=true").first.wait_for(timeout=20_000)
    pred = PlanPrediction.of(cfg)
    lay = T.mesh_layout(cfg.cluster, cfg.plan, "tp")
    want = T.overloaded_links(lay, pred)
    assert len(want) == 2
    deadline = time.monotonic() + 20
    hot = []
    while not hot and time.monotonic() < deadline:
        hot = [g for g in glyphs(page) if g["glyph"] == "Segment" and "what" in g["data"]]
        time.sleep(0.2)
    assert len(hot) == 1, hot
    data = hot[0]["data"]
    assert hot[0]["line_color"] == OVERLOAD_COLOR
    assert sorted(data["node"]) == [0, 1] and set(data["what"]) == {"tensor parallel"}
    assert set(data["sent"]) == {T.format_bytes(want[0]["bytes"])} and set(data["time"]) == {want[0]["time"]}
    labels = [g["data"]["text"] for g in glyphs(page) if g["glyph"] == "Text" and "text" in g["data"]]
    assert {t.replace("\n", " ") for ts in labels for t in ts} == {want[0]["label"]}, labels  # "TP 436.2 MiB · 63.5 ms"
    time.sleep(1.0)
    screenshot(page, "numbers-04-mesh-gpt3-tp16-across-nodes-overloaded-links")
