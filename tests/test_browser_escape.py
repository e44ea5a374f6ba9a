"""Strings that did not come from the code never become markup in the UI (issue 13).

Hostile model names, error texts, run ids, host names, file names, event fields and profile
names are pushed through every view; then every pane's HTML, exactly as it is sent to the browser,
and every Bokeh hover template is searched for a live ``<img`` or ``<script`` tag. The browser test
pastes hostile Hugging Face configs into the served app's Model tab and checks that no script ran
and that the text is shown literally.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import time

import pytest

from browser.helpers import CHROMIUM, OfflinePage, screenshot  # tests/browser/

IMG = '<img src=x onerror="window.__pwned=1">'
SCRIPT = "<script>window.__pwned=1</script>"
HOSTILE = (IMG, SCRIPT)
LIVE_TAG = re.compile(r"<\s*(img|script)\b", re.IGNORECASE)
TINY_HF = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256}


# ---------------------------------------------------------------------------- what reaches the page
def _roots(app):
    return [*app.template.main, *app.template.sidebar]


def page_markup(roots) -> list[str]:
    """The innerHTML of every text pane under ``roots`` (HTML, Markdown, Alert, Str ...), as the
    browser sets it: Panel escapes the pane's HTML once for the wire, the page unescapes it."""
    import panel as pn
    from panel.pane.markup import HTMLBasePane

    out = []
    for root in roots:
        for pane in root.select(pn.pane.PaneBase):
            if isinstance(pane, HTMLBasePane):
                out.append(html.unescape(pane._transform_object(pane.object)["object"]))
    return out


def hover_templates(roots) -> list[str]:
    """Every Bokeh hover template under ``roots``, HoloViews' included: a template is HTML, so data
    may reach it only through ``@fields`` (whose values Bokeh escapes), never in the text."""
    import holoviews as hv
    import panel as pn
    from bokeh.models import HoverTool

    figs = []
    for root in roots:
        figs += [p.object for p in root.select(pn.pane.Bokeh) if p.object is not None]
        figs += [hv.render(p.object, backend="bokeh") for p in root.select(pn.pane.HoloViews) if p.object is not None]
    out = []
    for fig in figs:
        for tool in getattr(fig, "tools", []):
            if isinstance(tool, HoverTool):
                tips = tool.tooltips
                out += [tips] if isinstance(tips, str) else [value for _label, value in (tips or [])]
    return out


def assert_shown_as_text(roots, where: str) -> None:
    """No live tag in any pane; and the hostile text is on the page, escaped (else nothing was checked)."""
    markup = page_markup(roots)
    live = [m for m in markup if LIVE_TAG.search(m)]
    assert not live, f"{where}: markup from data reached the page: {live[0][:300]}"
    assert any("&lt;img" in m or "&lt;script" in m for m in markup), f"{where}: the hostile text is not shown"


# ---------------------------------------------------------------------------- the unit test
def test_hostile_strings_reach_every_view_as_text(tmp_path):
    import widgets
    from workbench.launch.handle import NodeStatus, RankStatus, RunStatus
    from workbench.rundir.benchmarks import CommsResults, CommsRow, save_results
    from widgets.app import create_app
    from widgets.compare_view import comparison_html
    from widgets.ui import html_pane

    os.environ["WORKBENCH_RUNS"] = str(tmp_path)  # the sessions' runs root: the bench view reads it at start
    try:
        # a comms benchmark whose group names and directory name are hostile
        from workbench import Cluster, ParallelPlan

        bench_dir = tmp_path / IMG.replace("/", "")
        bench_dir.mkdir()
        rows = tuple(CommsRow(dim, "all_reduce", 2, "intra_node", s, s, 5, 1, 1e-3, 1e-3, 1e-3)
                     for dim in HOSTILE for s in (64, 4096))
        save_results(CommsResults(cluster=Cluster.preset("local-cpu"), plan=ParallelPlan(dp_shard=2), world_size=2,
                                  backend="gloo", device="cpu", dtype="float32", rows=rows),
                     bench_dir / "comms.json")
        app = create_app()
    finally:
        del os.environ["WORKBENCH_RUNS"]
    views, state = app.views, app.state
    for view in views.values():
        view.panel()
    roots = _roots(app)

    # 1 Model: a hostile name imported, a hostile model_type refused, a hostile name typed in
    model = views["1 · Model"]
    assert model.load_hf_config(json.dumps({**TINY_HF, "_name_or_path": IMG}))
    assert state.model.name == IMG
    assert_shown_as_text(roots, "imported model name")
    for bad in ({**TINY_HF, "model_type": IMG}, {**TINY_HF, "model_type": SCRIPT}, {**TINY_HF, "hidden_size": SCRIPT}):
        assert not model.load_hf_config(json.dumps(bad))
        assert_shown_as_text(roots, f"refused config {bad}")
    model._editors["name"].value = SCRIPT
    assert state.model.name == SCRIPT
    model._editors["n_kv_heads"].value = 3  # an invalid edit: its error beside the field and in the sidebar
    assert_shown_as_text(roots, "invalid edit")
    model._editors["n_kv_heads"].value = 4

    # 2 Memory, 3 Mesh, 4 Advisor: a framework profile with a hostile name, and an invalid one
    memory, advisor = views["2 · Memory"], views["4 · Advisor"]
    band = {"step_error": 0.05, "p90_step_error": 0.1, "n_runs": 9, "method": SCRIPT}
    assert memory.framework.load(json.dumps({"name": IMG, "band": band}))
    advisor.search()
    assert_shown_as_text(roots, "profile name")
    assert not memory.framework.load(json.dumps({"name": "x", "efficiency": {"matmul": SCRIPT}}))
    assert_shown_as_text(roots, "invalid profile")
    state.param.update(model=None, model_error=IMG)  # the advisor's error line
    asyncio.run(advisor._on_click(None))
    assert "advisor-error" in advisor._status.object
    assert_shown_as_text(roots, "advisor error")
    state.param.update(model=widgets.PlanState().model, model_error="")

    # 6 Launch: a hostile model error (the tab launches the shared plan), gateway URL, status with
    # hostile hosts, states and reasons
    launch = views["6 · Launch"]
    state.param.update(model=None, model_error=IMG)
    asyncio.run(launch._on_start())
    assert "launch-error" in launch._message.object
    assert_shown_as_text(roots, "launch plan")
    state.param.update(model=widgets.PlanState().model, model_error="")
    launch.param.update(backend="gateway", url=SCRIPT)
    asyncio.run(launch._on_start())
    assert_shown_as_text(roots, "gateway url")
    status = RunStatus(state=IMG, why=SCRIPT, nodes=(NodeStatus(0, IMG, "failed", SCRIPT, (0,)),),
                       ranks=(RankStatus(0, 0, SCRIPT, why=IMG, step=1, loss=1.0, events=3),))
    launch._refresh([], status)
    assert_shown_as_text(roots, "run status")

    # 7 Live run: events from a run directory whose fields are hostile
    live = views["7 · Live run"]
    live.session.run_dir = str(tmp_path / IMG.replace("/", ""))
    events = [
        {"kind": "step", "rank": 0, "step": 0, "loss": 2.0, "tokens_per_s": 1.0, "grad_norm": 1.0, "step_time_s": 0.1},
        {"kind": "error", "rank": 0, "step": 0, "error": IMG},
        {"kind": "guard", "rank": 0, "step": 0, "guard": SCRIPT, "message": IMG},
        {"kind": "fault", "rank": 0, "attempt": 1, "cause": SCRIPT, "detail": IMG, "last_step": 0},
        {"kind": "checkpoint_rejected", "rank": 0, "step": 0, "reason": SCRIPT},
        {"kind": "resume", "rank": 0, "step": 0, "path": f"/x/{IMG}"},
        {"kind": "checkpoint", "rank": 0, "step": 0, "phase": IMG, "mode": SCRIPT, "t": 1.0, "bytes": 10},
        {"kind": "collectives", "rank": 0, "step": 0,
         "calls": [{"dim": IMG, "op": SCRIPT, "bytes": 64, "start": 0.0, "end": 0.001, "busbw": 1e6}]},
        {"kind": "pipeline", "rank": 0, "pp_rank": 0, "step": 0, "window": [0.0, 1.0],
         "actions": [["F", 0, 0, 0.0, 0.1], [IMG, 0, 0, 0.1, 0.2]]},
    ]
    live.update(events)
    assert "live-errors" in live._headline.object and "failed" in live._headline.object
    assert_shown_as_text(roots, "live run events")

    # 8 Compare: a run directory that is no run, and a replay that fails, both with hostile names
    compare = views["8 · Compare"]
    pane = html_pane(comparison_html(tmp_path / IMG.replace("/", ""), "t"))
    assert_shown_as_text([pane], "comparison of a foreign directory")
    compare.replay(IMG.replace("/", ""))
    assert_shown_as_text(roots, "failed replay")

    # 9 Bandwidth: the hostile groups are drawn (their names go to the hover through a column)
    bench = views["9 · Bandwidth"]
    assert bench.results and bench.series and {s["dim"] for s in bench.series} == set(HOSTILE)
    assert_shown_as_text(roots, "bandwidth groups")
    # hover templates are HTML: every one (the bandwidth's, and the measured pipeline's of the live
    # run, drawn by HoloViews) is code, with the hostile names only in @fields
    templates = hover_templates(roots)
    assert len(templates) > 20 and not [t for t in templates if "<" in t or "img" in t or "script" in t], templates
    (bench_dir / "comms.json").write_text(json.dumps({"kind": "comms", "rows": [{"dim": IMG}]}))
    bench.show()
    assert 'class="wb-error"' in bench._table.object
    assert_shown_as_text(roots, "broken comms.json")

    # the mechanism: a plain str in a view's HTML pane is shown as text, however it was built
    raw = html_pane(f"<b>{IMG}</b>")
    assert page_markup([raw]) == [html.escape(f"<b>{IMG}</b>")]


# ---------------------------------------------------------------------------- the browser test
HOSTILE_CONFIGS = [  # (what to paste, the note that shows the outcome, what it must show as text)
    (json.dumps({**TINY_HF, "_name_or_path": IMG}), "hf-imported", IMG),
    (json.dumps({**TINY_HF, "_name_or_path": SCRIPT}), "hf-imported", SCRIPT),
    (json.dumps({**TINY_HF, "model_type": IMG}), "error-hf_config", IMG),  # refused: the error text carries it
    (json.dumps({**TINY_HF, "model_type": SCRIPT}), "error-hf_config", SCRIPT),
    (json.dumps({**TINY_HF, "hidden_size": IMG}), "error-hf_config", IMG),  # "...='<img ...>' must be an integer"
]


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)")
def test_hostile_configs_pasted_in_the_model_tab_run_no_script(app_url, chromium_browser):
    t0 = time.monotonic()
    url, browser = app_url, chromium_browser  # one app and one Chromium for the session (conftest)
    off = OfflinePage(browser, viewport=(1400, 1100))  # the outside aborted and recorded
    page = off.page
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.get_by_test_id("summary-peak").wait_for(timeout=60_000)
    paste = page.locator("textarea").locator("visible=true").first
    button = page.get_by_role("button", name="Import pasted config")
    for text, testid, shown in HOSTILE_CONFIGS:
        paste.fill(text)
        button.click()
        try:  # the literal text in its note (a tag would show no text)
            page.get_by_test_id(testid).get_by_text(shown).locator("visible=true").wait_for(timeout=15_000)
        finally:
            assert page.evaluate("typeof window.__pwned") == "undefined", f"a script ran: {text}"
    # the imported names reach the sidebar as text as well
    paste.fill(HOSTILE_CONFIGS[0][0])  # a hostile name imported last: the sidebar shows it too
    button.click()
    page.get_by_test_id("summary-model").get_by_text(IMG).wait_for(timeout=20_000)
    time.sleep(0.5)  # an onerror fires when the broken image fails to load: give it the time
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("img[src='x']").count() == 0
    screenshot(page, "11-hostile-config-shown-as-text")
    assert not errors, errors
    assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
    assert time.monotonic() - t0 < 60
