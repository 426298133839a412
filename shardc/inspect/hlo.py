"""Read the collectives XLA actually compiled, and price the compiled program.

:func:`collectives` walks every computation of an optimized HLO module (the text of
``jax.jit(f).lower(...).compile().as_text()``) and returns one :class:`HloCollective` per
collective instruction: its kind, per-device result size, replica groups, and the mesh axes
those groups run over. :func:`price` turns them into α-β seconds on a
:class:`~shardc.cost.cluster.Cluster` with the planner's own formulas
(:func:`shardc.cost.comm.collective_time`), and adds compute time from XLA's
``cost_analysis`` and peak memory from ``memory_analysis``.

Replica groups
--------------
XLA prints the device groups of a collective in three spellings; all three name *logical*
device ids, i.e. positions in the program's device assignment. For a program jitted on a
``jax.sharding.Mesh`` that assignment is ``mesh.devices.flat``, so id ``i`` sits at mesh
coordinate ``np.unravel_index(i, mesh.devices.shape)`` (on the default CPU mesh id ``i`` is
also ``device.id == i``; on a permuted mesh it is not, and the position is what counts).

1. Explicit lists, ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (``{}`` = one group of every
   device). On jax 0.10.2 CPU this is what ``shard_map`` collectives (``psum``,
   ``psum_scatter``, ``all_to_all``) print.
2. Iota lists, ``replica_groups=[2,4]<=[4,2]T(1,0)``: ``iota(prod(dims))`` reshaped to
   ``dims``, transposed by ``T(perm)`` (omitted when there is none), reshaped to
   ``[num_groups, group_size]``. Not printed by this build by default, parsed anyway.
3. Mesh axes, ``replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2],
   device_ids=([2,4]T(1,0)) {'axis_1'}``: a synthetic mesh (its own axis names, unrelated
   to the JAX mesh's) whose device assignment is ``device_ids`` (an iota
   ``[reshape_dims]T(perm)``, a comma list of ids, or absent = ``iota``); each group holds
   the devices that differ only along the braced axes, in the braced order. A braced axis
   may be a sub-axis ``'a':(pre)size``. This is what GSPMD/Shardy partitioning of
   ``NamedSharding`` programs prints on this build.

``collective-permute`` has ``source_target_pairs={{0,1},{1,2},...}`` instead; its groups
are the connected components of those pairs (a shift along one mesh axis gives that axis's
lines).

The CPU reduce-scatter
----------------------
XLA:CPU has no reduce-scatter rewrite for partitioned programs: a ``P → S`` conversion
compiles to a full ``all-reduce`` whose only user keeps ``1/n`` of it, a ``dynamic-slice``
(or ``slice``) indexed by ``partition-id``, often inside a fusion
(``%bitcast_dynamic-slice_fusion = f32[32,16] fusion(%all-reduce, ...)``) and possibly behind
``bitcast``/``reshape``/``copy``. :func:`collectives` follows the users of each single-array
all-reduce inside its computation (into fused computations through their parameters) and,
when the kept slice is ``1/group_size`` of the result, reports a ``reduce-scatter`` of the
slice's size with ``from_all_reduce=True``: what a backend with the rewrite would run, and
what the planner predicts for ``P → S``. (``shard_map``'s ``psum_scatter`` does print a real
``reduce-scatter`` on CPU.)

Async forms ``<kind>-start`` count as their kind, ``-done`` (and ``-update``) never count;
a generic ``async-start`` is not a collective itself, the op in the async computation it
wraps is, so each collective counts once. A collective in a while body counts once per text
occurrence; its :attr:`HloCollective.computation` names the body, and
:func:`loop_trip_counts` gives XLA's known trip counts to weight it by.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Mesh

from shardc.cost import comm
from shardc.cost.cluster import Cluster

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Groups = tuple[tuple[int, ...], ...]
ShapeTree = str | tuple["ShapeTree", ...]

# ---- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled module.

    ``result_bytes`` is per device: the sum over a tuple result's elements, the result part
    of an async ``-start`` op, or the kept slice of a CPU reduce-scatter. ``groups`` hold
    logical device ids (positions in ``mesh.devices.flat``). ``axes`` are the mesh axes the
    groups span, in mesh order, or None when the groups are not full lines/planes of mesh
    axes. ``computation`` is the HLO computation the instruction sits in.
    """

    kind: str
    name: str
    result_bytes: int
    shapes: tuple[str, ...]
    group_size: int
    groups: Groups
    axes: tuple[str, ...] | None
    from_all_reduce: bool = False
    computation: str = ""

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends (ring formulas of :func:`shardc.cost.comm.wire_bytes`)."""
        return comm.wire_bytes(self.kind, self.group_size, self.result_bytes)


@dataclass(frozen=True)
class CompiledCost:
    """A compiled program priced on a cluster.

    ``times`` are the α-β seconds of ``collectives``, index by index; ``comm_time`` is their
    sum (no overlap). ``flops`` are per device from ``compiled.cost_analysis()``;
    ``peak_memory`` is ``temp + argument + output - alias`` bytes from
    ``compiled.memory_analysis()`` (generated code and host-side sizes excluded), None when
    the backend gives no memory analysis.
    """

    comm_time: float
    compute_time: float
    wire_bytes: float
    flops: float
    peak_memory: float | None
    collectives: tuple[HloCollective, ...]
    counts: dict[str, int] = field(default_factory=dict)
    times: tuple[float, ...] = ()

    @property
    def time(self) -> float:
        return self.comm_time + self.compute_time


# ---- HLO text -> computations ------------------------------------------------------------


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclass
class _Computation:
    name: str
    instructions: dict[str, _Instruction] = field(default_factory=dict)
    users: dict[str, list[str]] = field(default_factory=dict)

    def add(self, instr: _Instruction) -> None:
        self.instructions[instr.name] = instr
        for op in instr.operands:
            self.users.setdefault(op, []).append(instr.name)

    def parameter(self, index: int) -> _Instruction | None:
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
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


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


def _parse_instruction(line: str) -> _Instruction | None:
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
    return _Instruction(m.group(1), _COMMENT.sub("", shape), op.group(1), operands,
                        rest[close + 1:])


def _parse_module(text: str) -> dict[str, _Computation]:
    comps: dict[str, _Computation] = {}
    current: _Computation | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.strip() == "}":
                current = None
                continue
            header = _HEADER.match(line)
            if header:
                current = comps.setdefault(header.group(1), _Computation(header.group(1)))
            continue
        if current is not None:
            instr = _parse_instruction(line)
            if instr is not None:
                current.add(instr)
    if not comps:
        raise ValueError(f"no HLO computations found in text starting {text[:120]!r}")
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


def _shape_tree(text: str) -> ShapeTree:
    text = text.strip()
    if text.startswith("("):
        return tuple(_shape_tree(p) for p in _split_top(text[1:-1]))
    m = _LEAF.match(text)
    if m is None:
        raise ValueError(f"unrecognised HLO shape {text!r}")
    return m.group(0)


def _leaves(tree: ShapeTree) -> tuple[str, ...]:
    if isinstance(tree, str):
        return (tree,)
    return tuple(leaf for t in tree for leaf in _leaves(t))


def shape_bytes(shape: str) -> int:
    """Bytes of one array shape string such as ``"f32[32,256]"`` (layout optional)."""
    m = _LEAF.match(shape.strip())
    if m is None:
        raise ValueError(f"unrecognised HLO array shape {shape!r}")
    dtype, dims = m.groups()
    if dtype not in _DTYPE_BITS:
        raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
    n = math.prod(int(d.strip().removeprefix("<=")) for d in dims.split(",") if d.strip())
    return math.ceil(n * _DTYPE_BITS[dtype] / 8)


def _result_shapes(opcode: str, shape: str) -> tuple[str, ...]:
    """Leaf shapes of a collective's result; async ``-start`` ops return
    ``(operands, results, context...)`` except ``all-reduce-start`` (results only)."""
    tree = _shape_tree(shape)
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        if isinstance(tree, str) or len(tree) < 2:
            raise ValueError(f"{opcode} result {shape!r} is not an (operand, result, ...) tuple")
        tree = tree[1]
    return _leaves(tree)


# ---- replica groups ------------------------------------------------------------------------

_EXPLICIT = re.compile(r"\{((?:\s*\{[\d,\s]*\}\s*,?)*)\s*\}")
_IOTA = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^{}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\s*\{\d+,\d+\}\s*,?)*)\s*\}")
_INTS = re.compile(r"\d+")


def _ints(text: str) -> list[int]:
    return [int(x) for x in _INTS.findall(text)]


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """``iota(prod(dims))`` reshaped to ``dims`` and transposed by ``perm``."""
    arr = np.arange(math.prod(dims)).reshape(dims)
    if not perm:
        return arr
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"iota transpose T{tuple(perm)} is not a permutation of the "
                         f"{len(dims)} reshape dims {list(dims)}")
    return arr.transpose(perm)


def _explicit_groups(m: re.Match, num_devices: int) -> Groups:
    groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
    return groups or (tuple(range(num_devices)),)


def _iota_groups(m: re.Match) -> Groups:
    n_groups, size = int(m.group(1)), int(m.group(2))
    dims = _ints(m.group(3))
    perm = _ints(m.group(4)) if m.group(4) else None
    if math.prod(dims) != n_groups * size:
        raise ValueError(f"iota replica groups {m.group(0)!r}: {n_groups}x{size} groups "
                         f"but {math.prod(dims)} devices")
    return tuple(tuple(int(d) for d in row) for row in _iota(dims, perm).reshape(n_groups, size))


def _mesh_device_ids(spec: str | None, n: int) -> np.ndarray:
    """Flat device assignment of a mesh-spelled replica group: ``[dims]T(perm)`` iota,
    ``[dims]`` iota, a comma list of ids, or None (plain iota)."""
    if spec is None:
        return np.arange(n)
    spec = spec.strip()
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if iota:
        ids = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
    elif re.fullmatch(r"[\d,\s]+", spec):
        ids = np.array(_ints(spec))
    else:
        raise ValueError(f"unrecognised mesh device_ids=({spec})")
    if ids.size != n:
        raise ValueError(f"mesh device_ids=({spec}) has {ids.size} ids, mesh has {n} devices")
    return ids.ravel()


def _axis_reshape(refs: list[tuple[int, int]], full: int) -> tuple[list[int], list[int]]:
    """Split one mesh axis of size ``full`` for its sub-axis refs ``(pre_size, size)``:
    the reshaped dims and, per ref in the given order, the dim it aggregates over."""
    if len(refs) == 1 and refs[0] == (1, full):
        return [full], [0]
    order = sorted(range(len(refs)), key=lambda i: refs[i][0])
    dims: list[int] = []
    agg_sorted: list[int] = []
    prefix = 1
    for i in order:
        pre, size = refs[i]
        if pre != prefix:
            dims.append(pre // prefix)
            prefix = pre
        agg_sorted.append(len(dims))
        dims.append(size)
        prefix *= size
    if prefix != full:
        dims.append(full // prefix)
    agg = [0] * len(refs)
    for pos, i in enumerate(order):
        agg[i] = agg_sorted[pos]
    return dims, agg


def _mesh_refs(m: re.Match) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Axis sizes of a mesh spelling and its braced refs as ``(axis, pre_size, size)``."""
    axes = re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", m.group(1))
    if not axes:
        raise ValueError(f"mesh replica groups {m.group(0)!r} name no axes")
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    refs = []
    for name, pre, size in re.findall(r"'?([^',:\s{}]+)'?(?::\((\d+)\)(\d+))?", m.group(3)):
        if name not in names:
            raise ValueError(f"mesh replica groups {m.group(0)!r} group over unknown axis "
                             f"{name!r}; mesh axes are {names}")
        dim = names.index(name)
        refs.append((dim, int(pre), int(size)) if pre else (dim, 1, sizes[dim]))
    return sizes, refs


def _mesh_groups(m: re.Match) -> Groups:
    """Groups of a mesh spelling, as XLA's ``MeshAxesReplicaGroupList`` builds them: split
    each axis for its sub-axis refs, move the grouped dims (in ref order) last, chunk."""
    sizes, refs = _mesh_refs(m)
    ids = _mesh_device_ids(m.group(2), math.prod(sizes))
    reshaped: list[int] = []
    offsets: list[int] = []
    splits: list[list[int]] = []
    for dim, full in enumerate(sizes):
        dim_refs = [(pre, size) for d, pre, size in refs if d == dim]
        dims, agg = _axis_reshape(dim_refs, full) if dim_refs else ([full], [])
        offsets.append(len(reshaped))
        splits.append(agg)
        reshaped += dims
    grouped: list[int] = []
    used: Counter[int] = Counter()
    for dim, _, _ in refs:
        grouped.append(splits[dim][used[dim]] + offsets[dim])
        used[dim] += 1
    perm = [d for d in range(len(reshaped)) if d not in grouped] + grouped
    size = math.prod(size for _, _, size in refs)
    arr = ids.reshape(reshaped).transpose(perm).reshape(-1, size)
    return tuple(tuple(int(d) for d in row) for row in arr)


def parse_replica_groups(spelling: str, num_devices: int) -> Groups:
    """Device groups of a ``replica_groups=`` value in any of the three spellings (module
    docstring); ``num_devices`` expands the empty explicit list ``{}``."""
    text = spelling.strip().removeprefix("replica_groups=")
    if m := _EXPLICIT.match(text):
        return _explicit_groups(m, num_devices)
    if m := _IOTA.match(text):
        return _iota_groups(m)
    if m := _MESH.match(text):
        return _mesh_groups(m)
    raise ValueError(f"unrecognised replica_groups spelling {text[:160]!r}; expected "
                     "{{..},..}, [g,s]<=[dims]T(perm) or mesh[..], device_ids=(..) {axes}")


def _permute_groups(pairs: Sequence[tuple[int, int]]) -> Groups:
    """Connected components of collective-permute source→target pairs."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for s, t in pairs:
        parent[root(s)] = root(t)
    comps: dict[int, list[int]] = {}
    for d in parent:
        comps.setdefault(root(d), []).append(d)
    return tuple(sorted(tuple(sorted(c)) for c in comps.values()))


def _instruction_groups(instr: _Instruction, num_devices: int) -> Groups:
    if instr.opcode.startswith("collective-permute"):
        m = _PAIRS.search(instr.attrs)
        if m is None:
            raise ValueError(f"{instr.opcode} %{instr.name} has no source_target_pairs")
        ints = _ints(m.group(1))
        return _permute_groups(list(zip(ints[::2], ints[1::2])))
    at = instr.attrs.find("replica_groups=")
    if at < 0:
        return (tuple(range(num_devices)),)
    try:
        return parse_replica_groups(instr.attrs[at:], num_devices)
    except ValueError as e:
        raise ValueError(f"{instr.opcode} %{instr.name}: {e}") from None


def group_axes(groups: Groups, mesh: Mesh) -> tuple[str, ...] | None:
    """Mesh axes (in mesh order) the groups span, or None unless every group is exactly a
    full line/plane of those axes. Ids are positions in ``mesh.devices.flat``."""
    shape = mesh.devices.shape
    n = mesh.devices.size
    varying: list[frozenset[int]] = []
    for g in groups:
        bad = [d for d in g if not 0 <= d < n]
        if bad:
            raise ValueError(f"replica group {g} names device ids {bad} outside the mesh's "
                             f"{n} devices (shape {dict(mesh.shape)})")
        coords = np.array(np.unravel_index(list(g), shape)).T
        varying.append(frozenset(i for i in range(len(shape)) if len(set(coords[:, i])) > 1))
    axes = frozenset().union(*varying)
    size = math.prod(shape[i] for i in axes)
    if any(v != axes or len(set(g)) != size for g, v in zip(groups, varying)):
        return None
    return tuple(mesh.axis_names[i] for i in sorted(axes))


# ---- the CPU reduce-scatter pattern ----------------------------------------------------------

_PASS_THROUGH = frozenset({"bitcast", "reshape", "copy", "transpose", "all-reduce-done"})
_CALLS = re.compile(r"calls=%?([^\s,}]+)")


def _kept_slice(comps: Mapping[str, _Computation], comp: _Computation, name: str,
                full_bytes: int, n: int) -> str | None:
    """Shape of the ``1/n`` slice that the sole user chain of ``name`` keeps, if any."""
    users = comp.users.get(name, [])
    if len(users) != 1:
        return None
    user = comp.instructions[users[0]]
    if user.opcode in _PASS_THROUGH:
        return _kept_slice(comps, comp, user.name, full_bytes, n)
    if user.opcode in ("dynamic-slice", "slice"):
        kept = _shape_tree(user.shape)
        if user.operands[:1] == (name,) and isinstance(kept, str):
            return kept if shape_bytes(kept) * n == full_bytes else None
        return None
    if user.opcode == "fusion":
        callee = _CALLS.search(user.attrs)
        slots = [i for i, op in enumerate(user.operands) if op == name]
        if callee is None or callee.group(1) not in comps or len(slots) != 1:
            return None
        inner = comps[callee.group(1)]
        param = inner.parameter(slots[0])
        if param is None:
            return None
        return _kept_slice(comps, inner, param.name, full_bytes, n)
    return None


# ---- collectives -----------------------------------------------------------------------------


def _hlo_text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    as_text = getattr(compiled_or_text, "as_text", None)
    if as_text is None:
        raise TypeError("collectives() needs HLO text or a jax Compiled (with .as_text()), "
                        f"got {type(compiled_or_text).__name__}")
    text = as_text()
    if not isinstance(text, str):
        raise TypeError(f"{type(compiled_or_text).__name__}.as_text() returned "
                        f"{type(text).__name__}, not HLO text")
    return text


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _collective(comps: Mapping[str, _Computation], comp: _Computation, instr: _Instruction,
                kind: str, mesh: Mesh) -> HloCollective:
    groups = _instruction_groups(instr, mesh.devices.size)
    size = max((len(g) for g in groups), default=1)
    shapes = _result_shapes(instr.opcode, instr.shape)
    nbytes = sum(shape_bytes(s) for s in shapes)
    from_ar = False
    if kind == "all-reduce" and len(shapes) == 1 and size > 1:
        kept = _kept_slice(comps, comp, instr.name, nbytes, size)
        if kept is not None:
            kind, shapes, nbytes, from_ar = "reduce-scatter", (kept,), shape_bytes(kept), True
    return HloCollective(kind, instr.name, nbytes, shapes, size, groups,
                         group_axes(groups, mesh), from_ar, comp.name)


def collectives(compiled_or_hlo_text: Any, mesh: Mesh) -> list[HloCollective]:
    """Every collective of an optimized HLO module, in text order, over all computations
    (entry, while bodies, fusions, async computations); see the module docstring."""
    comps = _parse_module(_hlo_text(compiled_or_hlo_text))
    found = []
    for comp in comps.values():
        for instr in comp.instructions.values():
            kind = _kind(instr.opcode)
            if kind is not None:
                found.append(_collective(comps, comp, instr, kind, mesh))
    return found


_WHILE_BODY = re.compile(r"body=%?([^\s,}]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def loop_trip_counts(compiled_or_hlo_text: Any) -> dict[str, int]:
    """While-body computation name -> XLA's known trip count (per entry into the loop;
    multiply through enclosing loops yourself). Loops without a known count are absent."""
    counts: dict[str, int] = {}
    for comp in _parse_module(_hlo_text(compiled_or_hlo_text)).values():
        for instr in comp.instructions.values():
            body, trip = _WHILE_BODY.search(instr.attrs), _TRIP.search(instr.attrs)
            if instr.opcode == "while" and body and trip:
                counts[body.group(1)] = int(trip.group(1))
    return counts


# ---- pricing ---------------------------------------------------------------------------------


def _link(c: HloCollective, mesh: Mesh, cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) a collective runs at: the slowest bandwidth and largest latency
    among its axes; the mesh's slowest axis when its groups match no mesh axes."""
    if c.axes:
        return (min(cluster.bandwidth(a) for a in c.axes),
                max(cluster.latency(a) for a in c.axes))
    slowest = min(mesh.axis_names, key=lambda a: (cluster.bandwidth(a), -cluster.latency(a)))
    return cluster.bandwidth(slowest), cluster.latency(slowest)


def collective_seconds(c: HloCollective, mesh: Mesh, cluster: Cluster) -> float:
    bw, lat = _link(c, mesh, cluster)
    return comm.collective_time(c.kind, c.group_size, c.result_bytes, bw, lat)


def compiled_flops(compiled: Any) -> float:
    """Per-device FLOPs from ``compiled.cost_analysis()`` (a dict, or a list of dicts that
    are summed); 0.0 when the backend reports none."""
    analysis = compiled.cost_analysis()
    if analysis is None:
        return 0.0
    if isinstance(analysis, Mapping):
        entries: Sequence[Mapping] = [analysis]
    elif isinstance(analysis, list | tuple):
        entries = analysis
    else:
        raise TypeError(f"cost_analysis() returned {type(analysis).__name__}, "
                        "expected a dict or a list of dicts")
    return float(sum(e.get("flops", 0.0) for e in entries if e))


def compiled_peak_memory(compiled: Any) -> float | None:
    """``temp + argument + output - alias`` bytes per device from
    ``compiled.memory_analysis()``; None when unavailable."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return float(stats.temp_size_in_bytes + stats.argument_size_in_bytes
                 + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def price(compiled: Any, mesh: Mesh, cluster: Cluster) -> CompiledCost:
    """Price a ``jax`` Compiled on ``cluster``: each collective with
    :func:`~shardc.cost.comm.collective_time`, compute as
    ``flops / (device_flops * utilization)``."""
    found = tuple(collectives(compiled, mesh))
    times = tuple(collective_seconds(c, mesh, cluster) for c in found)
    flops = compiled_flops(compiled)
    return CompiledCost(
        comm_time=sum(times),
        compute_time=flops / (cluster.device_flops * cluster.utilization),
        wire_bytes=sum(c.wire_bytes for c in found),
        flops=flops,
        peak_memory=compiled_peak_memory(compiled),
        collectives=found,
        counts=dict(Counter(c.kind for c in found)),
        times=times,
    )
