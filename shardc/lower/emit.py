"""Plan → executable: NamedShardings for inputs/outputs, and the graph re-evaluated with
``with_sharding_constraint`` on every planned, non-partial value, under ``jax.jit``.

Partial values have no spelling on Auto mesh axes, so they are left unconstrained: XLA
places the reduction where the next constrained value needs it. Where an op wants an input
in another layout than its producer made, the input is constrained to the wanted layout too,
so the resharding happens where the plan put it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from shardc.cost.comm import conversion
from shardc.ir.graph import Graph
from shardc.ir.sbp import NdSbp, to_partition_spec


def _sharding(mesh: Mesh, nd: NdSbp, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, to_partition_spec(nd, ndim, mesh.axis_names))


def evaluator(graph: Graph, plan, mesh: Mesh) -> Callable[..., list]:
    """A function of the flat inputs that evaluates ``graph`` with the plan's constraints."""
    by_op = {o.id: o for o in plan.ops}

    def constrain(x, nd: NdSbp | None):
        if nd is None or nd.has_partial or not hasattr(x, "shape"):
            return x
        return jax.lax.with_sharding_constraint(x, _sharding(mesh, nd, x.ndim))

    def convert(x, src: NdSbp | None, dst: NdSbp):
        """Pin each layout of the planned conversion in turn (:mod:`shardc.cost.comm`), so
        XLA runs the collectives the plan priced, one mesh axis at a time."""
        if src is None or src == dst:
            return x
        for nd in conversion(src, dst, plan.axis_sizes, plan.axis_names, plan.cluster).layouts:
            x = constrain(x, nd)
        return constrain(x, dst)

    def settle(v, x):
        """Convert a value used more than once to the layout its uses read, once."""
        nd = plan.settled.get(v.id)
        return x if nd is None else convert(x, plan.values.get(v.id), nd)

    def run(*flat):
        raw = {v.id: x for v, x in zip(graph.inputs, flat)}
        env: dict[int, Any] = {v.id: settle(v, x) for v, x in zip(graph.inputs, flat)}
        for op in graph.ops:
            planned = by_op[op.id]
            args = []
            for k, v in enumerate(op.inputs):
                if v.is_const:
                    args.append(v.const)
                    continue
                args.append(convert(env[v.id], plan.read_as(v.id), planned.ins[k]))
            outs = op.prim.bind(*args, **op.params)
            if not op.prim.multiple_results:
                outs = [outs]
            for v, x, nd in zip(op.outputs, outs, planned.outs):
                env[v.id] = settle(v, constrain(x, nd))
        outs = []
        for v, nd in zip(graph.outputs, plan.outputs):
            if v.is_const:
                outs.append(v.const)
            elif v.id in raw and nd == plan.values[v.id]:
                outs.append(raw[v.id])  # an input passed through in its own layout
            else:
                outs.append(convert(env[v.id], plan.read_as(v.id), nd))
        return outs

    return run


def jit_plan(graph: Graph, plan, mesh: Mesh, in_tree, out_tree, *,
             donate_argnums: tuple[int, ...] = ()) -> Callable:
    """``jax.jit`` of the constrained evaluator, taking and returning the user's pytrees."""
    run = evaluator(graph, plan, mesh)
    in_sh = [_sharding(mesh, nd, v.ndim) for nd, v in zip(plan.inputs, graph.inputs)]
    out_sh = [_sharding(mesh, nd, v.ndim) for nd, v in zip(plan.outputs, graph.outputs)]

    def tree_fn(*args):
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(args)))

    in_tree_sh = jax.tree.unflatten(in_tree, in_sh)
    return jax.jit(tree_fn, in_shardings=tuple(in_tree_sh),
                   out_shardings=jax.tree.unflatten(out_tree, out_sh),
                   donate_argnums=donate_argnums)
