"""On what machines: :class:`Cluster` (nodes x GPUs, links, calibration) and its presets.

Bandwidths are bytes per second *per GPU, each way* (what one GPU can push into the fabric while
receiving as much), latencies are seconds. A cluster has up to three link tiers:

* ``intra_node``: NVLink/NVSwitch or PCIe between GPUs of one node;
* ``inter_node``: the scale-out network between nodes under one leaf switch;
* ``inter_leaf``: across leaf switches, when ``nodes_per_leaf`` is set (``spine`` link).

A :class:`Calibration` holds what the cluster benchmarks measured (achieved bandwidth and latency
per tier and collective, achieved FLOP/s per dtype); when present it overrides the peak figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from workbench.spec.errors import ConfigError, check_choice, check_int, check_positive, require
from workbench.spec.fields import check_types, from_mapping
from workbench.spec.files import parse_json

GiB = 1 << 30
TIERS = ("intra_node", "inter_node", "inter_leaf")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = ("bf16", "fp16", "fp8", "fp32")

# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384
# H100s (2,048 nodes of 8) => one per node every 54 * 2048 / 419 = 264 days.
DEFAULT_NODE_MTBF_S = 54 * 24 * 3600 * 2048 / 419


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: memory and dense (non-sparse) peak throughput."""

    name: str
    hbm_bytes: int
    bf16_flops: float  # dense peak FLOP/s
    fp8_flops: float = 0.0  # 0: no fp8 tensor cores
    fp32_flops: float = 0.0  # 0: unknown (taken as bf16_flops / 2 where needed)
    hbm_bandwidth_bytes_per_s: float = 0.0
    # The CUDA context, cuBLAS/NCCL workspaces and kernels loaded: memory the allocator never
    # sees. ~0.5-1 GiB on Hopper with NCCL; measure with nvidia-smi minus torch's reserved bytes.
    context_bytes: int = 0

    def __post_init__(self) -> None:
        check_types(self, "gpu.")
        check_int("gpu.hbm_bytes", self.hbm_bytes)
        check_positive("gpu.bf16_flops", self.bf16_flops)
        check_positive("gpu.fp8_flops", self.fp8_flops, allow_zero=True)
        check_positive("gpu.fp32_flops", self.fp32_flops, allow_zero=True)
        check_positive("gpu.hbm_bandwidth_bytes_per_s", self.hbm_bandwidth_bytes_per_s, allow_zero=True)
        check_int("gpu.context_bytes", self.context_bytes, minimum=0)
        require(self.context_bytes < self.hbm_bytes, f"gpu.context_bytes={self.context_bytes} must be less than "
                f"gpu.hbm_bytes={self.hbm_bytes}", field="gpu.context_bytes", value=self.context_bytes)

    def peak_flops(self, dtype: str) -> float:
        if dtype in ("bf16", "fp16"):
            return self.bf16_flops
        if dtype == "fp8":
            require(self.fp8_flops > 0, f"gpu={self.name} has no fp8 tensor cores", field="dtype", value=dtype)
            return self.fp8_flops
        if dtype == "fp32":
            return self.fp32_flops or self.bf16_flops / 2
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}", field="dtype", value=dtype)


@dataclass(frozen=True)
class LinkSpec:
    """A link tier: per-GPU bandwidth each way and one-hop latency."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        check_types(self, "link.")
        check_positive(f"{self.name}.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_positive(f"{self.name}.latency_s", self.latency_s, allow_zero=True)


@dataclass(frozen=True)
class LinkCalibration:
    """Fitted alpha-beta model of one collective on one tier: t = latency_s + bytes / bandwidth."""

    bandwidth_bytes_per_s: float  # bus bandwidth (nccl-tests convention)
    latency_s: float

    def __post_init__(self) -> None:
        check_types(self, "calibration.")
        check_positive("calibration.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_positive("calibration.latency_s", self.latency_s, allow_zero=True)


@dataclass(frozen=True)
class Calibration:
    """Measured figures that replace the datasheet ones.

    ``links[tier][collective]`` and ``flops_per_s[dtype]`` (achieved dense matmul FLOP/s).
    """

    links: Mapping[str, Mapping[str, LinkCalibration]] = field(default_factory=dict)
    flops_per_s: Mapping[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        check_types(self, "calibration.")
        for tier, by_op in self.links.items():
            check_choice("calibration.links tier", tier, TIERS)
            require(isinstance(by_op, Mapping), f"calibration.links[{tier!r}] must be an object",
                    field="calibration.links", value=by_op)
            for op, fit in by_op.items():
                check_choice(f"calibration.links[{tier!r}] collective", op, COLLECTIVES)
                require(isinstance(fit, LinkCalibration), f"calibration.links[{tier!r}][{op!r}]={fit!r} must be "
                        "a fit {bandwidth_bytes_per_s, latency_s}", field="calibration.links", value=fit)
        for dtype, rate in self.flops_per_s.items():
            check_choice("calibration.flops_per_s dtype", dtype, DTYPES)
            check_positive(f"calibration.flops_per_s[{dtype!r}]", rate)

    def link(self, tier: str, collective: str) -> LinkCalibration | None:
        return self.links.get(tier, {}).get(collective)

    def to_dict(self) -> dict[str, Any]:
        return {
            "links": {t: {c: asdict(v) for c, v in cs.items()} for t, cs in self.links.items()},
            "flops_per_s": dict(self.flops_per_s),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        def links(raw: Any) -> dict[str, dict[str, LinkCalibration]]:
            require(isinstance(raw, Mapping), "calibration.links must be an object", field="calibration.links")
            out: dict[str, dict[str, LinkCalibration]] = {}
            for tier, by_op in raw.items():
                require(isinstance(by_op, Mapping), f"calibration.links[{tier!r}] must be an object",
                        field="calibration.links")
                out[tier] = {op: from_mapping(LinkCalibration, v, f"calibration.links[{tier!r}][{op!r}]")
                             for op, v in by_op.items()}
            return out

        return from_mapping(cls, data, "calibration", {"links": links})


@dataclass(frozen=True)
class Cluster:
    """Nodes x GPUs per node, the GPU, and the links between them."""

    nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    nodes_per_leaf: int | None = None  # None: one non-blocking switch tier
    spine: LinkSpec | None = None  # link across leaf switches (used when nodes_per_leaf is set)
    node_mtbf_s: float = DEFAULT_NODE_MTBF_S
    calibration: Calibration | None = None
    name: str = ""

    def __post_init__(self) -> None:
        check_types(self)
        check_int("nodes", self.nodes, maximum=1 << 20)
        check_int("gpus_per_node", self.gpus_per_node, maximum=1 << 10)
        check_positive("node_mtbf_s", self.node_mtbf_s)
        if self.nodes_per_leaf is not None:
            check_int("nodes_per_leaf", self.nodes_per_leaf)
            require(self.spine is not None, "nodes_per_leaf is set but no spine link is given", field="spine")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self, tier: str) -> LinkSpec:
        if tier == "intra_node":
            return self.intra_node
        if tier == "inter_node":
            return self.inter_node
        if tier == "inter_leaf":
            return self.spine or self.inter_node
        raise ConfigError(f"tier={tier!r} is not one of {', '.join(TIERS)}", field="tier", value=tier)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def leaf_of(self, rank: int) -> int:
        return self.node_of(rank) // self.nodes_per_leaf if self.nodes_per_leaf else 0

    def tier_between(self, ranks: list[int] | tuple[int, ...]) -> str:
        """The slowest tier a group of ranks spans."""
        nodes = {r // self.gpus_per_node for r in ranks}
        if len(nodes) <= 1:
            return "intra_node"
        if self.nodes_per_leaf and len({n // self.nodes_per_leaf for n in nodes}) > 1:
            return "inter_leaf"
        return "inter_node"

    def achieved_flops(self, dtype: str) -> float | None:
        """Measured matmul FLOP/s for ``dtype`` if calibrated, else None."""
        if self.calibration and dtype in self.calibration.flops_per_s:
            return self.calibration.flops_per_s[dtype]
        return None

    # ------------------------------------------------------------------ presets and JSON
    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, nodes: int = 1, **overrides: Any) -> "Cluster":
        if not isinstance(name, str) or name not in _PRESETS:
            raise ConfigError(
                f"cluster={name!r} is not a preset; presets: {', '.join(_PRESETS)}", field="cluster", value=name
            )
        return replace(_PRESETS[name], nodes=nodes, name=name, **overrides)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calibration"] = self.calibration.to_dict() if self.calibration else None
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cluster":
        def link(where: str) -> Any:
            return lambda v: from_mapping(LinkSpec, v, f"cluster.{where}")

        return from_mapping(cls, data, "cluster", {
            "gpu": lambda v: from_mapping(GPUSpec, v, "cluster.gpu"),
            "intra_node": link("intra_node"), "inter_node": link("inter_node"), "spine": link("spine"),
            "calibration": Calibration.from_dict,
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        return cls.from_dict(parse_json(text, "cluster"))


# GPUs. Dense peaks from NVIDIA datasheets (the sparse figures are 2x these).
GPUS: dict[str, GPUSpec] = {
    # H100 SXM5 80 GB: 989.4 TFLOP/s bf16 dense, 1978.9 fp8, 3.35 TB/s HBM3 (H100 datasheet)
    "h100-80gb": GPUSpec("h100-80gb", 80 * GiB, 989.4e12, 1978.9e12, 66.9e12, 3.35e12, context_bytes=GiB // 2),
    # H200 SXM 141 GB: same tensor cores as H100, 4.8 TB/s HBM3e (H200 datasheet)
    "h200-141gb": GPUSpec("h200-141gb", 141 * 10**9, 989.4e12, 1978.9e12, 66.9e12, 4.8e12, context_bytes=GiB // 2),
    # A100 SXM4 80 GB: 312 TFLOP/s bf16 dense, no fp8, 2.039 TB/s (A100 datasheet)
    "a100-80gb": GPUSpec("a100-80gb", 80 * GiB, 312e12, 0.0, 19.5e12, 2.039e12, context_bytes=GiB // 2),
    # L40S 48 GB GDDR6: 362.05 TFLOP/s bf16 dense, 733 fp8 dense, 864 GB/s (L40S datasheet)
    "l40s-48gb": GPUSpec("l40s-48gb", 48 * GiB, 362.05e12, 733e12, 91.6e12, 864e9, context_bytes=GiB // 2),
    # A CPU process of the bundled trainer: a 4 GiB budget per rank; FLOP/s of one AVX2 core in
    # fp32 (the trainer runs fp32 on CPU). Rough on purpose: `workbench calibrate` measures it.
    "cpu": GPUSpec("cpu", 4 * GiB, 20e9, 0.0, 20e9, 10e9, context_bytes=0),
}

_NVLINK4 = LinkSpec("nvlink4", 450e9, 3e-6)  # 900 GB/s bidirectional per GPU through NVSwitch
_NVLINK3 = LinkSpec("nvlink3", 300e9, 3e-6)  # 600 GB/s bidirectional per GPU (A100)
_NDR400 = LinkSpec("ib-ndr400", 50e9, 5e-6)  # one 400 Gb/s ConnectX-7 per GPU (DGX H100/H200)
_HDR200 = LinkSpec("ib-hdr200", 25e9, 5e-6)  # one 200 Gb/s ConnectX-6 per GPU (DGX A100)
_PCIE4 = LinkSpec("pcie4", 32e9, 5e-6)  # PCIe Gen4 x16, ~32 GB/s each way, no NVLink on L40S
_ETH_L40S = LinkSpec("eth-200g", 12.5e9, 10e-6)  # assumed: 4 x 200 GbE per 8-GPU L40S server
_LOOPBACK = LinkSpec("gloo-loopback", 2e9, 50e-6)  # gloo over TCP loopback between processes

_PRESETS: dict[str, Cluster] = {
    # NVIDIA DGX H100: 8 x H100 SXM, NVLink4 via 4 NVSwitches, 8 x 400 Gb/s InfiniBand NDR.
    "dgx-h100": Cluster(1, 8, GPUS["h100-80gb"], _NVLINK4, _NDR400),
    # NVIDIA DGX H200: as DGX H100 with H200 GPUs.
    "dgx-h200": Cluster(1, 8, GPUS["h200-141gb"], _NVLINK4, _NDR400),
    # NVIDIA DGX A100: 8 x A100 SXM, NVLink3 via 6 NVSwitches, 8 x 200 Gb/s InfiniBand HDR.
    "dgx-a100": Cluster(1, 8, GPUS["a100-80gb"], _NVLINK3, _HDR200),
    # 8 x L40S PCIe server (no NVLink): GPUs talk over PCIe Gen4; Ethernet between nodes.
    "pcie-l40s": Cluster(1, 8, GPUS["l40s-48gb"], _PCIE4, _ETH_L40S),
    # Processes on this machine standing in for GPUs: 2 ranks per "node", gloo over loopback.
    "local-cpu": Cluster(1, 2, GPUS["cpu"], _LOOPBACK, _LOOPBACK),
}
