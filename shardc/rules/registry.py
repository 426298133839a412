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
    """SBPs of every input and output of an op along one mesh axis.

    Attributes:
        ins: The SBP of each input.
        outs: The SBP of each output.
        ring: -1 for a signature each device runs on its own pieces; else what passes
            round the axis while each device computes (a collective matmul,
            :mod:`shardc.rules.dot`): operand 0 or 1 (its blocks, gathered one by one) or
            2 (the result's partial sums, reduced and scattered one block at a time).
    """

    ins: tuple[Sbp, ...]
    outs: tuple[Sbp, ...]
    ring: int = -1

    @property
    def divides_work(self) -> bool:
        """Each device does 1/n of the work when any output is not broadcast."""
        return any(not isinstance(s, Broadcast) for s in self.outs)

    def __str__(self) -> str:
        """``"S(0),B->S(0)"``."""
        return f"{','.join(map(str, self.ins))}->{','.join(map(str, self.outs))}"


@dataclass(frozen=True, slots=True)
class Strategy:
    """One nd placement of an op.

    Attributes:
        ins: The NdSbp of each input.
        outs: The NdSbp of each output.
        flops: FLOPs per device.
        ring: ``(mesh axis, what passes round it)`` for a strategy with a ring signature
            (:attr:`Signature.ring`) on that axis, else ().
    """

    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]
    flops: float
    ring: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """The strategy per mesh axis, ``"S(0),B->S(0) | B,S(1)->S(1)"``."""
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
    """Register the decorated function as the sharding rule of primitives.

    ``@register("add", "sub")`` makes the function the rule of those primitives: given an
    :class:`~shardc.ir.graph.Op`, it returns the op's 1-D :class:`Signature` s.

    Args:
        *names: The primitives' names.
        flops: The primitives' FLOP count, ``flops(op) -> float``; None keeps theirs.

    Returns:
        The decorator; it returns the function unchanged.
    """
    return _registrar(_RULES, names, flops)


def register_fixed(*names: str, flops: FlopsFn | None = None):
    """Register the rule of primitives whose placement the user fixed.

    The decorated function gives the nd placements a user fixed for these primitives
    (``with_sharding_constraint``, ``shard_map`` regions), which the planner keeps as they
    are; it raises :class:`LayoutError` when the mesh cannot express them.

    Args:
        *names: The primitives' names.
        flops: The primitives' FLOP count, ``flops(op) -> float``; None keeps theirs.

    Returns:
        The decorator; it returns the function unchanged.
    """
    return _registrar(_FIXED, names, flops)


def _ring_alone(ins: Sequence[NdSbp], outs: Sequence[NdSbp], axis: int) -> bool:
    """Whether a ring on ``axis`` runs per device over the other axes.

    None of them may hold a partial value or split a dim the ring splits.
    """
    for nd in (*ins, *outs):
        ring = nd.sbps[axis]
        for a, s in enumerate(nd.sbps):
            if a != axis and (isinstance(s, Partial) or s == ring and not isinstance(s, Broadcast)):
                return False
    return True


def has_rule(name: str) -> bool:
    """Whether primitive ``name`` has a rule (its own or a fixed placement)."""
    return name in _RULES or name in _FIXED


def is_pinned(op: Op) -> bool:
    """The op carries a layout the user fixed (planned as it is)."""
    return op.name in _FIXED


def registered() -> list[str]:
    """The names of the primitives with a rule, sorted."""
    return sorted(_RULES)


def replicated_signature(op: Op) -> Signature:
    """The signature broadcasting every input and output of ``op``."""
    return Signature((B,) * len(op.inputs), (B,) * len(op.outputs))


#: the warnings shown (Python's per-module warning registry, shardc's own): under the
#: default filters each primitive's warning shows once per line of the user's that made it,
#: however many step objects plan it; a change of the filters (``warnings.catch_warnings``,
#: ``pytest.warns``) shows it again
_SHOWN: dict = {}


def warn_missing(ops: Sequence[Op]) -> None:
    """Warn once per primitive without a rule among ``ops``.

    Called once per plan. Each :class:`NoRuleWarning` points at the user's line that made
    the primitive's first op, else at the first caller outside shardc; it shows once per
    primitive and line in a process (:data:`_SHOWN`).

    Args:
        ops: The program's ops.
    """
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
    """The 1-D signatures of ``op``.

    Args:
        op: The op.

    Returns:
        Its rule's signatures, deduplicated, all-broadcast first; only the replicated one
        for a primitive without a rule.

    Raises:
        ValueError: When the rule returns a signature of the wrong arity.
    """
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
    """The nd strategies of ``op`` on a mesh with ``axis_sizes``.

    The product of its 1-D signatures, keeping only even splits; constant inputs are never
    partial. Lowering on Auto mesh axes cannot keep a value unreduced across ops (XLA
    reduces a partial result before its next use), so a plan must not count on reading
    one; ops may still *produce* partial values.

    Args:
        op: The op.
        axis_sizes: The mesh's axis sizes.
        axis_names: The mesh's axis names: an op carrying a layout the user fixed
            (:func:`register_fixed`) then has exactly that placement; None plans it by
            its rule like any other op.
        consume_partial: Keep signatures that read a partial input; False keeps only the
            P -> P of ops that pass partial values through
            (:func:`shardc.ir.prims.passes_partial`).

    Returns:
        The strategies, each with its per-device FLOPs.

    Raises:
        LayoutError: When the mesh cannot express a fixed layout.
    """
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
        rings = [(a, s.ring) for a, s in enumerate(combo) if s.ring >= 0]
        if len(rings) > 1 or rings and not _ring_alone(ins, outs, rings[0][0]):
            continue
        seen.add(key)
        div = math.prod(n for s, n in zip(combo, axis_sizes) if s.divides_work)
        result.append(Strategy(ins, outs, total / div, rings[0] if rings else ()))
    return result

