"""How many times a ``while`` loop runs: read off its jaxprs where the bounds are static (a
``fori_loop`` or a counted ``while_loop``), else an estimate the caller gives.

A loop is counted when its predicate is ``counter < bound`` (or ``<=``, or the same written
``bound > counter``), the counter a carry that starts at a constant and that the body steps
by a positive constant, the bound a literal, a constant, or a carry that starts at a
constant and the body passes on unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.extend import core as jcore

__all__ = ["DEFAULT_WHILE_TRIPS", "static_trips", "while_trips"]

#: the trip count a ``while`` loop is planned for when its jaxprs do not give one (its body's
#: ops are weighted by it): a guess, since the count is known only when the loop runs
DEFAULT_WHILE_TRIPS = 16


def _known(atom, consts: dict, carries: dict) -> float | None:
    """The value of ``atom`` of the predicate's jaxpr if it is fixed through the loop."""
    if isinstance(atom, jcore.Literal):
        return float(np.asarray(atom.val))
    if atom in consts:
        return consts[atom]
    return carries.get(atom)


def static_trips(eqn, ins: Sequence) -> int | None:
    """The trip count of ``while`` equation ``eqn`` (operands ``ins``: values with ``const``
    set where known), or None when its jaxprs do not fix it (see the module docstring)."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "le", "gt", "ge"):
        return None
    test = cond.eqns[0]
    if test.outvars[0] is not cond.outvars[0]:
        return None

    def fixed(v) -> float | None:
        return None if v.const is None or np.ndim(v.const) else float(np.asarray(v.const))

    consts = {var: fixed(v) for var, v in zip(cond.invars[:cn], ins[:cn]) if fixed(v) is not None}
    carried = cond.invars[cn:]
    inits = ins[cn + bn:]
    passed = {k for k, (i, o) in enumerate(zip(body.invars[bn:], body.outvars)) if i is o}
    bounds = {carried[k]: fixed(inits[k]) for k in passed if fixed(inits[k]) is not None}
    lhs, rhs = test.invars
    name = test.primitive.name
    if name in ("gt", "ge"):
        lhs, rhs, name = rhs, lhs, "lt" if name == "gt" else "le"
    if lhs not in carried:
        return None
    k = carried.index(lhs)
    start, bound = fixed(inits[k]), _known(rhs, consts, bounds)
    step = _step(body, bn + k, k)
    if start is None or bound is None or step is None:
        return None
    span = bound - start + (1 if name == "le" else 0)
    return max(0, math.ceil(span / step))


def _step(body, invar: int, outvar: int) -> float | None:
    """The positive constant the body adds to carry ``invar`` to give ``outvar``."""
    out = body.outvars[outvar]
    for e in body.eqns:
        if e.primitive.name == "add" and out in e.outvars:
            a, b = e.invars
            if b is body.invars[invar]:
                a, b = b, a
            if a is body.invars[invar] and isinstance(b, jcore.Literal):
                step = float(np.asarray(b.val))
                return step if step > 0 else None
    return None


def while_trips(eqn, ins: Sequence, default: int = DEFAULT_WHILE_TRIPS) -> int:
    """:func:`static_trips`, else ``default``."""
    trips = static_trips(eqn, ins)
    return default if trips is None else trips
