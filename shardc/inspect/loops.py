"""Loops in a compiled program: how often each computation runs, and the FLOPs
``cost_analysis()`` leaves out.

XLA's ``cost_analysis()`` counts a ``while`` body once: a 10-step ``lax.scan`` of 256x256
matmuls reports a tenth of the same loop unrolled, and a collective in the body appears
once in the text. :func:`multiplicity` gives how many times each computation runs per call
(the product of the known trip counts of the loops around it), to weight the collectives
by; :func:`loop_extra_flops` what ``cost_analysis`` leaves out: every loop body's FLOPs
(fusions and nested calls and loops included) times its known trip count less one, counted
from the optimized HLO: ``dot`` and ``convolution`` as XLA counts them (2 per
multiply-add), elementwise arithmetic one per result element. Loops without a known trip
count count once.

References:
  XLA ``hlo_cost_analysis.cc`` (``HandleDot``: 2 * output elements * contracted size;
  ``HandleConvolution``: 2 * output elements * kernel taps per output; ``HandleWhile``
  counts the body once; ``HandleConditional``: the costliest branch).
"""

from __future__ import annotations

import math
import re

from shardc.errors import HloError
from shardc.inspect.hlotext import Computation, Instruction, parse_module

__all__ = ["ELEMENTWISE", "branches", "called_flops", "instruction_flops", "loop_extra_flops",
           "multiplicity", "trip_count"]

_DIMS = re.compile(r"^[a-z][a-z0-9]*\[([^\]]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([^\s,}]+)")
#: a ``conditional``'s branches: ``branch_computations={%a, %b}`` or ``true_computation=%a,
#: false_computation=%b``
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%?([^\s,}]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([^}]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
#: one FLOP per result element, as XLA counts elementwise arithmetic
ELEMENTWISE = frozenset(
    "add subtract multiply divide maximum minimum negate abs exponential log tanh logistic "
    "sqrt rsqrt power remainder sine cosine compare select clamp and or xor not "
    "exponential-minus-one log-plus-one atan2 floor ceil round-nearest-afz sign cbrt erf"
    .split())


def _dims(shape: str) -> list[int] | None:
    """Dims of an array shape; None for a tuple or token (no elements of its own)."""
    m = _DIMS.match(shape.strip())
    if m is None:
        return None
    return [int(d.strip().removeprefix("<=")) for d in m.group(1).split(",") if d.strip()]


def _operand_dims(comp: Computation, instr: Instruction, k: int) -> list[int]:
    src = comp.instructions.get(instr.operands[k]) if k < len(instr.operands) else None
    return (_dims(src.shape) or []) if src is not None else []


def instruction_flops(comp: Computation, instr: Instruction) -> float:
    """FLOPs of one instruction on its own (a fusion's or loop's body not included)."""
    dims = _dims(instr.shape)
    out = math.prod(dims) if dims is not None else 0
    if instr.opcode == "dot":
        lhs = _operand_dims(comp, instr, 0)
        m = _LHS_CONTRACT.search(instr.attrs)
        contracted = [int(d) for d in m.group(1).split(",") if d.strip()] if m else []
        return 2.0 * out * math.prod(lhs[d] for d in contracted if d < len(lhs))
    if instr.opcode == "convolution":
        rhs = _operand_dims(comp, instr, 1)
        labels = _DIM_LABELS.search(instr.attrs)
        if not rhs or labels is None:
            return 0.0
        o = labels.group(2).index("o")
        return 2.0 * out * math.prod(rhs) / max(rhs[o], 1)
    if instr.opcode in ELEMENTWISE:
        return float(out)
    return 0.0


def _flops(comps: dict[str, Computation], name: str, trips: bool, memo: dict) -> float:
    """FLOPs of computation ``name``: its instructions and what they call, each loop body
    times its known trip count (``trips``) or once (as ``cost_analysis`` counts it)."""
    key = (name, trips)
    if key in memo:
        return memo[key]
    memo[key] = 0.0  # a recursive reference (none in valid HLO) counts nothing
    comp = comps.get(name)
    total = 0.0
    for instr in (comp.instructions.values() if comp is not None else ()):
        total += instruction_flops(comp, instr)
        n = (trip_count(instr) or 1) if trips else 1
        total += n * called_flops(comps, instr, trips, memo)
    memo[key] = total
    return total


def branches(instr: Instruction) -> list[str]:
    """The branch computations of a ``conditional`` (none for another instruction)."""
    m = _BRANCHES.search(instr.attrs)
    names = m.group(1).split(",") if m else _TRUE_FALSE.findall(instr.attrs)
    return [n.strip().lstrip("%") for n in names if n.strip()]


def called_flops(comps: dict[str, Computation], instr: Instruction, trips: bool,
                 memo: dict) -> float:
    """FLOPs of what one run of ``instr`` calls: the computations it calls (a fusion's, a
    loop's body once), and of a ``conditional``'s branches the costliest (as
    ``cost_analysis`` counts it: which branch runs is known only at run time)."""
    called = sum(_flops(comps, c, trips, memo) for c in _CALLS.findall(instr.attrs))
    return called + max((_flops(comps, b, trips, memo) for b in branches(instr)), default=0.0)


def loop_extra_flops(hlo_text: str) -> float:
    """Per-device FLOPs ``cost_analysis()`` leaves out of the program in ``hlo_text``: the
    later iterations of every loop with a known trip count."""
    comps = parse_module(hlo_text)
    entry = _entry(hlo_text)
    memo: dict = {}
    return _flops(comps, entry, True, memo) - _flops(comps, entry, False, memo)


def trip_count(instr: Instruction) -> int | None:
    """XLA's known trip count of a ``while`` instruction (None when it does not know)."""
    m = _TRIP.search(instr.attrs)
    return int(m.group(1)) if instr.opcode == "while" and m else None


def multiplicity(hlo_text: str) -> dict[str, int]:
    """Computation name -> how many times it runs per call of the program: 1 for the
    entry and what it calls, times the trip count of every loop around it (loops without
    a known count taken once)."""
    comps = parse_module(hlo_text)
    out: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        if out.get(name, 0) >= times or name not in comps:
            return
        out[name] = times
        for instr in comps[name].instructions.values():
            n = (trip_count(instr) or 1) if instr.opcode == "while" else 1
            for callee in _CALLS.findall(instr.attrs) + branches(instr):
                visit(callee, times * n)

    visit(_entry(hlo_text), 1)
    return out


def _entry(hlo_text: str) -> str:
    m = re.search(r"^ENTRY\s+%?([^\s(]+)", hlo_text, re.MULTILINE)
    if m is None:
        raise HloError("no ENTRY computation in the HLO text")
    return m.group(1)


