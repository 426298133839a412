"""Logical views of a physical mesh, for the mesh-shape search.

Two nodes of 8 GPUs, given as the mesh ``(node=2, gpu=8)``, can also run as ``(16,)``,
``(4, 4)`` or ``(8, 2)``: the same devices in the same order, cut into other axes (AutoDDL's
parallel schemes; Alpa's logical meshes of a device cluster). A logical axis takes its
devices from consecutive physical axes in row-major order, whole or in part; it runs at the
slowest link it crosses (an axis of 4 spanning 2 nodes x 2 GPUs is an InfiniBand axis) with
the largest latency. :func:`views` lists the physical mesh and every 1-D and 2-D cut of it;
the planner prices each and keeps the cheapest (``auto_shard(..., mesh_search=True)``).
With ``max_axes=3`` it adds the 3-D cuts (``(2, 2, 2)`` of 8 devices; ``(2, 2, 4)``, ``(2, 4,
2)``, ``(4, 2, 2)`` of 16), where the bench's three-axis experts (data x FSDP x TP) run; the
mesh search keeps to 2-D, since each view is one more full solve.

References:
  AutoDDL (Chen et al., 2023) §4: the device mesh as a tunable scheme per parallel dim.
  Alpa (Zheng et al., OSDI'22) §5: logical mesh shapes of a physical cluster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from shardc.cost.cluster import Cluster, slowest_link
from shardc.report.explain import mesh_label

__all__ = ["View", "views"]


@dataclass(frozen=True)
class View:
    """A logical mesh over the physical devices: its shape, axis names, and the cluster
    with each logical axis priced at the links it crosses."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    cluster: Cluster

    @property
    def label(self) -> str:
        return mesh_label(zip(self.names, self.shape))

    def mesh(self, physical: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
        """This view of ``physical``'s devices (same order), every axis Auto; of an
        AbstractMesh, the AbstractMesh of this shape."""
        if tuple(physical.axis_names) == self.names and \
                tuple(physical.axis_sizes) == self.shape:
            return physical
        if isinstance(physical, AbstractMesh):
            return AbstractMesh(self.shape, self.names,
                                axis_types=(AxisType.Auto,) * len(self.shape))
        return Mesh(np.asarray(physical.devices).reshape(self.shape), self.names,
                    axis_types=(AxisType.Auto,) * len(self.shape))


def _cut(shape: Sequence[int], logical: Sequence[int]) -> list[list[tuple[int, int]]] | None:
    """Which physical axes (index, devices taken) each logical axis covers, taking devices
    in row-major order; None when a logical axis would cut a physical one unevenly."""
    left = list(shape)
    k, out = 0, []
    for m in logical:
        parts = []
        while m > 1:
            while k < len(left) and left[k] == 1:
                k += 1
            if k == len(left):
                return None
            take = math.gcd(m, left[k])
            if take == 1:
                return None
            if take < m and take < left[k]:
                return None  # would need part of this axis and part of the next
            parts.append((k, take))
            left[k] //= take
            m //= take
        out.append(parts)
    return out


def _name(physical_names: Sequence[str], shape: Sequence[int],
          parts: Sequence[tuple[int, int]]) -> str:
    return "_".join(physical_names[k] if take == shape[k] else f"{physical_names[k]}{take}"
                    for k, take in parts)


def _factorizations(n: int, max_axes: int) -> list[tuple[int, ...]]:
    """``n`` as a product of at most ``max_axes`` factors, each at least 2 (outer first), by
    number of factors: ``(8,)``, ``(2, 4)``, ``(4, 2)``, ``(2, 2, 2)``."""
    def split(m: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(m,)]
        return [(a, *rest) for a in range(2, m) if m % a == 0 for rest in split(m // a, k - 1)]

    return [f for k in range(1, max_axes + 1) for f in split(n, k)]


def _distinct(lnames: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated names (equal pieces of one physical axis) told apart in order, ``gpu2a``,
    ``gpu2b``, ``gpu2c``."""
    seen: dict[str, int] = {}
    out = []
    for n in lnames:
        if lnames.count(n) > 1:
            out.append(n + "abcdefgh"[seen.get(n, 0)])
            seen[n] = seen.get(n, 0) + 1
        else:
            out.append(n)
    return tuple(out)


def views(shape: Sequence[int], names: Sequence[str], cluster: Cluster,
          max_axes: int = 2) -> list[View]:
    """The physical mesh first, then every logical cut of it of up to ``max_axes`` axes (each
    at least 2 devices) that cuts the physical axes evenly. Physical axes of size 1 (a
    sub-mesh of :func:`shardc.tradeoff.sweep.device_counts`) hold no devices to cut: the cut that
    only drops them is the physical mesh again, and one device has no cut at all. A 1-D or
    2-D cut whose two axes would take the same name (two halves of one physical axis) is
    left out, as the mesh search always has; a 3-D cut names its repeated pieces apart
    (:func:`_distinct`), or 8 devices of one axis would have no 3-D view."""
    shape, names = tuple(shape), tuple(names)
    out = [View(shape, names, cluster)]
    for logical in _factorizations(math.prod(shape), max_axes):
        if logical == tuple(s for s in shape if s > 1) or min(logical) < 2:
            continue
        cut = _cut(shape, logical)
        if cut is None:
            continue
        lnames = tuple(_name(names, shape, parts) for parts in cut)
        if len(set(lnames)) != len(lnames):
            if len(logical) < 3:
                continue
            lnames = _distinct(lnames)
        out.append(View(logical, lnames, _view_cluster(cluster, names, lnames, cut)))
    return out


def _view_cluster(cluster: Cluster, names: Sequence[str], lnames: Sequence[str],
                  cut: Sequence[Sequence[tuple[int, int]]]) -> Cluster:
    """The cluster of a view: a logical axis made of parts of physical axes has the link of
    its slowest part (a network where any part crosses nodes), spans the nodes its parts
    span, and runs its steps inside a node over its other parts' links."""
    bw, lat, link, nodes = {}, {}, {}, {}
    inside = cluster.node_bandwidth, cluster.node_latency, cluster.node_link
    for ln, parts in zip(lnames, cut):
        kinds = [cluster.link(names[k]) for k, _ in parts]
        net = [(k, take) for (k, take), kind in zip(parts, kinds) if kind == "net"]
        mine = net or parts
        bw[ln] = min(cluster.bandwidth(names[k]) for k, _ in mine)
        lat[ln] = max(cluster.latency(names[k]) for k, _ in mine)
        link[ln] = slowest_link(kinds)
        nodes[ln] = math.prod(cluster.nodes(names[k], take) for k, take in parts)
        local = [k for (k, _), kind in zip(parts, kinds) if kind in ("nvlink", "pcie")]
        if net and local:
            inside = (min(cluster.bandwidth(names[k]) for k in local),
                      max(cluster.latency(names[k]) for k in local),
                      slowest_link(cluster.link(names[k]) for k in local))
    return dataclasses.replace(cluster, axis_bandwidth=bw, axis_latency=lat, axis_link=link,
                               axis_nodes={a: n for a, n in nodes.items() if n > 1},
                               node_bandwidth=inside[0], node_latency=inside[1],
                               node_link=inside[2])
