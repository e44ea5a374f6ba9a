"""The Launch tab offers the slurm backend: its fields, checked as the CLI checks them
(``SlurmRequest``), shown only for slurm, a bad value one escaped line in the view and no launch.

Widget-level, no browser and no process: ``launch`` is replaced by a recorder that raises, so a
call is seen and nothing starts (tests/test_launch_slurm.py runs the real backend).
"""

from __future__ import annotations

import asyncio

import pytest

from workbench import ConfigError, ModelSpec
from workbench.launch import handle
from workbench.launch.slurm_options import SlurmRequest
from workbench.spec.config import build_run_config

from widgets import launch_view
from widgets.launch_view import LaunchView, backend_options, blockers
from widgets.markup import escape
from widgets.state import PlanState


def slurm(**fields: str) -> dict:
    return backend_options("slurm", "", "", "", **fields)


# ---------------------------------------------------------------------------- the options
def test_the_backends_come_from_the_launcher():
    assert launch_view.BACKENDS is handle.BACKENDS and "slurm" in launch_view.BACKENDS
    assert LaunchView.param.backend.objects == list(handle.BACKENDS)


def test_good_slurm_values_are_the_launch_keywords():
    got = slurm(partition=" gpu,debug ", account="ml", time_limit="1:00:00",
                extra_sbatch="  --qos=high\t--constraint=h100 --exclusive ")
    assert got == {"partition": "gpu,debug", "account": "ml", "time_limit": "1:00:00",
                   "extra_sbatch": ["--qos=high", "--constraint=h100", "--exclusive"]}
    assert got == SlurmRequest("gpu,debug", "ml", "1:00:00", ("--qos=high", "--constraint=h100",
                                                              "--exclusive")).to_dict()
    # empty fields: Slurm's defaults
    assert slurm() == {"partition": None, "account": None, "time_limit": None, "extra_sbatch": []}
    # the other backends ignore them, and old positional callers still work
    assert backend_options("ssh", "a b", "", "", partition="-x") == {"hosts": ["a", "b"]}
    assert backend_options("local", "", "", "") == {}


@pytest.mark.parametrize("fields, field, value", [
    (dict(time_limit="1:75"), "time_limit", "1:75"),
    (dict(partition="-x"), "partition", "-x"),
    (dict(account="a b"), "account", "a b"),
    (dict(extra_sbatch="--qos=high --nodes=3"), "extra_sbatch", "--nodes=3"),
    (dict(extra_sbatch="-N 3"), "extra_sbatch", "-N"),
])
def test_a_bad_slurm_value_is_one_line_naming_the_field(fields, field, value):
    with pytest.raises(ConfigError) as e:
        slurm(**fields)
    message = str(e.value)
    assert (e.value.field, e.value.value) == (field, value)
    assert message.startswith(field) and repr(value) in message and "\n" not in message


def test_slurm_runs_elsewhere_so_this_machines_gpus_do_not_block_it():
    config = build_run_config("tiny", cluster="dgx-h100", nodes=2, plan={})
    assert [b.field for b in blockers(config, "local", gpus=0)] == ["cluster"]
    assert blockers(config, "slurm", gpus=0) == []


# ---------------------------------------------------------------------------- the view
@pytest.fixture
def view(tmp_path, monkeypatch):
    """A Launch tab on the default (trainable) plan whose ``launch`` records its calls and raises."""
    calls: list[tuple] = []

    def recorded(config, backend, **options):
        calls.append((backend, options))
        raise RuntimeError("recorded, not launched")

    monkeypatch.setattr(launch_view, "launch", recorded)
    v = LaunchView(PlanState())
    v.session.runs_root = str(tmp_path)
    v.calls = calls
    v.panel()
    return v


def shown(v: LaunchView) -> dict[str, bool]:
    boxes = {"hosts": v._hosts, "url": v._url, "token": v._token}
    boxes.update(zip(launch_view.SLURM_FIELDS, v._slurm))
    return {name: box.visible for name, box in boxes.items()}


def test_the_slurm_fields_show_only_for_slurm(view):
    slurm_fields = set(launch_view.SLURM_FIELDS)
    assert not any(shown(view).values())  # local: none
    view.backend = "slurm"
    assert {n for n, on in shown(view).items() if on} == slurm_fields
    labels = [box[0].label for box in view._slurm]
    assert labels == ["partition", "account", "time limit", "extra sbatch options"]
    assert view._slurm[2][0].placeholder == "1:00:00"
    row = next(o for o in view.panel().objects if view._backend in getattr(o, "objects", ()))
    assert all(box in row.objects for box in view._slurm)  # beside the backend selector
    view.backend = "ssh"
    assert {n for n, on in shown(view).items() if on} == {"hosts"}
    view.backend = "gateway"
    assert {n for n, on in shown(view).items() if on} == {"url", "token"}


def test_a_bad_slurm_value_is_shown_escaped_and_nothing_launches(view, tmp_path):
    view.param.update(backend="slurm", time_limit="1:75")
    asyncio.run(view._on_start())
    line = view._message.object
    assert 'data-testid="launch-error"' in line and escape("ConfigError: time_limit='1:75'") in line
    assert escape("time_limit='1:75'") in view._slurm[2][1].object and view._slurm[2][1].visible  # under its box
    assert view.calls == [] and not any(tmp_path.iterdir())

    view.param.update(partition="<b>x</b>", time_limit="1:00:00")
    asyncio.run(view._on_start())
    for html in (view._message.object, view._slurm[0][1].object):
        assert "partition=&#x27;&lt;b&gt;x&lt;/b&gt;&#x27;" in html and "<b>x</b>" not in html
    assert not view._slurm[2][1].visible  # the time limit's old error is cleared
    assert view.calls == [] and not any(tmp_path.iterdir())


def test_good_slurm_values_reach_launch(view):
    view.param.update(backend="slurm", partition="gpu", account="ml", time_limit="30",
                      extra_sbatch="--qos=high")
    asyncio.run(view._on_start())
    assert view.calls == [("slurm", {"run_root": view.session.runs_root, "partition": "gpu", "account": "ml",
                                     "time_limit": "30", "extra_sbatch": ["--qos=high"]})]
    assert "RuntimeError: recorded, not launched" in view._message.object  # the recorder's refusal, shown
