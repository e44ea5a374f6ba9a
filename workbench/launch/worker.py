"""``python -m workbench.launch.worker <run_dir>/config.json [trainer args]``: one trainer rank,
bound to the torchrun that started it (``--bench <run_dir>/bench.json``: one rank of the cluster
benchmark instead).

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
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--bench":  # the cluster benchmark rides the same launcher (issue 8)
        from ..bench.comms import main as bench_main

        return bench_main(args[1:])
    from ..trainer.train import main as train_main

    return train_main(args)


if __name__ == "__main__":
    sys.exit(main())
