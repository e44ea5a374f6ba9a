"""Two runs side by side: ``workbench compare A B`` and the app's comparison of a plan with its
naive baseline.

First what differs in their lineages (:mod:`workbench.rundir.lineage`): data, code, packages,
model, cluster, profile; if anything does, the metrics below compare runs that differ by more than
their plans, and the table says so before any number. Then, per run: the plan, ranks, steps run,
median step time of rank 0 over the timed steps, tokens/s per GPU, the most loaded rank's measured memory (model states and
activations, :func:`workbench.rundir.analysis.memory`, its largest total over the ranks), the
final loss, and the declared acceptance thresholds' verdicts; and the loss over the steps both ran
(their largest relative difference: the same data and global batch make the same curve, up to the
layout's order of reductions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from workbench.rundir import analysis
from workbench.rundir.acceptance import ThresholdResult, evaluate_acceptance
from workbench.rundir.compare import measured_step_time
from workbench.rundir.lineage import LineageDifference, diff_lineage, read_lineage
from workbench.rundir.record import load_run

# Lineage leaves that differ between any two runs and say nothing of comparability.
VOLATILE = ("code.untracked_files",)


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    label: str  # the plan, and "baseline of ..." for a baseline run
    world_size: int
    steps: int
    step_time_s: float | None
    tokens_per_s_per_gpu: float | None
    memory_bytes: int | None
    final_loss: float | None
    losses: dict[int, float]
    acceptance: list[ThresholdResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "label": self.label, "world_size": self.world_size, "steps": self.steps,
                "step_time_s": self.step_time_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "memory_bytes": self.memory_bytes, "final_loss": self.final_loss,
                "acceptance": [r.to_dict() for r in self.acceptance]}


def summarize_run(run_dir: str | os.PathLike) -> RunSummary:
    run = load_run(run_dir)
    config = run.config
    events, _ = run.checked_events()
    steps = {int(e["step"]): float(e["loss"]) for e in events if e["kind"] == "step" and e["rank"] == 0}
    measured = measured_step_time(events, 0)  # median over the timed steps (after the warm-up)
    step_time = measured[0] if measured else None
    memory = [sum(v for k, v in analysis.memory(events, r).items() if not k.startswith("cuda"))
              for r in range(config.world_size)]
    baseline_of = run.manifest.get("baseline_of")
    of = baseline_of.get("plan") if isinstance(baseline_of, dict) else None
    label = config.plan.describe() + (f" (naive baseline of {of})" if of else "")
    acceptance, _ = evaluate_acceptance(run_dir) if config.train.accept else ([], True)
    return RunSummary(
        str(run_dir), label, config.world_size, len(steps), step_time,
        config.tokens_per_step / step_time / config.world_size if step_time else None,
        max(memory) if any(memory) else None, steps[max(steps)] if steps else None, steps, acceptance)


@dataclass(frozen=True)
class RunsComparison:
    a: RunSummary
    b: RunSummary
    lineage: list[LineageDifference]
    notes: list[str]

    @property
    def common_steps(self) -> list[int]:
        return sorted(set(self.a.losses) & set(self.b.losses))

    @property
    def loss_diff(self) -> float | None:
        """Largest relative loss difference over the steps both runs ran."""
        common = self.common_steps
        if not common:
            return None
        return max(abs(self.a.losses[s] - self.b.losses[s]) / abs(self.b.losses[s]) for s in common)

    def to_dict(self) -> dict[str, Any]:
        return {"lineage": [{"key": d.key, "a": d.a, "b": d.b} for d in self.lineage], "notes": self.notes,
                "a": self.a.to_dict(), "b": self.b.to_dict(), "common_steps": len(self.common_steps),
                "loss_max_rel_diff": self.loss_diff}

    def format(self) -> str:
        lines = [f"A: {self.a.run_dir}", f"B: {self.b.run_dir}", ""]
        if self.lineage:
            lines.append(f"lineage: {len(self.lineage)} difference{'s' if len(self.lineage) != 1 else ''} "
                         "(the runs differ by more than their plans)")
            lines += [f"  {d.describe()}" for d in self.lineage]
        else:
            lines.append("lineage: the same data, model, code, packages, cluster and profile")
        lines += [f"note: {n}" for n in self.notes]
        rows = [("plan", self.a.label, self.b.label), ("ranks", self.a.world_size, self.b.world_size),
                ("steps", self.a.steps, self.b.steps),
                ("step time (median)", _num(self.a.step_time_s, " s"), _num(self.b.step_time_s, " s")),
                ("tokens/s per GPU", _num(self.a.tokens_per_s_per_gpu), _num(self.b.tokens_per_s_per_gpu)),
                ("memory, most loaded rank", _bytes(self.a.memory_bytes), _bytes(self.b.memory_bytes)),
                ("final loss", _num(self.a.final_loss), _num(self.b.final_loss))]
        width = max(26, *(len(str(v)) for _, x, y in rows for v in (x, y)))
        lines += ["", f"  {'':<26} {'A':>{width}} {'B':>{width}}"]
        lines += [f"  {name:<26} {str(x):>{width}} {str(y):>{width}}" for name, x, y in rows]
        diff = self.loss_diff
        lines.append(f"  loss over the {len(self.common_steps)} steps both ran: max relative difference "
                     + ("—" if diff is None else f"{diff:.2e}"))
        for tag, s in (("A", self.a), ("B", self.b)):
            if s.acceptance:
                lines += ["", f"acceptance of {tag}:"] + [f"  {r.describe()}" for r in s.acceptance]
        return "\n".join(lines)


def _num(x: float | None, unit: str = "") -> str:
    return "—" if x is None else f"{x:.4g}{unit}"


def _bytes(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**20:.2f} MiB"


def compare_runs(a: str | os.PathLike, b: str | os.PathLike) -> RunsComparison:
    """Run ``a`` beside run ``b``: lineage differences first, then the numbers."""
    la, lb = read_lineage(a), read_lineage(b)
    notes = [f"{tag} has no lineage.json (a run from before lineages): its inputs are unknown"
             for tag, lin in (("A", la), ("B", lb)) if lin is None]
    diffs = [d for d in diff_lineage(la, lb) if d.key not in VOLATILE] if la and lb else []
    return RunsComparison(summarize_run(a), summarize_run(b), diffs, notes)
