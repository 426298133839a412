"""Resharding (boxing) cost in the α-β model, axis by axis.

Per mesh axis of size n, on the bytes that axis moves (the value's size divided by the
splits of the other axes, i.e. conversions are ordered so each one runs on the smallest
data):

=========  =============  ===========================
from→to    collective     time
=========  =============  ===========================
S→B        all-gather     α + β·(n−1)/n·b
P→B        all-reduce     α + 2β·(n−1)/n·b
P→S        reduce-scatter α + β·(n−1)/n·b
S(i)→S(j)  all-to-all     α + β·(n−1)/n²·b
S→P        all-gather     α + β·(n−1)/n·b (then a local zeroing)
B→S        local slice    0
B→P        local zeroing  α (penalised: it poisons consumers)
=========  =============  ===========================

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
    MPICH" (IJHPCA 2005): ring all-gather / reduce-scatter / all-reduce costs.
  Alpa (Zheng et al., OSDI'22) §4.2; PaddlePaddle ``comm_op_cost.py`` (2(p−1)/p all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from shardc.cost.cluster import Cluster
from shardc.cost.combine import COMBINED_KINDS
from shardc.ir.sbp import Broadcast, NdSbp, Partial, Sbp, Split


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str  # all-gather | all-reduce | reduce-scatter | all-to-all | local
    axis: int
    bytes_factor: float  # wire bytes per device = bytes_factor * logical bytes


@dataclass(frozen=True, slots=True)
class Conversion:
    """Cost of a conversion as ``alpha + per_byte * logical_bytes`` seconds.

    ``combinable_alpha`` is the part of ``alpha`` paid by collectives XLA may combine with
    independent ones of their kind (:data:`shardc.cost.combine.COMBINED_KINDS`)."""

    alpha: float
    per_byte: float
    wire_per_byte: float
    collectives: tuple[Collective, ...]
    combinable_alpha: float = 0.0

    def time(self, nbytes: float, alpha_scale: float = 1.0) -> float:
        """Seconds; ``alpha_scale`` < 1 when XLA combines the combinable collectives of this
        conversion with others."""
        if not self.collectives:
            return 0.0
        return self.alpha - self.combinable_alpha * (1.0 - alpha_scale) + self.per_byte * nbytes

    def wire_bytes(self, nbytes: float) -> float:
        return self.wire_per_byte * nbytes


def _axis_step(src: Sbp, dst: Sbp, n: int) -> tuple[str, float] | None:
    """(collective kind, wire bytes per byte of the axis-local value), None when free."""
    if src == dst or n == 1:
        return None
    f = (n - 1) / n
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return "all-gather", f
        if isinstance(dst, Split):
            return "all-to-all", f / n
        return "all-gather", f  # S -> P: gather, then zero all but one copy
    if isinstance(src, Partial):
        if isinstance(dst, Broadcast):
            return "all-reduce", 2 * f
        if isinstance(dst, Split):
            return "reduce-scatter", f
        return "all-reduce", 2 * f  # P(op1) -> P(op2)
    if isinstance(dst, Split):
        return None  # B -> S: each device keeps its slice
    return "local", 0.0  # B -> P


@lru_cache(maxsize=1 << 16)
def conversion(src: NdSbp, dst: NdSbp, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
               cluster: Cluster) -> Conversion:
    alpha = per_byte = wire = combinable = 0.0
    colls = []
    for i, n in enumerate(axis_sizes):
        step = _axis_step(src.sbps[i], dst.sbps[i], n)
        if step is None:
            continue
        kind, factor = step
        shrink = 1
        for j, m in enumerate(axis_sizes):
            if j != i and (isinstance(src.sbps[j], Split) or isinstance(dst.sbps[j], Split)):
                shrink *= m
        local = factor / shrink
        alpha += cluster.latency(axis_names[i])
        if kind in COMBINED_KINDS:
            combinable += cluster.latency(axis_names[i])
        per_byte += local / cluster.bandwidth(axis_names[i])
        wire += local
        colls.append(Collective(kind, i, local))
    return Conversion(alpha, per_byte, wire, tuple(colls), combinable)


def reshard_time(src: NdSbp, dst: NdSbp, nbytes: float, axis_sizes: Sequence[int],
                 axis_names: Sequence[str], cluster: Cluster) -> float:
    return conversion(src, dst, tuple(axis_sizes), tuple(axis_names), cluster).time(nbytes)


def wire_bytes(kind: str, n: int, result_bytes: float) -> float:
    """Bytes each device sends in a ring collective over ``n`` devices, from the per-device
    *result* size as XLA prints it (the same formulas as the planner's conversions)."""
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    factor = {"all-reduce": 2 * f, "all-gather": f, "reduce-scatter": float(n - 1),
              "all-to-all": f, "collective-permute": 1.0}
    if kind not in factor:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(factor)}")
    return factor[kind] * result_bytes


def collective_time(kind: str, n: int, result_bytes: float, bandwidth: float,
                    latency: float) -> float:
    """α-β time of one collective over ``n`` devices (see :func:`wire_bytes`)."""
    if n <= 1:
        return 0.0
    return latency + wire_bytes(kind, n, result_bytes) / bandwidth
