"""The views in a real JupyterLab, in Debian's headless Chromium, with every request outside
127.0.0.1 blocked (a cluster login node has no internet).

``jupyter lab`` runs on 127.0.0.1 with a token (``tests/browser/jupyter.py``). One test opens a
notebook of the memory, mesh and pipeline views, runs it with *Run > Run All Cells*, asserts the
Bokeh plots are drawn with the bill ``estimate_memory`` computes, clicks *full* recomputation in
the memory view and asserts the drawn bars follow (the bill of the new configuration, to the
byte). The other runs a teaching notebook the same way and asserts its plots are drawn and no
cell failed. Screenshots go to test-artifacts/screenshots/ (jupyterlab-...).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import nbformat
import pytest

from browser.helpers import CHROMIUM, ROOT, chromium, offline_page, screenshot  # tests/browser/
from browser.jupyter import jupyter_lab

from workbench import RunConfig, estimate_memory
from workbench.predict.memory import COMPONENTS

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]

# Every ColumnDataSource of every Bokeh document on the page, as plain {column: [values]}.
SOURCES_JS = """() => {
  if (!window.Bokeh) return [];
  const out = [];
  for (const doc of window.Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.type !== 'ColumnDataSource') continue;
      const data = {};
      for (const [k, v] of (m.data instanceof Map ? m.data.entries() : Object.entries(m.data))) data[k] = Array.from(v);
      out.push(data);
    }
  }
  return out;
}"""
# The Bokeh plots actually drawn: canvases with a size (a blank output has none).
DRAWN_JS = """() => {
  const walk = root => Array.from(root.querySelectorAll('*')).flatMap(
    e => [...(e.tagName === 'CANVAS' ? [e] : []), ...(e.shadowRoot ? walk(e.shadowRoot) : [])]);
  return Array.from(document.querySelectorAll('.jp-OutputArea-output')).flatMap(walk)
    .filter(c => c.width > 20 && c.height > 20).length;
}"""

VIEWS_CELLS = [
    "import widgets\nwidgets.extension()",
    "state = widgets.PlanState(pp=2)",
    "widgets.MemoryView(state)",
    "widgets.MeshView(state)",
    "widgets.PipelineView(state)",
]
SETTINGS = {
    # JupyterLab would ask to fetch news from the internet: it is told not to
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    # and it starts the notebook's kernel without asking which (a dialog, when the kernel list is late)
    # every cell in the page (no windowing), so the test reads every prompt and output
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"autoStartDefaultKernel": True,
                                                                  "windowingMode": "none"},
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root, home = tmp_path_factory.mktemp("lab-root"), tmp_path_factory.mktemp("lab-home")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in VIEWS_CELLS]
    nbformat.write(nb, root / "views.ipynb")
    shutil.copy(ROOT / "notebooks" / "03_pipeline_schedules.ipynb", root)
    for rel, values in SETTINGS.items():
        path = home / "settings" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    with jupyter_lab(root, home) as server:
        yield server


def run_all(page, timeout_s: float = 240.0) -> list[str]:
    """Open *Run > Run All Cells*, then wait until every code cell has an execution count; return
    the prompts. The menu is opened again if the first click came before the notebook was ready
    (no cell queued)."""
    def prompts() -> list[str]:
        return [t.strip() for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]

    def click_run_all() -> None:
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            raise AssertionError("JupyterLab shows a dialog: " + dialog.first.inner_text())
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=90_000)
    time.sleep(2)
    click_run_all()
    deadline, retried = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        now = prompts()
        if now and all(p[1:-2].isdigit() for p in now):  # "[12]:"
            return now
        if not retried and time.monotonic() > deadline - timeout_s + 20 and all(p in ("[ ]:", "[]:") for p in now):
            click_run_all()
            retried = True
        time.sleep(0.5)
    screenshot(page, "jupyterlab-run-all-failed")
    failed = page.locator("[data-mime-type='application/vnd.jupyter.stderr'], .jp-OutputArea-output",
                          has_text="Error")
    raised = failed.first.inner_text()[-2000:] if failed.count() else "no error shown"
    raise AssertionError(f"the cells did not all run within {timeout_s:.0f} s: prompts {prompts()}; {raised}")


def bill_bars(page) -> list[dict]:
    """The memory view's drawn stacked bars: sources with a ``bar`` column and every component."""
    return [s for s in page.evaluate(SOURCES_JS) if "bar" in s and all(c in s for c in COMPONENTS)]


def peak_drawn(sources: list[dict]) -> float:
    """Height of the most loaded rank's bar (the source whose bars are named ``rank N``), in the
    chart's unit."""
    for s in sources:
        if s["bar"] and all(str(b).startswith("rank ") for b in s["bar"]):
            return sum(s[c][0] for c in COMPONENTS)
    raise AssertionError(f"no most-loaded-rank bar among {[s['bar'] for s in sources]}")


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")


def config_of(**overrides) -> RunConfig:
    """The notebook's configuration, built the way the views build it (PlanState), in this process."""
    import widgets

    state = widgets.PlanState(pp=2, **overrides)
    assert state.config is not None, state.error
    return state.config


def test_views_draw_and_follow_a_widget_in_jupyterlab(lab, browser_session):
    with offline_page(browser_session) as off:
        page = off.page
        page.goto(lab.notebook_url("views.ipynb"))
        prompts = run_all(page)
        assert len(prompts) == len(VIEWS_CELLS)
        assert not page.locator("[data-mime-type='application/vnd.jupyter.error']").count(), "a cell raised"
        # memory + per-stage bars, the mesh, the Gantt: at least four plots drawn, not blank outputs
        drawn = wait_for(lambda: page.evaluate(DRAWN_JS) >= 4 and page.evaluate(DRAWN_JS), 90, "four drawn plots")
        bars = wait_for(lambda: bill_bars(page), 60, "the memory view's bars")
        unit = 2**20  # the tiny model's bill is drawn in MiB
        before = estimate_memory(config_of()).peak_bytes
        assert peak_drawn(bars) * unit == pytest.approx(before, rel=1e-9)
        screenshot(page, "jupyterlab-views")

        # a widget changed in the browser reaches the kernel, and the chart follows
        page.locator(".jp-OutputArea-output").get_by_role("button", name="full", exact=True).first.click()
        after = estimate_memory(config_of(recompute="full")).peak_bytes
        assert after < before
        try:
            wait_for(lambda: abs(peak_drawn(bill_bars(page)) * unit - after) < 1e-6 * after, 60,
                     f"the drawn peak to become the full-recompute bill ({after} B)")
        finally:
            screenshot(page, "jupyterlab-views-recompute-full")
            failed = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
            if failed.count():
                (ROOT / "test-artifacts" / "jupyterlab-kernel-error.txt").write_text(failed.first.inner_text())
            assert not failed.count(), "the kernel raised: " + failed.first.inner_text()[-1500:]
        assert page.evaluate(DRAWN_JS) >= drawn
        assert not off.errors, off.errors


def test_a_teaching_notebook_runs_all_in_jupyterlab(lab, browser_session):
    nb = nbformat.read(ROOT / "notebooks" / "03_pipeline_schedules.ipynb", as_version=4)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    with offline_page(browser_session, viewport=(1400, 1000)) as off:
        page = off.page
        page.goto(lab.notebook_url("03_pipeline_schedules.ipynb"))
        prompts = run_all(page, timeout_s=300)
        assert len(prompts) == n_code
        assert not page.locator("[data-mime-type='application/vnd.jupyter.error']").count(), "a cell raised"
        # the Gantt charts of the schedules, drawn (outputs scroll into view as they render lazily)
        for out in page.locator(".jp-OutputArea-output").all():
            out.scroll_into_view_if_needed()
        wait_for(lambda: page.evaluate(DRAWN_JS) >= 5, 90, "the notebook's plots drawn")
        gantt = [s for s in page.evaluate(SOURCES_JS) if len(next(iter(s.values()), [])) > 0]
        assert len(gantt) >= 5, f"only {len(gantt)} plots with data"
        screenshot(page, "jupyterlab-03-pipeline-schedules")
        assert not off.errors, off.errors


@pytest.fixture(scope="module")
def browser_session():
    with chromium() as browser:
        yield browser
