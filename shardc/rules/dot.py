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

References:
  OneFlow ``user/ops/matmul_op.cpp`` SBP signatures; Alpa OSDI'22 §4.2 dot strategies.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Op
from shardc.ir.sbp import B, P, Split
from shardc.rules.registry import Signature, register

__all__ = ["dot_flops", "dot_general_rule", "ring_of"]


def _dims(op: Op):
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.inputs
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb), lfree, rfree


def dot_flops(op: Op) -> float:
    lc = op.params["dimension_numbers"][0][0]
    k = math.prod(op.inputs[0].shape[d] for d in lc)
    return 2.0 * op.outputs[0].size * k


@register("dot_general", flops=dot_flops)
def dot_general_rule(op: Op) -> list[Signature]:
    lc, rc, lb, rb, lfree, rfree = _dims(op)
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
    lc, rc, lb, rb, lfree, rfree = _dims(op)
    lout = {d: len(lb) + j for j, d in enumerate(lfree)}
    rout = {d: len(lb) + len(lfree) + j for j, d in enumerate(rfree)}
    sigs = [Signature((Split(m), Split(r)), (Split(lout[m]),), ring=1)
            for m in lfree for r in (*rfree, *rc)]
    sigs += [Signature((Split(l), Split(n)), (Split(rout[n]),), ring=0)
             for n in rfree for l in (*lfree, *lc)]
    sigs += [Signature((Split(l), Split(r)), (Split(o),), ring=2)
             for l, r in zip(lc, rc) for o in (*lout.values(), *rout.values())]
    return sigs


def ring_of(op: Op, ins, outs) -> tuple[int, int] | None:
    """``(mesh axis, what passes round it)`` where an op's planned layouts ``ins`` /
    ``outs`` (NdSbp) hold a ring signature on an axis (module docstring), else None: the
    lowering reads the ring from the plan's layouts."""
    if op.name != "dot_general" or not op.params["dimension_numbers"][1][0]:
        return None
    for sig in _rings(op):
        for a in range(len(outs[0].sbps)):
            if (ins[0].sbps[a], ins[1].sbps[a], outs[0].sbps[a]) == (*sig.ins, *sig.outs):
                return a, sig.ring
    return None
