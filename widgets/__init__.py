"""The workbench UI: Panel + HoloViews views over the planning API, for JupyterLab and the served app.

In a notebook::

    import widgets
    widgets.extension()                     # inline resources: draws offline
    state = widgets.PlanState()             # shared by the views below
    widgets.ModelSketch(state)              # 1. the model
    widgets.MemoryView(state)               # 2. its memory bill
    widgets.MeshView(state)                 # 3. the mesh on the cluster
    widgets.AdvisorView(state)              # 4. the plan advisor
    widgets.PipelineView(state)             # 5. pipeline bubbles
    widgets.LaunchView(state)               # 6. launch, stop, resume a run
    widgets.LiveView(state)                 # 7. the live run (and the measured pipeline)
    widgets.CompareView(state)              # 8. compare two runs, replay one
    widgets.BenchView(state)                # 9. measured bus bandwidth beside the planner's
    widgets.PlanCompareView(state)          # 10. two planned configurations side by side

``widgets.create_app()`` composes them into one page and returns an :class:`App` (``.template``,
the page; ``.state``, the PlanState behind it; ``.views``); ``widgets.serve()`` serves it (one
fresh app per browser session). Data transforms live in :mod:`widgets.transforms` and
:mod:`widgets.run_transforms` (no UI imports); reading run directories is :mod:`workbench.rundir`'s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562): ``python -m widgets`` runs this file first, and it checks its
# --basic-auth before the views' Panel, HoloViews and Bokeh load (seconds).
_HOMES = {
    "AdvisorView": "widgets.advisor_view",
    "App": "widgets.app",
    "BenchView": "widgets.bench_view",
    "CompareView": "widgets.compare_view",
    "LaunchView": "widgets.launch_view",
    "LiveView": "widgets.live_view",
    "MemoryView": "widgets.memory_view",
    "MeshView": "widgets.mesh_view",
    "ModelSketch": "widgets.model_view",
    "PipelineView": "widgets.pipeline_view",
    "PlanCompareView": "widgets.plan_compare_view",
    "PlanState": "widgets.state",
    "RunSession": "widgets.run_session",
    "SECTIONS": "widgets.app",
    "create_app": "widgets.app",
    "extension": "widgets.resources",
    "serve": "widgets.app",
    "session_of": "widgets.run_session",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


if TYPE_CHECKING:
    from widgets.advisor_view import AdvisorView
    from widgets.app import SECTIONS, App, create_app, serve
    from widgets.bench_view import BenchView
    from widgets.compare_view import CompareView
    from widgets.launch_view import LaunchView
    from widgets.live_view import LiveView
    from widgets.memory_view import MemoryView
    from widgets.mesh_view import MeshView
    from widgets.model_view import ModelSketch
    from widgets.pipeline_view import PipelineView
    from widgets.plan_compare_view import PlanCompareView
    from widgets.run_session import RunSession, session_of
    from widgets.resources import extension
    from widgets.state import PlanState

__all__ = [
    "AdvisorView",
    "App",
    "BenchView",
    "CompareView",
    "LaunchView",
    "LiveView",
    "RunSession",
    "session_of",
    "MemoryView",
    "MeshView",
    "ModelSketch",
    "PipelineView",
    "PlanCompareView",
    "PlanState",
    "SECTIONS",
    "create_app",
    "extension",
    "serve",
]
