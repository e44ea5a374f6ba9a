"""Deliberate fault injection, for the recovery drill and the tests of guards and failures.

Read once from the environment when a run starts (:meth:`Faults.from_env`) and applied at the start
of each step (:meth:`Faults.before_step`) and before a rank writes its part of a checkpoint
(:meth:`Faults.before_checkpoint_write`). Nothing is injected
unless one of these is set:

* ``WORKBENCH_KILL_AT="<rank>:<step>"``: that rank sends itself SIGKILL at the start of that step,
  on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0), so that the job torchrun
  restarts can finish. SIGKILL: no handler, no event, no flush, exactly like the OOM killer or a
  lost node (notebook 05's drill, tests/test_recovery.py).
* ``WORKBENCH_FAIL_AT="<rank>:<step>"``: that rank raises ``RuntimeError("injected failure at step
  <step>")``, on every attempt: an error the trainer reports (an ``error`` event) before exiting,
  while its peers wait in a collective.
* ``WORKBENCH_CHECKPOINT_FAIL_AT="<rank>:<step>"``: that rank's write of the checkpoint of that
  step raises ``OSError(ENOSPC)`` (a full disk), on every attempt: what the checkpointer's
  handling of a failed save (report, clean up, go on; or stop, for the final one) must survive.
* ``WORKBENCH_INJECT="nan:<step>"`` or ``"spike:<step>"``: before that step, every rank makes one
  parameter NaN (the loss becomes non-finite) or scales the output projection by 100 (its input
  gradients, hence the gradient norm, grow ~100x): what the ``guard_nonfinite`` and
  ``guard_grad_spike`` guards must catch.

No torch facility does this (``torch.distributed.elastic`` restarts failed workers but makes none
fail); the parameter edits use the public ``DTensor.to_local()``, which under ``no_grad`` is this
rank's shard itself.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor

from workbench.trainer.checkpoint import restart_count
from workbench.trainer.console import say

ENV_KILL = "WORKBENCH_KILL_AT"
ENV_FAIL = "WORKBENCH_FAIL_AT"
ENV_INJECT = "WORKBENCH_INJECT"
ENV_CHECKPOINT_FAIL = "WORKBENCH_CHECKPOINT_FAIL_AT"
INJECTIONS = ("nan", "spike")


def _rank_step(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    r, s = (int(x) for x in spec.split(":"))
    return r, s


@dataclass(frozen=True)
class Faults:
    """The faults this process injects (see the module docstring); all None: none."""

    kill_at: tuple[int, int] | None = None  # (rank, step): SIGKILL, first attempt only
    fail_at: tuple[int, int] | None = None  # (rank, step): raise RuntimeError
    inject: tuple[str, int] | None = None  # ("nan" | "spike", step), every rank
    checkpoint_fail_at: tuple[int, int] | None = None  # (rank, step): its checkpoint write hits ENOSPC

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Faults":
        env = os.environ if environ is None else environ
        kill = _rank_step(env.get(ENV_KILL)) if restart_count() == 0 else None
        inject = None
        if env.get(ENV_INJECT):
            what, at = env[ENV_INJECT].split(":")
            if what not in INJECTIONS:
                raise ValueError(f"{ENV_INJECT}={env[ENV_INJECT]!r}: expected nan:<step> or spike:<step>")
            inject = (what, int(at))
        return cls(kill_at=kill, fail_at=_rank_step(env.get(ENV_FAIL)), inject=inject,
                   checkpoint_fail_at=_rank_step(env.get(ENV_CHECKPOINT_FAIL)))

    def before_step(self, trainer: Any) -> None:
        """Inject what is due at the start of step ``trainer.step`` on rank ``trainer.rank``."""
        rank, step = trainer.rank, trainer.step
        if self.kill_at == (rank, step):
            say(f"[workbench] {ENV_KILL}: rank {rank} sends itself SIGKILL at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fail_at == (rank, step):
            raise RuntimeError(f"injected failure at step {step}")
        if self.inject is not None and self.inject[1] == step:
            _corrupt(trainer.modules, self.inject[0])


    def before_checkpoint_write(self, rank: int, step: int, path: os.PathLike) -> None:
        """Raise the injected full disk if rank ``rank`` is due to fail writing step ``step``'s checkpoint."""
        if self.checkpoint_fail_at == (rank, step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def _corrupt(modules: list[torch.nn.Module], what: str) -> None:
    """``nan``: fill the first parameter of the first module with NaN; ``spike``: multiply the
    output projection of every module that has one by 100."""
    for module in modules:
        if what == "nan":
            _local(next(module.parameters())).fill_(float("nan"))
            return
        if what == "spike" and getattr(module, "output", None) is not None:
            _local(module.output.weight).mul_(100.0)
