"""Turn the published tables of ``shared/measurements/`` into the project's measurement format
(:mod:`workbench.predict.measurements`): ``python -m workbench.predict.data.clean SHARED_DIR``.

Run once when the shared tables change; the cleaned CSVs beside this file are what the tests and
``workbench validate`` read. Every row keeps its source (repository, file and commit) and label.
"""

from __future__ import annotations

import csv
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
            "framework": "fsdp", "source": f"{r['source']} ({r['table']}, row {r['row_in_table']})",
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


def main(argv: list[str]) -> int:
    shared = Path(argv[0]) if argv else HERE.parents[3] / ".." / "shared" / "measurements"
    rows = mpt_rows(shared / "mpt-h100-bf16.csv")
    with (HERE / "mpt-h100-bf16.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {HERE / 'mpt-h100-bf16.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
