"""The cluster a plan is priced on: per-mesh-axis links, device FLOP/s and memory.

Every constant carries its source. Bandwidths are bytes/s per device in one direction, the
``β⁻¹`` of the α-β model; latencies are the ``α`` of one collective step.

References:
  NVIDIA H100 SXM5 datasheet (2023): NVLink 4 at 900 GB/s bidirectional per GPU (450 GB/s
    per direction); 989 TFLOP/s dense BF16, 494 TFLOP/s dense TF32; 80 GB HBM3.
  NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s = 50 GB/s per port, one per GPU in
    a DGX H100.
  PaddlePaddle ``auto_parallel/static/cost/comm_op_cost.py``: ring latencies 3.4 µs intra-node
    (NVLink) and 9.6 µs inter-node.
  PCI-SIG PCIe 5.0 specification: 32 GT/s per lane, x16 ~ 64 GB/s per direction (the H100
    SXM host link).
  Dubey et al., "The Llama 3 Herd of Models" (2024) §3.3.1: H100 servers of 8 GPUs on
    NVLink, 400 Gb/s per GPU between servers; a pod of 3,072 GPUs has full bisection
    bandwidth, and pods are joined by an aggregation layer with an oversubscription ratio
    of 1:7, so a GPU's share of the link across pods is 1/7 of its in-pod link.
  Google Cloud TPU v4 documentation: 275 TFLOP/s BF16, 32 GiB HBM, ICI ~ 45 GB/s per link
    per direction (TPU v4 paper, Jouppi et al. ISCA'23).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

NVLINK_BW = 450e9  # H100 NVLink 4, per direction per GPU
NVLINK_LAT = 3.4e-6  # PaddlePaddle intra-node ring latency
IB_BW = 50e9  # NDR InfiniBand, one 400 Gb/s port per GPU
IB_LAT = 9.6e-6  # PaddlePaddle inter-node ring latency
CROSS_POD_BW = IB_BW / 7  # Llama 3: the per-GPU link, oversubscribed 1:7 between pods
# PaddlePaddle's inter-node latency: no published figure separates the aggregation layer's
# extra switch hops from the end points' software latency
CROSS_POD_LAT = IB_LAT
H100_TF32_FLOPS = 494e12
H100_MEMORY = 80 * 2**30
PCIE5_BW = 64e9  # PCIe 5.0 x16, per direction: host -> device feed of the batch
TPU_V4_ICI_BW = 45e9
TPU_V4_FLOPS = 275e12
TPU_V4_MEMORY = 32 * 2**30


@dataclass(frozen=True)
class Cluster:
    """α-β links per mesh axis plus device compute and memory.

    ``axis_bandwidth`` / ``axis_latency`` map mesh axis names to bytes/s per device and
    seconds. An axis missing from the maps uses ``default_bandwidth`` / ``default_latency``
    (an NVLink link by default). ``utilization`` is the fraction of ``device_flops`` that
    real kernels reach (PaddlePaddle's cost model uses the same factor). ``host_bandwidth``
    prices feeding inputs that are not carried from step to step (the batch) to devices.
    """

    axis_bandwidth: Mapping[str, float] = field(default_factory=dict)
    axis_latency: Mapping[str, float] = field(default_factory=dict)
    device_flops: float = H100_TF32_FLOPS
    device_memory: float = H100_MEMORY
    utilization: float = 0.5
    host_bandwidth: float = PCIE5_BW
    default_bandwidth: float = NVLINK_BW
    default_latency: float = NVLINK_LAT

    def __post_init__(self):
        for name in ("axis_bandwidth", "axis_latency"):
            object.__setattr__(self, name, dict(sorted(dict(getattr(self, name)).items())))
        positive = {**{f"axis_bandwidth[{a!r}]": v for a, v in self.axis_bandwidth.items()},
                    "default_bandwidth": self.default_bandwidth,
                    "device_flops": self.device_flops, "device_memory": self.device_memory,
                    "host_bandwidth": self.host_bandwidth}
        for k, v in positive.items():
            if not _number(v) or not v > 0:
                raise ValueError(f"Cluster: {k} must be positive (a number of bytes/s, FLOP/s "
                                 f"or bytes), got {v!r}")
        latencies = {**{f"axis_latency[{a!r}]": v for a, v in self.axis_latency.items()},
                     "default_latency": self.default_latency}
        for k, v in latencies.items():
            if not _number(v) or not v >= 0:
                raise ValueError(f"Cluster: {k} must be seconds >= 0, got {v!r}")
        if not _number(self.utilization) or not 0 < self.utilization <= 1:
            raise ValueError(f"Cluster: utilization is the share of device_flops that kernels "
                             f"reach, in (0, 1]; got {self.utilization!r} (0.5 is typical)")

    def __hash__(self):
        return hash(self.key())

    def key(self) -> tuple:
        return (tuple(self.axis_bandwidth.items()), tuple(self.axis_latency.items()),
                self.device_flops, self.device_memory, self.utilization, self.host_bandwidth,
                self.default_bandwidth, self.default_latency)

    def bandwidth(self, axis: str) -> float:
        return self.axis_bandwidth.get(axis, self.default_bandwidth)

    def latency(self, axis: str) -> float:
        return self.axis_latency.get(axis, self.default_latency)

    def check_axes(self, axis_names: Sequence[str]) -> None:
        unknown = set(self.axis_bandwidth) | set(self.axis_latency)
        unknown -= set(axis_names)
        if unknown:
            raise ValueError(
                f"Cluster names mesh axes {sorted(unknown)} that the mesh {list(axis_names)} "
                "does not have; key axis_bandwidth/axis_latency by the mesh's axis names"
            )

    def to_json(self) -> dict:
        return {"axis_bandwidth": dict(self.axis_bandwidth),
                "axis_latency": dict(self.axis_latency),
                "device_flops": self.device_flops, "device_memory": self.device_memory,
                "utilization": self.utilization, "host_bandwidth": self.host_bandwidth,
                "default_bandwidth": self.default_bandwidth,
                "default_latency": self.default_latency}

    @classmethod
    def from_json(cls, d: Mapping) -> Cluster:
        return cls(**d)

    @classmethod
    def calibrate(cls, mesh, options=None):
        """Measure the devices of ``mesh``: α and bandwidth per mesh axis from timed
        all-reduces, all-gathers and all-to-alls, achievable FLOP/s from a matmul. Returns
        ``(cluster, calibration)``: the Cluster, and the fit behind it
        (:class:`shardc.cost.calibrate.Calibration`, ``.report()`` prints it). ``options``:
        a :class:`shardc.cost.calibrate.CalibrateOptions`."""
        from shardc.cost.calibrate import calibrate

        return calibrate(mesh, options)

    # ---- presets -----------------------------------------------------------------------
    @classmethod
    def nvlink_node(cls, axis_names: Sequence[str] = ("gpu",)) -> Cluster:
        """One 8-GPU H100 node: every mesh axis runs over NVLink."""
        return cls({a: NVLINK_BW for a in axis_names}, {a: NVLINK_LAT for a in axis_names})

    @classmethod
    def multi_node(cls, node_axis: str = "node", gpu_axis: str = "gpu") -> Cluster:
        """H100 nodes joined by NDR InfiniBand: ``node_axis`` over IB, ``gpu_axis`` NVLink."""
        return cls({node_axis: IB_BW, gpu_axis: NVLINK_BW},
                   {node_axis: IB_LAT, gpu_axis: NVLINK_LAT})

    @classmethod
    def multi_pod(cls, pod_axis: str = "pod", node_axis: str = "node",
                  gpu_axis: str = "gpu") -> Cluster:
        """Pods of H100 nodes: ``gpu_axis`` over NVLink within a node, ``node_axis`` over NDR
        InfiniBand within a pod (full bisection bandwidth), ``pod_axis`` across pods over
        the 1:7 oversubscribed aggregation layer (64 nodes of 8 GPUs in pods of 16 nodes:
        the mesh ``(pod=4, node=16, gpu=8)``)."""
        return cls({pod_axis: CROSS_POD_BW, node_axis: IB_BW, gpu_axis: NVLINK_BW},
                   {pod_axis: CROSS_POD_LAT, node_axis: IB_LAT, gpu_axis: NVLINK_LAT})

    @classmethod
    def tpu_v4(cls, axis_names: Sequence[str] = ("x", "y")) -> Cluster:
        return cls({a: TPU_V4_ICI_BW for a in axis_names}, {a: 1e-6 for a in axis_names},
                   device_flops=TPU_V4_FLOPS, device_memory=TPU_V4_MEMORY)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


DEFAULT_CLUSTER = Cluster()
