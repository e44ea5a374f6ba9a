import os

# Multi-process tests share 2 cores: one thread per process keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

# ---------------------------------------------------------------------------- tiers
# Markers (registered in pyproject.toml): `multiprocess` on every test that starts processes
# (torchrun ranks, Jupyter kernels, the CLI or the trainer in a subprocess, sshd, a served app),
# `browser` on those that drive Chromium. `-m "not multiprocess and not browser"` is the fast tier:
# it starts no process. To keep it so, every process started while an unmarked test runs (its
# fixtures included) is listed at the end of the run, save the one-shot helpers that library code
# runs for a value (INCIDENTAL: the run manifest's `git rev-parse`, platform's `uname -p`).
# `slow` marks in-process tests that train long enough to matter in the fast tier.

INCIDENTAL = {"git", "uname"}

_current: list[pytest.Item] = []
_unmarked_starts: dict[str, list[str]] = {}


def _record(what: str) -> None:
    item = _current[-1] if _current else None
    # browser tests serve the app and start Chromium: outside the fast tier as well
    if item is not None and not any(item.get_closest_marker(m) for m in ("multiprocess", "browser")):
        _unmarked_starts.setdefault(item.nodeid, []).append(what[:120])


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _recording_popen_init(self, args, *a, **kw):
    argv = [str(x) for x in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not argv or os.path.basename(argv[0]) not in INCIDENTAL:
        _record(" ".join(argv))
    _popen_init(self, args, *a, **kw)


def _recording_process_start(self):
    _record(f"multiprocessing {self.name}")
    _process_start(self)


subprocess.Popen.__init__ = _recording_popen_init
multiprocessing.process.BaseProcess.start = _recording_process_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


def pytest_terminal_summary(terminalreporter):
    if _unmarked_starts:
        terminalreporter.section("processes started by tests without the multiprocess marker")
        for nodeid, starts in _unmarked_starts.items():
            terminalreporter.line(f"{nodeid}: {len(starts)} x, first: {starts[0]}")


# ---------------------------------------------------------------------------- shared fixtures
@pytest.fixture(scope="session")
def reference_losses():
    """``reference_losses(model, **train)``: the single-process losses of :func:`dist.make_config`
    with the loss-equality settings (updated by ``train``, e.g. ``dropout=True``), trained once per
    session, model and settings (several files compare to them)."""
    cache: dict[tuple, list[float]] = {}

    def get(model: str = "tiny", **train) -> list[float]:
        key = (model, tuple(sorted(train.items())))
        if key not in cache:
            from dist import make_config
            from workbench.trainer.train import run_training

            cache[key] = run_training(make_config("", 1, model, **train))
        return cache[key]

    return get


# ---------------------------------------------------------------------------- the served app
@pytest.fixture(scope="session")
def app_url():
    """One app served with the default arguments (``python -m widgets.app``) for every browser
    test that needs no run root of its own: each page that opens it is a Bokeh session of its own
    (tests/test_widgets.py checks that sessions share no state), and the server's start-up (4-5 s)
    is paid once, not per module."""
    from browser.helpers import served_app  # tests/browser/: imported only where a browser test runs

    with served_app() as url:
        yield url


@pytest.fixture(scope="module")
def chromium_browser():
    """A headless Chromium for a module's browser tests. Per module, not per session: Playwright's
    sync API keeps an event loop running in this thread while a browser is open, and an in-process
    test that runs asyncio (a Panel app built in the test) must not come while one is."""
    from browser.helpers import chromium  # tests/browser/: imported only where a browser test runs

    with chromium() as browser:
        yield browser
