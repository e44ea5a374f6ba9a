"""The tiny model learns the pydoc corpus: loss over 200 steps, printed every 20th step.

    python benchmarks/loss_curve.py [--steps 200] [--plan "dp_shard=2"]

With no plan it trains in this process (one rank); with a plan it goes through
``workbench.launch.local.train_local`` (torchrun). A byte-level model starts near ln(256) = 5.55.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--plan", default="")
    ap.add_argument("--every", type=int, default=20)
    args = ap.parse_args()

    from workbench.launch.local import config_from_cli

    config = config_from_cli("tiny", args.plan, args.steps, seq_len=64, micro_batch_size=8, lr=3e-3,
                             warmup_steps=20, seed=0)
    t0 = time.time()
    if not args.plan:
        from workbench.trainer.train import run_training

        losses = run_training(config)
    else:
        from workbench.launch.local import train_local
        from workbench.rundir import load_run

        root = tempfile.mkdtemp()
        assert train_local(config, run_root=root, run_id="curve", stream=lambda s: None) == 0
        losses = [e["loss"] for e in load_run(f"{root}/curve").steps()]
    elapsed = time.time() - t0
    tokens = config.tokens_per_step
    print(f"tiny ({config.model.n_params():,} params) on pydoc, {config.plan.describe()}, "
          f"{tokens} tokens/step, {args.steps} steps in {elapsed:.1f} s")
    for i in range(0, len(losses), args.every):
        print(f"step {i:4d}  loss {losses[i]:.4f}")
    print(f"step {len(losses) - 1:4d}  loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
