"""workbench: plan, launch and watch distributed training of large models.

The planning core (model, cluster, plan, memory, comms, schedule, perf, advisor) imports no
torch and no UI: it is instant and importable anywhere.
"""

from .cluster import Calibration, Cluster, GPUSpec, LinkSpec
from .config import PRECISIONS, RunConfig, TrainSettings
from .errors import ConfigError
from .model import ModelSpec
from .plan import ParallelPlan, Placement
from .memory import MemoryBill, estimate_memory
from .schedule import simulate_schedule
from .perf import StepPrediction, predict_step
from .advisor import PlanCandidate, advise
from .cost import estimate_cost
from . import launch  # noqa: E402  (callable: workbench.launch(config, backend="local"))
from .launch import open_run

__version__ = "0.1.0"

__all__ = [
    "MemoryBill",
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
