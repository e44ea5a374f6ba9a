"""The run half of the app in a real headless Chromium (Debian's), driven by Playwright.

One session plans a tiny run (tiny model, pp=2 in the Mesh tab: one kernel, two ranks), launches
that plan from the Launch tab (the start and the resume show what they are doing, with seconds), watches the loss curve and the measured pipeline bubble fill in, stops it, sees the
status say "stopped", resumes it from its checkpoint (the resume marked on the curves), stops it
again, then finds it in Compare runs with its predicted-vs-measured table.
Screenshots go to test-artifacts/screenshots/ (10-...).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from browser.helpers import (CHROMIUM, OfflinePage, chromium, screenshot, served_app, tab, text_of,  # tests/browser/
                             wait_until)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]


def set_field(page, label: str, value) -> None:
    box = page.get_by_label(label, exact=True).locator("visible=true")
    box.fill(str(value))
    box.press("Enter")


def test_launch_watch_stop_compare_in_the_browser(tmp_path):
    t0 = time.monotonic()
    with served_app(args=("--runs", str(tmp_path))) as url, chromium() as browser:
        off = OfflinePage(browser)  # every request outside 127.0.0.1 aborted and recorded
        page, errors = off.page, off.errors
        page.goto(url)
        page.get_by_test_id("summary-peak").wait_for(timeout=60_000)

        # 3 -> 6: an invalid plan is refused with the field named, nothing starts
        tab(page, "3 · Mesh")
        set_field(page, "pp", 2)
        set_field(page, "tp", 3)
        wait_until(page, "summary-status", lambda s: s == "invalid", timeout_s=20)
        tab(page, "6 · Launch")
        page.get_by_role("button", name="Start").click()
        msg = page.get_by_test_id("launch-error").locator("visible=true")
        msg.wait_for(timeout=20_000)
        assert "tp=3" in msg.inner_text()
        assert not any(tmp_path.iterdir())
        # a valid one: tiny, pp=2 (2 ranks on one node), 400 steps (stopped long before the end),
        # a checkpoint every 5 steps (to resume from)
        tab(page, "3 · Mesh")
        set_field(page, "tp", 1)
        wait_until(page, "summary-plan", lambda s: s == "pp=2 1f1b", timeout_s=20)
        tab(page, "6 · Launch")
        wait_until(page, "launch-plan", lambda s: s == "pp=2 1f1b", timeout_s=20)
        set_field(page, "steps", 400)
        set_field(page, "checkpoint every", 5)
        page.get_by_role("button", name="Start").click()
        # the start shows what it is doing and for how long, until the ranks' first step
        progress = wait_until(page, "launch-progress", lambda s: re.fullmatch(
            r"(Starting 1 kernel for 2 ranks|Kernels started; waiting for the ranks' first step)… \d+ s", s),
            timeout_s=30)
        print(f"\nlaunch progress: {progress}")
        wait_until(page, "run-state", lambda s: s == "running", timeout_s=60)
        screenshot(page, "10-launch-running-status-per-rank")
        table = page.get_by_test_id("rank-status").locator("visible=true")
        assert table.locator("tr").count() == 3  # header + ranks 0, 1

        # 7: the loss curve and the measured bubble fill in
        tab(page, "7 · Live run")
        points = int(wait_until(page, "live-points", lambda s: s.isdigit() and int(s) >= 5, timeout_s=60))
        loss = float(text_of(page, "live-loss"))
        assert 3.0 < loss < 7.0  # cross-entropy of a 256-token vocabulary starts near ln 256 = 5.5
        measured = wait_until(page, "measured-bubble", lambda s: s.endswith("%"), timeout_s=30)
        predicted = text_of(page, "bubble-fraction")
        assert 0.0 < float(measured.rstrip("%")) < 100.0
        assert 0.0 < float(predicted.rstrip("%")) < 100.0
        # the measured step is named under the charts
        assert re.fullmatch(r"\d+", text_of(page, "measured-step"))
        time.sleep(1.0)
        more = int(wait_until(page, "live-points", lambda s: int(s) > points, timeout_s=30))
        assert more > points  # still streaming
        screenshot(page, "11-live-run-loss-tokens-mfu-gradnorm-curves")
        page.get_by_test_id("measured-step").locator("visible=true").evaluate(
            "e => e.scrollIntoView({block: 'start'})")  # the page scrolls inside the template
        time.sleep(0.5)
        screenshot(page, "12-live-run-measured-bubble-beside-simulated")
        # the rest of the live panels: memory per rank (measured / predicted), groups, checkpoints
        memory = text_of(page, "live-memory")
        assert memory.count("KiB /") >= 2 * 3  # 2 ranks x (parameters, gradients, optimizer) at least
        assert "pp" in text_of(page, "live-comm") and "send_recv" in text_of(page, "live-comm")
        wait_until(page, "live-checkpoints", lambda s: "committed" in s and "verified" in s, timeout_s=30)

        # 6: stop it; the status says stopped
        tab(page, "6 · Launch")
        page.get_by_role("button", name="Stop").click()
        wait_until(page, "run-state", lambda s: s == "stopped", timeout_s=40)
        screenshot(page, "13-launch-stopped")
        tab(page, "7 · Live run")
        last = int(text_of(page, "live-points"))
        assert more <= last < 400

        # resume from the latest checkpoint: the resume is marked on the curves, steps go on
        tab(page, "6 · Launch")
        page.get_by_role("button", name="Resume").click()
        progress = wait_until(page, "launch-progress", lambda s: s.startswith("Resum") and s.endswith(" s"),
                              timeout_s=30)
        print(f"resume progress: {progress}")
        wait_until(page, "run-state", lambda s: s == "running", timeout_s=60)
        tab(page, "7 · Live run")
        marks = wait_until(page, "run-marks", lambda s: "resume at step" in s, timeout_s=60)
        m = re.search(r"resume at step (\d+) from step-(\d+)", marks)
        assert m and int(m.group(1)) % 5 == 0 and int(m.group(1)) <= last
        wait_until(page, "live-points", lambda s: int(s) >= last + 3, timeout_s=60)
        screenshot(page, "14-live-run-resumed-from-checkpoint-marked")
        tab(page, "6 · Launch")
        page.get_by_role("button", name="Stop").click()
        wait_until(page, "run-state", lambda s: s == "stopped", timeout_s=40)

        # 8: the run is in Compare runs, with its predicted-vs-measured table
        tab(page, "8 · Compare")
        page.get_by_role("button", name="Refresh list").click()
        table_b = page.get_by_test_id("compare-table-b").locator("visible=true")
        table_b.wait_for(timeout=30_000)
        assert "bubble fraction" in table_b.inner_text()
        assert re.search(r"parameters", table_b.inner_text())
        screenshot(page, "15-compare-runs-predicted-vs-measured")
        assert not errors, errors
        assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
    assert time.monotonic() - t0 < 180
