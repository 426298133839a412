"""Compute priced as a GPU runs it: kernels, not FLOPs.

A GPU step is a sequence of kernels, each taking the larger of its arithmetic and its
memory traffic, and never less than a launch floor. Measured on an H100
(``docs/benchmarks/gpu-h100.md``): no kernel takes under 2.6 us; an f32 dot reaches 20% of
the TF32 peak at 2 GFLOP and 90% at 1 TFLOP; elementwise kernels run at 3 TB/s from
100 MB and at the floor below 1 MB. FLOPs over a fixed throughput put the zoo's
one-device steps 1.85-27x under the measured ones.

:class:`KernelModel` holds measured curves: seconds against FLOPs for dots and
convolutions (per operand width), seconds against bytes moved for every other kernel,
each interpolated in log-log between measured points (below the first: the first; past
the last: the last point's rate). :func:`fusion` groups a graph's ops into the kernels
XLA fuses them into (elementwise chains with the reductions they feed; dots alone), and
:func:`op_seconds` gives each op its share of its kernel's time under a strategy.

References:
  ``docs/benchmarks/gpu-h100/kernels.json``: the single kernels measured on an NVIDIA
  H100 80GB HBM3 (jax 0.11.2), each run 50 times in a chain inside one executable
  (``python -m shardc.bench.device kernels``): the points of :data:`H100`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardc.ir.flops import op_flops
from shardc.ir.graph import Graph, Op
from shardc.ir.prims import facts

__all__ = ["compute_seconds", "Fused", "fusion", "H100", "interpolate", "KERNEL_MODELS", "monotone",
           "KernelModel", "op_seconds"]

Curve = tuple[tuple[float, float], ...]


def monotone(points: Sequence[tuple[float, float]]) -> Curve:
    """``points`` (size, seconds) sorted by size, repeated sizes averaged, and each time
    lowered to the least time of any larger size (a smaller kernel never costs more)."""
    by: dict[float, list[float]] = {}
    for x, t in points:
        by.setdefault(float(x), []).append(float(t))
    xs = sorted(by)
    ts = [sum(by[x]) / len(by[x]) for x in xs]
    for i in range(len(ts) - 2, -1, -1):
        ts[i] = min(ts[i], ts[i + 1])
    return tuple(zip(xs, ts))


def interpolate(curve: Curve, x: float) -> float:
    """Seconds at size ``x`` on ``curve``: log-log between its points; below the first
    the first's seconds (the floor); past the last, the last's rate."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1] * x / curve[-1][0]
    lx = [math.log(p[0]) for p in curve]
    lt = [math.log(p[1]) for p in curve]
    return float(math.exp(np.interp(math.log(x), lx, lt)))


@dataclass(frozen=True)
class KernelModel:
    """A device's kernels, measured.

    Attributes:
        name: what the curves were measured on.
        dot_wide: (FLOPs, seconds) of dots with 4-byte operands (TF32 on an H100).
        dot_narrow: (FLOPs, seconds) of dots with 2-byte operands (bf16, f16).
        memory: (bytes read and written, seconds) of elementwise kernels.
    """

    name: str
    dot_wide: Curve
    dot_narrow: Curve
    memory: Curve

    def dot_seconds(self, flops: float, itemsize: int) -> float:
        """A dot's (or convolution's) arithmetic time at ``flops``."""
        return interpolate(self.dot_narrow if itemsize <= 2 else self.dot_wide, flops)

    def memory_seconds(self, nbytes: float) -> float:
        """A kernel's time to move ``nbytes`` through HBM, launch floor included."""
        return interpolate(self.memory, nbytes)


#: an NVIDIA H100 80GB HBM3's kernels (module References: kernels.json, rounded)
H100 = KernelModel(
    name="NVIDIA H100 80GB HBM3",
    dot_wide=monotone([
        (4.194e6, 4.90e-6), (3.355e7, 6.03e-6), (7.550e7, 7.11e-6), (2.684e8, 9.13e-6),
        (1.859e9, 1.80e-5), (2.147e9, 2.17e-5), (9.664e9, 4.38e-5), (1.718e10, 5.52e-5),
        (3.436e10, 9.92e-5), (3.865e10, 1.245e-4), (1.374e11, 3.63e-4),
        (1.100e12, 2.47e-3)]),
    dot_narrow=monotone([
        (4.194e6, 4.93e-6), (3.355e7, 5.27e-6), (7.550e7, 7.48e-6), (2.684e8, 1.02e-5),
        (1.859e9, 9.24e-6), (2.147e9, 8.67e-6), (9.664e9, 2.07e-5), (1.718e10, 3.49e-5),
        (3.436e10, 4.76e-5), (3.865e10, 5.12e-5), (1.374e11, 1.63e-4),
        (1.100e12, 1.25e-3)]),
    memory=monotone([
        (8192, 2.61e-6), (32768, 3.15e-6), (131072, 3.10e-6), (524288, 3.94e-6),
        (2097152, 4.19e-6), (8388608, 4.87e-6), (33554432, 1.04e-5),
        (134217728, 5.01e-5), (536870912, 1.88e-4), (2147483648, 7.26e-4)]),
)

#: kernel models by the name a :class:`~shardc.cost.cluster.Cluster` gives
KERNEL_MODELS: dict[str, KernelModel] = {"h100": H100}

#: layout ops XLA folds into the kernels around them (no kernel, no traffic of their own)
_FREE = frozenset(
    "reshape squeeze expand_dims name stop_gradient copy copy_p optimization_barrier "
    "scan_enter scan_exit cond_enter cond_exit pjit".split())
#: ops XLA fuses with elementwise neighbours besides the elementwise ones
_FUSIBLE = frozenset(
    "broadcast_in_dim transpose iota reduce_sum reduce_max reduce_min reduce_prod argmax "
    "argmin slice concatenate pad rev select_n convert_element_type".split())
_REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod argmax argmin".split())
#: ops that read (or write in place) only a slice of their big operand
_SLICES = frozenset("dynamic_slice gather".split())
_IN_PLACE = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2, "scatter_add": 2}


@dataclass(frozen=True, slots=True)
class Fused:
    """One op's place in the kernels of its graph.

    Attributes:
        kind: "dot" (a library kernel of its own), "fused" (in an elementwise kernel),
            "own" (a kernel of its own, moving ``nbytes``) or "free" (no kernel).
        nbytes: the bytes this op moves through HBM (a fused op: what it reads from
            outside its kernel and writes for readers outside it).
        kernel_bytes: a fused op's whole kernel's bytes (its own for the others).
    """

    kind: str
    nbytes: float
    kernel_bytes: float


def _fusible(op: Op) -> bool:
    return facts(op.name).elementwise or op.name in _FUSIBLE


def _joins(op: Op, producers: dict) -> list[Op]:
    """The producers ``op`` fuses with: fusible ones making a non-scalar operand, unless
    the operand is a reduction's result (its readers start a kernel: XLA reads the reduced
    value back, as a normalisation's second pass does) or the producer runs another number
    of times (a loop's body and what is outside it)."""
    ins = [producers.get(v.id) for v in op.inputs if not v.is_const and v.size > 1]
    if any(p is not None and p.name in _REDUCE for p in ins):
        return []
    return [p for p in ins if p is not None and _fusible(p) and p.weight == op.weight]


def _groups(graph: Graph) -> dict[int, int]:
    """op id -> the id of the kernel it is fused into (union-find over fusible edges)."""
    parent = {op.id: op.id for op in graph.ops}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    producers = graph.producers()
    for op in graph.ops:
        if _fusible(op):
            for p in _joins(op, producers):
                parent[find(op.id)] = find(p.id)
    return {k: find(k) for k in parent}


def _own_bytes(op: Op) -> float:
    if op.name in _SLICES:
        return 2.0 * sum(v.nbytes for v in op.outputs)
    if op.name in _IN_PLACE:
        return 2.0 * op.inputs[_IN_PLACE[op.name]].nbytes
    return float(sum(v.nbytes for v in op.inputs if not v.is_const) +
                 sum(v.nbytes for v in op.outputs))


def _crossing(op: Op, group: dict[int, int], producers: dict, consumers: dict,
              outputs: set[int]) -> float:
    """The bytes a fused op reads from outside its kernel and writes for readers outside."""
    k = group[op.id]
    read = sum(v.nbytes for v in op.inputs if not v.is_const and
               (producers.get(v.id) is None or group[producers[v.id].id] != k))
    written = sum(v.nbytes for v in op.outputs
                  if v.id in outputs or any(group[u.id] != k for u, _ in consumers.get(v.id, [])))
    return float(read + written)


def _kind(op: Op) -> str:
    if facts(op.name).kernel:
        return "dot"
    if op.name in _FREE or (_fusible(op) and all(
            v.size <= 1 for v in (*op.inputs, *op.outputs))):
        return "free"  # a scalar's arithmetic is folded into the kernels reading it
    return "fused" if _fusible(op) else "own"


def fusion(graph: Graph) -> dict[int, Fused]:
    """op id -> its :class:`Fused` place, for every op of ``graph``."""
    group = _groups(graph)
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {v.id for v in graph.outputs}
    kinds = {op.id: _kind(op) for op in graph.ops}
    moved: dict[int, float] = {}
    for op in graph.ops:
        if kinds[op.id] == "fused":
            moved[op.id] = _crossing(op, group, producers, consumers, outputs)
        elif kinds[op.id] != "free":
            moved[op.id] = _own_bytes(op)
    total: dict[int, float] = {}
    for op in graph.ops:
        if kinds[op.id] == "fused":
            total[group[op.id]] = total.get(group[op.id], 0.0) + moved[op.id]
    return {op.id: Fused(kinds[op.id], moved.get(op.id, 0.0),
                         total.get(group[op.id], 0.0) if kinds[op.id] == "fused"
                         else moved.get(op.id, 0.0))
            for op in graph.ops}


def op_seconds(model: KernelModel, op: Op, place: Fused, flops: float) -> float:
    """Seconds ``op`` adds to one run of its graph on one device doing ``flops`` of its
    work (a strategy's per-device FLOPs): a dot the larger of its arithmetic and its
    traffic; a fused op its share of its kernel's time (the share of the kernel's bytes it
    moves), the kernel's bytes taken in the proportion the op's work is split."""
    whole = op_flops(op)
    share = flops / whole if whole > 0 else 1.0
    if place.kind == "free":
        return 0.0
    if place.kind == "dot":
        width = min((v.dtype.itemsize for v in op.inputs), default=4)
        return max(model.dot_seconds(flops, width), model.memory_seconds(place.nbytes * share))
    if place.kernel_bytes <= 0:
        return 0.0
    return place.nbytes / place.kernel_bytes * model.memory_seconds(place.kernel_bytes * share)


def compute_seconds(cluster, graph: Graph, op: Op, flops: float) -> float:
    """Seconds of one run of ``op`` (of ``graph``) on one device doing ``flops`` of it,
    on ``cluster`` (a :class:`~shardc.cost.cluster.Cluster`): by its kernel model
    (:func:`op_seconds`), or FLOPs over ``device_flops * utilization`` where it names
    none."""
    if cluster.kernels is None:
        return flops / (cluster.device_flops * cluster.utilization)
    places = graph.memo("kernel_fusion", fusion)
    return op_seconds(KERNEL_MODELS[cluster.kernels], op, places[op.id], flops)
