"""Per-primitive strategy rules.

A rule looks at one :class:`Op` and returns its 1-D :class:`Signature` s: the SBP of every
input and output along ONE mesh axis. :func:`strategies` builds the nd strategies as the
Cartesian product over mesh axes (OneFlow's nd-SBP construction) and keeps only those whose
splits divide evenly. The all-broadcast signature is always present, so every op has at least
one strategy; a primitive with no rule gets only that one, with one warning naming it.

References:
  OneFlow ``framework/sbp_infer_util.cpp`` (nd-SBP as a product of 1-D signatures).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardc.errors import LayoutError as LayoutError
from shardc.errors import NoRuleWarning as NoRuleWarning
from shardc.ir.flops import FLOPS, FlopsFn, op_flops
from shardc.ir.graph import Op
from shardc.ir.prims import passes_partial
from shardc.ir.sbp import B, Broadcast, NdSbp, Partial, Sbp
from shardc.ir.trace import PACKAGE_DIR

__all__ = ["FixedFn", "has_rule", "is_pinned", "LayoutError", "NoRuleWarning", "register",
           "register_fixed", "registered", "replicated_signature", "RuleFn", "Signature",
           "signatures", "strategies", "Strategy", "warn_missing"]


@dataclass(frozen=True, slots=True)
class Signature:
    """SBPs of every input and output of an op along one mesh axis."""

    ins: tuple[Sbp, ...]
    outs: tuple[Sbp, ...]

    @property
    def divides_work(self) -> bool:
        """Each device does 1/n of the work when any output is not broadcast."""
        return any(not isinstance(s, Broadcast) for s in self.outs)

    def __str__(self) -> str:
        return f"{','.join(map(str, self.ins))}->{','.join(map(str, self.outs))}"


@dataclass(frozen=True, slots=True)
class Strategy:
    """One nd placement of an op: input/output NdSbps and per-device FLOPs."""

    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]
    flops: float

    @property
    def name(self) -> str:
        parts = []
        for axis in range(len(self.outs[0]) if self.outs else 0):
            ins = ",".join(str(nd.sbps[axis]) for nd in self.ins)
            outs = ",".join(str(nd.sbps[axis]) for nd in self.outs)
            parts.append(f"{ins}->{outs}")
        return " | ".join(parts)


RuleFn = Callable[[Op], Sequence[Signature]]
#: a layout the user fixed: (op, mesh axis names) -> the op's nd (ins, outs) placements
FixedFn = Callable[[Op, Sequence[str]], Sequence[tuple[tuple[NdSbp, ...], tuple[NdSbp, ...]]]]

_RULES: dict[str, RuleFn] = {}
_FIXED: dict[str, FixedFn] = {}


def _registrar(table: dict, names: Sequence[str], flops: FlopsFn | None):
    def wrap(fn):
        for n in names:
            table[n] = fn
            if flops is not None:
                FLOPS[n] = flops
        return fn

    return wrap


def register(*names: str, flops: FlopsFn | None = None):
    """Decorator: ``@register("add", "sub")`` makes the function the rule of those primitives."""
    return _registrar(_RULES, names, flops)


def register_fixed(*names: str, flops: FlopsFn | None = None):
    """Decorator: the function gives the nd placements a user fixed for these primitives
    (``with_sharding_constraint``, ``shard_map`` regions), which the planner keeps as they
    are. It raises :class:`LayoutError` when the mesh cannot express them."""
    return _registrar(_FIXED, names, flops)


def has_rule(name: str) -> bool:
    return name in _RULES or name in _FIXED


def is_pinned(op: Op) -> bool:
    """The op carries a layout the user fixed (planned as it is)."""
    return op.name in _FIXED


def registered() -> list[str]:
    return sorted(_RULES)


def replicated_signature(op: Op) -> Signature:
    return Signature((B,) * len(op.inputs), (B,) * len(op.outputs))


#: the warnings shown (Python's per-module warning registry, shardc's own): under the
#: default filters each primitive's warning shows once per line of the user's that made it,
#: however many step objects plan it; a change of the filters (``warnings.catch_warnings``,
#: ``pytest.warns``) shows it again
_SHOWN: dict = {}


def warn_missing(ops: Sequence[Op]) -> None:
    """One :class:`NoRuleWarning` per primitive without a rule among ``ops`` (called once
    per plan), pointing at the user's line that made its first op, else at the first caller
    outside shardc; shown once per primitive and line in a process (:data:`_SHOWN`)."""
    first: dict[str, Op] = {}
    for op in ops:
        first.setdefault(op.name, op)
    for name in sorted(first):
        path, _, line = first[name].source.rpartition(":")
        if not (path and line.isdigit()):
            path, line = _caller()
        warnings.warn_explicit(
            f"shardc has no sharding rule for primitive {name!r}; it runs replicated. "
            f"Register one with @shardc.register({name!r}).",
            NoRuleWarning, path, int(line),
            module=os.path.splitext(os.path.basename(path))[0], registry=_SHOWN)


def _caller() -> tuple[str, int]:
    """File and line of the innermost frame outside shardc (the user's call)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            PACKAGE_DIR):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def signatures(op: Op) -> list[Signature]:
    """The 1-D signatures of ``op`` (deduplicated, all-broadcast first); only the
    replicated one for a primitive without a rule."""
    rule = _RULES.get(op.name)
    if rule is None:
        sigs: Sequence[Signature] = ()
    else:
        sigs = rule(op)
    out = [replicated_signature(op)]
    for s in sigs:
        if len(s.ins) != len(op.inputs) or len(s.outs) != len(op.outputs):
            raise LayoutError(
                f"rule for {op.name!r} returned {s} with {len(s.ins)} inputs / {len(s.outs)} "
                f"outputs, but the op has {len(op.inputs)} / {len(op.outputs)}; fix the rule"
            )
        if s not in out:
            out.append(s)
    return out


def strategies(op: Op, axis_sizes: Sequence[int], axis_names: Sequence[str] | None = None,
               consume_partial: bool = False) -> list[Strategy]:
    """nd strategies of ``op`` on a mesh with ``axis_sizes``: product of 1-D signatures,
    keeping only even splits. Constant inputs are never partial.

    An op carrying a layout the user fixed (:func:`register_fixed`) has exactly that
    placement when ``axis_names`` are given (:class:`LayoutError` if the mesh cannot
    express it); without names it is planned by its rule like any other op.

    ``consume_partial=False`` drops signatures that take a partial input, except the P -> P
    of ops that pass partial values through (:attr:`shardc.ir.prims.Prim.passes_partial`):
    lowering on Auto mesh axes cannot keep a value unreduced across ops (XLA reduces a
    partial result before its next use; an add of two partials becomes two all-reduces), so
    a plan must not count on it. Ops may still *produce* partial values (and a sum over
    dims of size 1 passes them, as a reshape does: :func:`shardc.ir.prims.passes_partial`)."""
    total = op_flops(op)
    if axis_names is not None and op.name in _FIXED:
        return [Strategy(tuple(ins), tuple(outs), total)
                for ins, outs in _FIXED[op.name](op, axis_names)]
    sigs = signatures(op)
    if not consume_partial:
        keep = passes_partial(op)
        sigs = [s for s in sigs if not any(isinstance(x, Partial) for x in s.ins)
                or (keep and all(isinstance(x, Partial) for x in (*s.ins[:1], *s.outs)))]
    result: list[Strategy] = []
    seen = set()
    only = [replicated_signature(op)]  # an axis of size 1: every signature places alike
    for combo in itertools.product(*(only if n == 1 else sigs for n in axis_sizes)):
        ins = tuple(NdSbp(tuple(s.ins[k] for s in combo)) for k in range(len(op.inputs)))
        outs = tuple(NdSbp(tuple(s.outs[k] for s in combo)) for k in range(len(op.outputs)))
        key = (ins, outs)
        if key in seen:
            continue
        if not all(nd.fits(v.shape, axis_sizes) for nd, v in zip(ins, op.inputs)):
            continue
        if not all(nd.fits(v.shape, axis_sizes) for nd, v in zip(outs, op.outputs)):
            continue
        if any(v.is_const and nd.has_partial for nd, v in zip(ins, op.inputs)):
            continue  # a constant is the same on every device: never partial
        seen.add(key)
        div = math.prod(n for s, n in zip(combo, axis_sizes) if s.divides_work)
        result.append(Strategy(ins, outs, total / div))
    return result

