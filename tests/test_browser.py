"""The served app in a real headless Chromium (Debian's), driven by Playwright.

One session walks the planning story: load the app, change the model and read the memory bill
change, pick a plan from the advisor and see the mesh follow, change the pipeline schedule and
see the bubble change, type an invalid value and see the message next to its field. Each step
saves a screenshot under test-artifacts/screenshots/.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from browser.helpers import CHROMIUM, OfflinePage, screenshot  # tests/browser/

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def to_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*(-?[\d.,]+)\s*(B|KiB|MiB|GiB)\s*", text)
    assert m, f"not a byte count: {text!r}"
    return float(m.group(1).replace(",", "")) * UNITS[m.group(2)]


def tab(page, title: str) -> None:
    page.get_by_text(title, exact=True).click()
    time.sleep(0.3)


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True).locator("visible=true")
    box.fill(str(value))
    box.press("Enter")


def text_of(page, testid: str) -> str:
    return page.get_by_test_id(testid).locator("visible=true").first.inner_text()


def wait_text_change(page, testid: str, old: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            now = text_of(page, testid)
        except Exception:
            now = old
        if now != old:
            return now
        time.sleep(0.1)
    raise AssertionError(f"{testid} stayed {old!r} for {timeout_s} s")


def wait_for_text(page, testid: str, expected: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    now = None
    while time.monotonic() < deadline:
        try:
            now = text_of(page, testid)
        except Exception:
            now = None
        if now == expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"{testid} is {now!r}, not {expected!r}, after {timeout_s} s")


def test_planning_story_in_the_browser(app_url, chromium_browser):
    t0 = time.monotonic()
    url, browser = app_url, chromium_browser  # one app and one Chromium for the session (conftest)
    off = OfflinePage(browser)  # every request outside 127.0.0.1 aborted and recorded
    page, errors = off.page, off.errors
    page.goto(url)
    page.get_by_test_id("summary-peak").wait_for(timeout=60_000)
    assert text_of(page, "summary-model") == "tiny"
    assert text_of(page, "n-params") == "217.7 K"  # ModelSpec.preset("tiny").n_params() = 217,664
    screenshot(page, "01-model-sketch-tiny-default")

    # 1 -> 2: change the model, read the bill change
    tab(page, "2 · Memory")
    page.get_by_test_id("peak-memory").locator("visible=true").wait_for()
    tiny_peak = text_of(page, "peak-memory")
    screenshot(page, "02-memory-bill-tiny-on-local-cpu")
    tab(page, "1 · Model")
    # latent attention and DeepSeek's MoE: the counts the importer and preset give (671,026,419,200;
    # 37,552,297,472 active; the MTP module apart), the KV cache of one token and layer in latent form
    page.locator("select:has(option[value='deepseek-v3'])").select_option("deepseek-v3")
    assert wait_text_change(page, "n-params", "217.7 K") == "671.0 B"
    assert text_of(page, "n-active-params") == "37.55 B"
    assert text_of(page, "n-mtp-params") == "11.61 B"
    assert text_of(page, "kv-cache-per-token") == "576"
    screenshot(page, "01b-model-sketch-deepseek-v3")
    page.locator("select:has(option[value='llama3-8b'])").select_option("llama3-8b")
    assert wait_text_change(page, "n-params", "671.0 B") == "8.03 B"
    tab(page, "2 · Memory")
    big_peak = wait_text_change(page, "peak-memory", tiny_peak)
    assert to_bytes(big_peak) > 1000 * to_bytes(tiny_peak)
    assert text_of(page, "fit-status") == "does not fit"  # 8B parameters in 4 GiB of a CPU rank
    # the toggles: ZeRO-1 -> more memory than ZeRO-3 on the same ranks
    # fp32 everything is 4 + 4 + 8 = 16 bytes of model states per parameter; Megatron's recipe
    # (bf16 parameters, fp32 main gradients, fp32 master and Adam states) 2 + 4 + 12 = 18
    page.locator("select:has(option[value='bf16-megatron'])").locator("visible=true").select_option("bf16-megatron")
    bf16_peak = wait_text_change(page, "peak-memory", big_peak)
    assert to_bytes(bf16_peak) > to_bytes(big_peak)
    screenshot(page, "03-memory-bill-llama3-8b-does-not-fit-on-cpu")
    # round trip of one toggle, click to new numbers on the page (server + network + render)
    t_click = time.monotonic()
    page.get_by_role("button", name="1", exact=True).locator("visible=true").click()  # ZeRO-1
    zero1_peak = wait_text_change(page, "peak-memory", bf16_peak)
    print(f"\nmemory view in the browser: ZeRO toggle to new peak in {1e3 * (time.monotonic() - t_click):.0f} ms")
    assert to_bytes(zero1_peak) > to_bytes(bf16_peak)  # ZeRO-1 keeps full parameters and gradients

    # 3: a real cluster: 2 DGX H100 nodes
    tab(page, "3 · Mesh")
    page.locator("select:has(option[value='dgx-h100'])").locator("visible=true").select_option("dgx-h100")
    set_number(page, "nodes", 2)
    wait_for_text(page, "summary-cluster", "2 × 8 h100-80gb")
    plan_before = text_of(page, "plan-label")
    assert plan_before == "dp_shard=16 zero1"
    # an FP8 recipe on H100s: MFU against the bf16 peak, and beside it the FP8-peak figure (half)
    assert page.get_by_test_id("summary-mfu-fp8").count() == 0
    tab(page, "2 · Memory")
    page.locator("select:has(option[value='float8-tensorwise'])").locator("visible=true").first.select_option(
        "float8-tensorwise")
    page.get_by_test_id("summary-mfu-fp8").wait_for(timeout=20_000)
    mfu, mfu_fp8 = (float(text_of(page, t).rstrip("%")) for t in ("summary-mfu", "summary-mfu-fp8"))
    assert mfu_fp8 == pytest.approx(mfu / 2, abs=0.1)  # 989.4 against 1978.9 TFLOP/s dense
    page.locator("select:has(option[value='bf16-megatron'])").locator("visible=true").first.select_option("bf16-megatron")
    page.get_by_test_id("summary-mfu-fp8").wait_for(state="detached", timeout=20_000)
    time.sleep(1.5)  # the cluster picture is a canvas: give it time to redraw before the screenshot
    screenshot(page, "04-mesh-dgx-h100-x2-zero1")

    # 4: the advisor; pick a plan with tensor or pipeline parallelism, see the mesh follow
    tab(page, "4 · Advisor")
    page.get_by_role("button", name="Find plans").click()
    page.get_by_test_id("best-plan").locator("visible=true").wait_for(timeout=60_000)
    rows = page.locator(".tabulator-row").locator("visible=true")
    rows.first.wait_for(timeout=20_000)
    time.sleep(0.5)  # the table fills in one message, but let it settle
    n = rows.count()
    assert n >= 3
    plans = [rows.nth(i).locator("[tabulator-field='plan']").inner_text() for i in range(n)]
    pick = next(i for i, t in enumerate(plans) if "pp=" in t or "tp=" in t)
    chosen = plans[pick]
    rows.nth(pick).click()
    applied = page.get_by_test_id("chosen-plan").locator("visible=true")
    applied.wait_for(timeout=20_000)
    assert chosen in applied.inner_text()
    screenshot(page, "05-advisor-top-plans-one-chosen")
    tab(page, "3 · Mesh")
    plan_after = wait_text_change(page, "plan-label", plan_before)
    assert plan_after == chosen
    assert text_of(page, "summary-plan") == chosen
    time.sleep(1.5)
    screenshot(page, "06-mesh-after-choosing-the-advisor-plan")
    if "tp=" not in chosen:  # colour by pp when the plan has no TP
        page.get_by_role("button", name="pp", exact=True).locator("visible=true").click()
        time.sleep(1.5)
        screenshot(page, "06b-mesh-coloured-by-pp")

    # 5: pipeline bubbles: 1F1B with pp=4, m=8 (unit times) then interleaved with v=2
    tab(page, "5 · Pipeline")
    bubble_1f1b = text_of(page, "bubble-fraction")
    assert bubble_1f1b == "27.3%"  # (p-1)/(m+p-1) = 3/11
    screenshot(page, "07-pipeline-1f1b-pp4-m8")
    page.locator("select:has(option[value='interleaved-1f1b'])").locator("visible=true").select_option(
        "interleaved-1f1b")
    set_number(page, "virtual_stages (v)", 2)
    bubble_inter = wait_text_change(page, "bubble-fraction", bubble_1f1b)
    assert float(bubble_inter.rstrip("%")) < float(bubble_1f1b.rstrip("%"))
    screenshot(page, "08-pipeline-interleaved-1f1b-v2-smaller-bubble")

    # invalid input: the message names the field, next to it; the app keeps working
    tab(page, "1 · Model")
    set_number(page, "n_kv_heads", 3)
    msg = page.get_by_test_id("error-n_kv_heads").locator("visible=true")
    msg.wait_for(timeout=20_000)
    assert "n_kv_heads=3 does not divide n_heads=32" in msg.inner_text()
    assert text_of(page, "summary-status") == "invalid"
    screenshot(page, "09-model-sketch-inline-validation-error")
    set_number(page, "n_kv_heads", 8)
    page.get_by_test_id("summary-peak").locator("visible=true").wait_for(timeout=20_000)
    assert not errors, errors
    assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
    assert time.monotonic() - t0 < 120


def test_framework_choice_reprices_the_bill_in_the_browser(app_url, chromium_browser):
    """Choose the megatron profile on the memory tab: the drawn bill changes and states its profile."""
    url, browser = app_url, chromium_browser  # one app and one Chromium for the session (conftest)
    off = OfflinePage(browser)  # every request outside 127.0.0.1 aborted and recorded
    page, errors = off.page, off.errors
    page.goto(url)
    page.get_by_test_id("summary-peak").wait_for(timeout=60_000)
    tab(page, "2 · Memory")
    page.get_by_test_id("bill-band").locator("visible=true").wait_for(timeout=20_000)
    bundled_peak, bundled_band = text_of(page, "peak-memory"), text_of(page, "bill-band")
    assert "uncalibrated, bundled profile" in bundled_band
    assert text_of(page, "framework-profile") == "bundled"
    page.locator("select:has(option[value='megatron'])").locator("visible=true").select_option("megatron")
    megatron_band = wait_text_change(page, "bill-band", bundled_band)
    assert "megatron profile" in megatron_band and megatron_band.startswith("Predicted step ")
    wait_for_text(page, "framework-profile", "megatron")
    # Megatron keeps no per-layer RoPE cache: the tiny model's bill is smaller
    assert to_bytes(text_of(page, "peak-memory")) < to_bytes(bundled_peak)
    wait_for_text(page, "summary-framework", "megatron")
    screenshot(page, "10-memory-bill-under-the-megatron-profile")
    assert not errors, errors
    assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
