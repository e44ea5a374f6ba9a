"""One workflow in a real headless Chromium (Debian's): plan, launch that plan, export it, compare plans.

One served app (``--runs`` a temporary directory), one page with everything outside 127.0.0.1
blocked: pp=2 set in the Mesh tab reaches the Launch tab through the sidebar's "Launch this plan";
its export shows the ``workbench memory`` / ``workbench train`` lines and the RunConfig JSON of
exactly that plan (checked against a RunConfig built here, and the downloaded plan.json); a plan
pinned as A and one changed after it show side by side with the numbers of ``estimate_memory`` and
``predict_step``; llama3-70b on a DGX preset is refused in one line naming the field, value and
rule, nothing starts, and the offered tiny plan can run. No run starts here (tests/test_browser_run.py
runs one). Screenshots: test-artifacts/screenshots/40-...
"""

from __future__ import annotations

import json
import os
import time

import pytest

from browser.helpers import CHROMIUM, chromium, open_app, screenshot, served_app, tab, text_of, wait_until
from workbench import RunConfig, estimate_memory, predict_step
from workbench.spec.config import build_run_config
from widgets.launch_view import blockers, launch_config
from widgets.plan_export import memory_line, train_line
from widgets.transforms import format_bytes, format_seconds

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]


def app_plan(model: str = "tiny", cluster: str = "local-cpu", precision: str = "fp32", **plan) -> RunConfig:
    """The app's plan for these choices: its defaults (seq 256, micro-batch 1) and one node."""
    return build_run_config(model, cluster=cluster, nodes=1, plan=plan, precision=precision, seq_len=256,
                            micro_batch_size=1)


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True).locator("visible=true")
    box.fill(str(value))
    box.press("Enter")


def sidebar_button(page, name: str):
    return page.get_by_role("button", name=name).locator("visible=true").first


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The served app's --runs."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def page(runs):
    """One page of one served app for the module (the tests go on from each other's plan)."""
    with served_app(args=("--runs", str(runs))) as url, chromium() as browser, open_app(browser, url) as off:
        yield off.page
        assert not off.errors, off.errors


def test_launch_this_plan_shows_the_current_plan_and_exports_it(page, runs):
    t0 = time.monotonic()
    tab(page, "3 · Mesh")
    set_number(page, "pp", 2)
    wait_until(page, "summary-plan", lambda s: s == "pp=2 1f1b", timeout_s=20)
    sidebar_button(page, "Launch this plan").click()
    assert wait_until(page, "launch-plan", lambda s: s == "pp=2 1f1b", timeout_s=20)
    assert text_of(page, "launch-model") == "tiny"
    assert text_of(page, "launch-cluster") == "1 × 2 cpu"
    assert text_of(page, "launch-batch") == "seq 256 · mbs 1 · gbs 4"
    assert text_of(page, "launch-ok").startswith("Start runs this plan here: 2 ranks")
    screenshot(page, "40-launch-this-plan-the-current-plan")

    # the export: the lines and the JSON of exactly this plan (the Launch tab's 40 steps)
    plan = app_plan(pp=2)
    launched = launch_config(plan, steps=40)
    assert text_of(page, "export-memory") == memory_line(plan).text == (
        "workbench memory --model tiny --cluster local-cpu --nodes 1 --pp 2 --seq 256 --mbs 1 --recompute none "
        "--precision fp32")
    assert text_of(page, "export-train") == train_line(launched, str(runs)).text == (
        f"workbench train --model tiny --plan pp=2 --steps 40 --seq 256 --mbs 1 --runs {runs}")
    assert RunConfig.from_dict(json.loads(text_of(page, "export-json"))) == launched
    with page.expect_download() as download:
        page.get_by_role("button", name="Download plan.json").click()
    with open(download.value.path()) as f:
        assert RunConfig.from_json(f.read()) == launched
    page.get_by_test_id("export-json").locator("visible=true").evaluate("e => e.scrollIntoView({block: 'center'})")
    time.sleep(0.3)
    screenshot(page, "41-launch-export-cli-lines-and-json")
    print(f"\nlaunch this plan + export: {time.monotonic() - t0:.1f} s")


def test_compare_two_planned_configurations_side_by_side(page):
    t0 = time.monotonic()
    a, b = app_plan(pp=2), app_plan(tp=2)
    tab(page, "3 · Mesh")
    wait_until(page, "summary-plan", lambda s: s == "pp=2 1f1b", timeout_s=20)
    sidebar_button(page, "Pin as plan A").click()
    set_number(page, "pp", 1)
    set_number(page, "tp", 2)
    wait_until(page, "summary-plan", lambda s: s == "tp=2", timeout_s=20)
    tab(page, "10 · Compare plans")
    assert wait_until(page, "cmp-plan-b", lambda s: s == "tp=2", timeout_s=20)
    assert text_of(page, "cmp-plan-a") == "pp=2 1f1b" and text_of(page, "cmp-plan-diff") == "changed"
    for cfg, col in ((a, "a"), (b, "b")):
        step, peak = predict_step(cfg), estimate_memory(cfg).fits().peak_bytes
        assert text_of(page, f"cmp-step-{col}") == format_seconds(step.step_time_s)
        assert text_of(page, f"cmp-mfu-{col}") == f"{step.mfu:.1%}"
        assert text_of(page, f"cmp-bubble-{col}") == f"{step.bubble_fraction:.1%}"
        assert text_of(page, f"cmp-peak-{col}") == format_bytes(peak)
    sa, sb = predict_step(a).step_time_s, predict_step(b).step_time_s
    assert text_of(page, "cmp-step-diff") == f"{(sb - sa) / sa:+.1%}"
    assert text_of(page, "cmp-model-diff") == "same"
    # the traffic: A sends pipeline activations only, B tensor-parallel collectives only
    assert text_of(page, "cmp-traffic-pp-b") == "—" and text_of(page, "cmp-traffic-tp-a") == "—"
    assert text_of(page, "cmp-traffic-tp-diff") == "only in B"
    screenshot(page, "42-compare-plans-a-pinned-vs-b-current")
    print(f"\ncompare plans: {time.monotonic() - t0:.1f} s")


def test_a_plan_too_large_to_train_here_says_why_and_starts_nothing(page, runs):
    t0 = time.monotonic()
    tab(page, "3 · Mesh")
    set_number(page, "tp", 1)
    page.locator("select:has(option[value='dgx-h100'])").locator("visible=true").select_option("dgx-h100")
    wait_until(page, "summary-cluster", lambda s: s == "1 × 8 h100-80gb", timeout_s=20)
    tab(page, "1 · Model")
    page.locator("select:has(option[value='llama3-70b'])").locator("visible=true").select_option("llama3-70b")
    wait_until(page, "summary-model", lambda s: s == "llama3-70b", timeout_s=20)
    sidebar_button(page, "Launch this plan").click()
    big = build_run_config("llama3-70b", cluster="dgx-h100", nodes=1, plan={}, precision="bf16-megatron",
                           seq_len=256, micro_batch_size=1)
    why = blockers(big)  # on this machine: no GPU (or fewer than 8), and 190 GiB in 80
    reason = wait_until(page, "launch-blocked", lambda s: s.startswith("cluster="), timeout_s=20)
    assert reason == why[0].line() and "\n" not in reason
    assert "8 GPUs" in reason and "local-cpu" in reason
    assert text_of(page, "launch-blocked-1") == why[1].line()
    assert why[1].field == "peak memory" and why[1].value == format_bytes(estimate_memory(big).fits().peak_bytes)
    page.get_by_role("button", name="Start").click()
    msg = page.get_by_test_id("launch-error").locator("visible=true")
    msg.wait_for(timeout=20_000)
    assert why[0].line() in msg.inner_text()
    time.sleep(1.0)
    assert not any(runs.iterdir())  # nothing started
    screenshot(page, "43-launch-too-large-plan-one-line-reason")
    # what can run is offered, never substituted: pressing it makes it the plan
    assert text_of(page, "launch-model") == "llama3-70b"
    page.get_by_role("button", name="Use the tiny model, pp=2 on one local-cpu node (2 ranks)").click()
    wait_until(page, "launch-ok", lambda s: s.startswith("Start runs this plan here"), timeout_s=20)
    assert (text_of(page, "launch-model"), text_of(page, "launch-plan"), text_of(page, "launch-cluster")) == (
        "tiny", "pp=2 1f1b", "1 × 2 cpu")
    assert not any(runs.iterdir())
    screenshot(page, "44-launch-offered-plan-applied")
    print(f"\ntoo-large plan refused: {time.monotonic() - t0:.1f} s")
