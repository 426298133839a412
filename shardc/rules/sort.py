"""Sorting rules: sort (any number of operands, ``num_keys`` of them compared), top_k and
approx_top_k.

``sort`` orders every row along ``dimension``, moving all operands together (``jnp.argsort``
is a sort of ``(x, iota)`` that keeps the second result). Rows are independent, so any other
dim may be split, on every operand and result together: S(d)...->S(d)... for d != dimension
(OneFlow ``arg_sort_op.cpp`` / ``top_k_op.cpp``: split every axis but the sorted one, inputs
and outputs together; XLA's SPMD partitioner (``HandleSort``) partitions a sort only when all
operands share one sharding and no sort dimension is tiled, a sort+slice top-k aside: that
one it cuts along the sort dim into per-device top-k's and a final sort of the gathered
devices x k candidates, a two-phase plan with communication, not one signature). ``top_k``
picks the k largest of every row along ``axis``: split any dim but ``axis``. Splitting the
sorted dim would need a merge across devices, and an order is no sum: no S of the sorted dim, no P.
``approx_top_k`` (``lax.approx_max_k`` / ``approx_min_k``) is the same rule along its
``reduction_dimension``: every row's result depends on that row alone, whether XLA computes it
exactly (every platform but TPU: ``is_fallback``, ``ApproxTopKFallback``, a sort of the row with
an iota and a slice) or approximately row by row (TPU's ``PartialReduce``), so split any dim but
the reduced one. Its params hold on a device as they are: ``reduction_input_size_override``
and the output size (k, or more with ``aggregate_to_topk=False``) concern the reduced dim only.

FLOPs: binary insertion and two-way merge sort order n elements in at most
n ceil(lg n) - 2^ceil(lg n) + 1 <= n ceil(lg n) comparisons, against the lower bound
ceil(lg n!) = n lg n - 1.44 n + O(log n) (Knuth, TAOCP vol. 3, §5.3.1), so a sort costs
rows x n ceil(log2 n). XLA's ``HloCostAnalysis::HandleSort`` charges N ceil(log2 N) for all N
elements of the operand as if they were one row: the same for a 1-D sort, an overcount for a
batch of rows. ``num_keys`` and extra operands add no comparisons to either count. ``top_k`` is
priced as the sort XLA's ``TopkDecomposer`` turns it into (each row sorted with an iota, then
k sliced off; ``HloCostAnalysis::HandleTopK`` charges nothing). ``approx_top_k`` is priced
the same: its fallback is that sort (CPU keeps a max's as the TopK custom call, a min's as a
sort); TPU's approximate ``PartialReduce`` is another algorithm, which this count does not model.

References:
  OneFlow ``user/ops/arg_sort_op.cpp``, ``top_k_op.cpp``; XLA
  ``service/spmd/spmd_partitioner.cc`` (``HandleSort``), ``service/hlo_cost_analysis.cc``,
  ``service/topk_rewriter.cc``, ``hlo/builder/lib/approx_topk.cc`` (``ApproxTopKFallback``);
  jax ``_src/lax/ann.py`` (the lowering); D. E. Knuth, The Art of Computer Programming vol. 3,
  §5.3.1.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Op
from shardc.ir.sbp import Split
from shardc.rules.registry import Signature, register

__all__ = ["row_sort_flops", "sort_flops", "sort_rule", "top_k_flops", "top_k_rule"]


def row_sort_flops(rows: int, n: int) -> float:
    """Comparisons of sorting ``rows`` rows of ``n`` elements: rows * n * ceil(log2 n)."""
    return float(rows * n * math.ceil(math.log2(n))) if n > 1 else 0.0


def _rows(size: int, n: int) -> int:
    return size // n if n else 0


def sort_flops(op: Op) -> float:
    x = op.inputs[0]
    n = x.shape[op.params["dimension"] % x.ndim]
    return row_sort_flops(_rows(x.size, n), n)


def _top_k_dim(op: Op) -> int:
    """The dim a top_k (``axis``) or approx_top_k (``reduction_dimension``) reduces."""
    dim = op.params["reduction_dimension"] if op.name == "approx_top_k" else op.params.get(
        "axis", -1)
    return dim % op.inputs[0].ndim


def top_k_flops(op: Op) -> float:
    x = op.inputs[0]
    n = x.shape[_top_k_dim(op)]
    return row_sort_flops(_rows(x.size, n), n)


def _other_dims(op: Op, sorted_dim: int) -> list[Signature]:
    x = op.inputs[0]
    return [Signature((Split(d),) * len(op.inputs), (Split(d),) * len(op.outputs))
            for d in range(x.ndim) if d != sorted_dim and x.shape[d] > 1]


@register("sort", flops=sort_flops)
def sort_rule(op: Op) -> list[Signature]:
    return _other_dims(op, op.params["dimension"] % op.inputs[0].ndim)


@register("top_k", "approx_top_k", flops=top_k_flops)
def top_k_rule(op: Op) -> list[Signature]:
    return _other_dims(op, _top_k_dim(op))
