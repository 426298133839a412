"""The lowering of control flow the planner saw inline: a ``cond`` rebuilt with its
branches rewritten, a ``while`` loop with its predicate and body rewritten, the plan's
layouts placed inside (the scan's rebuild is in :mod:`shardc.lower.emit`, its partial
carries held stacked by :mod:`shardc.lower.stacking`); and the binding of one equation,
which every rebuilt body uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util
from jax.sharding import AxisType, NamedSharding

from shardc.ir.trace import Fork, Loop
from shardc.lower.partial import unstack

__all__ = ["ControlFlow", "bind_eqn", "explicit_axes", "holds_named", "needs_devices",
           "typed_sharding", "untyped_aval"]


def bind_eqn(eqn, args: Sequence, params: dict | None = None) -> list:
    """Bind ``eqn``'s primitive on ``args`` as ``jax.core.eval_jaxpr`` does (its source
    info and context kept, but the mesh context of the lowering, which runs on Auto axes),
    with ``params`` in place of the equation's own if given. A ``reshard`` onto a mesh with
    Explicit axes (a trace under ``jax.set_mesh`` writes one for every scalar it lifts
    onto that mesh) is its operand here: its layout is the plan's, which the lowering
    constrains, and a typed result would not match the Auto context."""
    params = _untyped(eqn.params if params is None else params)
    if eqn.primitive.name == "reshard" and typed_sharding(params.get("dst_sharding")):
        return list(args)
    bind_params = eqn.primitive.get_bind_params(params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    mesh = jax.sharding.get_abstract_mesh()  # the lowering's, not the one traced under
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager, jax.sharding.use_abstract_mesh(mesh)):
        outs = eqn.primitive.bind(*args, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def explicit_axes(mesh) -> tuple[str, ...]:
    """The names of ``mesh``'s axes of type Explicit."""
    types = getattr(mesh, "axis_types", None) or ()
    return tuple(n for n, t in zip(mesh.axis_names, types) if t == AxisType.Explicit)


def typed_sharding(sharding) -> bool:
    """Whether ``sharding`` is a type: a ``NamedSharding`` on a mesh with Explicit axes."""
    return isinstance(sharding, NamedSharding) and bool(explicit_axes(sharding.mesh))


#: primitives whose lowering needs the devices (callbacks, custom partitioning, cuDNN
#: attention and scaled matmuls), by name: read where JAX's own set is not importable
_NEEDS_DEVICES = frozenset({
    "io_callback", "pure_callback", "custom_partitioning", "inspect_sharding",
    "dot_product_attention_fwd", "dot_product_attention_bwd", "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd", "scaled_matmul"})


def needs_devices(jaxpr) -> bool:
    """Whether ``jaxpr`` (its sub-jaxprs included) holds a primitive whose lowering needs
    the devices: JAX then asks every sharding of the program, its arguments', results' and
    constraints', to name one abstract mesh, axis types included, so such a program cannot
    take typed arguments and results beside the plan's constraints on the Auto view."""
    try:
        from jax._src.dispatch import jaxpr_has_prim_requiring_devices
    except ImportError:  # JAX moved it: the primitives known to need them
        return holds_named(jaxpr, _NEEDS_DEVICES)
    return jaxpr_has_prim_requiring_devices(jaxpr)


def holds_named(jaxpr, names: frozenset[str]) -> bool:
    """Whether ``jaxpr`` or a jaxpr in its equations' params (bodies, branches) binds a
    primitive (or its ``_wrapper``) named in ``names``."""
    return any(e.primitive.name.removesuffix("_wrapper") in names for e in jaxpr.eqns) or \
        any(holds_named(sub, names) for sub in jcore.subjaxprs(jaxpr))


def untyped_aval(aval):
    """``aval`` without a sharding naming a mesh with Explicit axes (a trace under
    ``jax.set_mesh`` types every value so): a body rewritten under the lowering's Auto
    context is traced over the shapes alone, as they would be traced outside a mesh."""
    return aval.update(sharding=None) if typed_sharding(getattr(aval, "sharding", None)) \
        else aval


def _untyped(params: dict) -> dict:
    """``params`` without the shardings a trace on an Explicit mesh writes into its
    equations (``broadcast_in_dim``'s ``sharding``, a dot's or a reduction's
    ``out_sharding``: the values' types), which name a mesh the lowering's Auto context
    does not match; the planner reads none of them (the plan's layouts are constrained
    where it made them, and the results typed as ``jax.jit`` types them)."""
    out = None
    for key in ("sharding", "out_sharding"):
        value = params.get(key)
        if typed_sharding(value):
            out = dict(params) if out is None else out
            out[key] = None
    return params if out is None else out


class ControlFlow:
    """The cond and while lowering of :class:`shardc.lower.emit._Lowering` (its plan, ops
    and conversions: ``plan``, ``by_op``, ``free``, ``convert``, ``region``, ``_pass``)."""

    __slots__ = ()

    def fork(self, eqn, fork: Fork, args: list) -> list:
        """Bind a cond with its branches rewritten: each operand converted, before the
        cond, to the layout each branch reads it in (the cond takes every branch's copies,
        each branch reads its own); inside each branch, its ops as planned and each result
        converted to the cond's layout of it; the results pinned after the cond."""
        n = len(args) - 1
        copies = [self._pass(e, x, into=True)
                  for enters in fork.enters for e, x in zip(enters, args[1:])]
        avals = [untyped_aval(v.aval) for v in eqn.invars[1:]] * len(fork.bodies)

        def branch(b: int):
            def run(*xs):
                ins = [self._pass(e, x, into=False)
                       for e, x in zip(fork.enters[b], xs[b * n:(b + 1) * n])]
                outs = self.region(fork.bodies[b], eqn.params["branches"][b].consts, ins)
                return [self._exit(e, b, unstack(x)) for e, x in zip(fork.exits, outs)]

            return jax.make_jaxpr(run)(*avals)

        branches = tuple(branch(b) for b in range(len(fork.bodies)))
        outs = bind_eqn(eqn, [args[0], *copies], {**eqn.params, "branches": branches})
        return [self._pass(e, x, into=False) for e, x in zip(fork.exits, outs)]

    def _exit(self, op, b: int, x):
        """Branch ``b``'s value of a cond result, converted to the result's layout."""
        planned = self.by_op.get(op.id)
        v = op.inputs[1 + b]
        if planned is None or v.is_const or v.id in self.free or not hasattr(x, "shape"):
            return x
        return self.convert(x, self.plan.read_as(v.id), planned.ins[1 + b])

    def while_loop(self, eqn, loop: Loop, args: list) -> list:
        """Bind a while loop with its predicate and body rewritten: operands converted to
        the layouts the loop reads them in, before it; inside, the ops as planned and each
        carry converted back to its carried layout every iteration; the results pinned
        after the loop. The predicate is left to XLA, replicated as the plan priced it."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        enters = loop.enters
        carried = enters[cn + bn:]

        def pinned(ops, xs) -> list:
            return [self._pass(e, x, into=False) for e, x in zip(ops, xs)]

        def test(*xs):
            vals = pinned(enters[:cn] + carried, xs)
            return [unstack(x) for x in self.region(loop.test, p["cond_jaxpr"].consts, vals)]

        def body(*xs):
            outs = self.region(loop.body, p["body_jaxpr"].consts, pinned(enters[cn:], xs))
            return [self._back(e, unstack(x)) for e, x in zip(carried, outs)]

        tests = jax.make_jaxpr(test)(*(untyped_aval(v.aval)
                                       for v in p["cond_jaxpr"].jaxpr.invars))
        bodies = jax.make_jaxpr(body)(*(untyped_aval(v.aval)
                                        for v in p["body_jaxpr"].jaxpr.invars))
        ins = [self._pass(e, x, into=True) for e, x in zip(enters, args)]
        outs = bind_eqn(eqn, ins, {**p, "cond_jaxpr": tests, "body_jaxpr": bodies})
        return [self._pass(e, self._pass(e, x, into=True), into=False)
                for e, x in zip(loop.exits, outs)]

    def _back(self, enter, x):
        """The body's next value of a carry, converted to the carry's layout."""
        tie = enter.params["tie"]
        planned = self.by_op.get(enter.id)
        if planned is None or tie.is_const or tie.id in self.free or not hasattr(x, "shape"):
            return x
        return self.convert(x, self.plan.read_as(tie.id), planned.outs[0])
