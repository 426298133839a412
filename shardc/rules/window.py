"""Windowed reductions (pooling) and their gradients: ``reduce_window_sum`` /
``reduce_window_max`` / ``reduce_window_min``, the generic ``reduce_window``,
``select_and_scatter_add`` (max/min-pool's gradient) and ``select_and_gather_add`` (its
forward-mode tangent, and the transpose of ``select_and_scatter_add``).

``flax`` ``max_pool`` / ``min_pool`` / ``avg_pool`` lower to ``reduce_window_{max,min,sum}``;
``jax.grad`` turns max/min-pool into ``select_and_scatter_add(cotangent, operand)`` and
avg-pool into ``pad`` (interior padding by the stride, a ``shape`` rule) followed by a
stride-1 ``reduce_window_sum``.

A dim *passes through* the window when its window size, stride, base and window dilation are
1 and it is not padded (batch and channel dims of a pooling layer): its output dim is its
input dim. Per mesh axis (OneFlow's pooling ops and their gradients split the batch and
channel dims, ``AvgPoolForwardGetSbpFn`` / ``AvgPoolBackwardGetSbpFn``; XLA's SPMD
partitioner shards a dim whose window is trivial with no communication,
``SpmdPartitioningVisitor::HandleReduceWindow`` / ``HandleSelectAndScatter``):

* ``reduce_window_*``: ``S(d) -> S(d)`` for a pass-through dim ``d``;
* ``reduce_window`` (``n`` operands, ``n`` scalar init values, ``n`` outputs): every operand
  and output ``S(d)``, the init values ``B``;
* ``select_and_scatter_add(source, operand)`` and ``select_and_gather_add(tangents,
  operand)``: ``(S(d), S(d)) -> S(d)``.

Partial values: ``reduce_window_sum`` is linear (``P -> P``; its padding and base-dilation
holes add 0). ``select_and_scatter_add`` / ``select_and_gather_add`` are linear in their
first operand once the selecting operand is fixed: ``(P, B) -> P``. A max or min of sums is
not the sum of maxes, so ``reduce_window_max`` / ``_min`` and the generic ``reduce_window``
get no partial (shardc has no ``P(max)``).

Not offered: splits of a windowed (spatial) dim. A window crossing the cut between two
devices reads the neighbour's rows, i.e. a halo exchange (XLA's windowed-input
partitioning: ``collective-permute`` of the overlap), which a 1-D SBP signature cannot
express or price. Windows that tile the dim exactly (window == stride, no padding or
dilation) would split without a halo; they are left out too, like the spatial splits of
``conv_general_dilated``.

FLOPs, as XLA's ``HloCostAnalysis`` counts them (``compiled.cost_analysis()["flops"]``, the
number the rest of shardc's cost model is checked against; OneFlow's pooling cost counts one
op per window element per output, ``GetComputationCostFn``, one more per output than the
reducer applications XLA counts):

* ``reduce_window*``: ``(window elements - 1)`` applications of the reducer per output
  element (padded taps included), times the reducer's FLOPs (1 for sum/max/min; the body's
  FLOPs for the generic ``reduce_window``);
* ``select_and_scatter_add``: per source element, ``window elements - 1`` selects and one
  scatter add, i.e. ``source elements x window elements`` (XLA counts the HLO
  ``select-and-scatter`` this way; the CPU backend later expands it into index tuples,
  which is not the op's work);
* ``select_and_gather_add``: jax lowers it to a 2-operand ``reduce-window`` whose reducer
  is a compare and two selects: ``3 x (window elements - 1)`` per output element.

References:
  XLA ``service/hlo_cost_analysis.cc`` (``HandleReduceWindow``, ``HandleSelectAndScatter``);
  XLA ``service/spmd/spmd_partitioner.cc`` (windowed ops, halo exchange);
  OneFlow ``user/ops/avg_pool_op.cpp``, ``max_pool_op.cpp`` (SBP: split batch / channel;
  the pooling compute cost); jax ``_src/lax/windowed_reductions.py`` (the primitives, their
  lowerings and transposes).
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from shardc.ir.flops import op_flops
from shardc.ir.graph import Op
from shardc.ir.sbp import B, P, Split
from shardc.ir.trace import graph_from_jaxpr
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["generic_window_flops", "generic_window_rule", "monoid_window_flops",
           "monoid_window_rule", "MONOID_WINDOWS", "passthrough_dims", "reducer_flops",
           "select_and_gather_add_flops", "select_and_scatter_add_flops", "select_window_rule",
           "window_size"]

MONOID_WINDOWS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min")


def passthrough_dims(op: Op) -> list[int]:
    """Dims the window leaves alone: size, stride and dilations 1, no padding."""
    p = op.params
    n = len(p["window_dimensions"])
    ones = (1,) * n
    base = p.get("base_dilation") or ones
    wdil = p.get("window_dilation") or ones
    return [d for d in range(n)
            if p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
            and tuple(p["padding"][d]) == (0, 0) and base[d] == 1 and wdil[d] == 1]


def window_size(op: Op) -> int:
    return math.prod(op.params["window_dimensions"])


def monoid_window_flops(op: Op) -> float:
    """One reducer application per window element but the first, per output element."""
    return float((window_size(op) - 1) * op.outputs[0].size)


def reducer_flops(op: Op) -> float:
    """FLOPs of one application of a generic ``reduce_window``'s body (scalar ops)."""
    body = graph_from_jaxpr(jcore.ClosedJaxpr(op.params["jaxpr"], list(op.params["consts"])))
    return float(sum(op_flops(o) for o in body.ops))


def generic_window_flops(op: Op) -> float:
    return monoid_window_flops(op) * reducer_flops(op)


def select_and_scatter_add_flops(op: Op) -> float:
    """``window - 1`` selects and one add per source (cotangent) element."""
    return float(op.inputs[0].size * window_size(op))


def select_and_gather_add_flops(op: Op) -> float:
    """A compare and two selects per reduction of the (operand, tangent) pair."""
    return 3.0 * monoid_window_flops(op)


@register(*MONOID_WINDOWS, flops=monoid_window_flops)
def monoid_window_rule(op: Op) -> list[Signature]:
    sigs = [Signature((Split(d),), (Split(d),)) for d in passthrough_dims(op)]
    if op.name == "reduce_window_sum" and is_numeric(op.inputs[0].dtype):
        sigs.append(Signature((P,), (P,)))
    return sigs


@register("reduce_window", flops=generic_window_flops)
def generic_window_rule(op: Op) -> list[Signature]:
    n = len(op.outputs)
    return [Signature((Split(d),) * n + (B,) * n, (Split(d),) * n)
            for d in passthrough_dims(op)]


@register("select_and_scatter_add", flops=select_and_scatter_add_flops)
@register("select_and_gather_add", flops=select_and_gather_add_flops)
def select_window_rule(op: Op) -> list[Signature]:
    sigs = [Signature((Split(d), Split(d)), (Split(d),)) for d in passthrough_dims(op)]
    if is_numeric(op.inputs[0].dtype):
        sigs.append(Signature((P, B), (P,)))
    return sigs
