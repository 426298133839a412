"""Facts of how values flow through a graph, shared by the solver, the plan and the lowering:
what an op reads (a scan's carry result reads the loop-carried value), the loops' carries and
tests, how often a read runs, and the tail (values on their way to the outputs through tail
primitives only: gradients into the optimizer update)."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT

__all__ = ["carry_exit", "head_values", "loop_tests", "loop_ties", "read_runs", "reads",
           "late_op", "late_values", "settle_runs", "tail_values", "unrolled_sums"]


def carry_exit(op: Op) -> bool:
    """``op`` is a scan's carry result: it reads the loop-carried value (its
    ``scan_enter``'s output) as the loop keeps it, made, not settled for the body's uses."""
    return op.prim is SCAN_EXIT and op.params["kind"] == "carry"


def reads(op: Op) -> list[tuple[int, Value]]:
    """(input slot, value) pairs the cost graph prices for ``op``: its inputs, except that a
    scan's carry result is read from the loop-carried value (:func:`carry_exit`), not from
    the body's last value."""
    if carry_exit(op):
        return [(0, op.params["enter"])]
    return list(enumerate(op.inputs))


def read_runs(runs: Mapping[int, int], val: Value, op: Op) -> int:
    """How many times per call ``op``'s read of ``val`` is converted: as often as the more
    frequent end runs (a value made outside a loop and read inside it: every iteration).
    ``runs`` is :meth:`Graph.runs`."""
    return max(runs.get(val.id, 1), op.weight)


def settle_runs(graph: Graph) -> dict[int, int]:
    """value id -> how many times per call its settling conversion runs (the one layout its
    readers share): its producer's weight (:meth:`Graph.runs`), and for a loop's
    per-iteration input, an ``xs`` or ``carry`` ``scan_enter``'s output (a layer's slice
    of the stacked weights, the carry as an iteration reads it), the body's: that value
    exists inside the body only, so it is converted there, every iteration (the 1B Llama's
    layer weights settled whole: 16 all-gathers per step compiled, one planned)."""
    return graph.memo("settle_runs", _settle_runs)


def _settle_runs(graph: Graph) -> dict[int, int]:
    runs = dict(graph.runs())
    for op in graph.ops:
        if op.prim is SCAN_ENTER and op.params["kind"] in ("xs", "carry"):
            runs[op.outputs[0].id] = op.weight * op.params["length"]
    return runs


def loop_ties(graph: Graph) -> list[tuple[Op, Value]]:
    """(carry's ``scan_enter``, the value the body returns for it): converted to the
    carried layout at the end of every iteration."""
    out = []
    for op in graph.ops:
        tie = op.params.get("tie") if op.prim is SCAN_ENTER else None
        if tie is not None and not tie.is_const and tie is not op.outputs[0]:
            out.append((op, tie))
    return out


def loop_tests(graph: Graph) -> list[Value]:
    """The predicates of the while loops (a carry's ``scan_enter`` names it, ``test``): read
    replicated every iteration, so that every device runs the same number."""
    tests = {op.params["test"].id: op.params["test"] for op in graph.ops
             if op.prim is SCAN_ENTER and op.params.get("test") is not None}
    return [v for v in tests.values() if not v.is_const]


def unrolled_sums(graph: Graph) -> set[int]:
    """Ids of the program's own adds (not a loop's or a call's) of two values made by ops,
    on a tail path (:func:`shardc.ir.flow.tail_values`): the micro-batches' gradients
    summed by a Python loop, on their way into the optimizer. They may read partial values
    as a scan's accumulator does: each micro-batch's partial gradient is then held apart
    per device and the sum reduced once (``lower/stacking.py``), not once per micro-batch."""
    tail = tail_values(graph)
    return {op.id for op in graph.ops
            if op.name in ("add", "add_any") and len(op.where) == 1 and op.weight == 1
            and op.outputs[0].id in tail and jnp.issubdtype(op.outputs[0].dtype, jnp.inexact)
            and all(v.producer is not None for v in op.inputs)}


def tail_values(graph: Graph) -> frozenset[int]:
    """Ids of values whose every path to the outputs passes tail primitives only (computed
    once per graph: :meth:`shardc.ir.graph.Graph.memo`)."""
    return graph.memo("tail_values", _tail_values)


def late_values(graph: Graph) -> frozenset[int]:
    """Ids of values whose every path to the outputs passes tail primitives and full
    reductions only (:func:`late_op`): the tail, and before it the gradients a global norm
    or a finite check reads as well as the update (computed once per graph). No late value
    made by a non-late op depends on another: XLA combines their collectives."""
    return graph.memo("late_values", lambda g: _tail_values(g, late_op))


def late_op(op: Op) -> bool:
    """A tail primitive, or a reduction of every dimension to one scalar (a global norm's
    ``reduce_sum``, a finite check's ``reduce_and``): its result steers the tail and costs
    nothing to move, so a collective before it is as independent as one in the tail."""
    return facts(op.name).tail or (op.name in FULL_REDUCTIONS and len(op.outputs) == 1
                                   and not op.outputs[0].shape)


#: reductions that, over every dimension, make a scalar a tail reads (:func:`late_op`)
FULL_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and",
                             "reduce_or", "reduce_prod"})


def _tail_op(op: Op) -> bool:
    return facts(op.name).tail


def _tail_values(graph: Graph, passes=_tail_op) -> frozenset[int]:
    consumers = graph.consumers()
    outputs = {v.id for v in graph.outputs}
    tail: set[int] = set()

    def is_tail(v) -> bool:
        users = consumers.get(v.id, [])
        if not users:
            return v.id in outputs
        return all(passes(u) and all(o.id in tail for o in u.outputs) for u, _ in users)

    for op in reversed(graph.ops):
        tail.update(v.id for v in op.outputs if is_tail(v))
    tail.update(v.id for v in graph.inputs if is_tail(v))
    return frozenset(tail)


def head_values(graph: Graph) -> frozenset[int]:
    """Ids of the graph's inputs and of values made from them by tail primitives alone
    (a parameter, its cast or transpose): values no step computes from the batch, so their
    conversions depend on nothing in the step (computed once per graph)."""
    return graph.memo("head_values", _head_values)


def _head_values(graph: Graph) -> frozenset[int]:
    head = {v.id for v in graph.inputs}
    for op in graph.ops:
        if facts(op.name).tail and all(v.is_const or v.id in head for v in op.inputs):
            head.update(v.id for v in op.outputs)
    return frozenset(head)
