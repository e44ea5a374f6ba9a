"""Measuring the cluster: collective benchmarks, a matmul microbenchmark, and the calibration
that fits the planner's alpha-beta and FLOP/s figures to them.

Reading order: :mod:`workbench.rundir.benchmarks` (the files and the table),
:mod:`.collectives` (the benchmark that runs under torchrun; imports torch),
:mod:`workbench.launch.benchmark` (starting it, locally or through kernels), :mod:`.compute`
(matmul FLOP/s), :mod:`.calibrate` (the fit). Importing this package does not import torch.
"""

from workbench.bench.calibrate import (CalibrationReport, LinkFit, calibrate, calibration_report, fit_alpha_beta,
                                       format_fit)
from workbench.bench.compute import GemmShape, gemm_shapes, run_compute_benchmark

__all__ = [
    "CalibrationReport",
    "GemmShape",
    "LinkFit",
    "calibrate",
    "calibration_report",
    "fit_alpha_beta",
    "format_fit",
    "gemm_shapes",
    "run_compute_benchmark",
]
