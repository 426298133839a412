"""The plan beside the generic layouts a practitioner writes (data parallel, FSDP, Megatron,
DP x TP): each compiled with ``jax.jit`` and priced from its HLO on a mesh with devices
(:func:`shardc.tradeoff.baselines.margins` on an abstract one)."""

from __future__ import annotations

import functools

import jax
from jax.sharding import AbstractMesh, NamedSharding

from shardc.cost.comm import reshard_time
from shardc.ir.sbp import Broadcast, NdSbp, to_partition_spec
from shardc.plan.record import Plan, Predicted
from shardc.solve.collector import gc_paused
from shardc.solve.problem import feed_time
from shardc.step.calling import Call
from shardc.step.signature import TracedCall

__all__ = ["compare", "compiled_margin", "state_inputs"]


def state_inputs(step, call: Call, tr: TracedCall) -> set[int]:
    """The graph inputs that are the program's state (:mod:`shardc.tradeoff.baselines`): those
    its results replace, else the first argument's leaves."""
    trees = call.arg_trees()
    return {i for _, i in tr.ties} or set(range(trees[0].num_leaves if trees else 0))


def compare(step, *args, **kwargs):
    """:meth:`AutoSharded.margins <shardc.step.auto_shard.AutoSharded.margins>` of ``step``:
    the generic layouts compiled through :func:`compiled_margin` on a mesh with devices."""
    from shardc.tradeoff.baselines import margins

    call = step.convention.split(args, kwargs)
    _, tr, plan = step._plan(call)
    compile = None
    if not isinstance(step.mesh, AbstractMesh):
        compile = functools.partial(compiled_margin, step, call, tr, plan, args, kwargs)
    return margins(tr.traced.graph, tr.ties, plan, state_inputs(step, call, tr), compile,
                   tuple(tr.resident))


def compiled_margin(step, call: Call, tr: TracedCall, plan: Plan, args, kwargs,
                     layouts: dict[int, NdSbp] | None) -> Predicted:
    """The program compiled with ``layouts`` as its input shardings (``jax.jit``, XLA
    placing the rest; None: the plan's own program), priced from its HLO on the plan's
    cluster, with the host feed of the inputs not carried from step to step."""
    from shardc.inspect import price

    graph, cluster = tr.traced.graph, plan.cluster
    if layouts is None:
        compiled, mesh = step.lower(*args, **kwargs).compile(), step.mesh_for(plan)
        inputs = plan.inputs
    else:
        mesh, names = step.mesh, tuple(step.mesh.axis_names)
        whole = NdSbp((Broadcast(),) * len(names))
        inputs = tuple(layouts.get(k, whole) for k in range(len(graph.inputs)))
        shardings = [NamedSharding(mesh, to_partition_spec(nd, v.ndim, names))
                     for nd, v in zip(inputs, graph.inputs, strict=True)]
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in call.avals(step.fn)]
        with gc_paused():
            compiled = jax.jit(call.function(step.fn), in_shardings=shardings).lower(
                *leaves).compile()
    cost = price(compiled, mesh, cluster)
    carried = {i for _, i in tr.ties} | tr.resident
    sizes, names = tuple(mesh.shape.values()), tuple(mesh.axis_names)
    # placed layouts are on the step's own mesh (a plan on another view pays the feed)
    placed = tr.fixed.placed if names == tuple(step.mesh.axis_names) else {}
    feed = sum(reshard_time(placed[k], nd, v.nbytes, sizes, names, cluster)
               if k in placed and k not in carried else feed_time(v, nd, sizes, cluster,
                                                                  k in carried)
               for k, (v, nd) in enumerate(zip(graph.inputs, inputs, strict=True)))
    return Predicted(cost.comm_time, cost.compute_time, cost.wire_bytes,
                     cost.peak_memory or 0.0, feed)
