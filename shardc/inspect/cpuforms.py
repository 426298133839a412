"""XLA:CPU's forms of a collective, read back as the collective a backend without them runs.

**The reduce-scatter.** XLA:CPU has no reduce-scatter rewrite for partitioned programs: a
``P → S`` conversion compiles to a full ``all-reduce`` whose every use keeps ``1/n`` of it,
a ``dynamic-slice`` (or ``slice``) indexed by ``partition-id``, often inside a fusion
(``%bitcast_dynamic-slice_fusion = f32[32,16] fusion(%all-reduce, ...)``) and possibly
behind ``bitcast`` / ``reshape`` / ``copy`` / ``convert`` or a fusion that only converts.
:func:`split_scatters` follows the uses of an all-reduce (or of each element of a combined,
tuple all-reduce) and, where the kept slice is ``1/group_size`` of its elements, reports a
``reduce-scatter`` of the slice: what a backend with the rewrite runs, and what the planner
predicts for ``P → S``. (``shard_map``'s ``psum_scatter`` prints a real ``reduce-scatter``
on CPU.) Only a synchronous ``all-reduce`` (XLA:CPU's) is read so: XLA:GPU rewrites the
scatters it can, and an ``all-reduce-start`` whose users slice it is its combined all-reduce
unpacked into its members, which runs whole.

**16-bit floats.** XLA:CPU runs no collective on ``bf16`` or ``f16``: its float
normalization converts the operands to ``f32`` and the results back (a ``bf16`` step's
gradient all-reduces and parameter all-gathers compile to ``f32`` ones between converts).
:func:`narrowed` reads such a synchronous collective (XLA:GPU's are asynchronous) at the
16-bit type it moves on a backend that has it, as the planner prices it. A program that
itself converts a 16-bit value to ``f32`` right before a collective, or converts the result
back right after it, is read so too: the HLO does not tell the two apart.

References:
  XLA ``xla/service/cpu/cpu_float_support.cc`` (the types XLA:CPU's ops take) and
  ``float_normalization.cc`` (what it converts to ``f32``); checked on jax 0.10.2's XLA:CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shardc.inspect.hlotext import (
    Computation,
    Instruction,
    shape_dtype,
    shape_elements,
    shape_tree,
)

__all__ = ["narrowed", "split_scatters"]

#: ops that keep every element of their operand (a convert changes only its width)
_PASS_THROUGH = frozenset({"bitcast", "reshape", "copy", "transpose", "convert"})
_CALLS = re.compile(r"calls=%?([^\s,}]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
#: the ops of a fusion that moves elements without computing on them
_WIDTH_ONLY = frozenset({"parameter", "convert", "bitcast", "reshape", "copy", "transpose",
                         "slice"})
#: the float types XLA:CPU widens to ``f32`` around a collective
_NARROW = ("bf16", "f16")
#: :func:`_kept_slice`'s answer for a value that is its computation's result, unsliced
_RESULT = "<result>"


def _callee(comps: Mapping[str, Computation], instr: Instruction) -> Computation | None:
    found = _CALLS.search(instr.attrs)
    return comps.get(found.group(1)) if found is not None else None


def _kept_slice(comps: Mapping[str, Computation], comp: Computation, name: str,
                elements: int, n: int) -> str | None:
    """Shape of the ``1/n`` slice that every use of ``name`` (of ``elements`` elements)
    keeps, if every use keeps the same one: each user is a (dynamic-)slice of it, a
    pass-through op whose uses do so, or a fusion whose parameter does so (optimizer fusions
    read their slice of a gradient this way), or whose result, made from it by pass-through
    ops alone, does. :data:`_RESULT` where ``name`` is ``comp``'s result."""
    users = comp.users.get(name, [])
    if not users:
        return _RESULT
    kept: set[str] = set()
    for user_name in users:
        user = comp.instructions[user_name]
        if user.opcode in _PASS_THROUGH:
            k = _kept_slice(comps, comp, user.name, elements, n)
        elif user.opcode in ("dynamic-slice", "slice"):
            tree = shape_tree(user.shape)
            ok = user.operands[:1] == (name,) and name not in user.operands[1:]
            ok = ok and isinstance(tree, str) and shape_elements(tree) * n == elements
            k = tree if ok else None
        elif user.opcode == "fusion":
            k = _through_fusion(comps, comp, user, name, elements, n)
        else:
            return None
        if k is None or k == _RESULT:
            return k
        kept.add(k)
    return kept.pop() if len(kept) == 1 else None


def _through_fusion(comps: Mapping[str, Computation], comp: Computation, user: Instruction,
                    name: str, elements: int, n: int) -> str | None:
    """:func:`_kept_slice` of ``name`` read by the fusion ``user``: inside it, through each
    parameter it is passed as; where that reaches the fusion's result whole, through the
    fusion's own uses."""
    inner = _callee(comps, user)
    if inner is None:
        return None
    params = [inner.parameter(i) for i, op in enumerate(user.operands) if op == name]
    if not params or any(p is None for p in params):
        return None
    ks = {_kept_slice(comps, inner, p.name, elements, n) for p in params}
    k = ks.pop() if len(ks) == 1 else None
    return _kept_slice(comps, comp, user.name, elements, n) if k == _RESULT else k


def _tuple_parts(comp: Computation, instr: Instruction) -> dict[int, list[str]] | None:
    """Tuple index -> names of the get-tuple-elements reading it, when those are the only
    users of ``instr`` (else None)."""
    parts: dict[int, list[str]] = {}
    for user_name in comp.users.get(instr.name, []):
        user = comp.instructions[user_name]
        index = _INDEX.search(user.attrs)
        if user.opcode != "get-tuple-element" or index is None:
            return None
        parts.setdefault(int(index.group(1)), []).append(user.name)
    return parts


def _sliced(comps, comp: Computation, names: list[str], shape: str, n: int) -> str | None:
    slices = {_kept_slice(comps, comp, g, shape_elements(shape), n) for g in names}
    kept = slices.pop() if len(slices) == 1 else None
    return None if kept == _RESULT else kept


def split_scatters(comps: Mapping[str, Computation], comp: Computation, instr: Instruction,
                   shapes: tuple[str, ...], n: int) -> tuple[list[str], list[str]]:
    """(shapes all-reduced, kept slices reduce-scattered) of an all-reduce's elements, each
    read at the type a backend without XLA:CPU's widening moves (:func:`narrowed`). A
    tuple all-reduce is XLA's combination of several; each element whose every use keeps
    ``1/n`` of it is the reduce-scatter a backend with that rewrite would run."""
    if len(shapes) == 1:
        kept = _sliced(comps, comp, [instr.name], shapes[0], n)
        narrow = _widened_from(comps, comp, instr)
        return ([], [_retyped(kept, narrow)]) if kept is not None else \
            ([_retyped(shapes[0], narrow)], [])
    parts = _tuple_parts(comp, instr)
    reduced, scattered = [], []
    for i, shape in enumerate(shapes):
        names = (parts or {}).get(i, [])
        kept = _sliced(comps, comp, names, shape, n) if parts is not None else None
        narrow = _narrow_uses(comps, comp, names) if names else None
        if kept is not None:
            scattered.append(_retyped(kept, narrow))
        else:
            reduced.append(_retyped(shape, narrow))
    return reduced, scattered


def narrowed(comps: Mapping[str, Computation], comp: Computation, instr: Instruction,
             shapes: tuple[str, ...]) -> tuple[str, ...]:
    """``shapes``, the collective ``instr``'s results, at the 16-bit type they hold where
    XLA:CPU widened them to ``f32`` (every operand an upcast from it, or every use a
    downcast to it); as they are otherwise."""
    if instr.opcode.endswith("-start"):  # asynchronous: XLA:GPU's, which keeps bf16
        return shapes
    narrow = _widened_from(comps, comp, instr)
    return tuple(_retyped(s, narrow) for s in shapes)


def _widened_from(comps, comp: Computation, instr: Instruction) -> str | None:
    """The 16-bit type XLA:CPU widened ``instr``'s operands from, or its uses narrow its
    result back to; None for neither."""
    return _narrow_operands(comps, comp, instr) or _narrow_uses(comps, comp, [instr.name])


def _retyped(shape: str, narrow: str | None) -> str:
    return narrow + shape[3:] if narrow is not None and shape_dtype(shape) == "f32" else shape


def _narrow_operands(comps, comp: Computation, instr: Instruction) -> str | None:
    """The 16-bit type every operand of ``instr`` was converted to ``f32`` from; None where
    any was not."""
    found = set()
    for name in instr.operands:
        op = comp.instructions.get(name)
        if op is None:
            return None
        if op.opcode == "fusion":
            inner = _callee(comps, op)
            found.add(_converted_to(inner) if inner is not None else None)
        elif op.opcode == "convert":  # converted up from its operand's type
            src = comp.instructions.get(op.operands[0])
            found.add(shape_dtype(src.shape) if src is not None else None)
        else:
            return None
    return found.pop() if len(found) == 1 and found <= set(_NARROW) else None


def _narrow_uses(comps, comp: Computation, names: list[str]) -> str | None:
    """The 16-bit type every use of ``names`` converts them to; None where any does not."""
    found = set()
    for name in names:
        for user_name in comp.users.get(name, []):
            user = comp.instructions[user_name]
            if user.opcode == "fusion":
                inner = _callee(comps, user)
                found.add(_converted_to(inner) if inner is not None else None)
            elif user.opcode == "convert":
                found.add(shape_dtype(user.shape))
            else:
                return None
    return found.pop() if len(found) == 1 and found <= set(_NARROW) else None


def _converted_to(inner: Computation) -> str | None:
    """The 16-bit float type a fused computation of one parameter holds its elements in on
    the way (its parameter's, or a convert's: XLA:CPU's ``wrapped_convert``, a rounding
    through ``bf16`` and back), where it only converts, reshapes or slices them; None for
    any other."""
    instrs = list(inner.instructions.values())
    if not {i.opcode for i in instrs} <= _WIDTH_ONLY or \
            sum(i.opcode == "parameter" for i in instrs) != 1:
        return None
    narrow = {shape_dtype(i.shape) for i in instrs
              if i.opcode in ("parameter", "convert")} & set(_NARROW)
    return narrow.pop() if len(narrow) == 1 else None
