"""A rank dies with its supervisor: the parent-death signal, armed before torch is imported.

torchrun starts each rank in a session of its own, so nothing reaches the ranks when torchrun is
SIGKILLed (or the OOM killer takes it): they would train on, unsupervised, until a collective
timed out, holding their GPUs. Linux can send a process a signal when its parent goes
(``prctl(PR_SET_PDEATHSIG)``); the trainer asks for SIGTERM, which it handles like torchrun's own
stop: each rank ends with run_end "interrupted" at its last step (train.py). Two gaps remain and
are closed here:

* the parent may die before the signal is armed (the rank is then already an orphan):
  :func:`tie_to_parent` compares the parent's pid before and after arming, and the caller exits;
* a rank blocked inside a collective does not run Python signal handlers until the collective
  returns: :func:`watch_parent` is a daemon thread that ends the process (``os._exit``, the run
  then reads "killed") when the parent has been gone for ``grace_s`` without the handler ending it.

Imports nothing heavy (no torch), so that ``python -m workbench.trainer`` arms the signal first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

from workbench.trainer.console import say

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_GRACE_S = 10.0  # the SIGTERM handler's time to write run_end before the watchdog ends the rank

_parent: int | None = None  # the pid of the process that started this one (first call of tie_to_parent)


def tie_to_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux for ``sig`` when the parent exits; False when the parent has already gone (the
    caller should exit). A no-op returning True off Linux or without libc's prctl."""
    global _parent
    if _parent is None:
        _parent = os.getppid()
    if not sys.platform.startswith("linux"):
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return True  # refused (a sandbox): the watchdog still ends an orphan
    except (OSError, AttributeError):
        return True
    # Armed now; if the parent went before, no signal will come: the pid we are reparented to says so.
    return os.getppid() == _parent


def parent_gone() -> bool:
    return _parent is not None and os.getppid() != _parent


def watch_parent(grace_s: float = ORPHAN_GRACE_S, poll_s: float = 1.0) -> threading.Thread:
    """A daemon thread that exits the process ``grace_s`` after the parent is gone (one getppid()
    a second: nothing to measure)."""

    def watch() -> None:
        while not parent_gone():
            time.sleep(poll_s)
        time.sleep(grace_s)
        say(f"[workbench] rank {os.environ.get('RANK', '?')}: the supervisor (pid {_parent}) is gone and the "
            f"stop signal was not handled within {grace_s:.0f} s; exiting")
        os._exit(1)

    thread = threading.Thread(target=watch, name="workbench-watch-parent", daemon=True)
    thread.start()
    return thread
