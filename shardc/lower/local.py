"""Ops the lowering runs on each device's pieces (``shard_map`` over the plan's layouts):
a primitive XLA would gather whole (:attr:`shardc.ir.prims.Prim.per_device`), a grouped
convolution split along its groups (:func:`shardc.rules.conv.local_groups`), and a ring
signature run as a collective matmul (:mod:`shardc.rules.dot`, :func:`run_ring`), in which
each device computes with the block it holds while the next passes round the ring's mesh
axis by ``ppermute`` (device ``i`` sends to ``i + 1``):

- An operand passed round (ring 0 or 1): at step ``s`` device ``i`` holds the block of
  device ``i - s``. Where the passed operand's split dim is free, its product is that
  block's slice of the result, written in place; where it is contracted, the other
  operand's matching slice times it is added to the result.
- The partial sums passed round (ring 2): at step ``s`` device ``i`` computes its share of
  the result's block ``i - 1 - s``, adds it to the partial sums it received for that block
  and passes them on; after ``n - 1`` sends each device holds its own block, summed.

Where a slice of the other operand feeds each step (a contracted block, the partial sums'
blocks), the steps run as a loop (``fori_loop``): one block and one slice live at a time,
however many devices the axis has (unrolled, XLA:CPU computed every slice first). Where
each step writes a slice of the result, the ``n - 1`` sends are unrolled: a loop would carry
the whole result, whose buffer XLA:GPU then cannot share with any other (a long sequence's
scores: 8 GiB). In each step the send does not wait for the product nor the product for the
send, so XLA:GPU's scheduler runs them side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from shardc.cost.ring import repeat_of, repeated
from shardc.ir.sbp import to_partition_spec
from shardc.lower.control import bind_eqn
from shardc.rules.dot import dot_dims, result_dim

__all__ = ["per_device", "repeater", "ring_source", "run_ring"]


def per_device(mesh, body, op, planned, args: list, extra=()) -> list:
    """``body`` (each device's pieces of ``op``'s operands -> its pieces of the results)
    run under ``shard_map`` over ``op``'s planned layouts on ``mesh``; ``extra``: more
    ``(layout, value)`` pairs whose pieces follow the operands' (one per arg past them)."""
    names = mesh.axis_names

    def specs(nds, values):
        return tuple(to_partition_spec(nd, v.ndim, names) for nd, v in zip(nds, values))

    ins = specs(planned.ins, op.inputs) + specs([nd for nd, _ in extra],
                                                [v for _, v in extra])
    return list(jax.shard_map(body, mesh=mesh, in_specs=ins,
                              out_specs=list(specs(planned.outs, op.outputs)),
                              check_vma=False)(*args))


def run_ring(mesh, eqn, op, planned, args: list, ring: tuple[int, int],
             source=None) -> list:
    """``eqn`` (a ``dot_general``, op ``op`` of the plan's graph) on ``args`` as its
    planned layouts' ring ``(axis, what passes)`` (:func:`shardc.rules.dot.ring_of`);
    ``source``: ``(value, repeat)`` where the operand passed repeats a smaller value,
    passed in its place and repeated by ``repeat`` block by block."""
    axis, what = ring
    name, n = mesh.axis_names[axis], mesh.axis_sizes[axis]

    def body(lhs, rhs, *src):
        if what == 2:
            return [_scatter_ring(eqn, op, lhs, rhs, planned, axis, name, n)]
        made = op.outputs[0]  # this device's piece of the result
        piece = tuple(size // planned.outs[0].split_factor(mesh.axis_sizes, d)
                      for d, size in enumerate(made.shape))
        out = jnp.zeros(piece, made.dtype)
        passing = (src[0], source[1]) if src else None
        return [_gather_ring(eqn, op, lhs, rhs, out, planned, axis, what, name, n, passing)]

    if source is None:
        return per_device(mesh, body, op, planned, args)
    return per_device(mesh, body, op, planned, [*args, source[0]],
                      [(planned.ins[what], source[0])])


def ring_source(graph, made: dict, op, ins, what: int, args: list):
    """``(value, repeat)`` where a ring's passed operand ``what`` (of ``op``, read in the
    layouts ``ins``) repeats a smaller value lowered in the same trace (``made``: value id
    -> the value as lowered; :func:`shardc.cost.ring.repeated`): that value and the
    function repeating a block of it (:func:`repeater`); else None (the operand passes)."""
    if what == 2:
        return None
    src = repeated(graph, op.inputs[what], ins[what])
    x = None if src is None else made.get(src.id)
    if x is None or getattr(x, "_trace", None) is not getattr(args[what], "_trace", 0):
        return None
    return x, repeater(graph, op.inputs[what])


def repeater(graph, value):
    """The function making a device's block of ``value`` from its block of the smaller
    value it repeats (:func:`shardc.cost.ring.repeat_of`: a ``broadcast_in_dim`` then a
    ``reshape``, the leading dims a block splits kept as they are)."""
    _, grow, kept = repeat_of(graph, value)
    wide, dims = grow.outputs[0].shape, grow.params["broadcast_dimensions"]

    def repeat(block):
        lead = block.shape[:kept]
        grown = lax.broadcast_in_dim(block, lead + tuple(wide[kept:]), dims)
        return grown.reshape(lead + tuple(value.shape[kept:]))

    return repeat


def _perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _gather_ring(eqn, op, lhs, rhs, out, planned, axis: int, what: int, name: str, n: int,
                 passing=None):
    """Ring 0 or 1: operand ``what``'s blocks passed round (module docstring), into
    ``out``, zeros of this device's piece of the result; ``passing``: ``(block, repeat)``,
    the block of a smaller value passed instead, repeated into the operand's."""
    lc, rc, *_ = dot_dims(op)
    ops = [lhs, rhs]
    dim = planned.ins[what].sbps[axis].dim  # the passed operand's split dim
    mine, other = (lc, rc) if what == 0 else (rc, lc)
    me = lax.axis_index(name)
    size = ops[what].shape[dim]
    first, repeat = passing if passing is not None else (ops[what], lambda b: b)

    def product(s, cur, out):
        """``out`` with the product of the block held at step ``s``."""
        src = (me - s) % n
        pair = list(ops)
        pair[what] = repeat(cur)
        if dim in mine:  # contracted: the other operand's matching slice, added
            pair[1 - what] = lax.dynamic_slice_in_dim(ops[1 - what], src * size, size,
                                                      axis=other[mine.index(dim)])
            return out + bind_eqn(eqn, pair)[0]
        return lax.dynamic_update_slice_in_dim(  # free: a slice of the result
            out, bind_eqn(eqn, pair)[0], src * size, axis=result_dim(op, what, dim))

    def step(s, carry):
        cur, out = carry
        return lax.ppermute(cur, name, _perm(n)), product(s, cur, out)

    carry = (first, out)
    if dim in mine:
        carry = lax.fori_loop(0, n - 1, step, carry)
    else:  # unrolled: a loop would carry the whole result (module docstring)
        for s in range(n - 1):
            carry = step(s, carry)
    return product(n - 1, *carry)


def _scatter_ring(eqn, op, lhs, rhs, planned, axis: int, name: str, n: int):
    """Ring 2: the result's partial sums passed round (module docstring)."""
    _, _, lb, _, lfree, rfree = dot_dims(op)
    k = planned.outs[0].sbps[axis].dim - len(lb)  # the result's free dim scattered
    which, dim = (0, lfree[k]) if k < len(lfree) else (1, rfree[k - len(lfree)])
    ops = [lhs, rhs]
    size = ops[which].shape[dim] // n
    me = lax.axis_index(name)

    def share(s):
        """This device's share of the result's block ``i - 1 - s``."""
        pair = list(ops)
        pair[which] = lax.dynamic_slice_in_dim(ops[which], ((me - 1 - s) % n) * size, size,
                                               axis=dim)
        return bind_eqn(eqn, pair)[0]

    return lax.fori_loop(1, n, lambda s, acc: lax.ppermute(acc, name, _perm(n)) + share(s),
                         share(0))
