"""Balanced stages: measured layer costs split the pipeline; planner and trainer agree on it."""

from dataclasses import replace

from workbench import ModelSpec, estimate_memory
from workbench.launch.local import config_from_cli
from workbench.trainer.pipeline import stage_layers
from workbench.trainer.profile import LayerCosts, balance_stages, profile_layer_costs


def test_profile_measures_every_layer():
    config = config_from_cli("tiny", "pp=2", 2)
    costs = profile_layer_costs(config, repeats=2)
    assert len(costs.layers) == 4 and all(c > 0 for c in costs.layers)
    assert costs.embedding > 0 and costs.output > 0


def test_balanced_split_is_shared_by_planner_and_trainer():
    config = config_from_cli("tiny", "pp=2", 2)
    # An output layer as costly as three blocks pushes blocks to the first stage.
    balanced = balance_stages(config, LayerCosts(layers=(1.0, 1.0, 1.0, 1.0), embedding=0.0, output=2.0))
    assert balanced.plan.stage_layers == (3, 1)
    assert balanced.plan.stage_layer_counts(4) == (3, 1)
    bill = estimate_memory(balanced)
    even = estimate_memory(config)
    # the planner sees three blocks on stage 0 now
    assert bill.per_stage[0].components["parameters"] > even.per_stage[0].components["parameters"]
    # and the trainer builds the same stages
    assert [list(x) for x in stage_layers(balanced.plan, 4)] == [[0, 1, 2], [3]]


def test_no_pipeline_no_change():
    config = config_from_cli("tiny", "dp_shard=2", 2)
    assert balance_stages(config, LayerCosts((1.0,) * 4, 0.0, 0.0)) is config
