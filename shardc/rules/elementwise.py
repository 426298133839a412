"""Elementwise rules: unary, binary, select, comparisons.

In a jaxpr an operand of an elementwise op has the output's shape, or the output's rank with
some dims of size 1 (broadcast implicitly), or rank 0 (scalars and literals). Dim d may be
split on every operand that has it at full size; operands that broadcast along d (size 1, or
rank 0) are broadcast. Partial signatures only
where the algebra allows them (OneFlow's tables): linear unary ops P->P; add/sub (P,P)->P;
mul (P,B)->P and (B,P)->P; div (P,B)->P; select_n (B,P,P)->P.

``complex(x, y) = x + i y`` (``lax.complex``, the one elementwise op whose output dtype is
complex while its operands are real) is linear in the pair, (P,P)->P like add. A complex64
element is 8 bytes (``Value.nbytes`` reads the dtype's itemsize).
"""

from __future__ import annotations

import jax.numpy as jnp

from shardc.ir.graph import Op
from shardc.ir.prims import BINARY, UNARY, facts
from shardc.ir.sbp import B, P, Split
from shardc.rules.registry import Signature, register

__all__ = ["elementwise_rule", "split_signatures"]


def _floating(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))  # bfloat16 included


def _is_float(op: Op) -> bool:
    return all(_floating(v.dtype) for v in op.outputs)


def split_signatures(op: Op) -> list[Signature]:
    """Split dim d of the output and of every operand that has d at full size; operands
    broadcasting along d (size 1 or rank 0) stay broadcast."""
    out = op.outputs[0]
    sigs = []
    for d in range(out.ndim):
        if out.shape[d] == 1:
            continue
        ins = tuple(Split(d) if v.ndim == out.ndim and v.shape[d] == out.shape[d] else B
                    for v in op.inputs)
        sigs.append(Signature(ins, (Split(d),) * len(op.outputs)))
    return sigs


def _partial_signatures(op: Op) -> list[Signature]:
    if op.name == "complex":
        return [Signature((P, P), (P,))] if all(
            _floating(v.dtype) and v.ndim == op.outputs[0].ndim for v in op.inputs) else []
    if not _is_float(op) or not all(_floating(v.dtype) for v in op.inputs
                                    if op.name != "select_n" or v is not op.inputs[0]):
        return []
    name, n = op.name, len(op.inputs)
    full = [v.ndim == op.outputs[0].ndim for v in op.inputs]  # broadcasting is linear
    if facts(name).linear and n == 1:
        return [Signature((P,), (P,))]
    if name in ("add", "sub", "add_any") and all(full):
        return [Signature((P, P), (P,))]
    if name == "mul":
        return [Signature((P, B), (P,)), Signature((B, P), (P,))]
    if name == "div":
        return [Signature((P, B), (P,))]
    if name == "select_n" and all(full):
        return [Signature((B,) + (P,) * (n - 1), (P,))]
    return []


@register(*UNARY, *BINARY)
def elementwise_rule(op: Op) -> list[Signature]:
    return split_signatures(op) + _partial_signatures(op)
