"""Replica groups of HLO collectives in the three spellings XLA prints, and the mesh axes
they span (see :mod:`shardc.inspect.hlo` for the spellings)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from shardc.errors import HloError
from shardc.inspect.hlotext import Instruction

__all__ = ["group_axes", "group_spans", "Groups", "instruction_groups", "parse_replica_groups"]

Groups = tuple[tuple[int, ...], ...]

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
        raise HloError(f"iota transpose T{tuple(perm)} is not a permutation of the "
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
        raise HloError(f"iota replica groups {m.group(0)!r}: {n_groups}x{size} groups "
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
        raise HloError(f"unrecognised mesh device_ids=({spec})")
    if ids.size != n:
        raise HloError(f"mesh device_ids=({spec}) has {ids.size} ids, mesh has {n} devices")
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
        raise HloError(f"mesh replica groups {m.group(0)!r} name no axes")
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    refs = []
    for name, pre, size in re.findall(r"'?([^',:\s{}]+)'?(?::\((\d+)\)(\d+))?", m.group(3)):
        if name not in names:
            raise HloError(f"mesh replica groups {m.group(0)!r} group over unknown axis "
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
    raise HloError(f"unrecognised replica_groups spelling {text[:160]!r}; expected "
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


def instruction_groups(instr: Instruction, num_devices: int) -> Groups:
    if instr.opcode.startswith("collective-permute"):
        m = _PAIRS.search(instr.attrs)
        if m is None:
            raise HloError(f"{instr.opcode} %{instr.name} has no source_target_pairs")
        ints = _ints(m.group(1))
        return _permute_groups(list(zip(ints[::2], ints[1::2])))
    at = instr.attrs.find("replica_groups=")
    if at < 0:
        return (tuple(range(num_devices)),)
    try:
        return parse_replica_groups(instr.attrs[at:], num_devices)
    except ValueError as e:
        raise HloError(f"{instr.opcode} %{instr.name}: {e}") from None


def group_spans(groups: Groups, mesh: Mesh) -> tuple[tuple[str, int], ...]:
    """``(axis, count)`` for every mesh axis along which the first group's devices take
    ``count > 1`` distinct positions: the links a collective of these groups crosses (a
    group of 2 or 4 devices inside one mesh axis spans that axis only). Ids are positions
    in ``mesh.devices.flat``; XLA's groups of one collective all have the same shape."""
    if not groups or not groups[0]:
        return ()
    shape = mesh.devices.shape
    coords = np.array(np.unravel_index(list(groups[0]), shape)).T
    return tuple((mesh.axis_names[i], len(set(coords[:, i]))) for i in range(len(shape))
                 if len(set(coords[:, i])) > 1)


def group_axes(groups: Groups, mesh: Mesh) -> tuple[str, ...] | None:
    """Mesh axes (in mesh order) the groups span, or None unless every group is exactly a
    full line/plane of those axes. Ids are positions in ``mesh.devices.flat``."""
    shape = mesh.devices.shape
    n = mesh.devices.size
    varying: list[frozenset[int]] = []
    for g in groups:
        bad = [d for d in g if not 0 <= d < n]
        if bad:
            raise HloError(f"replica group {g} names device ids {bad} outside the mesh's "
                           f"{n} devices (shape {dict(mesh.shape)})")
        coords = np.array(np.unravel_index(list(g), shape)).T
        varying.append(frozenset(i for i in range(len(shape)) if len(set(coords[:, i])) > 1))
    axes = frozenset().union(*varying)
    size = math.prod(shape[i] for i in axes)
    if any(v != axes or len(set(g)) != size for g, v in zip(groups, varying)):
        return None
    return tuple(mesh.axis_names[i] for i in sorted(axes))


