"""Helpers of the browser tests: a served app in a subprocess and Debian's headless Chromium.

Chromium comes from Debian (``apt-get install chromium``), driven by Playwright's Python API
through ``executable_path``; Playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_app(timeout_s: float = 60.0, args: tuple[str, ...] = ()) -> Iterator[str]:
    """Serve the app (``python -m widgets.app [args]``) on a free local port; yield its URL."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    (ROOT / "test-artifacts").mkdir(exist_ok=True)  # git-ignored: absent in a fresh clone
    log = open(ROOT / "test-artifacts" / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "widgets.app", "--port", str(port), *args], cwd=ROOT, env=env,
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the app exited with code {proc.returncode}; see test-artifacts/server.log")
            try:  # the port answers once the server listens (a GET would build a whole session)
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the app did not listen on {url} within {timeout_s:.0f} s") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextmanager
def chromium() -> Iterator["object"]:
    """A headless Debian Chromium driven by Playwright; yields the Browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


# ------------------------------------------------------------------ pages with the outside blocked
LOCAL_PREFIXES = ("http://127.0.0.1", "ws://127.0.0.1", "http://localhost", "ws://localhost", "data:", "blob:",
                  "about:")


class OfflinePage:
    """A page whose every request outside 127.0.0.1 is aborted and recorded (``blocked``), as on a
    cluster login node without internet, with the page's uncaught errors in ``errors``."""

    def __init__(self, browser, viewport: tuple[int, int] = (1600, 1250)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route) -> None:
        url = route.request.url
        if url.startswith(LOCAL_PREFIXES):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def close(self) -> None:
        self.context.close()


@contextmanager
def offline_page(browser, viewport: tuple[int, int] = (1600, 1250)) -> Iterator[OfflinePage]:
    """An :class:`OfflinePage`; on leaving, asserts nothing outside 127.0.0.1 was requested."""
    off = OfflinePage(browser, viewport)
    try:
        yield off
        assert not off.blocked, f"the page requested outside 127.0.0.1: {sorted(set(off.blocked))}"
    finally:
        off.close()


def open_app(browser, url: str, viewport: tuple[int, int] = (1600, 1250), timeout_s: float = 90.0):
    """Open the served app on an :func:`offline_page` (a context manager) and wait until the sidebar
    has its numbers; yields the OfflinePage (``.page``, ``.blocked``, ``.errors``)."""
    @contextmanager
    def _opened() -> Iterator[OfflinePage]:
        with offline_page(browser, viewport) as off:
            off.page.goto(url)
            off.page.get_by_test_id("summary-peak").locator("visible=true").first.wait_for(timeout=timeout_s * 1000)
            yield off
    return _opened()


def tab(page, title: str) -> None:
    """Click the app's tab titled ``title`` (e.g. "3 · Mesh")."""
    page.locator(".bk-tab").get_by_text(title, exact=True).click()
    time.sleep(0.3)


def text_of(page, testid: str) -> str:
    """The text of the first visible element with ``data-testid=testid``."""
    return page.get_by_test_id(testid).locator("visible=true").first.inner_text()


def wait_until(page, testid: str, ok, timeout_s: float = 60.0) -> str:
    """Poll the text of ``testid`` until ``ok(text)``; return it (AssertionError with the last text)."""
    deadline = time.monotonic() + timeout_s
    now = None
    while time.monotonic() < deadline:
        try:
            now = text_of(page, testid)
            if ok(now):
                return now
        except Exception:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{testid} is {now!r} after {timeout_s} s")
