"""Refuse only what cannot run: a plan that breaks only torch.distributed.pipelining's limits
(1F1B with fewer micro-batches than stages, interleaved rounds that do not divide the
micro-batches) is predicted, with a note, as another framework runs it; the bundled trainer,
which runs torch's schedules, refuses it in its support check. What no framework can place or
order (gpipe with several stages per rank, DualPipeV under 2 pp micro-batches) stays refused.

No torch here: the agreement of these rules with torch's constructors is tests/test_schedule.py's.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from workbench import ConfigError
from workbench.cli import main
from workbench.predict import pipeline as S
from workbench.predict.perf import predict_step
from workbench.spec import schedules
from workbench.spec.config import build_run_config, plan_notes
from workbench.spec.trainable import check_trainable, unsupported


def config(schedule: str, gbs: int = 2, v: int = 1):
    """llama3-8b on one DGX H100, tp=2 x pp=4 (dp = 1): n_microbatches = gbs."""
    return build_run_config("llama3-8b", cluster="dgx-h100", nodes=1, seq_len=4096, global_batch_size=gbs,
                            plan=f"tp=2,pp=4,dp_shard=1,schedule={schedule},v={v}")


# ---------------------------------------------------------------------------- the planner
def test_1f1b_with_fewer_microbatches_than_stages_is_predicted_as_gpipe_with_a_note():
    one, gpipe = config("1f1b"), config("gpipe")
    assert (one.plan.pp, one.n_microbatches) == (4, 2)
    a, b = predict_step(one), predict_step(gpipe)
    assert a.bubble_fraction == pytest.approx(b.bubble_fraction, rel=1e-9)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-9)
    (note,) = plan_notes(one)
    assert note.startswith("pp_schedule=1f1b with n_microbatches=2 < pp=4: torch.distributed.pipelining refuses it")
    assert "degenerate pipeline" in note and "Megatron" in note and "\n" not in note
    assert plan_notes(gpipe) == [] and plan_notes(config("1f1b", gbs=8)) == []


def test_interleaved_rounds_torch_refuses_are_predicted_in_megatron_rounds():
    cfg = config("interleaved-1f1b", gbs=9, v=2)
    (note,) = plan_notes(cfg)
    assert "max(1, 9 // 4) = 2" in note and "9 % 2 = 1" in note and "nearest valid: 8 or 10" in note
    assert "rounds of 5 micro-batches and a last one of 4" in note
    assert predict_step(cfg).bubble_fraction > 0


def test_structural_rules_are_still_refused_by_the_planner():
    with pytest.raises(ConfigError, match="pp_schedule=gpipe runs one stage per rank; virtual_stages=2") as e:
        config("gpipe", gbs=8, v=2)
    assert e.value.field == "virtual_stages"
    with pytest.raises(ConfigError, match="virtual_stages=1 must be 2"):
        config("zbv", gbs=8, v=1)
    # DualPipeV's phases exist only from 2 pp micro-batches (torch and DeepSeek's code both assert it)
    with pytest.raises(ConfigError, match=r"= 6 / \(1 x 1\) = 6 micro-batches: .*n_microbatches=6 < 4 x 2 = 8"):
        config("dualpipev", gbs=6, v=2)
    with pytest.raises(ConfigError, match="n_microbatches=7 < 4 x 2 = 8"):
        S.simulate_schedule("dualpipev", 4, 7, 2)


# ---------------------------------------------------------------------------- the trainer
def test_the_bundled_trainer_refuses_what_torch_refuses_in_one_line():
    cfg = config("1f1b")
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("global_batch_size / (micro_batch_size x dp) = 2 / (1 x 1) = 2 micro-batches: ")
    assert "n_microbatches=2 < pp=4" in message and "use pp_schedule=gpipe" in message
    assert unsupported(config("gpipe")) == [] and unsupported(config("1f1b", gbs=8)) == []
    (why,) = unsupported(config("zero-bubble", gbs=9, v=2))
    assert "n_microbatches=9" in why and "9 % 2 = 1" in why


# ---------------------------------------------------------------------------- the simulation
def test_1f1b_with_fewer_microbatches_than_stages_is_gpipe():
    """Equal stages: GPipe's step exactly, (m + p - 1)(f + b). With unequal stages or p2p time
    the last ranks' B-before-F order (Megatron's, and 1F1B's with m >= p alike) shifts it a little."""
    for p in range(2, 9):
        for m in range(1, p):
            one, gpipe = S.simulate_schedule("1f1b", p, m), S.simulate_schedule("gpipe", p, m)
            assert one.step_time == gpipe.step_time == (m + p - 1) * 3, (p, m)
            assert one.bubble_fraction == pytest.approx(gpipe.bubble_fraction, rel=1e-12)
            assert one.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
            times = [(1.0 + 0.3 * s, 2.0 + 0.1 * (s % 3)) for s in range(p)]
            one = S.simulate_schedule("1f1b", p, m, 1, times, p2p_time=0.2)  # no deadlock
            assert one.step_time >= sum(f + b for f, b in times) + m - 1
            # warm-up cut to m: stage s holds min(p - s, m) micro-batches, GPipe's m where p - s >= m
            assert one.peak_in_flight == tuple(min(p - s, m) for s in range(p))
            for r, order in S.schedule_order("1f1b", p, m).items():
                warmup = next(i for i, (kind, _, _) in enumerate(order) if kind == "B")
                assert warmup == min(m, p - r)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zero-bubble"])
def test_rounds_torch_refuses_simulate_every_action_once_without_deadlock(name):
    cases = 0
    for p in (2, 3, 4, 5, 6):
        for v in (1, 2, 3):
            for m in range(p, 5 * p):
                if not schedules.torch_schedule_limits(name, p, m, v):
                    continue
                cases += 1
                times = [(1.0 + 0.2 * (s % 3), 2.0 + 0.1 * s, 1.0) for s in range(p * v)]
                res = S.simulate_schedule(name, p, m, v, times, p2p_time=0.3)  # raises on a deadlock
                backward = "I" if name == "zero-bubble" else "B"
                for r, order in S.schedule_order(name, p, m, v).items():
                    mine = sorted((c * p + r, mb) for c in range(v) for mb in range(m))
                    for kind in ("F", backward) + (("W",) if name == "zero-bubble" else ()):
                        assert sorted((s, mb) for k, s, mb in order if k == kind) == mine, (name, p, m, v, kind)
                if name == "interleaved-1f1b":  # Megatron's bubble, exactly, as in torch's own rounds
                    assert S.simulate_schedule(name, p, m, v).bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-12)
                assert res.step_time > 0
    assert cases >= 20


def test_round_size_is_torchs_or_the_smallest_megatron_core_accepts():
    for p in range(2, 9):
        for m in range(1, 8 * p):
            g = schedules.round_size(p, m)
            rounds = max(1, m // p)
            if m % rounds == 0:
                assert g == m // rounds
            else:
                ok = [x for x in range(p, m + 1) if m % x == 0 or m % x >= p]
                assert g == ok[0], (p, m)
    assert schedules.round_size(4, 9) == 5 and schedules.round_size(4, 11) == 6


# ---------------------------------------------------------------------------- the command line
def test_plan_command_prints_the_note_after_the_prediction():
    result = CliRunner().invoke(main, ["plan", "--model", "llama3-8b", "--nodes", "1", "--seq", "4096", "--gbs", "4",
                                       "--top", "40"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    notes = [i for i, line in enumerate(lines) if line.startswith("note: ")]
    assert notes, result.output
    assert "torch.distributed.pipelining refuses it" in lines[notes[0]]
    # under the candidate it belongs to: after its summary, before the next one
    head = max(i for i in range(notes[0]) if lines[i].startswith("#"))
    assert "1f1b" in lines[head]


def test_train_command_refuses_it_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["train", "--model", "tiny", "--plan", "pp=4", "--gbs", "4",
                                       "--runs", str(tmp_path)])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.splitlines() == [err]
    assert err.startswith("error: global_batch_size / (micro_batch_size x dp) = 4 / (2 x 1) = 2 micro-batches: ")
    assert "n_microbatches=2 < pp=4" in err
    assert list(tmp_path.iterdir()) == []  # no run directory, no process
