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
