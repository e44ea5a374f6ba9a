"""The run half of the app in a real headless Chromium (Debian's), driven by Playwright.

One session plans a tiny run (tiny model, pp=2 in the Mesh tab: one kernel, two ranks), launches
that plan from the Launch tab (the start and the resume show what they are doing, with seconds), watches the loss curve and the measured pipeline bubble fill in, stops it, sees the
status say "stopped", resumes it from its checkpoint (the resume marked on the curves), stops it
again, then finds it in Compare runs with its predicted-vs-measured table. The launch declares two
acceptance thresholds (after a bad one is refused under its box): the stopped run's verdicts show
one failing and one holding; then the naive baseline of the plan runs from its button, and
Compare sets the plan beside it: their lineage, the baseline's label, both throughputs.
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


def pick(page, which: int, name: str) -> None:
    """Choose ``name`` in Compare's run A (0) or run B (1) selector."""
    page.locator("select:visible").nth(which).select_option(label=name)


def table_rows(page, testid: str) -> list[list[str]]:
    """The cells of a table's rows, its header first."""
    rows = page.get_by_test_id(testid).locator("visible=true").first.locator("tr")
    return [[c.strip() for c in rows.nth(i).locator("td, th").all_inner_texts()] for i in range(rows.count())]


def rows_of(page, testid: str) -> dict[str, list[str]]:
    """A table's rows by their first cell: {first cell: [the other cells]}."""
    return {cells[0]: cells[1:] for cells in table_rows(page, testid)}


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
        # a bad acceptance threshold: one line under its box naming the rule, and nothing starts
        set_field(page, "Acceptance thresholds", "speed>=1")
        page.get_by_role("button", name="Start").click()
        bad = wait_until(page, "error-accept", lambda s: "speed" in s, timeout_s=20)
        assert "'speed' is not one of tokens_per_s_per_gpu" in bad and "\n" not in bad
        assert not any(tmp_path.iterdir())
        # two that the run must fail and hold: the loss stays far above 0.01, no guard fires
        set_field(page, "Acceptance thresholds", "final_loss<=0.01,guards_fired<=0")
        page.get_by_role("button", name="Start").click()
        # the start shows what it is doing and for how long, until the ranks' first step
        progress = wait_until(page, "launch-progress", lambda s: re.fullmatch(
            r"(Starting 1 kernel for 2 ranks|Kernels started; waiting for the ranks' first step)… \d+ s", s),
            timeout_s=30)
        print(f"\nlaunch progress: {progress}")
        wait_until(page, "run-state", lambda s: s == "running", timeout_s=60)
        plan_id = re.fullmatch(r"Launched (\S+)\.", text_of(page, "launch-message")).group(1)
        assert page.get_by_test_id("run-acceptance").count() == 0  # judged once the run has ended
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
        t_records = time.monotonic()

        # the ended run's verdicts under its status: the loss threshold fails, the guards' holds
        head = wait_until(page, "run-acceptance-head", lambda s: s.startswith("acceptance"), timeout_s=20)
        assert head == "acceptance: FAILED 1 of 2 declared thresholds", head
        verdicts = rows_of(page, "run-acceptance")
        assert verdicts["fail"][0] == "final_loss<=0.01" and float(verdicts["fail"][1]) > 1.0
        assert verdicts["pass"][:2] == ["guards_fired<=0", "0"]
        screenshot(page, "16-launch-acceptance-verdicts-of-the-stopped-run")

        # its naive baseline, from its button: plain data parallel over the same 2 ranks, 20 steps
        page.get_by_role("button", name="Run the naive baseline").click()
        launched = wait_until(page, "launch-message", lambda s: "the naive baseline of" in s, timeout_s=60)
        base_id = re.match(r"Launched (\S+): the naive baseline of (\S+) \(pp=2 1f1b\), dp_shard=2", launched)
        assert base_id and base_id.group(2) == plan_id, launched
        base_id = base_id.group(1)
        assert "for the first 20 of its 400 steps" in launched
        wait_until(page, "run-state", lambda s: s == "finished", timeout_s=120)
        steps_run = [r[4] for r in table_rows(page, "rank-status")[1:]]  # node, host, rank, state, step
        print(f"baseline {base_id}: finished after {steps_run} steps in {time.monotonic() - t_records:.1f} s")

        # 8: the plan beside its baseline: the same inputs, the baseline labelled, both throughputs
        tab(page, "8 · Compare")
        page.get_by_role("button", name="Refresh list").click()
        pick(page, 0, plan_id)
        pick(page, 1, base_id)
        lineage = wait_until(page, "compare-lineage", lambda s: s.startswith("Lineage"), timeout_s=30)
        if "same data, model, code, packages, cluster and profile" not in lineage:
            # another checkout's edits between the two launches change the code's state only
            lines = [line for line in lineage.splitlines()[1:] if line.strip()]
            assert lines and all(line.startswith("code.") for line in lines), lineage
        summary = rows_of(page, "compare-summary")
        assert summary["plan"][0] == "pp=2 1f1b" and summary["plan"][1].startswith("dp_shard=2")
        assert "(naive baseline of " in summary["plan"][1] and "pp=2 1f1b" in summary["plan"][1], summary["plan"]
        throughputs = [float(x.replace(",", "")) for x in summary["tokens/s per GPU"]]
        assert len(throughputs) == 2 and all(x > 0 for x in throughputs), summary["tokens/s per GPU"]
        assert summary["ranks"] == ["2", "2"]
        assert "final_loss<=0.01" in text_of(page, "compare-acceptance-a")
        assert page.get_by_test_id("compare-acceptance-b").count() == 0  # the baseline declares none
        print(f"plan {plan_id} beside its baseline: tokens/s per GPU {throughputs}; "
              f"records {time.monotonic() - t_records:.1f} s")
        screenshot(page, "17-compare-plan-beside-its-naive-baseline")

        # and the plan's predicted-vs-measured table
        table_a = page.get_by_test_id("compare-table-a").locator("visible=true")
        table_a.wait_for(timeout=30_000)
        assert "bubble fraction" in table_a.inner_text()
        assert re.search(r"parameters", table_a.inner_text())
        screenshot(page, "15-compare-runs-predicted-vs-measured")
        assert not errors, errors
        assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
    assert time.monotonic() - t0 < 240  # about 30 s of it the records: verdicts, the 20-step baseline, Compare
