"""The dataflow graph shardc plans over: a flat, inlined copy of a jaxpr.

``Value`` is an SSA value (shape, dtype, producer); ``Op`` is one primitive application
holding the primitive and its params unchanged, so the graph can be re-evaluated with
``prim.bind`` after sharding constraints are inserted. ``check_graph`` is the verifier every
pass must leave passing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from shardc.errors import GraphError as GraphError

__all__ = ["check_graph", "format_graph", "Graph", "GraphError", "Op", "Value"]

#: jaxpr-style short names of dtypes
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
          "int32": "i32", "int64": "i64", "uint32": "u32", "uint8": "u8", "int8": "i8",
          "bool": "bool"}


@functools.lru_cache(maxsize=4096)
def _type_str(dtype: Any, shape: tuple[int, ...]) -> str:
    """``f32[16,8]``: memoised (numpy's dtype names are slow, and planning a 12-layer GPT-2
    prints 39k of them, 0.2 s)."""
    name = getattr(dtype, "name", str(dtype))
    return f"{_SHORT.get(name, name)}[{','.join(map(str, shape))}]"


class Value:
    """An SSA value. ``const`` holds the data of literals and closed-over constants."""

    __slots__ = ("id", "shape", "dtype", "producer", "const")

    def __init__(self, id: int, shape: tuple[int, ...], dtype: Any, producer: Op | None = None,
                 const: Any = None):
        self.id = id
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype) if not hasattr(dtype, "itemsize") else dtype
        self.producer = producer
        self.const = const

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def type_str(self) -> str:
        return _type_str(self.dtype, self.shape)

    def __repr__(self) -> str:
        if self.is_const and np.ndim(self.const) == 0:
            return f"{np.asarray(self.const).item()!r}:{self.type_str()}"
        return f"v{self.id}"


class Op:
    """One primitive application. ``params`` are the jaxpr eqn's params, untouched;
    ``effects`` its equation's side effects (a callback, a print): an op with effects runs
    even when nothing reads its outputs, and may have none. ``weight`` is how many times it
    runs per call: 1, or a loop body's trip count (times its enclosing loops'). ``source``
    is the user's line that made it (``path:line``, "" if unknown); ``where`` its equation's
    place in the traced jaxpr: the indices of the equations of the calls (or the scan) around
    it, outermost first, then its own (a scan's enter and exit ops: the scan's); in a
    ``cond``'s branch, the cond's place, the branch's index, then its own (the cond's enter
    and exit ops: the cond's)."""

    __slots__ = ("id", "prim", "params", "inputs", "outputs", "effects", "weight", "source",
                 "where")

    def __init__(self, id: int, prim: Any, params: dict, inputs: Sequence[Value],
                 outputs: Sequence[Value], effects: frozenset = frozenset(), weight: int = 1,
                 source: str = "", where: tuple[int, ...] = ()):
        self.id = id
        self.prim = prim
        self.params = params
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.effects = frozenset(effects)
        self.weight = weight
        self.source = source
        self.where = tuple(where)

    @property
    def name(self) -> str:
        return self.prim.name

    @property
    def named(self) -> str:
        """The primitive and, where known, the user's line: ``"reduce_sum at f.py:12"``."""
        return self.name + (f" at {self.source}" if self.source else "")

    def replace(self, **kw) -> Op:
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(kw)
        return Op(**fields)

    def __repr__(self) -> str:
        return f"Op({self.id}, {self.name})"


class Graph:
    """Inputs, outputs, and ops in a valid topological (program) order. A graph is not
    changed once built (passes make new ones), so what is derived from it alone is kept
    (:meth:`memo`)."""

    __slots__ = ("inputs", "outputs", "ops", "_memo")

    def __init__(self, inputs: Sequence[Value], outputs: Sequence[Value], ops: Sequence[Op]):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.ops = list(ops)
        self._memo: dict[Hashable, Any] = {}

    def memo(self, name: Hashable, make: Callable[[Graph], Any]) -> Any:
        """``make(self)``, computed on the first call for ``name`` and kept: for facts of
        the whole graph that planning reads many times (a frontier of the 12-layer GPT-2
        computed its tail values 385 times, 48 s). The result is shared: not to be
        changed."""
        if name not in self._memo:
            self._memo[name] = make(self)
        return self._memo[name]

    def consumers(self) -> dict[int, list[tuple[Op, int]]]:
        """value id -> [(consumer op, input index)] (kept: :meth:`memo`)."""
        return self.memo("consumers", _consumers)

    def producers(self) -> dict[int, Op]:
        """value id -> the op making it; graph inputs are absent (kept: :meth:`memo`)."""
        return self.memo("producers", lambda g: {v.id: op for op in g.ops for v in op.outputs})

    def runs(self) -> dict[int, int]:
        """value id -> how many times it is made per call (its producer's ``weight``: a loop
        body's values once per iteration); graph inputs and constants are absent (once).
        Kept (:meth:`memo`)."""
        return self.memo("runs", lambda g: {v.id: op.weight for op in g.ops for v in op.outputs})

    def constants(self) -> frozenset[int]:
        """Ids of values computed from constants only (a ``1/N`` broadcast, an ``iota``, the
        zeros an accumulator starts from): XLA folds them and makes them in the layout their
        users need, so the lowering leaves them unconstrained (a constraint there would block
        the folding), and one read as a partial sum is made so, at no cost (the zeros of a
        partial accumulator). A scan carry is not one, whatever it starts from: the loop
        changes it. Kept (:meth:`memo`)."""
        return self.memo("constants", _constants)

    def values(self) -> Iterable[Value]:
        yield from self.inputs
        for op in self.ops:
            yield from op.outputs

    def __str__(self) -> str:
        return format_graph(self)


def _constants(graph: Graph) -> frozenset[int]:
    out: set[int] = set()
    for op in graph.ops:
        if op.effects or op.name == "scan_enter" and op.params["kind"] == "carry":
            continue
        if all(v.is_const or v.id in out for v in op.inputs):
            out.update(v.id for v in op.outputs)
    return frozenset(out)


def _consumers(graph: Graph) -> dict[int, list[tuple[Op, int]]]:
    users: dict[int, list[tuple[Op, int]]] = {}
    for op in graph.ops:
        for k, v in enumerate(op.inputs):
            users.setdefault(v.id, []).append((op, k))
    return users


def _format_params(params: dict) -> str:
    shown = []
    for k, v in params.items():
        if v is None or k in ("sharding", "out_sharding"):
            continue
        text = repr(v) if not hasattr(v, "eqns") and not hasattr(v, "jaxpr") else "{...}"
        if len(text) > 40:
            text = text[:37] + "..."
        shown.append(f"{k}={text}")
    return f"[{' '.join(shown)}]" if shown else ""


def format_graph(graph: Graph, annotate: dict[int, str] | None = None) -> str:
    """Pretty-print like a jaxpr; ``annotate`` maps value id -> text shown after its type."""
    annotate = annotate or {}

    def decl(v: Value) -> str:
        note = annotate.get(v.id)
        return f"{v!r}:{v.type_str()}" + (f"{{{note}}}" if note else "")

    lines = ["{ lambda ; " + " ".join(decl(v) for v in graph.inputs) + ". let"]
    for op in graph.ops:
        outs = " ".join(decl(v) for v in op.outputs)
        ins = " ".join(repr(v) for v in op.inputs)
        lhs = f"{outs} = " if outs else ""
        times = f" x{op.weight}" if op.weight != 1 else ""
        lines.append(f"    {lhs}{op.name}{_format_params(op.params)} {ins}{times}")
    lines.append("  in (" + ", ".join(repr(v) for v in graph.outputs) + ") }")
    return "\n".join(lines)


def _same_type(a: Value, b: Value) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _check_edge(op: Op) -> None:
    """The edge ops of the bodies the trace inlines (``ir/trace.py``): a loop carry's
    enter is tied to a value of its type and a while's carry names a scalar boolean
    predicate; a cond's enter passes one operand into a branch as it is, its exit reads a
    scalar integer index, then one value per branch (at least one), each of its result's
    type."""
    if op.name == "scan_enter":
        tie, test = op.params.get("tie"), op.params.get("test")
        if tie is not None and not _same_type(tie, op.outputs[0]):
            raise GraphError(f"{op}'s carry is tied to {tie!r}:{tie.type_str()}, not a value "
                             f"of its type {op.outputs[0].type_str()}")
        if test is not None and (test.ndim or test.dtype != np.bool_):
            raise GraphError(f"{op}'s loop predicate {test!r}:{test.type_str()} is not a "
                             "scalar boolean")
    elif op.name == "cond_enter":
        if len(op.inputs) != 1 or len(op.outputs) != 1 or \
                not _same_type(op.inputs[0], op.outputs[0]):
            raise GraphError(f"{op} must pass one operand into its branch unchanged")
    elif op.name == "cond_exit":
        index, values = op.inputs[0], op.inputs[1:]
        if index.ndim or not np.issubdtype(index.dtype, np.integer):
            raise GraphError(f"{op} reads index {index!r}:{index.type_str()}, not a scalar "
                             "integer")
        if len(op.outputs) != 1 or not values or \
                not all(_same_type(v, op.outputs[0]) for v in values):
            raise GraphError(f"{op} must join one value per branch, each of its result's "
                             "type")


def check_graph(graph: Graph) -> None:
    """Verify SSA and ordering invariants; raise :class:`GraphError` naming the broken one."""
    defined: set[int] = set()
    for v in graph.inputs:
        if v.id in defined:
            raise GraphError(f"graph input {v!r} is listed twice")
        if v.producer is not None:
            raise GraphError(f"graph input {v!r} has a producer {v.producer}")
        defined.add(v.id)
    seen_ops: set[int] = set()
    for op in graph.ops:
        if op.id in seen_ops:
            raise GraphError(f"{op} appears twice in the op list")
        seen_ops.add(op.id)
        for v in op.inputs:
            if not v.is_const and v.id not in defined:
                raise GraphError(f"{op} reads {v!r} before it is defined")
        for v in op.outputs:
            if v.id in defined:
                raise GraphError(f"{op} redefines {v!r}")
            if v.producer is not op:
                raise GraphError(f"{v!r} is an output of {op} but names {v.producer} as producer")
            defined.add(v.id)
        if not op.outputs and not op.effects:
            raise GraphError(f"{op} has no outputs and no effects: nothing can observe it")
        if op.weight < 0:
            raise GraphError(f"{op} runs {op.weight} times per call; a weight is >= 0")
        _check_edge(op)
    for v in graph.outputs:
        if not v.is_const and v.id not in defined:
            raise GraphError(f"graph output {v!r} is never defined")
