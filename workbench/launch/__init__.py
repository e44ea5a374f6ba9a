"""Starting, watching and stopping runs.

* :func:`launch` / :func:`open_run`: a run whose nodes are Jupyter kernels (local, SSH, gateway),
  as a :class:`~workbench.launch.run.Run` handle (``run.py``; the node agent is ``agent.py``, the
  kernels ``kernels.py``, ``ssh.py``, ``gateway.py``);
* :func:`~workbench.launch.local.train_local`: plain torchrun on this machine (``workbench train``).

Imports are lazy: ``python -m workbench.launch.worker`` (every rank) must not pay for jupyter_client.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def launch(config: Any, backend: str = "local", **options: Any):
    """See :func:`workbench.launch.run.launch`."""
    from .run import launch as _launch

    return _launch(config, backend, **options)


def open_run(path: Any, **backend_options: Any):
    """See :func:`workbench.launch.run.open_run`."""
    from .run import open_run as _open_run

    return _open_run(path, **backend_options)


__all__ = ["launch", "open_run"]


class _CallableModule(types.ModuleType):
    """``workbench.launch(config, backend=...)`` reads as the issue's API while
    ``workbench.launch.local`` and friends stay importable submodules: the package itself is
    callable and calls :func:`launch`."""

    def __call__(self, config: Any, backend: str = "local", **options: Any):
        return launch(config, backend, **options)


sys.modules[__name__].__class__ = _CallableModule
