"""Starting, watching and stopping runs.

* :func:`launch` / :func:`open_run`: a run whose nodes are Jupyter kernels (local, SSH, gateway),
  as a :class:`~workbench.launch.handle.RunHandle` (``handle.py``; the node agent is ``agent.py``,
  the kernels ``kernels.py``, ``ssh.py``, ``gateway.py``; every rank runs ``worker.py``);
* :func:`~workbench.launch.local.train_local`: plain torchrun on this machine (``workbench train``),
  its checks before anything starts (``preflight.py``) and its verdict read from the run
  directory (``outcome.py``: the final line and the exit status);
* :func:`~workbench.launch.benchmark.run_comms_benchmark`: the cluster benchmark, locally or
  through the same kernels.

The launcher starts the trainer and the benchmark as processes by module name and imports
neither. ``workbench.launch(config, backend=...)`` is :func:`launch` (bound in ``workbench/__init__``).
"""

from __future__ import annotations

from typing import Any


def launch(config: Any, backend: str = "local", **options: Any):
    """See :func:`workbench.launch.handle.launch`."""
    # import on call: every rank imports workbench.launch.worker and must not pay for the kernel client
    from workbench.launch.handle import launch as _launch

    return _launch(config, backend, **options)


def open_run(path: Any, **backend_options: Any):
    """See :func:`workbench.launch.handle.open_run`."""
    # import on call: as for launch()
    from workbench.launch.handle import open_run as _open_run

    return _open_run(path, **backend_options)


__all__ = ["launch", "open_run"]
