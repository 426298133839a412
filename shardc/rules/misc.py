"""Ops that do no arithmetic: identities (``name``, ``optimization_barrier``) and a
reinterpretation of bits (``bitcast_convert_type``).

``name`` is what ``jax.ad_checkpoint.checkpoint_name`` binds (a tag for remat policies);
``optimization_barrier`` returns its operands unchanged (it only stops XLA from moving work
across it). Result k is operand k, so every layout passes through: S(d)->S(d) on each dim of
size > 1, B->B, and P->P on numbers (an identity is linear; bool and PRNG keys are never
partial), as OneFlow's ``identity`` op offers (split on every axis, broadcast, partial sum).
FLOPs 0: XLA emits nothing for ``name`` and its ``HloCostAnalysis`` charges a barrier nothing.

Several operands: the registry takes ONE 1-D signature per mesh axis and multiplies them over
the axes, so pairs laid out independently must already be independent in the 1-D list. Each
pair is independent in fact (result k depends on operand k only), but listing every
combination costs prod_k (splittable dims_k + 1) signatures, raised to the mesh rank by the
product (e.g. 3 operands of rank 3 on a 3-axis mesh: 64^3 = 262144 strategies, against 125 for
a dot_general). So:

* at most :data:`MAX_FREE_PAIRINGS` (16) combinations: all of them, each pair on its own
  layout (a barrier over an activation and a weight keeps S(0) on one and S(1) on the
  other); 16 covers two operands of rank <= 3 and keeps a 3-axis mesh at 16^3 = 4096;
* more: every pair split on the same dim d (pairs without a dim d of size > 1 B), and each
  pair split alone with every other pair B: linear in the operands, and enough for the common
  cases (all operands alike, or one large one among small ones);
* and always all-B and one partial signature, P on every numeric pair and B on the others. A
  partial pair next to a split one is exact too but is left out: plans that do not consume
  partial values keep a partial signature only when every input and output is partial.

``bitcast_convert_type`` reinterprets the bits of each element: with equal widths it is
elementwise, S(d)->S(d); to a narrower type each element becomes a trailing dim of pieces, to a
wider type a trailing dim of pieces is merged, so every dim but that trailing one carries its
split (XLA's ``BitcastConvert`` semantics). Bits of a sum are not a sum of bits: no P. FLOPs:
one per output element, as XLA's ``HloCostAnalysis`` counts it (an elementwise op; the
hardware does no arithmetic, but the count keeps predicted FLOPs comparable with XLA's).

References:
  OneFlow ``user/ops/identity_op.cpp`` (identity SBP: split every axis, broadcast, partial);
  XLA operation semantics (``OptimizationBarrier``, ``BitcastConvertType``);
  jax ``ad_checkpoint.checkpoint_name`` (``name_p``).
"""

from __future__ import annotations

import itertools
import math

from shardc.ir.flops import elementwise_flops
from shardc.ir.graph import Op, Value
from shardc.ir.sbp import B, P, Sbp, Split
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["bitcast_convert_type_rule", "identity_rule", "MAX_FREE_PAIRINGS", "no_flops"]

#: the most operand/result layout combinations an identity lists in full (per mesh axis)
MAX_FREE_PAIRINGS = 16


def no_flops(op: Op) -> float:
    """FLOPs of an op that moves or relabels data and computes nothing."""
    return 0.0


def _layouts(v: Value) -> list[Sbp]:
    """B, then S(d) for each dim of size > 1."""
    return [B] + [Split(d) for d in range(v.ndim) if v.shape[d] > 1]


def _pairings(op: Op) -> list[tuple[Sbp, ...]]:
    options = [_layouts(v) for v in op.inputs]
    if math.prod(len(o) for o in options) <= MAX_FREE_PAIRINGS:
        return list(itertools.product(*options))
    n = len(op.inputs)
    together = [tuple(Split(d) if d < v.ndim and v.shape[d] > 1 else B for v in op.inputs)
                for d in range(max(v.ndim for v in op.inputs))]
    alone = [(B,) * k + (s,) + (B,) * (n - k - 1) for k in range(n) for s in options[k][1:]]
    return together + alone


@register("name", "optimization_barrier", flops=no_flops)
def identity_rule(op: Op) -> list[Signature]:
    sigs = [Signature(c, c) for c in _pairings(op)]
    partial = tuple(P if is_numeric(v.dtype) else B for v in op.inputs)
    if P in partial:
        sigs.append(Signature(partial, partial))
    return sigs


@register("bitcast_convert_type", flops=elementwise_flops)
def bitcast_convert_type_rule(op: Op) -> list[Signature]:
    x, out = op.inputs[0], op.outputs[0]
    kept = min(x.ndim, out.ndim)  # a trailing dim of pieces is added or removed
    return [Signature((Split(d),), (Split(d),)) for d in range(kept) if x.shape[d] > 1]
