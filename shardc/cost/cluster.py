"""The cluster a plan is priced on: per-mesh-axis links, device FLOP/s and memory.

Every constant carries its source (docs/design-notes.md, "Sources of the cluster's
constants"). Each mesh axis has a link kind (``axis_link``: NVLink, PCIe, a network, a TPU
ICI axis), a bandwidth (bytes/s per device in one direction) and a latency (seconds: the
ring/Simple per-step latency NCCL's tables give that kind, and the ``α`` of the α-β
model). A collective is priced over the links its group crosses with the model
``collective_model`` names (:mod:`shardc.cost.collectives`: NCCL's own by default).
:meth:`Cluster.calibrate` measures one on the devices at hand instead
(:mod:`shardc.cost.calibrate` times and fits; :class:`Calibration` is the fit behind it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from shardc.cost.calibrate import FIT_MODELS, AxisFit, CalibrateOptions, measure
from shardc.cost.collectives import COLLECTIVE_MODELS, LINK_KINDS, Group, seconds
from shardc.cost.kernels import KERNEL_MODELS
from shardc.errors import MeshAxisError, OptionsError, closest

__all__ = ["Calibration", "Cluster", "CROSS_POD_BW", "CROSS_POD_LAT", "DEFAULT_CLUSTER",
           "ETH_BW", "ETH_LAT", "H100_MEMORY", "H100_TF32_FLOPS", "IB_BW", "IB_LAT",
           "LINK_ORDER", "NVLINK_BW", "NVLINK_LAT", "PCIE5_BW", "slowest_link", "TPU_V4_FLOPS",
           "TPU_V4_ICI_BW", "TPU_V4_MEMORY"]

NVLINK_BW = 450e9  # H100 NVLink 4, per direction per GPU
NVLINK_LAT = 3.4e-6  # NCCL hwLat: ring/Simple step on NVLink
IB_BW = 50e9  # NDR InfiniBand, one 400 Gb/s port per GPU
IB_LAT = 9.6e-6  # NCCL hwLat: ring/Simple step over the network
ETH_BW = 12.5e9  # 100 Gb/s Ethernet (RoCE), one port per GPU
ETH_LAT = IB_LAT  # NCCL's one network row: no separate figure for RoCE
CROSS_POD_BW = IB_BW / 7  # Llama 3: the per-GPU link, oversubscribed 1:7 between pods
# NCCL's network step latency: no published figure separates the aggregation layer's
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
    """Links per mesh axis plus device compute and memory.

    An axis missing from the ``axis_*`` maps uses the ``default_*`` link (NVLink). The GPU
    and TPU presets (:meth:`nvlink_node`, :meth:`multi_node`, :meth:`ethernet_nodes`,
    :meth:`multi_pod`, :meth:`tpu_v4`) set ``overlap``; a Cluster built by hand adds
    communication to compute unless it asks.

    Attributes:
        axis_bandwidth: Mesh axis name -> bytes/s per device, one direction.
        axis_latency: Mesh axis name -> seconds, the link's ring/Simple per-step latency.
        device_flops: FLOP/s per device.
        device_memory: Bytes per device.
        utilization: The share of ``device_flops`` real kernels reach, in (0, 1]; compute
            is FLOPs over ``device_flops * utilization`` unless ``kernels`` is set.
        host_bandwidth: Bytes/s of feeding the inputs not carried between steps (the
            batch) to the devices.
        default_bandwidth: The bandwidth of an axis ``axis_bandwidth`` leaves out.
        default_latency: The latency of an axis ``axis_latency`` leaves out.
        axis_link: Mesh axis name -> link kind: ``"nvlink"``, ``"pcie"``, ``"net"`` or
            ``"ici"``.
        axis_nodes: Mesh axis name -> the nodes it spans, where that is neither its size
            (a network axis) nor one (any other): a flattened view axis over nodes.
        default_link: The link kind of an axis ``axis_link`` leaves out.
        node_bandwidth: The bandwidth inside a node (with ``axis_nodes``).
        node_latency: The latency inside a node (with ``axis_nodes``).
        node_link: The link kind inside a node: ``"nvlink"`` or ``"pcie"``.
        collective_model: How a collective is priced: ``"nccl"`` (NCCL's tuning model),
            ``"ring"`` (every ring step paying its latency) or ``"alpha-beta"`` (one
            latency per collective); see :mod:`shardc.cost.collectives`.
        overlap: Rank candidate plans by their step with communication overlapped with
            compute (:func:`shardc.plan.overlap.ranking_time`), as XLA's latency-hiding
            scheduler runs them on GPUs and TPUs.
        kernels: A measured kernel model to price compute by (``"h100"``,
            :mod:`shardc.cost.kernels`); None prices FLOPs.

    Raises:
        ValueError: At construction, for a value out of its range (named in the message).
    """

    axis_bandwidth: Mapping[str, float] = field(default_factory=dict)
    axis_latency: Mapping[str, float] = field(default_factory=dict)
    device_flops: float = H100_TF32_FLOPS
    device_memory: float = H100_MEMORY
    utilization: float = 0.5
    host_bandwidth: float = PCIE5_BW
    default_bandwidth: float = NVLINK_BW
    default_latency: float = NVLINK_LAT
    axis_link: Mapping[str, str] = field(default_factory=dict)
    axis_nodes: Mapping[str, int] = field(default_factory=dict)
    default_link: str = "nvlink"
    node_bandwidth: float = NVLINK_BW
    node_latency: float = NVLINK_LAT
    node_link: str = "nvlink"
    collective_model: str = "nccl"
    overlap: bool = False
    kernels: str | None = None

    def __post_init__(self):
        """Sort the maps (a cluster's hash and JSON do not depend on their order); check."""
        for name in ("axis_bandwidth", "axis_latency", "axis_link", "axis_nodes"):
            object.__setattr__(self, name, dict(sorted(dict(getattr(self, name)).items())))
        positive = {**{f"axis_bandwidth[{a!r}]": v for a, v in self.axis_bandwidth.items()},
                    "default_bandwidth": self.default_bandwidth,
                    "node_bandwidth": self.node_bandwidth,
                    "device_flops": self.device_flops, "device_memory": self.device_memory,
                    "host_bandwidth": self.host_bandwidth}
        for k, v in positive.items():
            if not _number(v) or not v > 0:
                raise OptionsError(f"Cluster: {k} must be positive (a number of bytes/s, FLOP/s "
                                   f"or bytes), got {v!r}")
        latencies = {**{f"axis_latency[{a!r}]": v for a, v in self.axis_latency.items()},
                     "default_latency": self.default_latency,
                     "node_latency": self.node_latency}
        for k, v in latencies.items():
            if not _number(v) or not v >= 0:
                raise OptionsError(f"Cluster: {k} must be seconds >= 0, got {v!r}")
        links = {**{f"axis_link[{a!r}]": v for a, v in self.axis_link.items()},
                 "default_link": self.default_link, "node_link": self.node_link}
        for k, v in links.items():
            if v not in LINK_KINDS:
                raise OptionsError(f"Cluster: {k} must be one of {LINK_KINDS}, got {v!r}")
        if self.node_link in ("net", "ici"):
            raise OptionsError(f"Cluster: node_link is the link inside a node ('nvlink' or "
                               f"'pcie'), got {self.node_link!r}")
        for a, v in self.axis_nodes.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise OptionsError(f"Cluster: axis_nodes[{a!r}] must be a whole number of "
                                   f"nodes >= 1, got {v!r}")
        if self.kernels is not None and self.kernels not in KERNEL_MODELS:
            raise OptionsError(f"Cluster: kernels names a measured kernel model, one of "
                               f"{sorted(KERNEL_MODELS)}, or None to price compute as FLOPs "
                               f"over device_flops * utilization; got {self.kernels!r}")
        if not isinstance(self.overlap, bool):
            raise OptionsError(f"Cluster: overlap must be True or False, got {self.overlap!r}")
        if self.collective_model not in COLLECTIVE_MODELS:
            raise OptionsError(f"Cluster: collective_model must be one of {COLLECTIVE_MODELS}, "
                               f"got {self.collective_model!r}")
        if not _number(self.utilization) or not 0 < self.utilization <= 1:
            raise OptionsError(f"Cluster: utilization is the share of device_flops that kernels "
                               f"reach, in (0, 1]; got {self.utilization!r} (0.5 is typical)")

    def __hash__(self):
        """The hash of :meth:`key`."""
        return hash(self.key())

    def key(self) -> tuple:
        """Every field as a hashable tuple (what the cluster hashes and caches by)."""
        return (tuple(self.axis_bandwidth.items()), tuple(self.axis_latency.items()),
                self.device_flops, self.device_memory, self.utilization, self.host_bandwidth,
                self.default_bandwidth, self.default_latency, tuple(self.axis_link.items()),
                tuple(self.axis_nodes.items()), self.default_link, self.node_bandwidth,
                self.node_latency, self.node_link, self.collective_model, self.overlap,
                self.kernels)

    def bandwidth(self, axis: str) -> float:
        """Bytes/s per device along ``axis``."""
        return self.axis_bandwidth.get(axis, self.default_bandwidth)

    def latency(self, axis: str) -> float:
        """Seconds of a ring step along ``axis``."""
        return self.axis_latency.get(axis, self.default_latency)

    def link(self, axis: str) -> str:
        """The link kind of ``axis``."""
        return self.axis_link.get(axis, self.default_link)

    def nodes(self, axis: str, count: int) -> int:
        """Nodes that ``count`` devices along ``axis`` span.

        Args:
            axis: A mesh axis name.
            count: Devices along it.

        Returns:
            The node count, at least 1.
        """
        if axis in self.axis_nodes:
            return min(self.axis_nodes[axis], count)
        return count if self.link(axis) == "net" else 1

    def group(self, spans: Sequence[tuple[str, int]]) -> Group:
        """The device group of a collective over ``spans``.

        Args:
            spans: ``(axis, count)`` pairs: the group's devices take ``count`` positions
                along each axis.

        Returns:
            The :class:`~shardc.cost.collectives.Group`, priced over the links it crosses.
        """
        return _group(self, tuple((a, int(k)) for a, k in spans if k > 1))

    def collective_seconds(self, kind: str, spans: Sequence[tuple[str, int]], nbytes: float,
                           share: float = 1.0) -> float:
        """Seconds of one collective over ``spans``.

        Args:
            kind: The collective, e.g. ``"all-reduce"`` or ``"all-gather"``.
            spans: ``(axis, count)`` pairs, as for :meth:`group`.
            nbytes: NCCL's buffer bytes.
            share: The share of one latency charged (collectives XLA combines share one).

        Returns:
            Seconds under this cluster's ``collective_model``
            (:func:`shardc.cost.collectives.seconds`).
        """
        return seconds(kind, self.group(spans), float(nbytes), self.collective_model, share)

    def send_seconds(self, spans: Sequence[tuple[str, int]], nbytes: float) -> float:
        """Seconds of a collective-permute over ``spans``.

        Every device sends ``nbytes`` to one other (a pipeline's shift to the next stage):
        one NCCL send / receive, whose pairs on different nodes each cross one NIC, not the
        node's NICs together as a ring's channels do (:meth:`group`).

        Args:
            spans: ``(axis, count)`` pairs, as for :meth:`group`.
            nbytes: Bytes each device sends.

        Returns:
            Seconds under this cluster's ``collective_model``.
        """
        g = self.group(spans)
        if g.nodes > 1:
            one = min(self.bandwidth(a) for a, k in spans if k > 1 and self.link(a) == "net")
            g = dataclasses.replace(g, bandwidth=min(g.bandwidth, one))
        return seconds("collective-permute", g, float(nbytes), self.collective_model)

    def check_axes(self, axis_names: Sequence[str]) -> None:
        """Refuse a cluster that prices axes the mesh does not have.

        Args:
            axis_names: the mesh's axis names.

        Raises:
            MeshAxisError: naming each axis the mesh lacks and the mesh axis closest to it,
                or, where the cluster prices more axes than the mesh has (a multi-node
                preset on a one-axis mesh), the preset that fits the mesh.
        """
        named = (set(self.axis_bandwidth) | set(self.axis_latency) | set(self.axis_link)
                 | set(self.axis_nodes))
        unknown = sorted(named - set(axis_names))
        if not unknown:
            return
        names = list(axis_names)
        close = "".join(f"; {a!r}{closest(a, names)}" for a in unknown if closest(a, names))
        raise MeshAxisError(
            f"Cluster names mesh axes {unknown} that the mesh {names} does not have{close}; "
            "key axis_bandwidth/axis_latency/axis_link/axis_nodes by the mesh's axis names"
            f"{self._preset_hint(names) if not close else ''}")

    def _preset_hint(self, names: list[str]) -> str:
        """The preset that prices a mesh of ``names``, for :meth:`check_axes`."""
        if len(names) == 1:
            return (f", or use a preset for one axis: Cluster.nvlink_node({tuple(names)!r}) "
                    "(the devices of one node over NVLink; Cluster.multi_node() is for a "
                    "(node, gpu) mesh)")
        if "net" in self.axis_link.values():
            return (f", or name the preset's axes after the mesh's: Cluster.multi_node("
                    f"node_axis={names[0]!r}, gpu_axis={names[-1]!r})")
        return f", or use Cluster.nvlink_node({tuple(names)!r})"

    def to_json(self) -> dict:
        """The cluster as a JSON-ready dict (:meth:`from_json` reads it back)."""
        return {"axis_bandwidth": dict(self.axis_bandwidth),
                "axis_latency": dict(self.axis_latency),
                "device_flops": self.device_flops, "device_memory": self.device_memory,
                "utilization": self.utilization, "host_bandwidth": self.host_bandwidth,
                "default_bandwidth": self.default_bandwidth,
                "default_latency": self.default_latency,
                "axis_link": dict(self.axis_link), "axis_nodes": dict(self.axis_nodes),
                "default_link": self.default_link, "node_bandwidth": self.node_bandwidth,
                "node_latency": self.node_latency, "node_link": self.node_link,
                "collective_model": self.collective_model, "overlap": self.overlap,
                "kernels": self.kernels}

    @classmethod
    def from_json(cls, d: Mapping) -> Cluster:
        """The cluster :meth:`to_json` (or ``shardc calibrate``) wrote.

        Args:
            d: Its fields by name.

        Returns:
            The cluster, checked as at construction.
        """
        return cls(**d)

    @classmethod
    def calibrate(cls, mesh, options=None):
        """Measure the devices of ``mesh`` into a Cluster.

        α and bandwidth per mesh axis come from timed all-reduces, all-gathers and
        all-to-alls, achievable FLOP/s from a matmul (:func:`shardc.cost.calibrate.measure`).

        Args:
            mesh: A concrete mesh of the devices to measure.
            options: A :class:`shardc.cost.calibrate.CalibrateOptions`; None: its defaults.

        Returns:
            ``(cluster, calibration)``: the Cluster, keyed by the mesh's axis names, and the
            fit behind it (:class:`Calibration`; ``.report()`` prints it).
        """
        opts = options if options is not None else CalibrateOptions()
        model, fits, flops, memory, source = measure(mesh, opts)
        cluster = Cluster(axis_bandwidth={f.axis: f.bandwidth for f in fits},
                          axis_latency={f.axis: f.latency for f in fits},
                          device_flops=flops, device_memory=memory, utilization=1.0,
                          collective_model=model, kernels=None)
        return cluster, Calibration(cluster, tuple(fits), flops, source, opts)

    # ---- presets -----------------------------------------------------------------------
    @classmethod
    def nvlink_node(cls, axis_names: Sequence[str] | str = ("gpu",)) -> Cluster:
        """One 8-GPU H100 node: every mesh axis runs over NVLink.

        Args:
            axis_names: The mesh's axis names, or one axis's name.

        Returns:
            The cluster, with ``overlap`` set.
        """
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        return cls({a: NVLINK_BW for a in axis_names}, {a: NVLINK_LAT for a in axis_names},
                   axis_link={a: "nvlink" for a in axis_names}, overlap=True)

    @classmethod
    def multi_node(cls, node_axis: str = "node", gpu_axis: str = "gpu") -> Cluster:
        """H100 nodes joined by NDR InfiniBand.

        Args:
            node_axis: The mesh axis across nodes (InfiniBand, one port per GPU).
            gpu_axis: The mesh axis inside a node (NVLink).

        Returns:
            The cluster, with ``overlap`` set.
        """
        return cls({node_axis: IB_BW, gpu_axis: NVLINK_BW},
                   {node_axis: IB_LAT, gpu_axis: NVLINK_LAT},
                   axis_link={node_axis: "net", gpu_axis: "nvlink"}, overlap=True)

    @classmethod
    def ethernet_nodes(cls, node_axis: str = "node", gpu_axis: str = "gpu") -> Cluster:
        """H100 nodes joined by 100 Gb/s Ethernet, one port per GPU.

        Args:
            node_axis: The mesh axis across nodes (Ethernet: a quarter of NDR InfiniBand).
            gpu_axis: The mesh axis inside a node (NVLink).

        Returns:
            The cluster, with ``overlap`` set.
        """
        return cls({node_axis: ETH_BW, gpu_axis: NVLINK_BW},
                   {node_axis: ETH_LAT, gpu_axis: NVLINK_LAT},
                   axis_link={node_axis: "net", gpu_axis: "nvlink"}, overlap=True)

    @classmethod
    def multi_pod(cls, pod_axis: str = "pod", node_axis: str = "node",
                  gpu_axis: str = "gpu") -> Cluster:
        """Pods of H100 nodes: NVLink, InfiniBand and a cross-pod network.

        For example 64 nodes of 8 GPUs in pods of 16 nodes: the mesh
        ``(pod=4, node=16, gpu=8)``.

        Args:
            pod_axis: The mesh axis across pods (the 1:7 oversubscribed aggregation layer).
            node_axis: The mesh axis across a pod's nodes (NDR InfiniBand, full bisection
                bandwidth).
            gpu_axis: The mesh axis inside a node (NVLink).

        Returns:
            The cluster, with ``overlap`` set.
        """
        return cls({pod_axis: CROSS_POD_BW, node_axis: IB_BW, gpu_axis: NVLINK_BW},
                   {pod_axis: CROSS_POD_LAT, node_axis: IB_LAT, gpu_axis: NVLINK_LAT},
                   axis_link={pod_axis: "net", node_axis: "net", gpu_axis: "nvlink"},
                   overlap=True)

    @classmethod
    def tpu_v4(cls, axis_names: Sequence[str] | str = ("x", "y")) -> Cluster:
        """A TPU v4 slice: every mesh axis an ICI torus axis.

        Each hop costs 1 µs (Austin et al., "How to Scale Your Model", 2025).

        Args:
            axis_names: The mesh's axis names, or one axis's name.

        Returns:
            The cluster, with ``overlap`` set.
        """
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        return cls({a: TPU_V4_ICI_BW for a in axis_names}, {a: 1e-6 for a in axis_names},
                   device_flops=TPU_V4_FLOPS, device_memory=TPU_V4_MEMORY,
                   axis_link={a: "ici" for a in axis_names}, kernels=None, overlap=True)


@dataclass(frozen=True)
class Calibration:
    """What :meth:`Cluster.calibrate` measured and the fit behind its Cluster.

    Attributes:
        cluster: The calibrated cluster.
        axes: The fit of each mesh axis, with its samples and residuals.
        matmul_flops: FLOP/s per device of a float32 matmul.
        memory_source: Where ``device_memory`` came from.
        options: The options measured with.
    """

    cluster: Cluster
    axes: tuple[AxisFit, ...]
    matmul_flops: float  # per device, float32
    memory_source: str  # where device_memory came from
    options: CalibrateOptions

    def report(self) -> str:
        """The fit as a table: per axis its latency, bandwidth and goodness of fit."""
        model = self.cluster.collective_model
        latency = "α (µs)" if model == "alpha-beta" else "λ/step (µs)"
        lines = [f"collective model: {model} (the better fit of {', '.join(FIT_MODELS)})",
                 f"{'axis':<8}{'devices':>8}{latency:>12}"
                 f"{'bandwidth (GB/s)':>18}{'R²':>8}{'max |residual|':>16}"]
        for f in self.axes:
            lines.append(f"{f.axis:<8}{f.size:>8}{f.latency * 1e6:>12.2f}"
                         f"{f.bandwidth / 1e9:>18.3f}{f.r2:>8.4f}{f.max_residual:>16.1%}")
        lines.append(f"matmul {self.options.matmul_size}^3 float32: "
                     f"{self.matmul_flops / 1e9:.2f} GFLOP/s per device (utilization 1)")
        lines.append(f"device memory: {self.cluster.device_memory / 2**30:.2f} GiB "
                     f"({self.memory_source})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The calibration as a JSON-ready dict, samples included."""
        return {
            "cluster": self.cluster.to_json(),
            "axes": [{"axis": f.axis, "size": f.size, "model": f.model, "latency": f.latency,
                      "bandwidth": f.bandwidth, "r2": f.r2,
                      "samples": [[s.kind, s.message, s.wire, s.seconds] for s in f.samples],
                      "residuals": list(f.residuals)} for f in self.axes],
            "matmul_flops": self.matmul_flops,
            "memory_source": self.memory_source,
        }


#: link kinds, fastest first: a group or view axis over several runs at the slowest
LINK_ORDER = ("nvlink", "pcie", "ici", "net")


def slowest_link(kinds) -> str:
    """The slowest of the link kinds ``kinds`` (:data:`LINK_ORDER`)."""
    return max(kinds, key=LINK_ORDER.index)



@lru_cache(maxsize=1 << 14)
def _group(cluster: Cluster, spans: tuple[tuple[str, int], ...]) -> Group:
    ranks = math.prod(k for _, k in spans)
    nodes = math.prod(cluster.nodes(a, k) for a, k in spans)
    net = [a for a, _ in spans if cluster.link(a) == "net"]
    local = [a for a, _ in spans if cluster.link(a) != "net"]
    alpha = max((cluster.latency(a) for a, _ in spans), default=cluster.default_latency)
    if local:
        intra = slowest_link(cluster.link(a) for a in local)
        intra_bw = min(cluster.bandwidth(a) for a in local)
        intra_lat = max(cluster.latency(a) for a in local)
    else:
        intra, intra_bw, intra_lat = (cluster.node_link, cluster.node_bandwidth,
                                      cluster.node_latency)
    if not net or nodes <= 1:
        return Group(ranks, 1, intra, intra, intra_bw, alpha, intra_lat, intra_lat)
    inter_bw = min(cluster.bandwidth(a) for a in net)
    inter_lat = max(cluster.latency(a) for a in net)
    per_node = max(ranks // nodes, 1)
    return Group(ranks, nodes, intra, "net", min(intra_bw, per_node * inter_bw), alpha,
                 intra_lat, inter_lat)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


DEFAULT_CLUSTER = Cluster()
