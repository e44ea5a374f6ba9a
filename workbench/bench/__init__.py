"""Measuring the cluster: collective benchmarks, a matmul microbenchmark, and the calibration
that fits the planner's alpha-beta and FLOP/s figures to them.

Reading order: :mod:`.results` (the files and the table), :mod:`.comms` (the benchmark that runs
under torchrun; imports torch), :mod:`.launch` (starting it locally), :mod:`.compute` (matmul
FLOP/s), :mod:`.calibrate` (the fit). Importing this package does not import torch.
"""

from .calibrate import CalibrationReport, LinkFit, calibrate, calibration_report, fit_alpha_beta, format_fit
from .compute import GemmShape, gemm_shapes, run_compute_benchmark
from .launch import bench_spec, run_comms_benchmark
from .results import (BenchSpec, CommsResults, CommsRow, ComputeResults, ComputeRow, format_table, load_results,
                      save_results, size_ladder)

__all__ = [
    "BenchSpec",
    "CalibrationReport",
    "CommsResults",
    "CommsRow",
    "ComputeResults",
    "ComputeRow",
    "GemmShape",
    "LinkFit",
    "bench_spec",
    "calibrate",
    "calibration_report",
    "fit_alpha_beta",
    "format_fit",
    "format_table",
    "gemm_shapes",
    "load_results",
    "run_comms_benchmark",
    "run_compute_benchmark",
    "save_results",
    "size_ladder",
]
