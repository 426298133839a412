"""Control flow: the edge ops framing the bodies the planner sees inline.

A ``scan``'s body is planned op by op like straight code (the trace inlines it, weighted by
its trip count); only its ``scan_enter`` / ``scan_exit`` ops have rules here: a const or
carry enters as it is, an xs slice per iteration (outer dim ``d + 1`` is the body's ``d``),
ys leave stacked (body dim ``d`` is the outer ``d + 1``), and the scanned axis is never
split. A ``while`` loop is framed by the same ops (consts and carries, ``loop="while"``),
its predicate and body inlined and weighted by its trip count (``ir/trips.py``); the
predicate is read replicated every iteration (``solve/problem.py``), so every device runs
the same number of iterations. A ``cond``'s branches are inlined too (weighted so that the
costlier one prices the cond, ``ir/trace.py``): a ``cond_enter`` gives an operand to a
branch as it is, a ``cond_exit`` joins the branches' values of a result in one layout, its
index replicated. No partial crosses a cond's edges.

A scan's float carry may be partial (its ``scan_enter`` / ``scan_exit`` take ``P -> P``):
the lowering holds each device's summand apart through the loop (``lower/partial.py``). A float
ys may leave the loop unreduced (its ``scan_exit`` takes ``P -> B`` on a mesh axis): a
per-layer gradient of a batch-split backward scan is held stacked with each device's
summands of every iteration, and all-reduced once after the loop, one collective for all
layers (priced on the exit, ``solve/problem.py``), instead of one per iteration; the
planner prices the two (for large gradients the in-loop reduce-scatter moves half the
bytes of the after-loop all-reduce). A
while's carries are not: the lowering rebuilds a while with plain carries.

References:
  XLA SPMD partitioning of ``while`` bodies by the loop-carried sharding
  (``spmd_partitioner.cc``); OneFlow's SBP signatures per op, applied to the body's ops.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from shardc.ir.graph import Graph, Op
from shardc.ir.sbp import B, P, Split
from shardc.ir.trace import graph_from_jaxpr
from shardc.rules.registry import Signature, register

__all__ = ["body_graph", "cond_enter_rule", "cond_exit_rule", "empty_rule", "scan_enter_rule",
           "scan_exit_rule"]


@functools.lru_cache(maxsize=256)
def body_graph(closed_jaxpr) -> Graph:
    """The sub-jaxpr as a shardc Graph (calls inlined, literals and consts as constants)."""
    return graph_from_jaxpr(closed_jaxpr)


# ---- scan: the body is planned op by op -------------------------------------------------

def _no_flops(op: Op) -> float:
    return 0.0


def _shift(op: Op) -> int:
    """1 where the outer value has the scanned axis in front (xs in, ys out), else 0."""
    return 1 if op.params["kind"] in ("xs", "ys") else 0


@register("scan_enter", flops=_no_flops)
def scan_enter_rule(op: Op) -> list[Signature]:
    """An operand entering a scan body: a const or carry as it is, an xs per iteration
    (outer dim ``d + 1`` is the body's dim ``d``; the scanned axis is never split)."""
    k = _shift(op)
    sigs = [Signature((Split(d + k),), (Split(d),)) for d in range(op.outputs[0].ndim)]
    return sigs + _partial_carry(op)


@register("scan_exit", flops=_no_flops)
def scan_exit_rule(op: Op) -> list[Signature]:
    """A scan result: a carry as it leaves the loop, ys stacked from the body's values."""
    k = _shift(op)
    sigs = [Signature((Split(d),), (Split(d + k),)) for d in range(op.inputs[0].ndim)]
    return sigs + _partial_carry(op) + _partial_ys(op)


def _float(op: Op) -> bool:
    v = op.outputs[0]
    return v.dtype is not None and jnp.issubdtype(v.dtype, jnp.inexact)


def _partial_ys(op: Op) -> list[Signature]:
    """A scan's float ys may leave the body partial and the loop reduced: each device's
    summands of every iteration are held stacked (``lower/partial.py``) and all-reduced
    once after the loop, one collective of the whole stack, where XLA runs one per
    iteration otherwise (each paying the collective's latency)."""
    if op.params["kind"] != "ys" or op.params.get("loop") == "while" or not _float(op):
        return []
    return [Signature((P,), (B,))]


def _partial_carry(op: Op) -> list[Signature]:
    """A carry may stay a partial sum across iterations (an accumulator of partial
    gradients, reduced once after the loop instead of every iteration): the lowering keeps
    each device's summand in a leading dim of the carry (``lower/partial.py``). Float carries
    only: an integer counter is never a sum of summands worth keeping apart. Not a while's
    carry (its lowering holds none stacked)."""
    if op.params["kind"] != "carry" or op.params.get("loop") == "while" or not _float(op):
        return []
    return [Signature((P,), (P,))]


# ---- cond: each branch is planned op by op ------------------------------------------------

@register("cond_enter", flops=_no_flops)
def cond_enter_rule(op: Op) -> list[Signature]:
    """An operand entering a branch, in the layout the branch reads it (converted before the
    cond: the conversion runs whichever branch is taken)."""
    return [Signature((Split(d),), (Split(d),)) for d in range(op.outputs[0].ndim)]


@register("cond_exit", flops=_no_flops)
def cond_exit_rule(op: Op) -> list[Signature]:
    """A cond result: the index, replicated (every device takes the same branch), and each
    branch's value of it, converted inside its branch to the result's layout."""
    n = len(op.inputs) - 1
    return [Signature((B,) + (Split(d),) * n, (Split(d),)) for d in range(op.outputs[0].ndim)]


@register("empty", "empty2", flops=_no_flops)
def empty_rule(op: Op) -> list[Signature]:
    """Uninitialised memory: what a branch returns for a residual only another branch makes
    (jax's partial evaluation of a ``cond``). Each device makes its own piece, any layout."""
    return [Signature((), (Split(d),)) for d in range(op.outputs[0].ndim)]
