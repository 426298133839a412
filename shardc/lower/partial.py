"""Partial sums held apart per device inside a scan body.

A plan may keep a scan's accumulator carry partial (``P``) across iterations: ``acc + g``
with ``g`` a micro-batch's partial gradient is then reduced once after the loop instead of
every iteration (:func:`shardc.solve.problem.accumulators`). Auto mesh axes cannot spell an
unreduced value, so the lowering spells it with a shape: a value partial over mesh axes ``A``
is held *stacked*, with one leading dim per axis of ``A`` (the axis's size, split on that
axis), each device holding its own summand in its slice; the logical value is the sum over
those dims.

* An op that makes or passes such a value runs under ``jax.vmap`` over the leading dims: a
  partial operand is read stacked, an operand split along an axis of ``A`` is cut into that
  axis's pieces (a dot or a sum over the split dim then computes each device's summand from
  its own piece, which XLA keeps on the device), a broadcast one is read whole.
* A value leaves the stacked form by a sum over the leading dims: the reduction the plan
  priced (XLA's all-reduce, or reduce-scatter where a split layout is pinned after it).
* A value enters it by staying on the first device of each axis, zeros on the others.

References:
  JAX's ``shard_map`` (per-device bodies with an explicit ``psum`` after the loop): the same
  program, written here in global form so XLA's partitioner still places everything else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardc.ir.prims import facts
from shardc.ir.sbp import B, NdSbp, P, Partial, Split, to_partition_spec

__all__ = ["lift", "stack", "stackable", "Stacked", "stacked_sharding", "sum_axes", "unstack",
           "vmapped", "widen"]


class Stacked:
    """A partial value held stacked: ``x`` has one leading dim per mesh axis of ``axes``
    (ascending); the value is the sum over them."""

    __slots__ = ("x", "axes")

    def __init__(self, x, axes: tuple[int, ...]):
        self.x = x
        self.axes = axes


def sum_axes(nd: NdSbp) -> tuple[int, ...]:
    """The mesh axes along which ``nd`` is a partial sum."""
    return tuple(a for a, s in enumerate(nd.sbps) if s == P)


def _other_partial(nd: NdSbp) -> bool:
    return any(isinstance(s, Partial) and s != P for s in nd.sbps)


def stackable(name: str, ins: Sequence[NdSbp], out: NdSbp) -> bool:
    """An op planned ``ins -> out`` computes each device's summand under ``jax.vmap``: its
    output is a partial sum along some axes, each of them fed by a partial operand or by an
    operand split along it into a dot or a reduction (the split dim is the one contracted),
    and no other kind of partial value is involved."""
    axes = sum_axes(out)
    if not axes or _other_partial(out) or any(_other_partial(nd) for nd in ins):
        return False
    for a in axes:
        fed = False
        for nd in ins:
            s = nd.sbps[a]
            if isinstance(s, Split) and not facts(name).splits_from_operands:
                return False
            fed = fed or s == P or isinstance(s, Split)
        if not fed:
            return False
    return True


def stacked_sharding(mesh: Mesh, axes: tuple[int, ...], nd: NdSbp, ndim: int
                     ) -> NamedSharding | None:
    """The sharding of a value held stacked over ``axes`` in layout ``nd`` (rank ``ndim``
    without the leading dims); None where ``nd`` is partial along other axes too."""
    if sum_axes(nd) != axes or _other_partial(nd):
        return None
    rest = NdSbp(tuple(B if a in axes else s for a, s in enumerate(nd.sbps)))
    spec = tuple(to_partition_spec(rest, ndim, mesh.axis_names))
    names = mesh.axis_names
    return NamedSharding(mesh, PartitionSpec(*(names[a] for a in axes), *spec))


def unstack(x):
    """The value of ``x``: the sum over its leading dims if it is held stacked."""
    if isinstance(x, Stacked):
        return jnp.sum(x.x, axis=tuple(range(len(x.axes))), dtype=x.x.dtype)
    return x


def stack(x, axes: tuple[int, ...], sizes: Sequence[int]):
    """``x`` held stacked over ``axes``: itself on the first device of each axis, zeros on
    the others (B -> P, no communication)."""
    shape = tuple(sizes[a] for a in axes)
    first = functools.reduce(jnp.logical_and, [
        jax.lax.broadcasted_iota(jnp.int32, shape, i) == 0 for i in range(len(shape))])
    first = first.reshape(shape + (1,) * jnp.ndim(x))
    x = jnp.asarray(x)
    return jnp.where(first, x[(None,) * len(shape)], jnp.zeros((), x.dtype))


def widen(x: Stacked, axes: tuple[int, ...], sizes: Sequence[int]) -> Stacked:
    """``x`` held stacked over ``axes`` (which hold ``x.axes``), its value replicated along
    the others (``B -> P`` there): on each new axis the summand is itself on the first
    device and zeros on the others (:func:`stack`'s convention), and nothing is summed (a
    ys the plan reduces after its loop, partial over one axis where it is made and read
    partial over two, was summed over the first inside the loop: one all-reduce per
    iteration)."""
    arr = x.x
    have = set(x.axes)
    for pos, a in enumerate(axes):  # ascending: the axes before ``a`` are in place
        if a in have:
            continue
        arr = jnp.expand_dims(arr, pos)
        first = jax.lax.broadcasted_iota(jnp.int32, (sizes[a],) + (1,) * (arr.ndim - 1 - pos),
                                         0) == 0
        arr = jnp.where(first, arr, jnp.zeros((), arr.dtype))
    return Stacked(arr, axes)


def lift(x, lead: tuple[int, ...], want: NdSbp, axes: tuple[int, ...], sizes: Sequence[int]
         ) -> tuple[object, tuple[int, ...]]:
    """``x`` (held stacked over ``lead``) read in layout ``want`` by an op vmapped over
    ``axes``: an array whose leading dims are, in the order of ``axes``, those it is batched
    along (stacked, or splitting one of its dims: that dim cut into the axis's pieces and
    the piece index moved to the front), then the per-device dims; and those axes."""
    if not hasattr(x, "shape"):
        return x, ()
    n = len(lead)
    cuts: dict[int, list[int]] = {}  # dim -> mesh axes splitting it, in mesh order
    for a, s in enumerate(want.sbps):
        if isinstance(s, Split):
            cuts.setdefault(s.dim, []).append(a)
    shape: list[int] = list(x.shape[:n])
    labels: list[int | None] = list(lead)
    local: list[int] = []
    for d, size in enumerate(x.shape[n:]):
        cut = cuts.get(d, [])
        mine = [a for a in cut if a in axes]
        if mine:
            pieces = [sizes[a] for a in cut]
            shape += [*pieces, size // math.prod(pieces)]
            labels += [*cut, None]
            size //= math.prod(sizes[a] for a in mine)
        else:
            shape.append(size)
            labels.append(None)
        local.append(size)
    batched = tuple(a for a in axes if a in labels)
    if batched == lead and len(shape) == x.ndim:
        return x, batched  # nothing cut
    front = [labels.index(a) for a in batched]
    x = jnp.transpose(x.reshape(shape), front + [i for i in range(len(shape)) if i not in front])
    return x.reshape([sizes[a] for a in batched] + local), batched


def vmapped(fn: Callable, batched: Sequence[tuple[int, ...]], axes: tuple[int, ...]
            ) -> Callable:
    """``fn`` vmapped over one leading dim per axis of ``axes`` (outermost first); operand
    ``k`` is batched along the axes ``batched[k]``."""
    for a in reversed(axes):
        fn = jax.vmap(fn, in_axes=tuple(0 if a in b else None for b in batched))
    return fn
