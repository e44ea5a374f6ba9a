"""FP8 training recipes: which GEMMs run on FP8 tensor cores, what the casts cost, what is stored.

A :class:`Float8Recipe` is the FP8 half of a precision recipe (``PRECISIONS`` in
:mod:`workbench.spec.config` holds the dtypes; its ``fp8_recipe`` names one of these). Every
number below is a documented fact of the library that runs it, with its source beside it; none
is fitted to measured runs. Each GEMM of a converted Linear (forward, input gradient, weight
gradient) runs at ``peak_flops("fp8") x efficiency.matmul x gemm_efficiency``; everything else
(attention core, output head, router, element-wise work) stays in the compute dtype.

``float8-tensorwise``
    torchao float8 training with dynamic tensorwise scaling, torchtitan's default float8
    (``--float8.enable_float8_linear`` at torchtitan 9dec370; ``Float8LinearRecipeName.TENSORWISE``,
    "fastest option", torchao ``float8/config.py``). torchtitan swaps the block ``nn.Linear``s for
    ``Float8Linear`` except the output head (``module_filter_fn=lambda mod, fqn: fqn != "output"``
    at 9dec370, later ``filter_fqns = ["output"]``, plus ``"router.gate"`` in its MoE configs);
    routed experts are ``GroupedExperts`` parameters, not ``nn.Linear``s, so they stay bf16
    (a separate prototype converter exists). With FSDP2 the weights are cast to FP8 before the
    all-gather (``enable_fsdp_float8_all_gather``: 1 byte per parameter on the wire instead of 2)
    and one all-reduce after the optimizer step gives every weight its scale
    (``precompute_float8_dynamic_scale_for_fsdp``), as torchtitan's float8 docs run it; under TP
    torchtitan uses ``Float8ColwiseParallel``/``PrepareFloat8ModuleInput``, whose sequence-parallel
    all-gathers (the input forward, the output gradient backward) move FP8 too.
``float8-rowwise``
    torchao rowwise scaling (``recipe_name = "rowwise"``): a scale per row, more accurate with
    outliers, and slower: the CUTLASS rowwise ``_scaled_mm`` reaches "90-100 % of tensor-wise
    efficiency" on most shapes (pytorch/pytorch#147971), taken as 0.9, and every cast also writes
    a transposed bf16 copy (the casts below). FP8 all-gather is tensorwise only (torchao asserts
    it in ``Float8LinearConfig``; torchtitan's float8 docs: "for float8 with rowwise scaling, all
    distributed communication is done in high precision"), so FSDP and TP move bf16. torchao's
    own end-to-end benchmark (Llama 3 8B, 8 x H100, FSDP2, compile) measured +25.0 % for
    tensorwise and +10.1 % for rowwise over bf16; the planner does not use those figures, it
    predicts them from the rate and the casts.
``te-fp8``
    Transformer Engine delayed scaling, as Megatron-LM runs it (``--fp8-format hybrid``: E4M3 in
    forward, E5M2 for gradients; ``DelayedScaling`` with ``amax_history_len = 1024`` and
    ``amax_compute_algo = "max"``, TE's defaults; Megatron's own ``--fp8-amax-history-len``
    defaults to 1). Every TE Linear of the block is FP8, routed experts too (``TEGroupedLinear``);
    the output layer (a Megatron ``ColumnParallelLinear``) and the router stay bf16. The scale comes
    from the amax history, so a cast is one fused cast-transpose pass with no amax pre-pass; the
    amaxes are all-reduced once per forward and once per backward (``reduce_amax``). TE caches the
    FP8 weight and its transpose between micro-batches (``is_first_microbatch``, which Megatron
    passes): 1 + 1 bytes per local parameter, cast once a step (billed where the weights are whole on
    the rank; under ZeRO-3 the planner takes each gathered unit's FP8 copy as made and freed with it). TE saves the FP8-cast input of a
    Linear for backward (``saved_inputmat`` is the quantized input): 1 byte per element instead of 2.
    Weights, main gradients, master weights and Adam states are ``bf16-megatron``'s.

Cast traffic (bytes through HBM per element of the tensor, unfused kernels) is torchao's own
roofline model (``torchao/testing/training/roofline_utils.py``, ``get_tensor_memory_traffic_ovhd_s``);
TE's is its fused cast-transpose: read 2, write the FP8 data and its transpose, 1 + 1.

What is stored, per recipe:

==================  ==============  ===========  ===========================  =================================
recipe              weights/master  grads/optim  saved for backward           all-gathered copies
==================  ==============  ===========  ===========================  =================================
float8-tensorwise   fp32 (FSDP2)    fp32 / fp32  bf16 inputs (as bf16 runs)   FSDP: fp8 Linear weights; SP: fp8
float8-rowwise      fp32 (FSDP2)    fp32 / fp32  bf16 inputs (as bf16 runs)   bf16 (as bf16 runs)
te-fp8              bf16 / fp32     fp32 / fp32  fp8 Linear inputs            bf16 params (ZeRO-1); SP: fp8
==================  ==============  ===========  ===========================  =================================

torchao saves the high-precision input (``ctx.save_for_backward(input_hp, weight_hp_t)`` in
``matmul_with_hp_or_float8_args``, which casts inside since torchao #1480, January 2025; the
weight too since #2594, July 2025) and casts again in backward, so a torchao run's activations are
its bf16 run's. Before #1480 (the December 2024 torchtitan benchmarks ran torchao eab345c) the
tensorwise path saved the FP8 input and weight; under activation checkpointing, as every published
float8 run used, what a Linear saves is dropped after forward either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.spec.errors import ConfigError

if TYPE_CHECKING:
    from workbench.spec.model import ModelSpec


@dataclass(frozen=True)
class Float8Recipe:
    """The FP8 facts of one recipe (see the module docstring for the sources).

    Casts are bytes through HBM per element of the tensor cast, split by where they run: the input
    of a Linear (M x K) and its weight (K x N) in forward, the weight again and the output
    gradient (M x N) in backward.
    """

    name: str
    library: str  # "torchao" | "transformer_engine"
    scaling: str  # "tensorwise" | "rowwise" | "delayed"
    base_precision: str  # the PRECISIONS entry whose dtypes the recipe keeps
    gemm_efficiency: float  # achieved FP8 GEMM rate / (fp8 peak x efficiency.matmul)
    converts_experts: bool  # routed experts' GEMMs in FP8 (the attention and MLP Linears always are)
    cast_input_bytes: tuple[float, float]  # (forward, backward) per input element
    cast_weight_bytes: tuple[float, float]  # (forward, backward) per weight element
    cast_grad_output_bytes: float  # backward, per output-gradient element
    weight_cast_per_step: bool  # the FP8 weight is cached across micro-batches (cast once a step)
    fsdp_fp8_all_gather: bool  # FSDP all-gathers the converted weights in FP8 (1 byte a parameter)
    tp_fp8_all_gather: bool  # sequence-parallel all-gathers before converted Linears move FP8
    saved_input_bytes: float | None  # bytes per element of a Linear's saved input (None: compute dtype)
    weight_cache_bytes: float  # FP8 weight copies kept per local converted parameter (TE: data + transpose)
    amax_history_len: int  # fp32 amaxes kept per FP8 tensor (0: dynamic scaling keeps none)
    fp8_tensors_per_gemm: int  # FP8 tensors with scaling state per GEMM (TE: input, weight, output; grad out, grad in)
    amax_reduce_per_microbatch: bool  # amaxes all-reduced after each forward and each backward (TE)
    weight_amax_reduce_per_step: bool  # one all-reduce of the weights' amaxes after the optimizer step (FSDP)

    def amax_state_bytes_per_gemm(self) -> float:
        """fp32 amax history, scale and inverse scale of each FP8 tensor of one GEMM (TE's fp8_meta)."""
        if not self.amax_history_len:
            return 0.0
        return 4.0 * self.fp8_tensors_per_gemm * (self.amax_history_len + 2)


FLOAT8_RECIPES: dict[str, Float8Recipe] = {
    "float8-tensorwise": Float8Recipe(
        name="float8-tensorwise", library="torchao", scaling="tensorwise", base_precision="fsdp2-bf16",
        gemm_efficiency=1.0, converts_experts=False,
        # roofline_utils, tensorwise: input / grad_output read 2 (amax) + read 2, write fp8 twice (row- and
        # column-major) 1 + 1 = 6; weight: amax 2, forward cast 2 + 1, backward cast 2 + 1
        cast_input_bytes=(6.0, 0.0), cast_weight_bytes=(5.0, 3.0), cast_grad_output_bytes=6.0,
        weight_cast_per_step=False, fsdp_fp8_all_gather=True, tp_fp8_all_gather=True, saved_input_bytes=None,
        weight_cache_bytes=0.0, amax_history_len=0, fp8_tensors_per_gemm=3,
        amax_reduce_per_microbatch=False, weight_amax_reduce_per_step=True,
    ),
    "float8-rowwise": Float8Recipe(
        name="float8-rowwise", library="torchao", scaling="rowwise", base_precision="fsdp2-bf16",
        gemm_efficiency=0.9, converts_experts=False,
        # roofline_utils, rowwise: input / grad_output: read 2, write fp8 1 and a transposed bf16 copy 2;
        # then read that 2, write fp8 1 (8); weight: cast 2 + 1, transpose 2 + 2, cast 2 + 1 (10)
        cast_input_bytes=(5.0, 3.0), cast_weight_bytes=(3.0, 7.0), cast_grad_output_bytes=8.0,
        weight_cast_per_step=False, fsdp_fp8_all_gather=False, tp_fp8_all_gather=False, saved_input_bytes=None,
        weight_cache_bytes=0.0, amax_history_len=0, fp8_tensors_per_gemm=3,
        amax_reduce_per_microbatch=False, weight_amax_reduce_per_step=False,
    ),
    "te-fp8": Float8Recipe(
        name="te-fp8", library="transformer_engine", scaling="delayed", base_precision="bf16-megatron",
        gemm_efficiency=1.0, converts_experts=True,
        # fused cast-transpose with the amax recorded on the way: read 2, write fp8 and its transpose 1 + 1
        cast_input_bytes=(4.0, 0.0), cast_weight_bytes=(4.0, 0.0), cast_grad_output_bytes=4.0,
        weight_cast_per_step=True, fsdp_fp8_all_gather=False, tp_fp8_all_gather=True, saved_input_bytes=1.0,
        weight_cache_bytes=2.0, amax_history_len=1024, fp8_tensors_per_gemm=5,
        amax_reduce_per_microbatch=True, weight_amax_reduce_per_step=False,
    ),
}


def float8_recipe(name: str | None) -> Float8Recipe | None:
    """The recipe called ``name`` (None: no FP8 GEMMs)."""
    if name is None:
        return None
    if name not in FLOAT8_RECIPES:
        raise ConfigError(f"fp8_recipe={name!r} is not one of {', '.join(FLOAT8_RECIPES)}", field="fp8_recipe",
                          value=name)
    return FLOAT8_RECIPES[name]


def converted_params(model: "ModelSpec", index: int, tp: int, ep: int, recipe: Float8Recipe) -> float:
    """Parameters of block ``index`` on one TP/EP rank whose GEMMs the recipe runs in FP8: the
    attention projections and the MLP (or shared experts), split by TP, and the routed experts
    (split by EP and TP) where the recipe converts them; not the norms, latent attention's whole
    down-projections, or the router."""
    p = model.layer_params(index)
    experts = p.experts / (ep * tp) if recipe.converts_experts else 0.0
    return p.attention / tp + p.mlp / tp + experts
