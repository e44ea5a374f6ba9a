"""Instrumentation and guards of the bundled trainer, in one process (multi-rank measurements are
checked against the planner in tests/test_compare.py)."""

from __future__ import annotations

import math

import pytest

from workbench import Cluster, ConfigError, ModelSpec, ParallelPlan, RunConfig, TrainSettings


def config(steps: int = 4, **train) -> RunConfig:
    settings = TrainSettings(seq_len=32, micro_batch_size=2, global_batch_size=4, steps=steps, warmup_steps=1,
                             seed=1, **train).with_precision("fp32")
    return RunConfig(ModelSpec.preset("tiny"), Cluster.preset("local-cpu", nodes=1, gpus_per_node=1),
                     ParallelPlan(dp_shard=1), settings)


def train(cfg: RunConfig, tmp_path, monkeypatch, inject: str | None = None, **env):
    from workbench.rundir import EventWriter, create_run_dir, read_events
    from workbench.trainer.train import run_training

    if inject:
        monkeypatch.setenv("WORKBENCH_INJECT", inject)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_dir = create_run_dir(cfg, tmp_path, "run")
    with EventWriter(run_dir, 0) as writer:
        losses = run_training(cfg, writer, run_dir=run_dir)
    return losses, read_events(run_dir), run_dir


def test_measured_memory_matches_the_bill(tmp_path, monkeypatch):
    """One process, m = 2 micro-batches: model states exact, activations (saved-tensor hooks)
    within 5% of the bill, every instrumented kind written."""
    from workbench.predict.memory import estimate_memory

    cfg = config(steps=2)
    losses, events, _ = train(cfg, tmp_path, monkeypatch)
    assert len(losses) == 2
    mem = [e for e in events if e["kind"] == "memory"]
    assert [e["step"] for e in mem] == [0, 1]
    bill = estimate_memory(cfg).components
    for name in ("parameters", "gradients", "optimizer"):
        assert mem[-1][name] == bill[name], name
    assert mem[-1]["activations"] == pytest.approx(bill["activations"], rel=0.05)
    steps = [e for e in events if e["kind"] == "step"]
    assert all(0 < e["mfu"] < 1 for e in steps)
    stats = [e for e in events if e["kind"] == "step_stats"]
    assert [len(e["step_time_s"]) for e in stats] == [1, 1] and stats[0]["slowest_rank"] == 0


def test_activation_meter_skips_weights_and_counts_storages_once():
    import torch

    from workbench.trainer.memory_meter import SavedTensorMeter

    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    meter = SavedTensorMeter()
    meter.start()
    h = x * 2  # saves nothing of size (constant factor)
    y = (h @ w).relu() @ w.t()  # saves h, relu output (and w, w.t(): weights, skipped)
    z = (h * h).sum()  # h again: the same storage
    meter.stop()
    assert meter.peak == 2 * 8 * 64 * 4
    (y.sum() + z).backward()
    assert meter.live == 0  # every saved storage was unpacked by backward and released


def test_guards_are_pure_functions_of_global_values():
    from workbench.trainer.guards import check_guards

    cfg = config(guard_grad_spike=3.0, guard_min_tokens_per_s=100.0)
    ok = {"loss": 2.0, "grad_norm": 1.0}
    assert check_guards(cfg, 5, ok, 1e3, [1.0] * 5) is None
    g = check_guards(cfg, 5, {"loss": math.nan, "grad_norm": 1.0}, 1e3, [])
    assert g.guard == "nonfinite" and "loss=nan" in g.message
    g = check_guards(cfg, 5, {"loss": 2.0, "grad_norm": 3.5}, 1e3, [1.0, 1.2, 0.9, 1.1, 1.0])
    assert g.guard == "grad_spike" and g.threshold == pytest.approx(3.0)
    assert check_guards(cfg, 5, {"loss": 2.0, "grad_norm": 3.5}, 1e3, [1.0] * 4) is None  # too little history
    g = check_guards(cfg, 2, ok, 50.0, [])
    assert g.guard == "min_tokens_per_s" and g.value == 50.0
    assert check_guards(cfg, 1, ok, 50.0, []) is None  # warm-up steps are not judged


def test_guard_settings_are_validated():
    with pytest.raises(ConfigError, match="guard_grad_spike=0.5 must be 0"):
        TrainSettings(guard_grad_spike=0.5)
    with pytest.raises(ConfigError, match="guard_min_tokens_per_s=-1 must be >= 0"):
        TrainSettings(guard_min_tokens_per_s=-1)
    with pytest.raises(ConfigError, match="instrument='yes' must be true or false"):
        TrainSettings(instrument="yes")


@pytest.mark.parametrize("inject, settings, guard, step", [
    ("nan:2", {}, "nonfinite", 2),
    ("spike:6", {"guard_grad_spike": 5.0}, "grad_spike", 6),
    (None, {"guard_min_tokens_per_s": 1e12}, "min_tokens_per_s", 2),
])
def test_a_fired_guard_stops_the_run_with_a_final_checkpoint(tmp_path, monkeypatch, inject, settings, guard, step):
    cfg = config(steps=10, checkpoint_every=100, **settings)
    losses, events, run_dir = train(cfg, tmp_path, monkeypatch, inject)
    assert len(losses) == step + 1  # the step that tripped it completed, then the run stopped
    guards = [e for e in events if e["kind"] == "guard"]
    assert [(g["guard"], g["step"]) for g in guards] == [(guard, step)]
    order = [(e["kind"], e.get("step")) for e in events if e["kind"] in ("step", "guard")]
    assert order[-2:] == [("step", step), ("guard", step)]  # the step's own event, then why it stopped
    assert any(p.name.startswith("step-") for p in (run_dir / "checkpoints").iterdir())


def test_switching_instrumentation_off(tmp_path, monkeypatch):
    _, events, _ = train(config(steps=1), tmp_path, monkeypatch, WORKBENCH_INSTRUMENT="0")
    assert {e["kind"] for e in events} == {"run_start", "step"}
