"""The run views on run directories written from events, in a real headless Chromium (Debian's).

No training: the module writes three run directories with the real EventWriter (the builders of
tests/test_run_views.py) and serves the app with ``--runs`` on them:

* ``stopped``: pp=2, stopped by a signal after 7 steps; rank 1, whose peer had gone, raised
  gloo's "Connection reset by peer" (a stop, not a failure);
* ``resumed``: the same stop, then a resume that rejected checkpoint step-6, loaded step-4 and
  ran to step 12 with a checkpoint every 2 steps;
* ``finished``: dp_shard=2 (no pipeline), 10 steps.

The live view watches runs launched in its session or opened from 8 · Compare ("Replay"), so the
on-disk runs are checked through Compare and its replay. What the browser drew is read from the
Bokeh documents (glyph data by renderer name). Screenshots: test-artifacts/screenshots/30-...
"""

from __future__ import annotations

import os
import re
import time

import pytest

from browser.helpers import CHROMIUM, chromium, open_app, screenshot, served_app, tab, text_of, wait_until
from test_run_views import RESUME_AT, STOP_AT, STOP_STEPS, write_finished_run, write_stopped_run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiprocess,  # serves the app in a subprocess
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]

# The data of the glyph renderers with a name, by name: {name: {column: [values]}} (the visible tab's).
GLYPHS_JS = """(cols) => {
  const out = {};
  for (const doc of Bokeh.documents) for (const m of doc.all_models) {
    if (m.type === "GlyphRenderer" && m.name) {
      const d = {};
      for (const c of cols) if (c in m.data_source.data) d[c] = Array.from(m.data_source.data[c]);
      out[m.name] = d;
    }
  }
  return out;
}"""
TITLES_JS = """() => { const out = [];
  for (const doc of Bokeh.documents) for (const m of doc.all_models) if (m.type === "Title" && m.text) out.push(m.text);
  return out; }"""
NEGATIVE_TIME = re.compile(r"(?<![\w.])-\d[\d,]*(\.\d+)? (ms|s)\b")


def glyphs(page, cols=("step", "kind", "y")) -> dict:
    return page.evaluate(GLYPHS_JS, list(cols))


def wait_glyphs(page, ok, cols=("step", "kind", "y"), timeout_s: float = 20.0) -> dict:
    """Poll the drawn glyph data until ``ok(data)``; return it."""
    deadline = time.monotonic() + timeout_s
    now = {}
    while time.monotonic() < deadline:
        now = glyphs(page, cols)
        try:
            if ok(now):
                return now
        except (KeyError, IndexError, TypeError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the glyphs are {now} after {timeout_s} s")


def pick(page, which: int, name: str) -> None:
    """Choose ``name`` in Compare's run A (0) or run B (1) selector."""
    page.locator("select:visible").nth(which).select_option(label=name)


def replay(page, button: str) -> None:
    tab(page, "8 · Compare")
    page.get_by_role("button", name=button).click()
    wait_until(page, "replay-message", lambda s: s.startswith("Replaying"), timeout_s=20)
    tab(page, "7 · Live run")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_stopped_run(root, "stopped")
    write_stopped_run(root, "resumed", resume=True)
    write_finished_run(root, "finished", steps=10)
    return root


def test_stops_checkpoints_and_compare_in_the_browser(runs):
    t0 = time.monotonic()
    with served_app(args=("--runs", str(runs))) as url, chromium() as browser, open_app(browser, url) as off:
        page = off.page
        laps = [("page open", time.monotonic() - t0)]

        # 8: A alone draws A; A and B draw both; no derived time is negative, each says how
        tab(page, "8 · Compare")
        pick(page, 1, "(none)")
        pick(page, 0, "stopped")
        g = wait_glyphs(page, lambda g: len(g["compare-a"]["step"]) == STOP_AT and g["compare-b"]["step"] == [])
        assert g["compare-a"]["step"] == list(range(1, STOP_AT + 1))
        assert "run: stopped at step 7" in text_of(page, "compare-table-a-outcome")
        screenshot(page, "30-compare-run-a-alone-drawn")
        pick(page, 1, "resumed")
        g = wait_glyphs(page, lambda g: len(g["compare-b"]["step"]) == STOP_STEPS)
        assert g["compare-b"]["step"] == list(range(1, STOP_STEPS + 1))  # the resumed run once through its steps
        assert len(g["compare-a"]["step"]) == STOP_AT
        for t in ("compare-table-a", "compare-table-b"):
            text = text_of(page, t)
            assert "how measured" in text and "pipeline actions" in text, text[:400]
            assert not NEGATIVE_TIME.search(text), NEGATIVE_TIME.search(text)
        assert "finished at step 12" in text_of(page, "compare-table-b-outcome")
        screenshot(page, "31-compare-runs-a-and-b-how-measured")
        laps.append(("compare", time.monotonic() - t0))

        # 7: the stopped run (replayed) is stopped, without errors or error marks
        replay(page, "Replay A")
        assert wait_until(page, "live-state", lambda s: s == "stopped", timeout_s=20) == "stopped"
        assert text_of(page, "live-errors") == "0"
        ranks = text_of(page, "live-ranks")
        assert "failed" not in ranks and ranks.count("stopped") >= 2 and "Connection reset by peer" in ranks
        g = wait_glyphs(page, lambda g: g["marks"]["kind"] == ["stop"])
        assert g["marks"]["step"] == [STOP_AT] and "error" not in g["marks"]["kind"]
        screenshot(page, "32-live-replay-stopped-run-no-errors")
        laps.append(("stopped run", time.monotonic() - t0))

        # the resumed run: finished, its last step everywhere, checkpoints on the step axis
        replay(page, "Replay B")
        wait_until(page, "live-state", lambda s: s == "finished", timeout_s=20)
        assert text_of(page, "live-step") == f"{STOP_STEPS} / {STOP_STEPS}" and text_of(page, "live-errors") == "0"
        assert wait_until(page, "measured-step", lambda s: s == str(STOP_STEPS), timeout_s=20) == str(STOP_STEPS)
        g = wait_glyphs(page, lambda g: g["checkpoint-loaded"]["step"] == [RESUME_AT], cols=("step", "kind", "lane"))
        saves = list(range(2, STOP_STEPS + 1, 2))
        assert g["checkpoint-saved"]["step"] == saves and g["checkpoint-committed"]["step"] == saves
        assert g["checkpoint-verified"]["step"] == saves and g["checkpoint-rejected"]["step"] == [6]
        assert g["checkpoint-failed"]["step"] == [] and set(g["checkpoint-rejected"]["lane"]) == {"rejected"}
        assert g["marks"]["kind"] == ["stop", "checkpoint_rejected", "resume"]
        assert "checkpoints (step axis of the curves)" in page.evaluate(TITLES_JS)
        screenshot(page, "33-live-replay-resumed-run-checkpoint-timeline")
        laps.append(("resumed run", time.monotonic() - t0))

        # the finished run without a pipeline: nothing of the previous run's pipeline is left
        tab(page, "8 · Compare")
        pick(page, 0, "finished")
        replay(page, "Replay A")
        wait_until(page, "live-step", lambda s: s == "10 / 10", timeout_s=20)
        assert text_of(page, "live-state") == "finished"
        assert "no pipeline" in text_of(page, "live-no-pipeline")
        assert not any(t.startswith("Simulated") for t in page.evaluate(TITLES_JS))
        assert page.get_by_test_id("measured-step").count() == 0
        g = wait_glyphs(page, lambda g: g["marks"]["step"] == [] and g["checkpoint-saved"]["step"] == [])
        screenshot(page, "34-live-replay-finished-run-without-pipeline")
        assert not off.errors, off.errors
    laps.append(("finished run, closed", time.monotonic() - t0))
    print("\nbrowser runs views: " + ", ".join(f"{what} {t:.1f} s" for what, t in laps))
