"""workbench: plan, launch and watch distributed training of large models.

The folders are the layers, each importing only those before it:
``spec`` (what, where, split how) <- ``predict`` (the planner) <- ``rundir`` (the run directory
contract) <- ``trainer`` / ``launch`` / ``bench`` <- ``cli``. This module re-exports the public
entry points of spec, predict and launch; spec and predict import no torch and no UI.
"""

from workbench.spec.cluster import Calibration, Cluster, GPUSpec, LinkSpec
from workbench.spec.config import PRECISIONS, RunConfig, TrainSettings
from workbench.spec.errors import ConfigError
from workbench.spec.framework import FRAMEWORKS, Efficiency, ErrorBand, FrameworkProfile, MemoryConventions
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan, Placement
from workbench.predict.memory import MemoryBill, estimate_memory
from workbench.predict.pipeline import simulate_schedule
from workbench.predict.perf import StepPrediction, predict_step
from workbench.predict.advisor import PlanCandidate, advise
from workbench.predict.cost import estimate_cost
from workbench.predict.measurements import Measurement, load_measurements, validate
from workbench.predict.fit import cross_validate, fit_framework, fit_report
# ``workbench.launch(config, backend=...)`` is the launcher function; the package workbench/launch/
# is loaded first by this line, so the name stays bound to the function afterwards.
from workbench.launch import launch, open_run
from workbench.rundir.record import workbench_version

__version__ = workbench_version()

__all__ = [
    "FRAMEWORKS",
    "Efficiency",
    "ErrorBand",
    "FrameworkProfile",
    "Measurement",
    "MemoryBill",
    "MemoryConventions",
    "cross_validate",
    "fit_framework",
    "fit_report",
    "load_measurements",
    "validate",
    "PlanCandidate",
    "StepPrediction",
    "advise",
    "estimate_cost",
    "launch",
    "open_run",
    "estimate_memory",
    "predict_step",
    "simulate_schedule",
    "Calibration",
    "Cluster",
    "ConfigError",
    "GPUSpec",
    "LinkSpec",
    "ModelSpec",
    "PRECISIONS",
    "ParallelPlan",
    "Placement",
    "RunConfig",
    "TrainSettings",
    "__version__",
]
