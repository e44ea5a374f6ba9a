"""One GPU, a ~1.1B-parameter Llama-style model, 30 steps in bf16: measured next to predicted.

Run by ``benchmarks/gpu_check.sh`` under torchrun with one process. Prints tokens/s, MFU by the
planner's convention (PaLM: 6N + 12 L h s per token, against the dense bf16 peak of the GPU the
cluster preset names), and the CUDA allocator's peak beside ``estimate_memory`` for the same config.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings, estimate_memory, predict_step
from workbench.trainer.train import init_distributed, setup, train_step

GiB = float(1 << 30)


def gpu_cluster() -> Cluster:
    name = torch.cuda.get_device_name().lower()
    preset = "dgx-h200" if "h200" in name else "dgx-a100" if "a100" in name else "dgx-h100"
    base = Cluster.preset(preset)
    return Cluster(**{**base.__dict__, "nodes": 1, "gpus_per_node": 1})


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_check needs a GPU", file=sys.stderr)
        return 1
    steps = int(os.environ.get("GPU_CHECK_STEPS", "30"))
    model = ModelSpec(n_layers=16, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=8192, vocab_size=32000,
                      max_seq_len=2048, name="llama-1.1b")
    train = TrainSettings(seq_len=2048, micro_batch_size=4, global_batch_size=4, steps=steps, warmup_steps=5,
                          lr=3e-4, dataset="synthetic").with_precision("fsdp2-bf16")
    config = RunConfig(model, gpu_cluster(), ParallelPlan(dp_shard=1, zero_stage=0), train)
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    trainer = setup(config, 0, device)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        m = train_step(trainer)
        times.append(m["step_time_s"])
        losses.append(m["loss"])
    peak_alloc = torch.cuda.max_memory_allocated()
    peak_reserved = torch.cuda.max_memory_reserved()
    step_s = statistics.median(times[5:])  # after warm-up
    tokens = config.tokens_per_step
    gpu = config.cluster.gpu
    mfu = model.flops_per_token(train.seq_len) * tokens / step_s / gpu.peak_flops("bf16")
    bill = estimate_memory(config)
    pred = predict_step(config)
    print(f"device: {torch.cuda.get_device_name()} ({gpu.name} preset), torch {torch.__version__}")
    print(f"model: {model.name}, {model.n_params() / 1e9:.3f}B parameters; seq {train.seq_len}, micro-batch "
          f"{train.micro_batch_size}, precision {train.precision}")
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} over {steps} steps")
    print(f"step time: measured median {step_s * 1e3:.1f} ms, predicted {pred.step_time_s * 1e3:.1f} ms")
    print(f"tokens/s: measured {tokens / step_s:,.0f}, predicted {pred.tokens_per_s:,.0f}")
    print(f"MFU: measured {mfu:.1%}, predicted {pred.mfu:.1%}")
    print(f"peak memory: allocated {peak_alloc / GiB:.2f} GiB, reserved {peak_reserved / GiB:.2f} GiB; "
          f"predicted {bill.peak_bytes / GiB:.2f} GiB = " + ", ".join(
              f"{k} {v / GiB:.2f}" for k, v in bill.components.items()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
