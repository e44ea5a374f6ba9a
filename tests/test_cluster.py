"""Cluster presets, link tiers, calibration and JSON round-trip."""

import pytest

from workbench import Calibration, Cluster, ConfigError
from workbench.spec.cluster import LinkCalibration, LinkSpec


@pytest.mark.parametrize("name", ["dgx-h100", "dgx-h200", "dgx-a100", "pcie-l40s", "local-cpu"])
def test_presets_round_trip(name):
    c = Cluster.preset(name, nodes=3)
    assert c.nodes == 3 and c.name == name
    assert Cluster.from_json(c.to_json()) == c


def test_datasheet_figures():
    h100 = Cluster.preset("dgx-h100", nodes=2)
    assert h100.world_size == 16
    assert h100.gpu.bf16_flops == 989.4e12 and h100.gpu.peak_flops("fp8") == 1978.9e12
    assert h100.intra_node.bandwidth_bytes_per_s == 450e9 and h100.inter_node.bandwidth_bytes_per_s == 50e9
    a100 = Cluster.preset("dgx-a100")
    with pytest.raises(ConfigError, match="has no fp8 tensor cores"):
        a100.gpu.peak_flops("fp8")
    local = Cluster.preset("local-cpu", nodes=2)
    assert local.world_size == 4 and local.gpus_per_node == 2


def test_tiers():
    c = Cluster.preset("dgx-h100", nodes=4, nodes_per_leaf=2, spine=LinkSpec("spine", 25e9, 10e-6))
    assert c.tier_between([0, 7]) == "intra_node"
    assert c.tier_between([0, 8]) == "inter_node"
    assert c.tier_between([0, 16]) == "inter_leaf"
    assert c.link("inter_leaf").bandwidth_bytes_per_s == 25e9


def test_calibration_round_trip_and_lookup():
    cal = Calibration(links={"intra_node": {"all_reduce": LinkCalibration(380e9, 12e-6)}},
                      flops_per_s={"bf16": 720e12}, source="bench 2026-11-29")
    c = Cluster.preset("dgx-h100", calibration=cal)
    again = Cluster.from_json(c.to_json())
    assert again.calibration.link("intra_node", "all_reduce").bandwidth_bytes_per_s == 380e9
    assert again.achieved_flops("bf16") == 720e12 and again.achieved_flops("fp8") is None
    assert again.calibration.link("inter_node", "all_reduce") is None


def test_bad_clusters():
    with pytest.raises(ConfigError, match="cluster='dgx-b900' is not a preset; presets: dgx-h100"):
        Cluster.preset("dgx-b900")
    with pytest.raises(ConfigError, match="nodes=0 must be >= 1"):
        Cluster.preset("dgx-h100", nodes=0)
    with pytest.raises(ConfigError, match="nodes_per_leaf is set but no spine link"):
        Cluster.preset("dgx-h100", nodes_per_leaf=2)
