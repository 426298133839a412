"""dot_general: batch, free-dim and contracting splits (the Megatron building blocks).

Per mesh axis (OneFlow matmul table, generalised to dot_general's dimension numbers):
batch pair (S(lb),S(rb))->S(i); lhs free dim (S(m),B)->S; rhs free dim (B,S(n))->S;
contracting pair (S(k),S(k))->P; (P,B)->P and (B,P)->P.

References:
  OneFlow ``user/ops/matmul_op.cpp`` SBP signatures; Alpa OSDI'22 §4.2 dot strategies.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Op
from shardc.ir.sbp import B, P, Split
from shardc.rules.registry import Signature, register

__all__ = ["dot_flops", "dot_general_rule"]


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
    return sigs
