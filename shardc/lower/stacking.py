"""The partial sums the lowering holds stacked, across a loop body or the program's own
Python loop: which values are held so, and how they run and leave that form.

:class:`StackedSums` is the part of :class:`shardc.lower.emit._Lowering` that decides
which values are held stacked (:meth:`~StackedSums.stack_plan` for a scan's partial carries
and ys, :meth:`~StackedSums.stack_top` for a Python loop's sums, each back through the
partial values they are made from), runs an op on each device's summand
(:meth:`~StackedSums._stacked_op`), pins a stacked value's layout, and sums it again: one
all-reduce over all its axes (:meth:`~StackedSums._unstack`), or, for a ys stacked through
its loop, once after the loop (:meth:`~StackedSums._reduce_ys`). The array-level helpers
(:class:`~shardc.lower.partial.Stacked`, ``lift``, ``vmapped``) are
:mod:`shardc.lower.partial`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardc.ir.sbp import NdSbp
from shardc.ir.trace import Fork, Inlined, Loop, Region
from shardc.lower.control import bind_eqn
from shardc.lower.partial import (
    Stacked,
    lift,
    stackable,
    stacked_sharding,
    sum_axes,
    unstack,
    vmapped,
)

__all__ = ["StackedSums", "own_ops"]


class StackedSums:
    """The stacked partial sums of :class:`shardc.lower.emit._Lowering` (its plan, mesh, ops
    and the values it holds stacked: ``plan``, ``mesh``, ``by_op``, ``free``, ``stacked``,
    ``sums``, ``source``, ``to_layout``, ``_pass``)."""

    __slots__ = ()

    def constrain_stacked(self, x, axes: tuple[int, ...], nd: NdSbp):
        sh = stacked_sharding(self.mesh, axes, nd, x.ndim - len(axes))
        return x if sh is None else jax.lax.with_sharding_constraint(x, sh)

    def stack_plan(self, loop: Loop, carried: Sequence, ys: Sequence) -> list[tuple]:
        """Record which values of ``loop``'s body are held stacked: each carry the plan
        keeps partial, and back from the value the body returns for it or for a ys the
        plan keeps partial, every partial value made by an op of the body (not of a call
        inside it) that :func:`stackable` allows. Returns, per ys, the mesh axes it leaves
        the loop stacked over (none where it leaves reduced)."""
        made = {v.id: op for op in own_ops(loop.body.steps) for v in op.outputs}
        todo = []
        for e in carried:
            planned = self.by_op.get(e.id)
            axes = sum_axes(planned.outs[0]) if planned is not None else ()
            if axes and stacked_sharding(self.mesh, axes, planned.outs[0],
                                         e.outputs[0].ndim) is not None:
                self.stacked[e.outputs[0].id] = axes
                todo.append(e.params["tie"])
        held = []
        for e in ys:
            planned, v = self.by_op.get(e.id), e.inputs[0]
            axes = sum_axes(planned.ins[0]) if planned is not None else ()
            if not axes or v.is_const or v.id in self.free or v.id in self.plan.settled or \
                    stacked_sharding(self.mesh, axes, planned.ins[0], v.ndim) is None:
                axes = ()
            held.append(axes)
            if axes:
                todo.append(v)
        self._stack_back(made, todo)
        return held

    def _unstack(self, x, nd: NdSbp | None):
        """``x``'s value (:func:`unstack`); held stacked over several mesh axes (in layout
        ``nd``), its summands' dims made one, split over all those axes, and summed: one
        all-reduce over them all, as priced (summed dim by dim, XLA runs one per axis)."""
        if not isinstance(x, Stacked) or len(x.axes) < 2 or nd is None:
            return unstack(x)
        k = len(x.axes)
        sh = stacked_sharding(self.mesh, x.axes, nd, x.x.ndim - k)
        if sh is None:
            return unstack(x)
        arr = jax.lax.with_sharding_constraint(x.x, sh)
        arr = arr.reshape((-1,) + arr.shape[k:])
        arr = jax.lax.with_sharding_constraint(arr, NamedSharding(
            self.mesh, PartitionSpec(tuple(sh.spec[:k]), *sh.spec[k:])))
        return jnp.sum(arr, axis=0, dtype=arr.dtype)

    def stack_top(self, region: Region) -> None:
        """Record which of the program's own values are held stacked: the sums a Python
        loop makes of partial values (:func:`shardc.ir.flow.unrolled_sums`) the plan
        keeps partial, and back from each, the partial values they are made from."""
        made = {v.id: op for op in region.steps
                if not isinstance(op, (Region, Loop, Fork, Inlined)) for v in op.outputs}
        self._stack_back(made, [v for v, op in made.items() if op.id in self.sums
                                and sum_axes(self.by_op[op.id].outs[0])
                                and v not in self.plan.settled])

    def _stack_back(self, made: dict, todo: list) -> None:
        """Hold stacked each value of ``todo`` (or id) made by an op of ``made`` that
        :func:`stackable` allows, and back from it, every partial value it reads."""
        while todo:
            v = todo.pop()
            vid = v if isinstance(v, int) else v.id
            op = made.get(vid)
            planned = self.by_op.get(op.id) if op is not None else None
            if planned is None or vid in self.stacked or len(op.outputs) != 1 or \
                    not stackable(op.name, planned.ins, planned.outs[0]):
                continue
            self.stacked[vid] = sum_axes(planned.outs[0])
            todo.extend(u for k, u in enumerate(op.inputs)
                        if not u.is_const and sum_axes(planned.ins[k]))

    def _stacked_op(self, eqn, op, planned, args: list) -> Stacked:
        """Each device's summand of ``op``'s partial output, under ``jax.vmap``."""
        axes = self.stacked[op.outputs[0].id]
        lifted, batched = [], []
        for k, (v, x) in enumerate(zip(op.inputs, args)):
            x = self.to_layout(x, self.source(v), planned.ins[k]) if hasattr(x, "shape") or \
                isinstance(x, Stacked) else x
            lead = x.axes if isinstance(x, Stacked) else ()
            arr, b = lift(x.x if isinstance(x, Stacked) else x, lead, planned.ins[k], axes,
                          self.plan.axis_sizes)
            lifted.append(arr)
            batched.append(b)
        out = vmapped(lambda *xs: bind_eqn(eqn, xs)[0], batched, axes)(*lifted)
        return Stacked(self.constrain_stacked(out, axes, planned.outs[0]), axes)

    def _ys(self, e, x, axes: tuple[int, ...]):
        """The body's value of ys ``e`` as the loop stacks it: converted to the exit's
        layout, or where the plan reduces it after the loop, each device's summand (held
        stacked, its leading dims the partial axes)."""
        if not axes:
            return self._pass(e, unstack(x), into=True)
        v = e.inputs[0]
        return self.to_layout(x, self.plan.read_as(v.id), self.by_op[e.id].ins[0]).x

    def _reduce_ys(self, e, x, axes: tuple[int, ...]):
        """A ys the loop stacked with each device's summands (``(trips, *axis sizes,
        *value)``): summed over the summands' dims, one all-reduce after the loop (pinned
        to the exit's layout just after)."""
        k = len(axes)
        sh = stacked_sharding(self.mesh, axes, self.by_op[e.id].ins[0], x.ndim - 1 - k)
        x = jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, PartitionSpec(None, *sh.spec)))
        # the summands' dims as one, split over all the axes: one all-reduce over them all,
        # as priced (summed dim by dim, XLA runs one all-reduce per axis)
        x = x.reshape(x.shape[:1] + (-1,) + x.shape[1 + k:])
        x = jax.lax.with_sharding_constraint(x, NamedSharding(
            self.mesh, PartitionSpec(None, tuple(sh.spec[:k]), *sh.spec[k:])))
        return jnp.sum(x, axis=1, dtype=x.dtype)


def own_ops(steps) -> list:
    """The ops of ``steps`` and of the calls among them, recursively (not of loops or
    conds inside, which run as their own bodies)."""
    out = []
    for step in steps:
        if isinstance(step, Region):
            out += own_ops(step.steps)
        elif not isinstance(step, (Loop, Fork, Inlined)):
            out.append(step)
    return out
