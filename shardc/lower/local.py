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

The ``n - 1`` sends are unrolled (each product is independent of the send after it, which
XLA:GPU's scheduler runs beside it).
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
    cur, out = ops[what], None
    for s in range(n):
        nxt = lax.ppermute(cur, name, _perm(n)) if s < n - 1 else None
        src = (me - s) % n
        pair = list(ops)
        pair[what] = cur
        if dim in mine:  # contracted: the other operand's matching slice
            o = other[mine.index(dim)]
            pair[1 - what] = lax.dynamic_slice_in_dim(ops[1 - what], src * cur.shape[dim],
                                                      cur.shape[dim], axis=o)
            part = bind_eqn(eqn, pair)[0]
            out = part if out is None else out + part
        else:  # free: a slice of the result
            part = bind_eqn(eqn, pair)[0]
            at = _out_dim(eqn, what, dim, lhs.ndim, rhs.ndim)
            if out is None:
                shape = list(part.shape)
                shape[at] *= n
                out = jnp.zeros(shape, part.dtype)
            out = lax.dynamic_update_slice_in_dim(out, part, src * part.shape[at], axis=at)
        cur = nxt
    return out


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
    acc = None
    for s in range(n):
        pair = list(ops)
        pair[which] = lax.dynamic_slice_in_dim(ops[which], ((me - 1 - s) % n) * size, size,
                                               axis=dim)
        part = bind_eqn(eqn, pair)[0]
        acc = part if acc is None else lax.ppermute(acc, name, _perm(n)) + part
    return acc


def _out_dim(eqn, what: int, dim: int, lnd: int, rnd: int) -> int:
    """The result dim an operand's free dim ``dim`` becomes: ``dot_general`` lays out the
    batch dims, then the lhs's free dims, then the rhs's."""
    lc, rc, lb, rb = _dims(eqn)
    lfree = [d for d in range(lnd) if d not in lc and d not in lb]
    rfree = [d for d in range(rnd) if d not in rc and d not in rb]
    return len(lb) + (lfree.index(dim) if what == 0 else len(lfree) + rfree.index(dim))
