"""Control flow: batch-parallel ``while``, and the edges of a ``scan`` body and of a
``cond``'s branches.

A ``scan``'s body is planned op by op like straight code (the trace inlines it, weighted by
its trip count); only its ``scan_enter`` / ``scan_exit`` ops have rules here: a const or
carry enters as it is, an xs slice per iteration (outer dim ``d + 1`` is the body's ``d``),
ys leave stacked (body dim ``d`` is the outer ``d + 1``), and the scanned axis is never
split. A ``cond``'s branches are inlined too (weighted so that the costlier one prices the
cond, ``ir/trace.py``): a ``cond_enter`` gives an operand to a branch as it is, a
``cond_exit`` joins the branches' values of a result in one layout, its index replicated.
No partial crosses a cond's edges.

A ``while`` loop is one op holding sub-jaxprs, so its signatures come from its body: a
split placement of the loop's inputs is exact when the body, run per device on the local
pieces, computes the local pieces of the outputs. That holds when every op of the body
has an exact signature (one the registry lists) for the placements flowing into it.
:func:`propagate` checks this by pushing 1-D SBPs through the body op by op with the body
ops' own rules:

* a value is ``B`` (replicated: a constant, a literal, or computed from replicated values
  only) or ``S(d)``; every split value's ``d`` has the loop's batch size, so the loop's
  even-split check covers the whole body;
* an op with only replicated inputs runs replicated; otherwise it needs a registered
  signature taking each split input in exactly its split, no ``P`` anywhere (a partial value
  would need a reduction inside the body), and a replicated input either whole or as a slice
  (a device holding the whole value takes its own chunk: free);
* any other op (no rule, a reduction over the split dim, a cumulative op along it, ...)
  makes the placement fail.

A replicated loop input (a const, or an xs without the batch dim where it was looked for)
that every use slices the same way is placed split that way: each device only needs its
chunk. A split signature is offered only when the body's replicated ops (constant
subexpressions aside) cost at most :data:`MAX_REPLICATED_SHARE` of its FLOPs, since the
strategy's FLOPs are the op's divided by the split.

Signatures offered (per mesh axis, besides the all-broadcast one):

* ``while`` (inputs ``cond_consts, body_consts, carries``): for every body dim ``d`` and
  batch size ``b`` seen there, carries split on ``d``, iterated to a fixed point (a carry's
  placement at the start of an iteration must be the one the body gives it at the end: a
  carry the body makes replicated becomes ``B``, one it makes split becomes split), and the
  predicate computed by ``cond_jaxpr`` must come out replicated, so every device runs the
  same number of iterations.

Not offered for ``while``: partial inputs, outputs or carries. A ``scan``'s float
carry may be partial (its ``scan_enter`` / ``scan_exit`` take ``P -> P``): the lowering holds
each device's summand apart through the loop (``lower/partial.py``).

FLOPs: a while loop one iteration of body and predicate (the trip count is unknown until it
runs).

References:
  OneFlow nd-SBP propagation (``sbp_infer_util.cpp``) applied to the body graph; XLA SPMD
  partitioning of ``while`` bodies by the loop-carried sharding (``spmd_partitioner.cc``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp

from shardc.ir.graph import Graph, Op, Value
from shardc.ir.sbp import B, P, Partial, Sbp, Split
from shardc.ir.trace import graph_from_jaxpr
from shardc.rules.registry import Signature, op_flops, register, signatures

#: a split signature is offered only when the ops the body runs replicated (on every device,
#: whole) cost at most this share of its FLOPs: ``Strategy.flops`` divides the whole op's
#: FLOPs by the split, which a body doing most of its work replicated would not earn.
MAX_REPLICATED_SHARE = 0.1


@functools.lru_cache(maxsize=256)
def body_graph(closed_jaxpr) -> Graph:
    """The sub-jaxpr as a shardc Graph (calls inlined, literals and consts as constants)."""
    return graph_from_jaxpr(closed_jaxpr)


def _fits(v: Value, s: Sbp, size: int) -> bool:
    return not isinstance(s, Split) or (s.dim < v.ndim and v.shape[s.dim] == size)


def _match(op: Op, cur: Sequence[Sbp], size: int) -> Signature | None:
    """The first signature of ``op`` taking the split inputs as they are and the replicated
    ones whole or sliced, with no partial and every split of size ``size``."""
    for sig in signatures(op):
        if any(isinstance(s, Partial) for s in (*sig.ins, *sig.outs)):
            continue
        if any(c != B and s != c for c, s in zip(cur, sig.ins)):
            continue
        if all(_fits(v, s, size) for v, s in zip((*op.inputs, *op.outputs),
                                                  (*sig.ins, *sig.outs))):
            return sig
    return None


@dataclass
class Flow:
    """What :func:`propagate` found: the outputs' SBPs, and per graph input the SBPs its
    uses take it in (``B``: whole; ``S(d)``: a replicated input sliced by its user)."""

    outs: list[Sbp]
    uses: list[set[Sbp]]
    replicated: float = 0.0  # FLOPs of the ops run replicated (every device, whole), but
    # not of constant subexpressions (of literals and closed-over constants: XLA folds them)
    total: float = 0.0  # FLOPs of all ops


def propagate(graph: Graph, in_sbps: Sequence[Sbp], size: int) -> Flow | None:
    """Push ``in_sbps`` (each ``B`` or ``S(d)`` with ``shape[d] == size``) through ``graph``;
    None when some op has no exact signature for what flows into it (see the module
    docstring)."""
    state: dict[int, Sbp] = {}
    index: dict[int, int] = {}
    constant: set[int] = set()  # ids of values computed from constants only
    for k, (v, s) in enumerate(zip(graph.inputs, in_sbps, strict=True)):
        if not _fits(v, s, size):
            return None
        state[v.id], index[v.id] = s, k
    uses: list[set[Sbp]] = [set() for _ in graph.inputs]
    replicated = total = 0.0

    def get(v: Value) -> Sbp:
        return B if v.is_const else state[v.id]

    def is_constant(v: Value) -> bool:
        return v.is_const or v.id in constant

    def use(v: Value, s: Sbp) -> None:
        if v.id in index:
            uses[index[v.id]].add(s)

    for op in graph.ops:
        cur = [get(v) for v in op.inputs]
        flops = op_flops(op)
        total += flops
        if all(s == B for s in cur):
            if all(is_constant(v) for v in op.inputs):
                constant.update(v.id for v in op.outputs)
            else:
                replicated += flops
            for v in op.inputs:
                use(v, B)
            outs: tuple[Sbp, ...] = (B,) * len(op.outputs)
        else:
            sig = _match(op, cur, size)
            if sig is None:
                return None
            for v, s in zip(op.inputs, sig.ins):
                use(v, s)
            outs = sig.outs
        state.update((v.id, s) for v, s in zip(op.outputs, outs))
    for v in graph.outputs:
        use(v, B)
    return Flow([get(v) for v in graph.outputs], uses, replicated, total)


def _promote(sbps: Sequence[Sbp], uses: Sequence[set[Sbp]]) -> list[Sbp]:
    """A replicated input that every use slices the same way is placed split that way:
    each device only needs its own chunk."""
    out = list(sbps)
    for k, (s, u) in enumerate(zip(sbps, uses)):
        if s == B and len(u) == 1 and isinstance(next(iter(u)), Split):
            out[k] = next(iter(u))
    return out


def _seeds(values: Sequence[Value]) -> list[tuple[int, int]]:
    """(dim, batch size) pairs to try: every dim of every value, sizes > 1."""
    seen: list[tuple[int, int]] = []
    for v in values:
        for d in range(v.ndim):
            key = (d, v.shape[d])
            if v.shape[d] > 1 and key not in seen:
                seen.append(key)
    return seen


def _seed(v: Value, d: int, size: int) -> Sbp:
    return Split(d) if v.ndim > d and v.shape[d] == size else B


def _loop_carries(body: Graph, n_consts: int, carries: list[Sbp], size: int
                  ) -> tuple[list[Sbp], Flow] | None:
    """Iterate the carries' placement to a fixed point; (carries, the body's flow)."""
    n_carry = len(carries)
    for _ in range(2 * n_carry + 2):
        flow = propagate(body, [B] * n_consts + carries, size)
        if flow is None:
            return None
        if flow.outs[:n_carry] == carries:
            return carries, flow
        carries = flow.outs[:n_carry]
    return None


def _has_split(sig: Signature) -> bool:
    return any(isinstance(s, Split) for s in (*sig.ins, *sig.outs))


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
    return sigs + _partial_carry(op)


def _partial_carry(op: Op) -> list[Signature]:
    """A carry may stay a partial sum across iterations (an accumulator of partial
    gradients, reduced once after the loop instead of every iteration): the lowering keeps
    each device's summand in a leading dim of the carry (``lower/partial.py``). Float carries
    only: an integer counter is never a sum of summands worth keeping apart."""
    v = op.outputs[0]
    if op.params["kind"] != "carry" or v.dtype is None or \
            not jnp.issubdtype(v.dtype, jnp.inexact):
        return []
    return [Signature((P,), (P,))]


# ---- while -------------------------------------------------------------------------------

def while_flops(op: Op) -> float:
    graphs = (body_graph(op.params["body_jaxpr"]), body_graph(op.params["cond_jaxpr"]))
    return float(sum(op_flops(o) * o.weight for g in graphs for o in g.ops))


@register("while", flops=while_flops)
def while_rule(op: Op) -> list[Signature]:
    cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
    body = body_graph(op.params["body_jaxpr"])
    cond = body_graph(op.params["cond_jaxpr"])
    carries = op.inputs[cn + bn:]
    sigs = []
    for d, size in _seeds(carries):
        found = _loop_carries(body, bn, [_seed(v, d, size) for v in carries], size)
        if found is None:
            continue
        k, flow = found
        test = propagate(cond, [B] * cn + k, size)
        if test is None or test.outs != [B]:
            continue  # the trip count would depend on the device's slice
        if test.replicated + flow.replicated > MAX_REPLICATED_SHARE * (test.total + flow.total):
            continue
        cconsts = _promote([B] * cn, test.uses[:cn])
        bconsts = _promote([B] * bn, flow.uses[:bn])
        sig = Signature(tuple(cconsts + bconsts + k), tuple(k))
        if _has_split(sig) and sig not in sigs:
            sigs.append(sig)
    return sigs


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
