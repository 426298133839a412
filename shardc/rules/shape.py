"""Shape and data-movement rules: broadcast, reshape, transpose, squeeze, slice, split,
concatenate, stack, unstack, tile, pad, rev.

These ops move data without arithmetic, so a split carries through a dim that maps one to
one (and is not cut, padded or reversed), and they are linear, so P->P (OneFlow's
``reshape``/``transpose``/``slice``/``concat``/``pad`` SBP tables; ``reshape`` follows
OneFlow's ``ReshapeUserOpUtil::GetGroupStartInDim2OutDim``: a split of the major dim of a
group of dims whose products match). ``broadcast_in_dim`` may also turn B into S(d) on a dim
it creates: each device materialises only its slice. Extra operands that carry dynamic
shapes are broadcast. Partial values are only formed for numbers (not bool, not PRNG keys).

``stack`` / ``unstack`` / ``tile`` are primitives of their own in jax >= 0.10 (``jnp.stack``,
the gradient of a stack, ``jnp.tile``), not ``broadcast_in_dim`` + ``concatenate``; jax lowers
them to exactly that (``lax._stack_lower``: expand each operand, concatenate along the new
axis; ``lax._tile_lower``: reshape to ``(1, d)`` pairs, broadcast to ``(reps, d)``, merge), so
they inherit the ``concatenate`` / ``broadcast_in_dim`` signatures:

* ``stack(xs, axis)``: every operand ``S(d)`` -> ``S(d')``, ``d'`` the dim's position in the
  output (``d`` below ``axis``, else ``d + 1``); ``(P, ..., P) -> P``;
* ``unstack(x, axis)``: ``S(d)`` -> every output ``S(d')`` (``d != axis``; ``d'`` is ``d``
  below ``axis``, else ``d - 1``); ``P -> P`` for every output;
* ``tile(x, reps)``: ``S(d) -> S(d)`` where ``reps[d] == 1`` (a repeated dim cut into chunks
  interleaves them: ``[x0 x1 x0 x1]``, not ``[x0 x0 x1 x1]``); ``B -> S(d)`` where
  ``reps[d] > 1`` (each device materialises its slice of the copies, as ``broadcast_in_dim``
  does on a dim it creates); ``P -> P``.

References:
  OneFlow ``user/ops/reshape_user_op_util.cpp``, ``broadcast_like_op.cpp``, ``pad_op.cpp``,
  ``concat_op.cpp``, ``stack_op.cpp``; jax ``_src/lax/lax.py`` (``stack_p``, ``tile_p``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from shardc.ir.graph import Op, Value
from shardc.ir.sbp import B, P, Sbp, Split
from shardc.rules.registry import Signature, register

__all__ = ["broadcast_in_dim_rule", "concatenate_rule", "is_known_zero", "is_numeric",
           "pad_rule", "reshape_groups", "reshape_rule", "rev_rule", "slice_rule", "split_rule",
           "squeeze_rule", "stack_rule", "tile_rule", "transpose_rule", "unstack_rule"]


def is_numeric(dtype) -> bool:
    """Partial (sum) makes sense for numbers (bfloat16 included), not for bool or PRNG keys."""
    return bool(jnp.issubdtype(dtype, jnp.number))


def _linear_ok(op: Op) -> bool:
    return all(is_numeric(v.dtype) for v in (*op.inputs, *op.outputs))


def _sig(op: Op, first: Sbp, out: Sbp) -> Signature:
    """Operand 0 gets ``first``, any further (dynamic-shape) operands B."""
    return Signature((first,) + (B,) * (len(op.inputs) - 1), (out,) * len(op.outputs))


def _partial(op: Op) -> list[Signature]:
    return [_sig(op, P, P)] if _linear_ok(op) else []


@register("broadcast_in_dim")
def broadcast_in_dim_rule(op: Op) -> list[Signature]:
    x, out = op.inputs[0], op.outputs[0]
    bd = tuple(op.params["broadcast_dimensions"])
    sigs = [_sig(op, Split(i), Split(bd[i]))
            for i in range(x.ndim) if x.shape[i] == out.shape[bd[i]]]
    kept = {bd[i] for i in range(x.ndim) if x.shape[i] == out.shape[bd[i]]}
    sigs += [_sig(op, B, Split(d)) for d in range(out.ndim) if d not in kept]
    if jnp.issubdtype(out.dtype, jnp.floating):
        sigs.append(_sig(op, P, P))
    return sigs


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Minimal groups of consecutive dims whose products match, e.g.
    ``(2, 8, 768) -> (2, 8, 12, 64)`` gives ``[([0], [0]), ([1], [1]), ([2], [2, 3])]``.
    Trailing size-1 dims are left out."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi, i = pi * src[i], i + 1
            elif pj < pi and j < len(dst):
                gj.append(j)
                pj, j = pj * dst[j], j + 1
            else:
                return groups  # inconsistent sizes: give up on the rest
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape: Sequence[int]) -> int | None:
    return next((d for d in dims if shape[d] != 1), None)


@register("reshape")
def reshape_rule(op: Op) -> list[Signature]:
    """Each group of dims the reshape keeps together splits along its major dim. With
    ``dimensions`` (what ``jax.vmap`` of a convolution emits) the operand is transposed
    by it first, so a group's major dim is read through that permutation."""
    x, out = op.inputs[0], op.outputs[0]
    order = op.params.get("dimensions") or tuple(range(x.ndim))
    shape = tuple(x.shape[d] for d in order)
    sigs = []
    if 0 not in x.shape:
        for gi, gj in reshape_groups(shape, out.shape):
            a, b = _major(gi, shape), _major(gj, out.shape)
            if a is not None and b is not None:
                sigs.append(_sig(op, Split(order[a]), Split(b)))
    return sigs + _partial(op)


@register("transpose")
def transpose_rule(op: Op) -> list[Signature]:
    perm = op.params["permutation"]
    return [_sig(op, Split(p), Split(i)) for i, p in enumerate(perm)] + _partial(op)


@register("squeeze")
def squeeze_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    removed = {d % x.ndim for d in op.params["dimensions"]}
    kept = [d for d in range(x.ndim) if d not in removed]
    return [_sig(op, Split(d), Split(i)) for i, d in enumerate(kept)] + _partial(op)


@register("slice")
def slice_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    start, limit = op.params["start_indices"], op.params["limit_indices"]
    strides = op.params["strides"] or (1,) * x.ndim
    whole = [d for d in range(x.ndim)
             if start[d] == 0 and limit[d] == x.shape[d] and strides[d] == 1]
    return [_sig(op, Split(d), Split(d)) for d in whole] + _partial(op)


@register("split")
def split_rule(op: Op) -> list[Signature]:
    axis = op.params["axis"] % op.inputs[0].ndim
    return [_sig(op, Split(d), Split(d))
            for d in range(op.inputs[0].ndim) if d != axis] + _partial(op)


@register("concatenate")
def concatenate_rule(op: Op) -> list[Signature]:
    n, dim = len(op.inputs), op.params["dimension"]
    sigs = [Signature((Split(d),) * n, (Split(d),))
            for d in range(op.outputs[0].ndim) if d != dim]
    if _linear_ok(op):
        sigs.append(Signature((P,) * n, (P,)))
    return sigs


@register("stack")
def stack_rule(op: Op) -> list[Signature]:
    n, axis = len(op.inputs), op.params["axis"]
    sigs = [Signature((Split(d),) * n, (Split(d if d < axis else d + 1),))
            for d in range(op.inputs[0].ndim)]
    if _linear_ok(op):
        sigs.append(Signature((P,) * n, (P,)))
    return sigs


@register("unstack")
def unstack_rule(op: Op) -> list[Signature]:
    axis = op.params["axis"]
    return [_sig(op, Split(d), Split(d if d < axis else d - 1))
            for d in range(op.inputs[0].ndim) if d != axis] + _partial(op)


@register("tile")
def tile_rule(op: Op) -> list[Signature]:
    reps = op.params["reps"]
    sigs = [_sig(op, Split(d) if r == 1 else B, Split(d)) for d, r in enumerate(reps)]
    return sigs + _partial(op)


def is_known_zero(v: Value, depth: int = 8) -> bool:
    """True when ``v`` is a constant zero, possibly through converts/broadcasts of one."""
    if v.is_const:
        return bool(np.all(np.asarray(v.const) == 0))
    op = v.producer
    if depth == 0 or op is None or not op.inputs:
        return False
    if op.name in ("convert_element_type", "broadcast_in_dim", "reshape", "copy", "copy_p"):
        return is_known_zero(op.inputs[0], depth - 1)
    return False


@register("pad")
def pad_rule(op: Op) -> list[Signature]:
    config = op.params["padding_config"]
    sigs = [Signature((Split(d), B), (Split(d),))
            for d, (lo, hi, interior) in enumerate(config) if lo == hi == interior == 0]
    if _linear_ok(op):
        # pad(x, v) is linear in (x, v) together; with v == 0 it is linear in x alone.
        sigs.append(Signature((P, P), (P,)))
        if is_known_zero(op.inputs[1]):
            sigs.append(Signature((P, B), (P,)))
    return sigs


@register("rev")
def rev_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    flipped = {d % max(x.ndim, 1) for d in op.params["dimensions"]}
    return [_sig(op, Split(d), Split(d))
            for d in range(x.ndim) if d not in flipped] + _partial(op)
