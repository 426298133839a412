"""SBP sharding IR: split / broadcast / partial per mesh axis.

A value's placement on a device mesh is an :class:`NdSbp`: one :data:`Sbp` per mesh axis.

* ``Split(dim)``: along this mesh axis each device holds a contiguous slice of ``dim``.
* ``Broadcast()``: every device along the axis holds the whole value.
* ``Partial("sum")``: every device holds a full-shaped value; the logical value is the
  element-wise sum over the devices of the axis (JAX calls this "unreduced").

This module is the only place that converts to and from ``jax.sharding.PartitionSpec``.

References:
  OneFlow ``oneflow/core/job/sbp_parallel.proto`` (the split / broadcast / partial words).
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

import numpy as np
from jax.sharding import PartitionSpec

from shardc.errors import LayoutError, MeshAxisError, closest
from shardc.util.axes import axis_tuple

__all__ = ["B", "Broadcast", "device_pieces", "from_partition_spec", "NdSbp", "P", "parse_sbp",
           "Partial", "replicated", "S", "Sbp", "shared_dim_splits", "Split", "to_partition_spec",
           "WHOLE"]


@dataclass(frozen=True, slots=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each device holds a summand (``op`` "sum"), or a candidate of a max / min, of the
    value. ``"whole"`` is a partial sum XLA reduces in full where it is made (a scatter-add
    of split updates into a replicated table: the partitioner all-reduces the scatter's
    result), so it is never reduce-scattered: a split of it is an all-reduce and a slice."""

    op: str = "sum"

    @property
    def reduction(self) -> str:
        """The reduction its collective runs: a ``"whole"`` partial is a sum."""
        return "sum" if self.op == "whole" else self.op

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Sbp = Union[Split, Broadcast, Partial]
B = Broadcast()
P = Partial()
WHOLE = Partial("whole")


def S(dim: int) -> Split:
    return Split(dim)


@dataclass(frozen=True, slots=True)
class NdSbp:
    """One :data:`Sbp` per mesh axis, in mesh-axis order."""

    sbps: tuple[Sbp, ...]
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    #: the sbps as plain values (a split's dim, a partial's op, None for broadcast):
    #: NdSbps key the solver's tables, and equal keys made apart compare millions of times
    #: a frontier, each through every element's generated ``__eq__`` otherwise
    _key: tuple = field(init=False, repr=False, compare=False, default=())
    #: the mesh axes that split the value (:meth:`shard_fraction` runs millions of times a
    #: frontier)
    _split_axes: tuple = field(init=False, repr=False, compare=False, default=())
    #: whether an axis holds it partial (:attr:`has_partial`: asked millions of times a
    #: frontier, by every memory profile)
    _partial: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self):  # hashed and keyed once
        object.__setattr__(self, "_hash", hash(self.sbps))
        object.__setattr__(self, "_key", tuple(
            s.dim if isinstance(s, Split) else s.op if isinstance(s, Partial) else None
            for s in self.sbps))
        object.__setattr__(self, "_split_axes", tuple(
            k for k, s in enumerate(self.sbps) if isinstance(s, Split)))
        object.__setattr__(self, "_partial", any(isinstance(s, Partial) for s in self.sbps))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not NdSbp:
            return NotImplemented
        return self._key == other._key

    def __str__(self) -> str:
        return "(" + ", ".join(str(s) for s in self.sbps) + ")"

    def __iter__(self):
        return iter(self.sbps)

    def __len__(self) -> int:
        return len(self.sbps)

    @property
    def has_partial(self) -> bool:
        return self._partial

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(s, Broadcast) for s in self.sbps)

    def split_factor(self, axis_sizes: Sequence[int], dim: int) -> int:
        """How many pieces dimension ``dim`` is cut into."""
        f = 1
        for s, n in zip(self.sbps, axis_sizes):
            if isinstance(s, Split) and s.dim == dim:
                f *= n
        return f

    def shard_fraction(self, axis_sizes: Sequence[int]) -> float:
        """Fraction of the logical value each device holds."""
        f, n = 1, len(axis_sizes)
        for k in self._split_axes:
            if k < n:
                f *= axis_sizes[k]
        return 1.0 / f

    def fits(self, shape: Sequence[int], axis_sizes: Sequence[int]) -> bool:
        """True when every split dim exists and divides evenly."""
        for s in self.sbps:
            if isinstance(s, Split) and not 0 <= s.dim < len(shape):
                return False
        return all(
            shape[d] % self.split_factor(axis_sizes, d) == 0 for d in range(len(shape))
        )

    def to_json(self) -> list[str]:
        return [str(s) for s in self.sbps]

    @classmethod
    def from_json(cls, items: Sequence[str]) -> NdSbp:
        return _parse_nd(tuple(items))


@functools.lru_cache(maxsize=4096)
def _parse_nd(items: tuple[str, ...]) -> NdSbp:
    """A plan file holds a few distinct layouts many times over: parse each once."""
    return NdSbp(tuple(parse_sbp(t) for t in items))


def replicated(n_axes: int) -> NdSbp:
    return NdSbp((B,) * n_axes)


def shared_dim_splits(layouts: Iterable[NdSbp], among: Container[int], dim: int = 0
                      ) -> tuple[int, ...]:
    """The mesh axes ``among`` (indices, in mesh order) that split ``dim`` of every one of
    ``layouts`` alike: a pipeline's batch axes, read from its layer carries; () unless they
    all agree (or there are none)."""
    found = {tuple(k for k, sbp in enumerate(nd.sbps)
                   if k in among and isinstance(sbp, Split) and sbp.dim == dim)
             for nd in layouts}
    return found.pop() if len(found) == 1 else ()


@functools.lru_cache(maxsize=4096)
def device_pieces(nd: NdSbp, shape: tuple[int, ...]) -> tuple:
    """Which piece of a value laid out ``nd`` on a mesh of ``shape`` each device holds, the
    devices in row-major order (how every view of a mesh's devices orders them,
    :class:`shardc.tradeoff.views.View`): per split dim its slice's index, per partial
    reduction its summand's, each a tuple over the devices. Two layouts, on the same view
    or on two views of the same devices, are equal here exactly when every device holds
    the same piece: batch-split data parallelism on ``gpu=8`` and on ``gpu2=2 x gpu4=4``
    (split over both, the first axis major as in a PartitionSpec) compare equal."""
    coords = np.indices(shape).reshape(len(shape), -1)
    pieces: dict[tuple, np.ndarray] = {}
    for axis, (s, n) in enumerate(zip(nd.sbps, shape, strict=True)):
        if isinstance(s, Broadcast) or n == 1:
            continue
        key = ("S", s.dim) if isinstance(s, Split) else ("P", s.op)
        major = pieces.get(key)
        pieces[key] = coords[axis] if major is None else major * n + coords[axis]
    return tuple(sorted((k, tuple(v.tolist())) for k, v in pieces.items()))


def parse_sbp(text: str) -> Sbp:
    """Inverse of ``str(sbp)``: ``"B"``, ``"P"``, ``"P(max)"``, ``"S(2)"``."""
    if text == "B":
        return B
    if text == "P":
        return P
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    if text.startswith("S(") and text.endswith(")"):
        return Split(int(text[2:-1]))
    raise LayoutError(f"cannot parse SBP {text=}; expected B, P, P(op) or S(dim)")


def to_partition_spec(nd: NdSbp, ndim: int, axis_names: Sequence[str]) -> PartitionSpec:
    """The PartitionSpec of ``nd`` for a rank-``ndim`` value.

    Partial axes are left out: on Auto mesh axes JAX cannot spell "unreduced", so a
    partial value is described by its split axes only (the reduction is XLA's to place).
    """
    if len(nd) != len(axis_names):
        raise LayoutError(f"NdSbp {nd} has {len(nd)} axes but the mesh has {list(axis_names)}")
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for s, name in zip(nd.sbps, axis_names):
        if isinstance(s, Split):
            entries[s.dim].append(name)
    spec = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries]
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def from_partition_spec(spec: PartitionSpec, ndim: int, axis_names: Sequence[str]) -> NdSbp:
    """The NdSbp of a PartitionSpec; mesh axes the spec does not name are broadcast.

    The order of mesh axes on one dim must follow mesh order (the only order an NdSbp can
    express); anything else is rejected with the fix.
    """
    sbps: dict[str, Sbp] = {}
    for dim, entry in enumerate(tuple(spec) + (None,) * (ndim - len(spec))):
        if entry is None:
            continue
        names = axis_tuple(entry)
        order = [axis_names.index(n) for n in names if n in axis_names]
        if len(order) != len(names):
            bad = next(n for n in names if n not in axis_names)
            raise MeshAxisError(f"{spec=} names axis {bad!r}, not in the mesh "
                                f"{list(axis_names)}{closest(bad, axis_names)}")
        if order != sorted(order):
            raise LayoutError(
                f"{spec=} splits dim {dim} over {names} out of mesh order; "
                f"write them as {tuple(axis_names[i] for i in sorted(order))}"
            )
        for n in names:
            sbps[n] = Split(dim)
    for n in getattr(spec, "unreduced", ()) or ():
        sbps[n] = P
    return NdSbp(tuple(sbps.get(n, B) for n in axis_names))
