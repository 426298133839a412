"""How long one collective takes: NCCL's own model, a pessimistic ring, or plain α-β.

A collective runs over a :class:`Group` of devices: ``ranks`` of them on ``nodes`` nodes,
joined within a node by an ``intra`` link and between nodes by an ``inter`` link (the link
kinds of :data:`LINK_KINDS`). Its time depends on the *buffer* NCCL is handed (``nBytes``:
an all-reduce's or all-to-all's per-device array, an all-gather's gathered result, a
reduce-scatter's input) and on the model the Cluster names (``Cluster.collective_model``):

``"nccl"`` (the default)
    NCCL's tuning model (``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``): every
    algorithm × protocol NCCL may run (ring and tree for all-reduce, ring for all-gather and
    reduce-scatter; LL, LL128 and Simple) is priced ``latency + nBytes / algorithm
    bandwidth`` and the cheapest one is what runs. Latency is the base latency of the
    (algorithm, protocol) plus a per-step hardware latency of the link each step crosses:
    a ring all-reduce takes ``2(n−1)`` steps (``2(nodes−1)`` of them between nodes), an
    all-gather or reduce-scatter ``n−1``; a tree ``2·((ranks per node − 1)·intra +
    log2(nodes)·inter)``. The bus bandwidth is scaled per protocol (ring LL 1/4 (1/3 for
    a single-node gather), LL128 0.92 (0.7 with one rank per node), tree 0.9 capped at
    110 GB/s (80 on more than two nodes), tree LL a further 1/3.8, tree LL128 7/9 on one
    node and 0.915 across nodes) and converted to algorithm bandwidth (ring ``× n /
    steps``, tree ``× 1/2``); trees get NCCL's medium-size correction factors, and a
    multi-node ring/Simple all-reduce of a large buffer pays NCCL's 1.9× plateau latency.
    LL128 is offered only on NVLink within one node (NCCL enables it by default only
    there). NCCL's LL128 per-channel bandwidth cap is left out: it depends on the channel
    count, which the Cluster does not describe.
``"ring"`` (pessimistic)
    ring / Simple only, every step paying its per-step latency: ``base + steps ×
    latency + wire / bus bandwidth``.
``"alpha-beta"`` (optimistic)
    one ``α`` per collective (the largest latency among its links) plus ``wire /
    bandwidth``: the classic model, kept as a named option.

Bus bandwidth of a group spanning several nodes: NCCL's ring graph spreads its channels
over the node's NICs (one per GPU on a DGX H100), so a ring whose ranks fill ``ppn`` GPUs of
each node crosses the network on ``ppn`` NICs at once: the group's bus bandwidth is the
smaller of the intra-node link and ``ppn`` NICs (nccl-tests report multi-node all-reduce bus
bandwidth near the node's aggregate NIC bandwidth). With one rank per node it is one NIC's.

All-to-all and collective-permute are point-to-point in NCCL (grouped send/receive), which
its tuning model does not cover: they are priced as one ring/Simple step (base latency plus
one step's hardware latency, the slowest link crossed) plus their wire bytes over the bus
bandwidth.

TPU ICI (``"ici"`` links) is priced with the bidirectional-ring formulas of an ICI torus
axis in every model but α-β: ``n/2`` hops of ``latency`` each, and the wire bytes over both
directions of the link (``2 × bandwidth``).

``share`` (< 1 for collectives XLA combines into one tuple collective,
:mod:`shardc.cost.combine`) scales the latency part only: the combined collective pays one
latency among its members, and NCCL picks its algorithm and protocol for the combined
buffer (taken as ``nbytes / share``), not for each member's.

Every latency in :data:`BASE_LATENCY` and :data:`HW_LATENCY` is in microseconds, as NCCL's
tables are; the link's ``latency`` in the Cluster (seconds) is the ring/Simple per-step
figure of its kind, and scales that kind's whole row (a calibrated link keeps NCCL's
protocol ratios).

References:
  NVIDIA NCCL ``src/graph/tuning.cc`` (``baseLat``, ``hwLat``, ``ncclTopoTuneModel``
    bandwidth rules, ``treeCorrectionFactor``, ``ncclTopoGetAlgoTime``; the 2.8 series).
  NVIDIA nccl-tests ``doc/PERFORMANCE.md``: algorithm vs bus bandwidth, ``busBw = algBw ×
    2(n−1)/n`` for all-reduce, ``(n−1)/n`` for all-gather / reduce-scatter.
  Austin et al., "How to Scale Your Model" (Google DeepMind, 2025), part 3: collectives on
    a bidirectional ICI ring, ``V / (2 W_ici)`` per all-gather, 1 µs per hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardc.errors import OptionsError

__all__ = ["COLLECTIVE_MODELS", "Group", "LINK_KINDS", "seconds", "wire_factor"]

#: the models a Cluster may name (see the module doc)
COLLECTIVE_MODELS = ("nccl", "ring", "alpha-beta")
#: link kinds: NVLink, PCIe, a network (InfiniBand / Ethernet), a TPU ICI torus axis
LINK_KINDS = ("nvlink", "pcie", "net", "ici")

_PROTOCOLS = ("LL", "LL128", "Simple")
#: NCCL ``baseLat`` (µs) per algorithm and protocol
BASE_LATENCY = {"tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0},
                "ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}}
#: NCCL ``hwLat`` (µs) per link kind, algorithm and protocol (``"ici"`` has no NCCL row)
HW_LATENCY = {
    "nvlink": {"tree": {"LL": 0.52, "LL128": 1.2, "Simple": 28.0},
               "ring": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4}},
    "pcie": {"tree": {"LL": 1.0, "LL128": 1.9, "Simple": 28.0},
             "ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7}},
    "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0},
            "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}},
}
#: NCCL ``treeCorrectionFactor`` per protocol, indexed by log2(nBytes / 64), 64 B to 128 MiB
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9,
           1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8,
              .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7,
               .8, .9),
}
#: NCCL's tree bus bandwidth caps (GB/s): on at most two nodes, and on more
TREE_MAX_BW = {"few": 110e9, "many": 80e9}


@dataclass(frozen=True, slots=True)
class Group:
    """The devices one collective runs over, as its cost sees them.

    ``bandwidth`` is the group's bus bandwidth in bytes/s per device (see the module doc
    for groups spanning nodes); ``alpha`` the α-β model's latency (seconds, the largest
    among its links); ``intra_latency`` / ``inter_latency`` the ring/Simple per-step
    latencies (seconds) of its intra- and inter-node links, which scale NCCL's rows."""

    ranks: int
    nodes: int
    intra: str
    inter: str
    bandwidth: float
    alpha: float
    intra_latency: float
    inter_latency: float

    @property
    def per_node(self) -> int:
        return max(self.ranks // max(self.nodes, 1), 1)


def wire_factor(kind: str, n: int) -> float:
    """Bytes each device sends per byte of NCCL's buffer on ``n`` devices (ring formulas:
    all-reduce ``2(n−1)/n``, all-gather and reduce-scatter ``(n−1)/n`` of the whole
    buffer, all-to-all ``(n−1)/n``, a permute its buffer)."""
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    factors = {"all-reduce": 2 * f, "all-gather": f, "reduce-scatter": f, "all-to-all": f,
               "collective-permute": 1.0}
    if kind not in factors:
        raise OptionsError(f"unknown collective kind {kind!r}; expected one of {sorted(factors)}")
    return factors[kind]


def _steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all-reduce" else n - 1


def _scaled(kind_row: str, algo: str, proto: str, latency: float) -> float:
    """NCCL's hwLat for ``kind_row``, in seconds, scaled by the link's ring/Simple figure."""
    row = HW_LATENCY[kind_row]
    return row[algo][proto] / row["ring"]["Simple"] * latency


def _nccl(kind: str, g: Group, nbytes: float, share: float) -> float:
    """NCCL's choice for the whole buffer a combined collective moves (``nbytes / share``:
    ``share`` is one member's part of it), charged for this member's share."""
    if kind in ("all-to-all", "collective-permute"):
        return _point_to_point(kind, g, nbytes, share)
    whole = nbytes / share
    lat, algbw = min(_nccl_options(kind, g, whole), key=lambda o: o[0] + whole / o[1])
    return share * lat + nbytes / algbw


def _nccl_options(kind: str, g: Group, nbytes: float) -> list[tuple[float, float]]:
    """(latency s, algorithm bandwidth B/s) of every algorithm x protocol NCCL may run."""
    n, nodes, ppn = g.ranks, g.nodes, g.per_node
    steps, inter_steps = _steps(kind, n), _steps(kind, nodes)
    algos = ("tree", "ring") if kind == "all-reduce" else ("ring",)
    log_size = int(math.log2(max(nbytes, 64) / 64))
    options = []
    for algo in algos:
        for proto in _PROTOCOLS:
            if proto == "LL128" and not (nodes == 1 and g.intra == "nvlink"):
                continue
            bus = g.bandwidth
            if algo == "ring" and proto == "LL":
                bus *= 1 / 4 if (nodes > 1 or kind == "all-reduce") else 1 / 3
            elif algo == "ring" and proto == "LL128":
                bus *= 0.7 if ppn < 2 else 0.92
            if algo == "tree":
                bus = min(bus * 0.9, TREE_MAX_BW["many" if nodes > 2 else "few"])
                if proto == "LL":
                    bus /= 3.8
                elif proto == "LL128":
                    bus *= 7 / 9 if nodes == 1 else 0.915
                if log_size < len(TREE_CORRECTION[proto]):
                    bus *= TREE_CORRECTION[proto][log_size]
            algbw = bus * (0.5 if algo == "tree" else n / steps)
            intra = _scaled(g.intra, algo, proto, g.intra_latency)
            inter = _scaled("net", algo, proto, g.inter_latency) if nodes > 1 else 0.0
            if nodes > 1 and proto == "LL":
                intra *= 1.8
            lat = BASE_LATENCY[algo][proto] * 1e-6
            if algo == "ring":
                lat += (steps - inter_steps) * intra + inter_steps * inter
                if (proto == "Simple" and nodes > 1 and kind == "all-reduce"
                        and nbytes >= n / 16 * 65536):
                    lat *= 1.9  # NCCL: "plateau effect of ring"
            else:
                lat += 2 * ((ppn - 1) * intra + math.log2(nodes) * inter)
            options.append((lat, algbw))
    return options


def _point_to_point(kind: str, g: Group, nbytes: float, share: float) -> float:
    slow, latency = (("net", g.inter_latency) if g.nodes > 1
                     else (g.intra, g.intra_latency))
    lat = BASE_LATENCY["ring"]["Simple"] * 1e-6 + _scaled(slow, "ring", "Simple", latency)
    return share * lat + wire_factor(kind, g.ranks) * nbytes / g.bandwidth


def _ring(kind: str, g: Group, nbytes: float, share: float) -> float:
    n, nodes = g.ranks, g.nodes
    if kind in ("all-to-all", "collective-permute"):
        return _point_to_point(kind, g, nbytes, share)
    steps, inter_steps = _steps(kind, n), _steps(kind, nodes)
    intra = _scaled(g.intra, "ring", "Simple", g.intra_latency)
    inter = _scaled("net", "ring", "Simple", g.inter_latency) if nodes > 1 else 0.0
    lat = (BASE_LATENCY["ring"]["Simple"] * 1e-6 + (steps - inter_steps) * intra
           + inter_steps * inter)
    return share * lat + wire_factor(kind, n) * nbytes / g.bandwidth


def _ici(kind: str, g: Group, nbytes: float, share: float) -> float:
    hops = 1 if kind in ("all-to-all", "collective-permute") else g.ranks // 2
    if kind == "all-reduce":
        hops *= 2
    return share * hops * g.alpha + wire_factor(kind, g.ranks) * nbytes / (2 * g.bandwidth)


def _alpha_beta(kind: str, g: Group, nbytes: float, share: float) -> float:
    return share * g.alpha + wire_factor(kind, g.ranks) * nbytes / g.bandwidth


@lru_cache(maxsize=1 << 18)
def seconds(kind: str, group: Group, nbytes: float, model: str = "nccl",
            share: float = 1.0) -> float:
    """Seconds one collective of ``kind`` takes over ``group`` on a buffer of ``nbytes``
    (NCCL's ``nBytes``: see the module doc), under ``model``."""
    if group.ranks <= 1:
        return 0.0
    if model == "alpha-beta":
        return _alpha_beta(kind, group, nbytes, share)
    if group.intra == "ici" or group.inter == "ici":
        return _ici(kind, group, nbytes, share)
    if model == "ring":
        return _ring(kind, group, nbytes, share)
    if model == "nccl":
        return _nccl(kind, group, nbytes, share)
    raise OptionsError(f"unknown collective model {model!r}; expected one of {COLLECTIVE_MODELS}")
