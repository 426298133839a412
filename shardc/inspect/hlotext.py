"""HLO module text -> computations of instructions, and array shape sizes.

The optimized HLO text of ``compiled.as_text()`` is a list of computations (``ENTRY``, fused
computations, while bodies, async computations), each a list of instructions
``%name = shape opcode(operands), attrs``. Only what the collective reader needs is kept:
name, result shape text, opcode, operand names, and the attribute text after the operands.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from shardc.errors import HloError

__all__ = ["Computation", "Instruction", "leaves", "parse_module", "result_shapes",
           "shape_bytes", "shape_dtype", "shape_elements", "shape_tree", "ShapeTree"]

ShapeTree = str | tuple["ShapeTree", ...]

@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction] = field(default_factory=dict)
    users: dict[str, list[str]] = field(default_factory=dict)

    def add(self, instr: Instruction) -> None:
        self.instructions[instr.name] = instr
        for op in instr.operands:
            self.users.setdefault(op, []).append(instr.name)

    def parameter(self, index: int) -> Instruction | None:
        for instr in self.instructions.values():
            if instr.opcode == "parameter" and instr.operands == (str(index),):
                return instr
        return None


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([A-Za-z][\w\-]*)\(")
_COMMENT = re.compile(r"/\*.*?\*/")


def _closing(text: str, start: int) -> int:
    """Index of the ``)`` matching the ``(`` at ``start`` (double-quoted text skipped)."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        ch = text[i]
        if ch == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    raise HloError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside (), [] and {}."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = len(rest.split(None, 1)[0]) if rest.strip() else 0
    shape, rest = rest[:end], rest[end:]
    op = _OPCODE.match(rest)
    if op is None:
        return None
    close = _closing(rest, op.end() - 1)
    operand_text = _COMMENT.sub("", rest[op.end():close])
    operands = tuple(p.split()[-1].lstrip("%") for p in _split_top(operand_text))
    return Instruction(m.group(1), _COMMENT.sub("", shape), op.group(1), operands,
                        rest[close + 1:])


@functools.lru_cache(maxsize=4)
def parse_module(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text, by name. Cached (pricing a program reads its
    collectives, loops and FLOPs from one parse): the result is shared, read it only."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.strip() == "}":
                current = None
                continue
            header = _HEADER.match(line)
            if header:
                current = comps.setdefault(header.group(1), Computation(header.group(1)))
            continue
        if current is not None:
            instr = _parse_instruction(line)
            if instr is not None:
                current.add(instr)
    if not comps:
        raise HloError(f"no HLO computations found in text starting {text[:120]!r}")
    return comps


# ---- shapes --------------------------------------------------------------------------------

_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "token": 0, "opaque": 0,
}
_LEAF = re.compile(r"^([a-z][a-z0-9]*)\[([^\]]*)\]")


def shape_tree(text: str) -> ShapeTree:
    text = text.strip()
    if text.startswith("("):
        return tuple(shape_tree(p) for p in _split_top(text[1:-1]))
    m = _LEAF.match(text)
    if m is None:
        raise HloError(f"unrecognised HLO shape {text!r}")
    return m.group(0)


def leaves(tree: ShapeTree) -> tuple[str, ...]:
    if isinstance(tree, str):
        return (tree,)
    return tuple(leaf for t in tree for leaf in leaves(t))


def _dtype_dims(shape: str) -> tuple[str, int]:
    m = _LEAF.match(shape.strip())
    if m is None:
        raise HloError(f"unrecognised HLO array shape {shape!r}")
    dtype, dims = m.groups()
    return dtype, math.prod(int(d.strip().removeprefix("<=")) for d in dims.split(",")
                            if d.strip())


def shape_dtype(shape: str) -> str:
    """The element type of one array shape string: ``"bf16"`` for ``"bf16[8,16]{1,0}"``."""
    return _dtype_dims(shape)[0]


def shape_elements(shape: str) -> int:
    """Elements of one array shape string such as ``"f32[32,256]"`` (layout optional)."""
    return _dtype_dims(shape)[1]


def shape_bytes(shape: str) -> int:
    """Bytes of one array shape string such as ``"f32[32,256]"`` (layout optional)."""
    dtype, n = _dtype_dims(shape)
    if dtype not in _DTYPE_BITS:
        raise HloError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
    return math.ceil(n * _DTYPE_BITS[dtype] / 8)


def result_shapes(opcode: str, shape: str) -> tuple[str, ...]:
    """Leaf shapes of a collective's result; async ``-start`` ops return
    ``(operands, results, context...)`` except ``all-reduce-start`` (results only)."""
    tree = shape_tree(shape)
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        if isinstance(tree, str) or len(tree) < 2:
            raise HloError(f"{opcode} result {shape!r} is not an (operand, result, ...) tuple")
        tree = tree[1]
    return leaves(tree)


