"""``python -m workbench.launch.worker <run_dir>/config.json [trainer args]``: one trainer rank,
bound to the torchrun that started it.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group does
not reach the workers, and a SIGKILLed torchrun would leave them running until a collective timed
out. This wrapper asks Linux to SIGKILL the worker as soon as its parent goes
(``PR_SET_PDEATHSIG``), then runs the bundled trainer unchanged.
"""

from __future__ import annotations

import os
import signal
import sys

from .agent import die_with_parent


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent went before the death signal was armed
        return 1
    from ..trainer.train import main as train_main

    return train_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
