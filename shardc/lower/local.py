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

from shardc.ir.sbp import to_partition_spec
from shardc.lower.control import bind_eqn

__all__ = ["per_device", "run_ring"]


def per_device(mesh, body, op, planned, args: list) -> list:
    """``body`` (each device's pieces of ``op``'s operands -> its pieces of the results)
    run under ``shard_map`` over ``op``'s planned layouts on ``mesh``."""
    names = mesh.axis_names

    def specs(nds, values):
        return tuple(to_partition_spec(nd, v.ndim, names) for nd, v in zip(nds, values))

    return list(jax.shard_map(body, mesh=mesh, in_specs=specs(planned.ins, op.inputs),
                              out_specs=list(specs(planned.outs, op.outputs)),
                              check_vma=False)(*args))


def run_ring(mesh, eqn, op, planned, args: list, ring: tuple[int, int]) -> list:
    """``eqn`` (a ``dot_general``, op ``op`` of the plan's graph) on ``args`` as its
    planned layouts' ring ``(axis, what passes)`` (:func:`shardc.rules.dot.ring_of`)."""
    axis, what = ring
    name, n = mesh.axis_names[axis], mesh.axis_sizes[axis]

    def body(lhs, rhs):
        if what == 2:
            return [_scatter_ring(eqn, lhs, rhs, planned, axis, name, n)]
        return [_gather_ring(eqn, lhs, rhs, planned, axis, what, name, n)]

    return per_device(mesh, body, op, planned, args)


def _perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _dims(eqn):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _gather_ring(eqn, lhs, rhs, planned, axis: int, what: int, name: str, n: int):
    """Ring 0 or 1: operand ``what``'s blocks passed round (module docstring)."""
    lc, rc, lb, rb = _dims(eqn)
    ops = [lhs, rhs]
    dim = planned.ins[what].sbps[axis].dim  # the passed operand's split dim
    mine, other = (lc, rc) if what == 0 else (rc, lc)
    me = lax.axis_index(name)
    size = ops[what].shape[dim]

    def product(s, cur, out):
        """``out`` with the product of the block held at step ``s``."""
        src = (me - s) % n
        pair = list(ops)
        pair[what] = cur
        if dim in mine:  # contracted: the other operand's matching slice, added
            pair[1 - what] = lax.dynamic_slice_in_dim(ops[1 - what], src * size, size,
                                                      axis=other[mine.index(dim)])
            return out + bind_eqn(eqn, pair)[0]
        at = _out_dim(eqn, what, dim, lhs.ndim, rhs.ndim)  # free: a slice of the result
        return lax.dynamic_update_slice_in_dim(out, bind_eqn(eqn, pair)[0], src * size,
                                               axis=at)

    # the result: one block's product (contracted), or whole along the passed dim (free)
    k, d, by = (1 - what, other[mine.index(dim)], 1 / n) if dim in mine else (what, dim, n)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ops]
    shape = list(ops[k].shape)
    shape[d] = int(shape[d] * by)
    shapes[k] = jax.ShapeDtypeStruct(tuple(shape), ops[k].dtype)
    made = jax.eval_shape(lambda a, b: bind_eqn(eqn, [a, b])[0], *shapes)
    out = jnp.zeros(made.shape, made.dtype)

    def step(s, carry):
        cur, out = carry
        return lax.ppermute(cur, name, _perm(n)), product(s, cur, out)

    carry = (ops[what], out)
    if dim in mine:
        carry = lax.fori_loop(0, n - 1, step, carry)
    else:  # unrolled: a loop would carry the whole result (module docstring)
        for s in range(n - 1):
            carry = step(s, carry)
    return product(n - 1, *carry)


def _scatter_ring(eqn, lhs, rhs, planned, axis: int, name: str, n: int):
    """Ring 2: the result's partial sums passed round (module docstring)."""
    lc, rc, lb, rb = _dims(eqn)
    at = planned.outs[0].sbps[axis].dim  # the result's dim scattered over the ring
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    k = at - len(lb)
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


def _out_dim(eqn, what: int, dim: int, lnd: int, rnd: int) -> int:
    """The result dim an operand's free dim ``dim`` becomes: ``dot_general`` lays out the
    batch dims, then the lhs's free dims, then the rhs's."""
    lc, rc, lb, rb = _dims(eqn)
    lfree = [d for d in range(lnd) if d not in lc and d not in lb]
    rfree = [d for d in range(rnd) if d not in rc and d not in rb]
    return len(lb) + (lfree.index(dim) if what == 0 else len(lfree) + rfree.index(dim))
