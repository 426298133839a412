"""Signatures of an op that holds sub-jaxprs and runs them per device.

An op that holds jaxprs (``custom_linear_solve``) is one op in the graph; a split placement
of its inputs is exact when each jaxpr, run per device on the local pieces, computes the
local pieces of the outputs. That holds when every op of the jaxpr has an exact signature
(one the registry lists) for the placements flowing into it. :func:`propagate` checks this
by pushing 1-D SBPs through the jaxpr op by op with its ops' own rules:

* a value is ``B`` (replicated: a constant, a literal, or computed from replicated values
  only) or ``S(d)``; every split value's ``d`` has the batch size tried, so the op's
  even-split check covers the whole jaxpr;
* an op with only replicated inputs runs replicated; otherwise it needs a registered
  signature taking each split input in exactly its split, no ``P`` anywhere (a partial
  value would need a reduction inside), and a replicated input either whole or as a slice
  (a device holding the whole value takes its own chunk: free);
* any other op (no rule, a reduction over the split dim, a cumulative op along it, ...)
  makes the placement fail.

A replicated input that every use slices the same way is placed split that way
(:func:`promote`). A split signature is worth offering only when the jaxpr's replicated
ops (constant subexpressions aside) cost at most :data:`MAX_REPLICATED_SHARE` of its FLOPs
(:attr:`Flow.divides_work`).

References:
  OneFlow nd-SBP propagation (``sbp_infer_util.cpp``) applied to the body graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardc.ir.flops import op_flops
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.sbp import B, Partial, Sbp, Split
from shardc.rules.registry import Signature, signatures

__all__ = ["MAX_REPLICATED_SHARE", "Flow", "has_split", "promote", "propagate", "push",
           "seed", "split_seeds"]

#: a split signature is offered only when the ops the body runs replicated (on every device,
#: whole) cost at most this share of its FLOPs: ``Strategy.flops`` divides the whole op's
#: FLOPs by the split, which a body doing most of its work replicated would not earn.
MAX_REPLICATED_SHARE = 0.1


def _fits(v: Value, s: Sbp, size: int) -> bool:
    return not isinstance(s, Split) or (s.dim < v.ndim and v.shape[s.dim] == size)


def _match(op: Op, cur: Sequence[Sbp], size: int,
           sliceable: Callable[[Value, int], bool]) -> Signature | None:
    """The first signature of ``op`` taking the split inputs as they are and the replicated
    ones whole or sliced (where ``sliceable`` allows), with no partial and every split of
    size ``size``."""
    for sig in signatures(op):
        if any(isinstance(s, Partial) for s in (*sig.ins, *sig.outs)):
            continue
        if any(c != B and s != c for c, s in zip(cur, sig.ins)):
            continue
        if any(c == B and isinstance(s, Split) and not sliceable(v, s.dim)
               for v, c, s in zip(op.inputs, cur, sig.ins)):
            continue
        if all(_fits(v, s, size) for v, s in zip((*op.inputs, *op.outputs),
                                                  (*sig.ins, *sig.outs))):
            return sig
    return None


def _uniform(op: Op, uniform: Callable[[Value], frozenset[int]]) -> frozenset[int]:
    """The dims along which ``op``'s (first) output is the same at every index: its size-1
    dims, a broadcast's new ones, what an elementwise op keeps of its operands' (a scalar
    operand is uniform along every dim) and a transpose or a reshape moves (a reshape that
    only adds or drops size-1 dims, or of a value uniform along all of its); none else."""
    out = op.outputs[0]
    ones = frozenset(j for j in range(out.ndim) if out.shape[j] == 1)
    src = op.inputs[0] if op.inputs else None
    if op.name == "broadcast_in_dim":
        dims = tuple(op.params["broadcast_dimensions"])
        return ones | frozenset(j for j in range(out.ndim) if j not in dims or
                                dims.index(j) in uniform(src))
    if op.name == "transpose":
        perm = tuple(op.params["permutation"])
        return ones | frozenset(j for j in range(out.ndim) if perm[j] in uniform(src))
    if op.name in ("reshape", "squeeze", "expand_dims"):
        if uniform(src) >= frozenset(range(src.ndim)):
            return frozenset(range(out.ndim))
        big_in = [d for d in range(src.ndim) if src.shape[d] != 1]
        big_out = [j for j in range(out.ndim) if out.shape[j] != 1]
        if [src.shape[d] for d in big_in] != [out.shape[j] for j in big_out]:
            return ones
        return ones | frozenset(j for d, j in zip(big_in, big_out) if d in uniform(src))
    if facts(op.name).elementwise:
        kept = frozenset(range(out.ndim))
        for v in op.inputs:
            if v.ndim:
                kept &= uniform(v) if v.shape == out.shape else frozenset()
        return ones | kept
    return ones


@dataclass
class Flow:
    """What :func:`propagate` found: the outputs' SBPs, and per graph input the SBPs its
    uses take it in (``B``: whole; ``S(d)``: a replicated input sliced by its user)."""

    outs: list[Sbp]
    uses: list[set[Sbp]]
    replicated: float = 0.0  # FLOPs of the ops run replicated (every device, whole), but
    # not of constant subexpressions (of literals and closed-over constants: XLA folds them)
    total: float = 0.0  # FLOPs of all ops

    @property
    def divides_work(self) -> bool:
        """Most of the body's work is split (what a split signature tells the cost model)."""
        return self.replicated <= MAX_REPLICATED_SHARE * self.total


def propagate(graph: Graph, in_sbps: Sequence[Sbp], size: int,
              uniform_slices: bool = False) -> Flow | None:
    """Push ``in_sbps`` (each ``B`` or ``S(d)`` with ``shape[d] == size``) through ``graph``;
    None when some op has no exact signature for what flows into it (see the module
    docstring; :func:`push` says which)."""
    flow = push(graph, in_sbps, size, uniform_slices)
    return flow if isinstance(flow, Flow) else None


def push(graph: Graph, in_sbps: Sequence[Sbp], size: int,
         uniform_slices: bool = False) -> Flow | str:
    """:func:`propagate`'s :class:`Flow`, or where it stops, in words (the op and the user's
    line that made it). With ``uniform_slices`` a replicated value is sliced only along a
    dim it is the same at every index of (:func:`_uniform`: a broadcast's): a slice of any
    other replicated value (an ``iota`` over the batch, random bits of the batch's shape, a
    weight) reads something a run on a part of the batch, traced at the part's size, would
    not read."""
    state: dict[int, Sbp] = {}
    index: dict[int, int] = {}
    constant: set[int] = set()  # ids of values computed from constants only
    same: dict[int, frozenset[int]] = {}  # replicated values' uniform dims (_uniform)
    for k, (v, s) in enumerate(zip(graph.inputs, in_sbps, strict=True)):
        if not _fits(v, s, size):
            return f"input {k} (shape {v.shape}) has no dim {s} of size {size}"
        state[v.id], index[v.id] = s, k
    uses: list[set[Sbp]] = [set() for _ in graph.inputs]
    replicated = total = 0.0

    def get(v: Value) -> Sbp:
        return B if v.is_const else state[v.id]

    def is_constant(v: Value) -> bool:
        return v.is_const or v.id in constant

    def uniform(v: Value) -> frozenset[int]:
        return same.get(v.id, frozenset(d for d in range(v.ndim) if v.shape[d] == 1))

    def sliceable(v: Value, d: int) -> bool:
        return not uniform_slices or d in uniform(v)

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
            if uniform_slices and op.outputs:
                same[op.outputs[0].id] = _uniform(op, uniform)
        else:
            sig = _match(op, cur, size, sliceable)
            if sig is None:
                return op.named
            for v, s in zip(op.inputs, sig.ins):
                use(v, s)
            outs = sig.outs
        state.update((v.id, s) for v, s in zip(op.outputs, outs))
    for v in graph.outputs:
        use(v, B)
    return Flow([get(v) for v in graph.outputs], uses, replicated, total)


def promote(sbps: Sequence[Sbp], uses: Sequence[set[Sbp]]) -> list[Sbp]:
    """A replicated input that every use slices the same way is placed split that way:
    each device only needs its own chunk."""
    out = list(sbps)
    for k, (s, u) in enumerate(zip(sbps, uses)):
        if s == B and len(u) == 1 and isinstance(next(iter(u)), Split):
            out[k] = next(iter(u))
    return out


def split_seeds(values: Sequence[Value]) -> list[tuple[int, int]]:
    """(dim, batch size) pairs to try: every dim of every value, sizes > 1."""
    seen: list[tuple[int, int]] = []
    for v in values:
        for d in range(v.ndim):
            key = (d, v.shape[d])
            if v.shape[d] > 1 and key not in seen:
                seen.append(key)
    return seen


def seed(v: Value, d: int, size: int) -> Sbp:
    return Split(d) if v.ndim > d and v.shape[d] == size else B

def has_split(sig: Signature) -> bool:
    return any(isinstance(s, Split) for s in (*sig.ins, *sig.outs))

