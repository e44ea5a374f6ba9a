"""``python -m workbench.launch.worker <module> [args]``: one rank of a program, bound to the
torchrun that started it. ``<module>`` is the program, by module name: ``workbench.trainer``
(a training rank: ``<run_dir>/config.json [--resume]``) or ``workbench.bench.collectives`` (a rank
of the cluster benchmark: ``<run_dir>/bench.json``).

torchrun starts each worker in a session of its own, so a signal to torchrun's process group does
not reach the workers, and a SIGKILLed torchrun would leave them running until a collective timed
out. This wrapper asks Linux to SIGKILL the worker as soon as its parent goes
(``PR_SET_PDEATHSIG``), then runs the program unchanged. The launcher names the program instead of
importing it, so the launcher, the trainer and the benchmark stay independent layers.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from workbench.launch.agent import die_with_parent

TRAINER = "workbench.trainer"
PROGRAMS = (TRAINER, "workbench.bench.collectives")


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent went before the death signal was armed
        return 1
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in PROGRAMS:
        print(f"usage: python -m workbench.launch.worker {{{'|'.join(PROGRAMS)}}} [args]", file=sys.stderr)
        return 2
    module, *rest = args
    sys.argv = [module, *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:  # the program's own exit status
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
