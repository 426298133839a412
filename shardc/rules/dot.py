"""dot_general: batch, free-dim and contracting splits (the Megatron building blocks).

Per mesh axis (OneFlow matmul table, generalised to dot_general's dimension numbers):
batch pair (S(lb),S(rb))->S(i); lhs free dim (S(m),B)->S; rhs free dim (B,S(n))->S;
contracting pair (S(k),S(k))->P; (P,B)->P and (B,P)->P.

Ring signatures (collective matmuls), for the dots with batch dims an attention is made of
(the scores ``q . k``, the output ``p . v`` and their gradients): both operands split along
the axis, and one thing passed round it by ``ppermute`` while each device computes with the
block it holds, so the transfer of the next block hides behind this block's product
(:attr:`shardc.rules.registry.Signature.ring`; run by :mod:`shardc.lower.local`):

* ``(S(m), S(r)) -> S(m)``, ring 1: the rhs's blocks passed round (``r`` free: each block
  makes a slice of the result; ``r`` contracted: each adds its share), as an all-gather of
  the rhs would feed the lhs-free split (K/V blocks round the ring, ring attention);
* ``(S(l), S(n)) -> S(n)``, ring 0: the same with the lhs's blocks passed round;
* ``(S(k), S(k)) -> S(o)``, ring 2: the contraction split and the result's partial sums
  passed round, each device adding its share to the block passing, as a reduce-scatter
  of the contraction split's partial result would (the keys' and values' gradients).

An operand passed round that repeats a smaller value (grouped-query attention's keys and
values, each head repeated for its query heads by ``jnp.repeat``:
:func:`shardc.cost.ring.repeated`) is
passed as that value, each device repeating the block it holds: 1 / groups of the bytes.

References:
  OneFlow ``user/ops/matmul_op.cpp`` SBP signatures; Alpa OSDI'22 §4.2 dot strategies.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Op
from shardc.ir.sbp import B, P, Split
from shardc.rules.registry import Signature, register

__all__ = ["batched_dot", "dot_dims", "dot_flops", "dot_general_rule", "result_dim",
           "ring_of"]


def dot_dims(op: Op):
    """``(lc, rc, lb, rb, lfree, rfree)`` of a ``dot_general``: its contracting and batch
    dims per operand, and each operand's free dims (neither), in operand order."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.inputs
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb), lfree, rfree


def batched_dot(op: Op) -> bool:
    """A ``dot_general`` with batch dims: attention's products (per batch and head) and
    the dots that may hold a ring (module docstring)."""
    return op.name == "dot_general" and bool(op.params["dimension_numbers"][1][0])


def result_dim(op: Op, operand: int, dim: int) -> int:
    """The dim of a ``dot_general``'s result that free dim ``dim`` of its operand
    ``operand`` (0 or 1) becomes: the batch dims come first, then the lhs's free dims,
    then the rhs's, each in operand order."""
    _, _, lb, _, lfree, rfree = dot_dims(op)
    return len(lb) + (lfree.index(dim) if operand == 0 else len(lfree) + rfree.index(dim))


def dot_flops(op: Op) -> float:
    lc = op.params["dimension_numbers"][0][0]
    k = math.prod(op.inputs[0].shape[d] for d in lc)
    return 2.0 * op.outputs[0].size * k


@register("dot_general", flops=dot_flops)
def dot_general_rule(op: Op) -> list[Signature]:
    lc, rc, lb, rb, lfree, rfree = dot_dims(op)
    sigs = []
    for i, (l, r) in enumerate(zip(lb, rb)):
        sigs.append(Signature((Split(l), Split(r)), (Split(i),)))
    for j, l in enumerate(lfree):
        sigs.append(Signature((Split(l), B), (Split(len(lb) + j),)))
    for j, r in enumerate(rfree):
        sigs.append(Signature((B, Split(r)), (Split(len(lb) + len(lfree) + j),)))
    for l, r in zip(lc, rc):
        sigs.append(Signature((Split(l), Split(r)), (P,)))
    sigs.append(Signature((P, B), (P,)))
    sigs.append(Signature((B, P), (P,)))
    return sigs + _rings(op) if lb else sigs


def _rings(op: Op) -> list[Signature]:
    """The ring signatures (module docstring) of a dot with batch dims."""
    lc, rc, lb, rb, lfree, rfree = dot_dims(op)
    sigs = [Signature((Split(m), Split(r)), (Split(result_dim(op, 0, m)),), ring=1)
            for m in lfree for r in (*rfree, *rc)]
    sigs += [Signature((Split(l), Split(n)), (Split(result_dim(op, 1, n)),), ring=0)
             for n in rfree for l in (*lfree, *lc)]
    frees = range(len(lb), len(lb) + len(lfree) + len(rfree))  # the result's free dims
    sigs += [Signature((Split(l), Split(r)), (Split(o),), ring=2)
             for l, r in zip(lc, rc) for o in frees]
    return sigs


def ring_of(op: Op, ins, outs) -> tuple[int, int] | None:
    """``(mesh axis, what passes round it)`` where an op's planned layouts ``ins`` /
    ``outs`` (NdSbp) hold a ring signature on an axis (module docstring), else None: the
    lowering reads the ring from the plan's layouts."""
    if not batched_dot(op):
        return None
    for sig in _rings(op):
        for a in range(len(outs[0].sbps)):
            if (ins[0].sbps[a], ins[1].sbps[a], outs[0].sbps[a]) == (*sig.ins, *sig.outs):
                return a, sig.ring
    return None

