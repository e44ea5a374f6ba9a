#!/usr/bin/env bash
# On a GPU machine: train a ~1.1B model for 30 steps in bf16 on one GPU and print tokens/s, MFU by
# the planner's convention and peak CUDA memory beside estimate_memory's prediction.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/gpu_check.py
