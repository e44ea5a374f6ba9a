"""Turn the published tables of ``shared/measurements/`` into the project's measurement format
(:mod:`workbench.predict.measurements`): ``python -m workbench.predict.data.clean SHARED_DIR``.

Run once when the shared tables change; the cleaned CSVs beside this file are what the tests and
``workbench validate`` read. Every row keeps its source (repository, file and commit) and label.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("label", "framework", "source", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
           "position", "max_seq_len", "norm", "activation", "tie_embeddings", "linear_bias", "gpu", "n_gpus", "plan", "seq_len",
           "micro_batch_size", "global_batch_size", "recompute", "precision", "tokens_per_s_per_gpu",
           "peak_memory_gib", "params_published", "notes")


def mpt_rows(path: Path) -> list[dict[str, str]]:
    """llm-foundry's H100 tables: PyTorch FSDP (Composer) with flash attention, learned positions,
    LayerNorm, GELU MLP (d_ff = 4d), tied embeddings, biases; FULL_SHARD is ZeRO-3, SHARD_GRAD_OP
    ZeRO-2; amp_bf16 keeps fp32 parameters and computes in bf16 (the fsdp2-bf16 recipe)."""
    out = []
    for r in csv.DictReader(path.open()):
        zero = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[r["sharding"]]
        out.append({
            "label": f"{r['model']} {r['n_gpus']}xH100 seq {r['seq_len']} mbs {r['micro_batch_size']} "
                     f"{r['sharding']} recompute {r['recompute']}",
            # the tables predate torch 2.0 (their README's TODO): FlashAttention v1's kernels
            "framework": "fsdp-flash1", "source": f"{r['source']} ({r['table']}, row {r['row_in_table']})",
            "n_layers": r["n_layers"], "d_model": r["d_model"], "n_heads": r["n_heads"], "n_kv_heads": r["n_heads"],
            "d_ff": r["d_ff"], "vocab_size": r["vocab_size"], "position": "learned", "norm": "layernorm",
            "activation": "gelu", "tie_embeddings": "true", "linear_bias": "true", "gpu": r["gpu"],
            "max_seq_len": r["seq_len"], "params_published": r["num_params_reported"],
            "n_gpus": r["n_gpus"], "plan": f"dp_shard={r['n_gpus']},zero={zero}", "seq_len": r["seq_len"],
            "micro_batch_size": r["micro_batch_size"], "global_batch_size": r["global_batch_size"],
            "recompute": r["recompute"], "precision": "fsdp2-bf16", "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
            "peak_memory_gib": "", "notes": r["notes"],
        })
    return out


def _default_seq_len(notes: str) -> str:
    """The sequence length a torchtitan row's notes say the default config of its commit used."""
    match = re.search(r"default seq_len=(\d+)", notes)
    return match.group(1) if match else ""


def torchtitan_rows(path: Path) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """torchtitan's benchmark tables (Llama 3.1 8B/70B/405B): the rows whose peak memory the
    planner can price, and (label, reason) for the others.

    Kept: rows with a measured ``memory_gib`` (peak *reserved* memory, max over GPUs) in bf16.
    torchtitan trains with FSDP2 (MixedPrecisionPolicy(param bf16, reduce fp32) over fp32 sharded
    parameters and AdamW: the ``fsdp2-bf16`` recipe), DTensor TP/SP, torch.distributed.pipelining
    and its own CP: priced under the ``torchtitan`` profile (the bundled trainer's conventions with
    torchtitan's per-op selective checkpointing, ``selective_ac_option = 'op'``, and one RoPE table
    per model). An unstated sequence length is its commit's default config (the row's notes say
    which; ``notes`` here says it was resolved so).
    """
    kept, dropped = [], []
    for r in csv.DictReader(path.open()):
        label = f"{r['model']} {r['n_gpus']}x{r['gpu'].split(' ')[0]} {r['table']}: {r['row_label']}"
        if not r["memory_gib"]:
            dropped.append((label, "no memory reported (throughput only; throughput rows are not "
                                   "priceable: no preset for the 500 W H100 96GB HBM2e)"))
            continue
        if r["float8"] != "no":
            dropped.append((label, "float8 linears (torchao): the planner has no fp8 precision recipe"))
            continue
        fsdp, tp, pp, cp = (int(r[k]) for k in ("fsdp_degree", "tp_degree", "pp_degree", "cp_degree"))
        if pp > 1:
            dropped.append((label, "pipeline micro-batch count not stated"))
            continue
        seq = r["seq_len"] or _default_seq_len(r["notes"])
        if not seq:
            dropped.append((label, "sequence length neither stated nor given by a default config"))
            continue
        notes = [r["notes"]]
        if not r["seq_len"]:
            notes.append(f"seq_len {seq} resolved from the default config of the benchmarked commit")
        if r["compile"] == "yes":
            notes.append("torch.compile of each block: not modelled by the memory bill")
        plan = [f"dp_shard={fsdp}", "zero=3"] + [f"{k}={v}" for k, v in (("tp", tp), ("cp", cp)) if v > 1]
        if tp > 1:
            plan.append("loss_parallel=true")  # torchtitan enables it with TP (--training.disable_loss_parallel)
        gbs = r["global_batch_size"]
        if not gbs:  # one local batch per data-parallel (FSDP) rank; CP ranks share theirs
            gbs = str(int(r["local_batch_size"]) * fsdp)
            notes.append(f"global batch {gbs} = local batch x FSDP degree (not stated)")
        recompute = "selective" if r["recompute"].startswith("selective") else r["recompute"]
        kept.append({
            "label": label, "framework": "torchtitan",
            "source": f"{r['source']} ({r['table']}, {r['row_label']})",
            "n_layers": r["n_layers"], "d_model": r["d_model"], "n_heads": r["n_heads"], "n_kv_heads": r["n_kv_heads"],
            "d_ff": r["d_ff"], "vocab_size": r["vocab_size"], "position": "rope", "max_seq_len": seq,
            "norm": "rmsnorm", "activation": "swiglu", "tie_embeddings": "false", "linear_bias": "false",
            # no preset for the 96 GB HBM2e H100 (500 W): the bill's bytes do not depend on the GPU
            "gpu": "h100-80gb" if r["gpu"].startswith("h100") else "h200-141gb",
            "n_gpus": r["n_gpus"], "plan": ",".join(plan), "seq_len": seq,
            "micro_batch_size": r["local_batch_size"], "global_batch_size": gbs, "recompute": recompute,
            "precision": "fsdp2-bf16", "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
            "peak_memory_gib": r["memory_gib"], "params_published": "",
            "notes": "; ".join(n.strip() for n in notes if n.strip()),
        })
    return kept, dropped


def _write(name: str, rows: list[dict[str, str]]) -> None:
    with (HERE / name).open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {HERE / name}")


def main(argv: list[str]) -> int:
    shared = Path(argv[0]) if argv else HERE.parents[3] / ".." / "shared" / "measurements"
    _write("mpt-h100-bf16.csv", mpt_rows(shared / "mpt-h100-bf16.csv"))
    kept, dropped = torchtitan_rows(shared / "torchtitan.csv")
    _write("torchtitan.csv", kept)
    for label, reason in dropped:
        print(f"  dropped {label}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
