"""The matmul microbenchmark: achieved FLOP/s per dtype at the GEMM shapes a model runs per TP rank.

With T tokens per micro-batch on the rank, d = d_model, t = tp (Megatron's column- and row-parallel
split of each linear, Shoeybi et al. 2019), L layers of which L_d dense and L_m MoE:

===============  ==============================  ==========================================
GEMM             (m, k) x (k, n)                 count per forward pass of the model
===============  ==============================  ==========================================
``qkv``          (T, d) x (d, (q + 2 kv) / t)    L (q, k, v fused)
``attn_out``     (T, q / t) x (q / t, d)         L (latent attention: (T, v / t) x (v / t, d))
``latent_down``  (T, d) x (d, r_q + r_kv + r)    L (latent attention: q_a, kv_a fused, whole)
``q_up``         (T, r_q) x (r_q, q / t)         L (latent attention: q_b; q_proj from d)
``kv_up``        (T, r_kv) x (r_kv, kv_up / t)   L (latent attention: kv_b, nope + v per head)
``mlp_up``       (T, d) x (d, d_ff / t)          L_d x u (u = 2 with SwiGLU: gate and up)
``mlp_down``     (T, d_ff / t) x (d_ff / t, d)   L_d
``shared_up``    (T, d) x (d, f_s / t)           L_m x n_shared x u
``shared_down``  (T, f_s / t) x (f_s / t, d)     L_m x n_shared
``router``       (T, d) x (d, E)                 L_m (not split by TP)
``expert_up``    (T k / E, d) x (d, f / t)       L_m x E x u
``expert_down``  (T k / E, f / t) x (f / t, d)   L_m x E
``head``         (T, d) x (d, vocab / t)         1
===============  ==============================  ==========================================

(q, kv: query and key/value widths; E routed experts of width f, top-k routing with balanced
load, so each expert sees T k / E tokens; f_s the shared experts' width.) Each shape runs as
``F.linear(x, w)`` (x (m, k), w (n, k)), what ``nn.Linear`` does, with warm-up, then timed batches
of calls; the median batch is kept. FLOPs are 2 m k n per GEMM (a multiply and an add per MAC).
:meth:`ComputeResults.flops_per_s` gives the per-dtype figure the planner uses: total FLOPs /
total time over the counts above, i.e. the rate of one forward pass's GEMMs (backward runs two
GEMMs of the same m k n per linear, so its mix is the same).

fp8 runs ``torch._scaled_mm`` (e4m3 inputs, per-tensor scales, bf16 output) where the GPU has fp8
tensor cores (compute capability >= 8.9); its k and n must be multiples of 16.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from workbench.rundir.record import workbench_version
from workbench.spec.errors import check_choice, check_int, require
from workbench.spec.model import ModelSpec
from workbench.rundir.benchmarks import ComputeResults, ComputeRow, save_results

GPU_DTYPES = ("bf16", "fp16", "fp32", "fp8")
CPU_DTYPES = ("fp32",)
# Tokens per GEMM: a micro-batch of 1 x 4096 on a GPU; on CPU 256, so that one GEMM of a small
# model takes milliseconds rather than seconds.
DEFAULT_TOKENS = {"cuda": 4096, "cpu": 256}


@dataclass(frozen=True)
class GemmShape:
    """``(m, k) x (k, n)``, ``count`` times in one forward pass of the model."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def gemm_shapes(model: ModelSpec, tp: int = 1, tokens: int = 4096) -> list[GemmShape]:
    """The distinct GEMMs of one forward pass on one TP rank for ``tokens`` tokens, each with its
    count in the whole model (see the module docstring). Pure Python."""
    check_int("tp", tp)
    check_int("tokens", tokens)
    d, q, kv = model.d_model, model.q_dim, model.kv_dim
    require(q % tp == 0 and kv % tp == 0, f"tp={tp} does not divide the attention widths q={q}, kv={kv}",
            field="tp", value=tp)
    u = 2 if model.activation == "swiglu" else 1
    layers, dense, moe = model.n_layers, model.n_dense_layers, model.n_moe_layers
    shapes = [GemmShape(name, tokens, int(k), int(n), layers) for name, _, k, n in model.attention_gemms(tp)]
    if dense:
        ff = max(1, model.d_ff // tp)
        shapes += [GemmShape("mlp_up", tokens, d, ff, dense * u), GemmShape("mlp_down", tokens, ff, d, dense)]
    if moe and model.n_shared_experts:
        ff = max(1, (model.shared_d_ff or model.moe_d_ff) // tp)
        k = moe * model.n_shared_experts
        shapes += [GemmShape("shared_up", tokens, d, ff, k * u), GemmShape("shared_down", tokens, ff, d, k)]
    if moe:
        shapes.append(GemmShape("router", tokens, d, model.n_experts, moe))  # replicated on every TP rank
        per_expert = max(1, tokens * model.top_k // model.n_experts)
        ff = max(1, model.moe_d_ff // tp)
        k = moe * model.n_experts
        shapes += [GemmShape("expert_up", per_expert, d, ff, k * u), GemmShape("expert_down", per_expert, ff, d, k)]
    shapes.append(GemmShape("head", tokens, d, max(1, model.vocab_size // tp)))
    return shapes


def _fp8_supported(torch: Any, device: Any) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "fp8 matmuls need a GPU"
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, "this torch has no float8_e4m3fn / _scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} < 8.9 has no fp8 tensor cores"
    return True, ""


def _matmul(torch: Any, shape: GemmShape, dtype: str, device: Any) -> Any:
    """A zero-argument function running the GEMM once."""
    F = torch.nn.functional
    if dtype == "fp8":
        # _scaled_mm wants the second operand column-major: w (n, k) row-major, transposed.
        x = torch.randn(shape.m, shape.k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(shape.n, shape.k, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.randn(shape.m, shape.k, device=device, dtype=tdtype)
    w = torch.randn(shape.n, shape.k, device=device, dtype=tdtype) / math.sqrt(shape.k)
    return lambda: F.linear(x, w)


def time_gemm(torch: Any, fn: Any, device: Any, samples: int, min_sample_s: float, warmup: int = 3) -> list[float]:
    """Seconds per call of ``samples`` batches, each of enough calls to last ``min_sample_s``."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    k = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-7)))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / k)
    return out


def run_compute_benchmark(model: ModelSpec | str, tp: int = 1, tokens: int | None = None,
                          dtypes: Sequence[str] | None = None, device: str = "auto", samples: int = 7,
                          min_sample_s: float | None = None,
                          out_path: str | os.PathLike | None = None) -> ComputeResults:
    """Achieved matmul FLOP/s of ``model``'s GEMMs on one TP rank of this process's device.

    Defaults: on CPU fp32 only (CPU bf16 GEMMs are emulated, not a training dtype here) with the
    current torch thread count (the trainer's ranks run one thread each) and 256 tokens; on a GPU
    bf16, fp16, fp32 (TF32 off: the strict fp32 rate) and fp8 where supported, 4096 tokens.
    ``samples`` timed batches per shape, the median kept. Writes ``out_path`` if given."""
    import torch  # here, so that importing workbench.bench never imports torch

    spec = ModelSpec.preset(model) if isinstance(model, str) else model
    check_choice("device", device, ("auto", "cpu", "cuda"))
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    tokens = tokens or DEFAULT_TOKENS[dev.type]
    dtypes = tuple(dtypes or (GPU_DTYPES if dev.type == "cuda" else CPU_DTYPES))
    for dt in dtypes:
        check_choice("dtypes", dt, GPU_DTYPES)
    check_int("samples", samples)
    min_sample_s = min_sample_s if min_sample_s is not None else (0.01 if dev.type == "cuda" else 0.02)
    shapes = gemm_shapes(spec, tp, tokens)
    rows: list[ComputeRow] = []
    skipped: dict[str, str] = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for dt in dtypes:
                if dt == "fp8":
                    ok, why = _fp8_supported(torch, dev)
                    if not ok:
                        skipped[dt] = why
                        continue
                    if any(s.k % 16 or s.n % 16 for s in shapes):
                        skipped[dt] = "a GEMM's k or n is not a multiple of 16 (torch._scaled_mm needs it)"
                        continue
                for s in shapes:
                    times = time_gemm(torch, _matmul(torch, s, dt, dev), dev, samples, min_sample_s)
                    times.sort()
                    rows.append(ComputeRow(dt, s.name, s.m, s.k, s.n, s.count, len(times), times[0],
                                           times[len(times) // 2]))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine()) + \
        f" ({os.cpu_count()} cores)"
    results = ComputeResults(
        model=spec.name or "model", tp=tp, tokens=tokens, device=dev.type, device_name=name,
        threads=torch.get_num_threads(), rows=tuple(rows), skipped=skipped,
        versions={"torch": torch.__version__, "python": platform.python_version(), "workbench": workbench_version(),
                  "cuda": torch.version.cuda},
    )
    if out_path is not None:
        save_results(results, Path(out_path))
    return results


__all__ = ["CPU_DTYPES", "DEFAULT_TOKENS", "GPU_DTYPES", "GemmShape", "gemm_shapes", "run_compute_benchmark"]
