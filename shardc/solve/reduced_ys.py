"""Per-layer values of a scan reduced once after the loop.

A batch-split backward scan makes each layer's weight gradient partial over the data axes
and stacks it as a ``ys``. Reduced inside the loop, it pays a collective's latency once per
layer (NCCL ring/Simple on 8 NVLink GPUs: 8.4 + 14 x 3.4 us each); a float ys exit may
instead read its body's value partial (``P -> B``, :func:`shardc.rules.control.scan_exit_rule`)
and all-reduce the whole stack once after the loop. These helpers find such exits, price
the after-loop all-reduce on the exit's strategies (one latency shared by the loop's ys,
which XLA's combiner joins into one collective) and restrict which partial layouts an exit
reads (those the lowering, ``lower/stacking.py``, holds stacked).

References:
  NCCL's latency model (``cost/collectives.py``); XLA's all-reduce combiner
  (``cost/combine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from shardc.ir.graph import Graph, Op, Value
from shardc.ir.sbp import NdSbp, Partial
from shardc.ir.trace import SCAN_EXIT

if TYPE_CHECKING:
    from shardc.solve.costgraph import CostGraph

__all__ = ["stacked_ys", "unreduced_ys", "whole_partial", "ys_exits", "ys_reduction",
           "ys_shares"]


def ys_reduction(cg: CostGraph, strats: Sequence, out: Value, share: float) -> np.ndarray:
    """Per strategy of a ys ``scan_exit``, the time of the all-reduce after the loop where
    it reads the body's value partial (:func:`unreduced_ys`), paying ``share`` of its
    latency (:func:`ys_shares`)."""
    return np.array([0.0 if (src := unreduced_ys(s)) is None else
                     cg.reshard_matrix([src], [s.outs[0]], out.nbytes, share)[0, 0]
                     for s in strats])


def ys_shares(graph: Graph, exits: set[int]) -> dict[int, float]:
    """Id of a ys exit's value -> the share of the after-loop all-reduce's latency it pays:
    the all-reduces of one loop's ys run side by side after it and XLA's combiner joins
    them into one collective (``cost/combine.py``), so each of the loop's ``K`` float ys
    pays ``1/K`` (as if all were reduced after it)."""
    loops: dict[tuple[int, ...], list[Value]] = {}
    for op in graph.ops:
        if op.id in exits:
            loops.setdefault(op.where, []).append(op.outputs[0])
    return {v.id: 1.0 / len(vs) for vs in loops.values() for v in vs}


def whole_partial(nd: NdSbp, axis_sizes: Sequence[int]) -> bool:
    """``nd`` is partial along every mesh axis (of size > 1), or along none. A ys exit
    reads its body's value partial only so: the lowering holds a value stacked over the
    axes it is made partial along, and a partial value converted in the loop to one partial
    along fewer axes (a reduce-scatter over one axis of a value partial over two) is summed
    over them all first (``lower/emit.py``), a full all-reduce every iteration."""
    return not nd.has_partial or all(isinstance(s, Partial)
                                     for s, n in zip(nd.sbps, axis_sizes) if n > 1)


def unreduced_ys(strat) -> NdSbp | None:
    """The layout a ys ``scan_exit`` planned ``strat`` holds its stacked value in until the
    all-reduce after the loop: as the exit makes it, but partial along the axes it reads
    the body's value partial (``P -> B``); None where it reads none partial."""
    if not strat.ins[0].has_partial:
        return None
    return NdSbp(tuple(i if isinstance(i, Partial) else o
                       for i, o in zip(strat.ins[0].sbps, strat.outs[0].sbps)))


def ys_exits(graph: Graph) -> set[int]:
    """Ids of the ys ``scan_exit`` ops that may read their body's value partial and
    all-reduce it after the loop (:func:`stacked_ys`)."""
    return {op.id for op in graph.ops if _float_ys(op)}


def _float_ys(op: Op) -> bool:
    return op.prim is SCAN_EXIT and op.params["kind"] == "ys" and \
        op.params.get("loop") != "while" and jnp.issubdtype(op.outputs[0].dtype, jnp.inexact)


def stacked_ys(graph: Graph) -> set[int]:
    """Ids of a scan's float ``ys`` exits and of the body's adds that make their values (a
    weight read twice in a layer: its gradient is the sum of two partial terms): a per-layer
    gradient may leave the body partial, held stacked and reduced once after the loop
    (:func:`shardc.rules.control.scan_exit_rule`), and the adds may then sum its partial
    terms, which the lowering holds apart per device (``lower/partial.py``)."""
    out: set[int] = set()
    for op in graph.ops:
        if not _float_ys(op):
            continue
        out.add(op.id)
        depth = len(op.where) + 1
        todo = [op.inputs[0]]
        while todo:
            made = todo.pop().producer
            if made is None or made.id in out or len(made.where) != depth or \
                    made.name not in ("add", "add_any"):
                continue
            out.add(made.id)
            todo.extend(v for v in made.inputs if not v.is_const)
    return out
