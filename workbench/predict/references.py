"""Published training measurements the planner is checked against (not tuned to row by row).

Megatron-Core on H100 SXM 80 GB, bf16, GPT models (GELU, d_ff = 4h, multi-head attention),
seq 4096, vocab 131072, 48-way data parallel; MFU = achieved TFLOP/s / 989.4. And Korthikanti et
al. 2022 (Table 4 / section 6): a 22B GPT on 8 A100 with tp 8, sequence parallel and selective
recompute, 1.10 s per iteration and 41.5% MFU (1.42 s with full recompute).
"""

from __future__ import annotations

from dataclasses import replace

from workbench.spec.cluster import Cluster
from workbench.spec.framework import FRAMEWORKS, TIERS
from workbench.spec.config import RunConfig, TrainSettings
from workbench.spec.model import ModelSpec
from workbench.spec.plan import ParallelPlan
from workbench.predict.measurements import Measurement


def _gpt(layers: int, hidden: int, heads: int, vocab: int) -> ModelSpec:
    return ModelSpec(
        n_layers=layers, d_model=hidden, n_heads=heads, d_ff=4 * hidden, vocab_size=vocab,
        activation="gelu", norm="layernorm", name=f"gpt-{layers}x{hidden}",
    )


def _h100_row(name: str, layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, gbs: int,
              tflops: float, mfu: float) -> Measurement:
    model = _gpt(layers, hidden, heads, 131072)
    cluster = Cluster.preset("dgx-h100", nodes=gpus // 8)
    # Megatron-Core's distributed optimizer shards optimizer states over data parallel (ZeRO-1).
    plan = ParallelPlan(tp=tp, pp=pp, zero_stage=1, sequence_parallel=tp > 1)
    train = TrainSettings(seq_len=4096, micro_batch_size=1, global_batch_size=gbs,
                          framework="megatron").with_precision("bf16-megatron")
    return Measurement(RunConfig(model, cluster, plan, train), mfu=mfu, label=name, framework="megatron",
                       source=f"Megatron-Core on H100 SXM 80 GB: {tflops} TFLOP/s per GPU published, MFU = / 989.4")


MEGATRON_H100 = (
    _h100_row("gpt-1.7b h100", 24, 2048, 16, 1, 1, 48, 192, 408.8, 0.41),
    _h100_row("gpt-16b h100", 32, 6144, 48, 4, 1, 192, 192, 489.1, 0.49),
    _h100_row("gpt-70b h100", 84, 8192, 64, 8, 2, 768, 384, 419.7, 0.42),
)


# The paper's Megatron (2022) predates Transformer Engine's TP-communication overlap: every TP
# collective is exposed, as in the paper's own timing model (section 6).
MEGATRON_2022 = replace(FRAMEWORKS["megatron"], name="megatron-2022",
                        in_stage_comm_exposed=tuple((t, 1.0) for t in TIERS))


def _korthikanti(recompute: str, step_time_s: float, mfu: float | None) -> Measurement:
    model = _gpt(48, 6144, 64, 51200)
    cluster = Cluster.preset("dgx-a100", nodes=1)
    plan = ParallelPlan(tp=8, dp_shard=1, zero_stage=0, sequence_parallel=True)
    # 2022 Megatron: fused softmax (no flash attention) and dropout 0.1, as the paper's activation
    # accounting assumes.
    train = TrainSettings(seq_len=2048, micro_batch_size=4, global_batch_size=4, recompute=recompute,
                          attention="eager", dropout=True, framework=MEGATRON_2022).with_precision("bf16-megatron")
    return Measurement(RunConfig(model, cluster, plan, train), mfu=mfu, step_time_s=step_time_s,
                       label=f"gpt-22b a100 {recompute}", framework="megatron",
                       source="Korthikanti et al. 2022, Table 4 / section 6")


KORTHIKANTI_A100 = (
    _korthikanti("selective", 1.10, 0.415),
    _korthikanti("full", 1.42, None),
)

ALL = MEGATRON_H100 + KORTHIKANTI_A100
