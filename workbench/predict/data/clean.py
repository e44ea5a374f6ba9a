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
# torchtitan's rows name a cluster file beside the table for the H100s (no preset for them)
TORCHTITAN_COLUMNS = COLUMNS[:COLUMNS.index("gpu") + 1] + ("cluster",) + COLUMNS[COLUMNS.index("gpu") + 1:]


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


# Sequence lengths of the default configs of benchmarked commits whose rows' notes do not give one:
# the async-TP report (2025-06) ran torchtitan 820504e, whose llama3_8b.toml and llama3_70b.toml
# both set seq_len = 8192.
DEFAULT_SEQ_LEN = {"benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md": ("8192", "820504e")}


def _default_seq_len(notes: str, file: str = "") -> tuple[str, str]:
    """The sequence length the default config of a torchtitan row's commit used, and where it is said."""
    match = re.search(r"default seq_len=(\d+)", notes)
    if match:
        return match.group(1), "the row's notes"
    if file in DEFAULT_SEQ_LEN:
        seq, commit = DEFAULT_SEQ_LEN[file]
        return seq, f"train_configs of torchtitan {commit}"
    return "", ""


# The float8 column: "no" is bf16; "rowwise" torchao's rowwise recipe; "yes" (the 2024-12 and H200
# reports) and "tensorwise" its tensorwise recipe, torchtitan's default (dynamic tensorwise scaling at
# 9dec370 and e7c0cae, the file's notes say).
FLOAT8_PRECISION = {"no": "fsdp2-bf16", "rowwise": "float8-rowwise"}
GRAND_TETON = "grand-teton-h100.json"  # beside this file: H100 96GB HBM2e at 500 W (see README.md)


def torchtitan_rows(path: Path) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """torchtitan's benchmark tables (Llama 3.1 8B/70B/405B): the rows the planner can price, and
    (label, reason) for the others.

    Kept: rows with a measured throughput and/or ``memory_gib`` (peak *reserved* memory, max over
    GPUs), bf16 or float8. torchtitan trains with FSDP2 (MixedPrecisionPolicy(param bf16, reduce
    fp32) over fp32 sharded parameters and AdamW: the ``fsdp2-bf16`` recipe; with torchao float8
    Linears ``float8-tensorwise``, or ``float8-rowwise`` where the row says rowwise), DTensor TP/SP,
    torch.distributed.pipelining and its own CP: priced under the ``torchtitan`` profile (the
    bundled trainer's conventions with torchtitan's per-op selective checkpointing,
    ``selective_ac_option = 'op'``, and one RoPE table per model). An unstated sequence length is its
    commit's default config (the row's notes say which; ``notes`` here says it was resolved so). The
    H100 rows ran on Grand Teton hosts (H100 96GB HBM2e, 2.4 TB/s, 500 W): the ``grand-teton-h100``
    cluster beside this file; the H200 rows on the ``dgx-h200`` preset's GPUs and links.
    """
    kept, dropped = [], []
    for r in csv.DictReader(path.open()):
        table = r["table"] if len(r["table"]) <= 24 else Path(r["file"]).stem  # the async-TP report's captions
        label = f"{r['model']} {r['n_gpus']}x{r['gpu'].split(' ')[0]} {table}: {r['row_label']}"
        fsdp, tp, pp, cp = (int(r[k]) for k in ("fsdp_degree", "tp_degree", "pp_degree", "cp_degree"))
        if pp > 1:
            dropped.append((label, "pipeline micro-batch count not stated"))
            continue
        if r["async_tp"] == "yes":
            dropped.append((label, "async TP (TP collectives overlapped through symmetric memory): not modelled"))
            continue
        seq, said = (r["seq_len"], "") if r["seq_len"] else _default_seq_len(r["notes"], r["file"])
        if not seq:
            dropped.append((label, "sequence length neither stated nor given by a default config"))
            continue
        notes = [r["notes"]]
        if not r["seq_len"]:
            notes.append(f"seq_len {seq} resolved from the default config of the benchmarked commit ({said})")
        if r["compile"] == "yes":
            notes.append("torch.compile of each block: not modelled")
        precision = FLOAT8_PRECISION.get(r["float8"], "float8-tensorwise")
        if precision != "fsdp2-bf16":
            notes.append(f"priced as {precision}")
        plan = [f"dp_shard={fsdp}", "zero=3"] + [f"{k}={v}" for k, v in (("tp", tp), ("cp", cp)) if v > 1]
        if tp > 1:
            plan.append("loss_parallel=true")  # torchtitan enables it with TP (--training.disable_loss_parallel)
        gbs = r["global_batch_size"]
        if not gbs:  # one local batch per data-parallel (FSDP) rank; CP ranks share theirs
            gbs = str(int(r["local_batch_size"]) * fsdp)
            notes.append(f"global batch {gbs} = local batch x FSDP degree (not stated)")
        recompute = "selective" if r["recompute"].startswith("selective") else r["recompute"]
        h100 = r["gpu"].startswith("h100")
        kept.append({
            "label": label, "framework": "torchtitan",
            "source": f"{r['source']} ({r['table']}, {r['row_label']})",
            "n_layers": r["n_layers"], "d_model": r["d_model"], "n_heads": r["n_heads"], "n_kv_heads": r["n_kv_heads"],
            "d_ff": r["d_ff"], "vocab_size": r["vocab_size"], "position": "rope", "max_seq_len": seq,
            "norm": "rmsnorm", "activation": "swiglu", "tie_embeddings": "false", "linear_bias": "false",
            "gpu": "" if h100 else "h200-141gb", "cluster": GRAND_TETON if h100 else "",
            "n_gpus": r["n_gpus"], "plan": ",".join(plan), "seq_len": seq,
            "micro_batch_size": r["local_batch_size"], "global_batch_size": gbs, "recompute": recompute,
            "precision": precision, "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
            "peak_memory_gib": r["memory_gib"], "params_published": "",
            "notes": "; ".join(n.strip() for n in notes if n.strip()),
        })
    return kept, dropped


def _write(name: str, rows: list[dict[str, str]], columns: tuple[str, ...] = COLUMNS) -> None:
    with (HERE / name).open("w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {HERE / name}")


def main(argv: list[str]) -> int:
    shared = Path(argv[0]) if argv else HERE.parents[3] / ".." / "shared" / "measurements"
    _write("mpt-h100-bf16.csv", mpt_rows(shared / "mpt-h100-bf16.csv"))
    kept, dropped = torchtitan_rows(shared / "torchtitan.csv")
    _write("torchtitan.csv", kept, TORCHTITAN_COLUMNS)
    for label, reason in dropped:
        print(f"  dropped {label}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
