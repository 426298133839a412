"""Resharding (boxing): a conversion is a sequence of collectives.

A conversion ``src -> dst`` of an NdSbp runs as the steps XLA compiles predictably, each a
layout the lowering pins with one sharding constraint (:attr:`Conversion.layouts`):

1. **Partial axes first** (a partial value has no spelling on Auto axes, so its first
   constraint must resolve every partial axis at once). Axes going to ``S(d)`` (one ``d``)
   reduce-scatter as one collective over their union, then axes going to ``B`` all-reduce
   as one collective on the already-scattered data; partial axes going to splits of
   different dims all-reduce and then slice. This is what XLA emits for those first
   constraints (seen on jax 0.10.2 CPU: ``(P, P) -> (B, S(1))`` is a reduce-scatter over
   the second axis and an all-reduce over the first on a quarter of the data).
2. **Slices** ``B -> S``: free, done early so later steps move less.
3. **All-to-alls** ``S(i) -> S(j)``, one mesh axis per step.
4. **All-gathers** ``S -> B``, one mesh axis per step, slowest link first (on the smallest
   data). One axis per constraint because XLA's partitioner falls back to gathering the
   whole value for some multi-axis transitions (``(S(0) over both) -> (B, S(1))``).

A dim split over several axes is cut major to minor in mesh order; a step only gathers,
slices or moves the minor-most axis of a dim (see :func:`_minor`), so every step is a
plain collective, never one XLA must follow with a collective-permute; anything else
gathers first.

Each step moves ``wire`` bytes per device computed on the value's *current* local size
``L`` (a partial axis holds the full size): all-gather ``(n−1)·L`` (the result is ``n·L``),
all-reduce ``2(n−1)/n·L``, reduce-scatter and all-to-all ``(n−1)/n·L``. A collective over
several mesh axes runs over the group those axes make (``n`` their product; its links and
nodes from the Cluster), as the compiled program is priced (:mod:`shardc.inspect.hlo`).
Each collective's time is the Cluster's collective model on NCCL's buffer for it
(:mod:`shardc.cost.collectives`: the per-device array, or the gathered result of an
all-gather); the path is chosen by bandwidth alone (the wire bytes over each step's bus
bandwidth), so it does not depend on the value's size. ``B -> P`` (a local zeroing) is not
charged: no collective runs, and the compiled program selects the value on one device, an
elementwise select that XLA fuses into the consumer (the wide ResNet's weight decay, added
to the partial gradients: 29 parameters, 146 MB); ``S -> P`` gathers first.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
    MPICH" (IJHPCA 2005): ring all-gather / reduce-scatter / all-reduce costs.
  Alpa (Zheng et al., OSDI'22) §4.2; PaddlePaddle ``comm_op_cost.py`` (2(p−1)/p all-reduce);
  OneFlow boxing (``boxing/``): nd conversions as a chain of 1-D ones.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from shardc.cost.cluster import Cluster
from shardc.cost.collectives import Group, seconds, wire_factor
from shardc.cost.combine import COMBINED_KINDS
from shardc.ir.sbp import WHOLE, B, Broadcast, NdSbp, Partial, Split

__all__ = ["Collective", "collective_buffer", "Conversion", "conversion", "reshard_time",
           "wire_bytes"]


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str  # all-gather | all-reduce | reduce-scatter | all-to-all | local
    axes: tuple[int, ...]  # mesh axes the group spans
    bytes_factor: float  # wire bytes per device = bytes_factor * logical bytes
    buffer_factor: float = 0.0  # NCCL's buffer = buffer_factor * logical bytes
    group: Group | None = None  # None for a local step

    def seconds(self, nbytes: float, model: str, share: float = 1.0,
                combined: frozenset[str] = COMBINED_KINDS) -> float:
        """Seconds on a value of ``nbytes`` logical bytes; ``share`` scales the latency of a
        kind the backend combines (``combined``: :attr:`shardc.cost.combine.Combiner.kinds`,
        XLA:CPU's by default)."""
        if self.group is None:
            return 0.0
        share = share if self.kind in combined else 1.0
        return seconds(self.kind, self.group, self.buffer_factor * nbytes, model, share)


@dataclass(frozen=True, slots=True)
class Conversion:
    """Cost of a conversion: its collectives priced with the Cluster's ``model`` (a local
    step, ``B -> P``, is listed and costs nothing).

    ``layouts`` are the layouts to pin one after the other to run it (see the module doc)."""

    collectives: tuple[Collective, ...]
    model: str = "nccl"
    layouts: tuple[NdSbp, ...] = ()

    def time(self, nbytes: float, alpha_scale: float = 1.0,
             combined: frozenset[str] = COMBINED_KINDS) -> float:
        """Seconds; ``alpha_scale`` < 1 when XLA combines the collectives of this conversion
        whose kinds it combines (``combined``) with others (they share one latency)."""
        return sum(c.seconds(nbytes, self.model, alpha_scale, combined)
                                for c in self.collectives)

    def wire_bytes(self, nbytes: float) -> float:
        return sum(c.bytes_factor for c in self.collectives) * nbytes


class _Builder:
    """Accumulates the steps of one conversion."""

    def __init__(self, src: NdSbp, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
                 cluster: Cluster):
        self.cur = list(src.sbps)
        self.sizes, self.names, self.cluster = axis_sizes, axis_names, cluster
        self.colls: list[Collective] = []
        self.layouts: list[NdSbp] = []

    def local(self) -> float:
        """Current bytes per device per logical byte."""
        return 1.0 / math.prod(n for s, n in zip(self.cur, self.sizes) if isinstance(s, Split))

    def group(self, axes: Sequence[int]) -> Group:
        return self.cluster.group([(self.names[a], self.sizes[a]) for a in axes])

    def collective(self, kind: str, axes: Sequence[int], factor: float) -> None:
        """One collective over ``axes`` moving ``factor`` x the current local bytes."""
        n = math.prod(self.sizes[a] for a in axes)
        if n == 1:
            return
        local = self.local()
        buffer = n * local if kind == "all-gather" else local
        self.colls.append(Collective(kind, tuple(axes), factor * local, buffer,
                                     self.group(axes)))

    def zeroing(self, axis: int) -> None:
        """``B -> P`` on ``axis``: a local step, free (the module doc)."""
        self.colls.append(Collective("local", (axis,), 0.0))

    def pin(self) -> None:
        nd = NdSbp(tuple(self.cur))
        if not self.layouts or self.layouts[-1] != nd:
            self.layouts.append(nd)

    def result(self) -> Conversion:
        return Conversion(tuple(self.colls), self.cluster.collective_model,
                          tuple(self.layouts))


def _split_axes(sbps: Sequence) -> dict[int, frozenset[int]]:
    """dim -> the mesh axes splitting it."""
    out: dict[int, set[int]] = {}
    for a, s in enumerate(sbps):
        if isinstance(s, Split):
            out.setdefault(s.dim, set()).add(a)
    return {d: frozenset(x) for d, x in out.items()}


def _safe(sbps: Sequence, src: NdSbp, dst: NdSbp) -> bool:
    """An intermediate layout divides evenly for any shape both ``src`` and ``dst`` fit:
    every dim is split by a subset of the axes splitting it in ``src`` or in ``dst``."""
    have, s, d = _split_axes(sbps), _split_axes(src.sbps), _split_axes(dst.sbps)
    empty: frozenset[int] = frozenset()
    return all(x <= s.get(k, empty) or x <= d.get(k, empty) for k, x in have.items())


def _minor(sbps: Sequence, axis: int, dim: int) -> bool:
    """``axis`` would be the minor-most (last in mesh order) of the axes splitting ``dim``.

    A dim split over several axes is cut major to minor in mesh order, so only its minor-
    most axis can be gathered (or added by a slice, or moved by an all-to-all) in place;
    the major one would leave each device's pieces out of order, and XLA reorders them with
    a collective-permute (seen on jax 0.10.2: gathering the major axis of ``S(0)`` over
    ``(node, gpu)``)."""
    return all(a <= axis for a, s in enumerate(sbps) if isinstance(s, Split) and s.dim == dim)


def _resolve_partials(b: _Builder, src: NdSbp, dst: NdSbp) -> None:
    """Step 1 of the module doc: every partial axis at once."""
    partial = [a for a, s in enumerate(b.cur) if isinstance(s, Partial)]
    if not partial:
        return
    to_split = [a for a in partial if isinstance(dst.sbps[a], Split)]
    trial = [dst.sbps[a] if a in to_split else s for a, s in enumerate(b.cur)]
    dims = {dst.sbps[a].dim for a in to_split}
    if (len(dims) > 1 or not _safe(trial, src, dst) or any(b.cur[a] == WHOLE for a in partial)
            or not all(_minor(trial, max(to_split), d) for d in dims)
            or any(s.dim in dims and a > min(to_split) and a not in to_split
                   for a, s in enumerate(trial) if isinstance(s, Split))):
        to_split = []  # all-reduce, then slice
    to_full = [a for a in partial if a not in to_split]
    if to_split:
        n = math.prod(b.sizes[a] for a in to_split)
        b.collective("reduce-scatter", to_split, (n - 1) / n)
        for a in to_split:
            b.cur[a] = dst.sbps[a]
    if to_full:
        n = math.prod(b.sizes[a] for a in to_full)
        b.collective("all-reduce", to_full, 2 * (n - 1) / n)
        for a in to_full:
            b.cur[a] = B
    b.pin()


def _moves(cur: tuple, src: NdSbp, dst: NdSbp, b: _Builder):
    """Plain single-axis steps from layout ``cur``: ``(kind, axis, next layout, seconds
    per logical byte)``; slices cost nothing, gathers and all-to-alls move the local data."""
    local = 1.0 / math.prod(n for s, n in zip(cur, b.sizes) if isinstance(s, Split))
    for a, s in enumerate(cur):
        n, bw = b.sizes[a], b.group([a]).bandwidth
        if isinstance(s, Broadcast):
            for d in {x.dim for x in dst.sbps if isinstance(x, Split)}:
                nxt = cur[:a] + (Split(d),) + cur[a + 1:]
                if _minor(nxt, a, d) and _safe(nxt, src, dst):
                    yield "slice", a, nxt, 0.0
        elif isinstance(s, Split) and _minor(cur, a, s.dim):
            nxt = cur[:a] + (B,) + cur[a + 1:]
            yield "all-gather", a, nxt, (n - 1) * local / bw
            d = dst.sbps[a]
            if isinstance(d, Split) and d != s:
                nxt = cur[:a] + (d,) + cur[a + 1:]
                if _minor(nxt, a, d.dim) and _safe(nxt, src, dst):
                    yield "all-to-all", a, nxt, (n - 1) / n * local / bw


def _plain_steps(b: _Builder, src: NdSbp, dst: NdSbp) -> None:
    """Steps 2-4 of the module doc: the cheapest sequence of plain moves (Dijkstra over the
    few layouts of a value on a small mesh; ties go to fewer collectives)."""
    start, goal = tuple(b.cur), tuple(dst.sbps)
    best = {start: (0.0, 0)}
    prev: dict[tuple, tuple] = {}
    heap = [(0.0, 0, 0, start)]
    tick = 1
    while heap:
        cost, hops, _, cur = heapq.heappop(heap)
        if cur == goal:
            break
        if (cost, hops) > best[cur]:
            continue
        for kind, a, nxt, t in _moves(cur, src, dst, b):
            key = (cost + t, hops + (kind != "slice"))
            if nxt not in best or key < best[nxt]:
                best[nxt] = key
                prev[nxt] = (cur, kind, a)
                heapq.heappush(heap, (*key, tick, nxt))
                tick += 1
    if goal not in best:
        raise AssertionError(f"no plain conversion from {src} to {dst}; please report this")
    path = []
    node = goal
    while node != start:
        before, kind, a = prev[node]
        path.append((kind, a, node))
        node = before
    path.reverse()
    for i, (kind, a, layout) in enumerate(path):
        n = b.sizes[a]
        if kind == "all-gather":
            b.collective(kind, [a], n - 1)
        elif kind == "all-to-all":
            b.collective(kind, [a], (n - 1) / n)
        b.cur = list(layout)
        if kind != "slice" or i + 1 == len(path) or path[i + 1][0] != "slice":
            b.pin()  # a run of (free) slices is one layout


@lru_cache(maxsize=1 << 16)
def conversion(src: NdSbp, dst: NdSbp, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
               cluster: Cluster) -> Conversion:
    b = _Builder(src, axis_sizes, axis_names, cluster)
    if src == dst:
        return b.result()
    if any(isinstance(s, Partial) for s in dst.sbps):
        return _into_partial(b, src, dst)
    _resolve_partials(b, src, dst)
    _plain_steps(b, src, dst)
    return b.result()


def _into_partial(b: _Builder, src: NdSbp, dst: NdSbp) -> Conversion:
    """Conversions that end partial on some axis (only ops passing a partial through read
    partial values, so these are never worth it; priced per axis as the module doc says).
    A whole partial (:data:`WHOLE`) is all-reduced over all its axes at once, as XLA reduces
    it where it is made, and is then replicated (read partial, the reduced value is the
    summand: the lowering spells no zeroing, or a local one where it holds the sum stacked)."""
    whole = [a for a, (s, d) in enumerate(zip(src.sbps, dst.sbps)) if s == WHOLE and d != s]
    if whole:
        n = math.prod(b.sizes[a] for a in whole)
        b.collective("all-reduce", whole, 2 * (n - 1) / n)
    for a, (s, d) in enumerate(zip(src.sbps, dst.sbps)):
        n = b.sizes[a]
        if s == d or n == 1 or a in whole and not isinstance(d, Split):
            b.cur[a] = d
            continue
        s = B if a in whole else s
        if isinstance(s, Split) and isinstance(d, Split):
            b.collective("all-to-all", [a], (n - 1) / n)
        elif isinstance(s, Split):
            b.collective("all-gather", [a], n - 1)
        elif isinstance(s, Partial):
            b.collective("reduce-scatter" if isinstance(d, Split) else "all-reduce", [a],
                         (n - 1) / n if isinstance(d, Split) else 2 * (n - 1) / n)
        elif isinstance(d, Partial):
            b.zeroing(a)
        b.cur[a] = d
    return b.result()


def reshard_time(src: NdSbp, dst: NdSbp, nbytes: float, axis_sizes: Sequence[int],
                 axis_names: Sequence[str], cluster: Cluster) -> float:
    return conversion(src, dst, tuple(axis_sizes), tuple(axis_names), cluster).time(nbytes)


def wire_bytes(kind: str, n: int, result_bytes: float) -> float:
    """Bytes each device sends in a ring collective over ``n`` devices, from the per-device
    *result* size as XLA prints it (the same formulas as the planner's conversions)."""
    if n <= 1:
        return 0.0
    return collective_buffer(kind, n, result_bytes) * wire_factor(kind, n)


def collective_buffer(kind: str, n: int, result_bytes: float) -> float:
    """NCCL's buffer (``nBytes``) of a collective over ``n`` devices whose per-device result
    XLA prints as ``result_bytes``: a reduce-scatter's input is ``n`` results, every other
    kind's buffer is its result (an all-gather's is the gathered array)."""
    wire_factor(kind, n)  # names the kinds it knows
    return n * result_bytes if kind == "reduce-scatter" else result_bytes
