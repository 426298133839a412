"""A call's traced signature: the program, the outputs tied to the inputs they replace
(a train step's new state), the inputs that stay on the devices, the layouts the plan must
keep (``in_shardings``, kept placements, results typed on a mesh with Explicit axes), and
whether ``jax.jit`` would type the results on the user's mesh."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding

from shardc.ir.sbp import Broadcast, NdSbp, from_partition_spec
from shardc.ir.trace import Traced
from shardc.lower.control import explicit_axes, typed_sharding
from shardc.rules.registry import is_pinned
from shardc.solve.fixed import Fixed
from shardc.step.calling import Call, abstract_leaf, placement
from shardc.step.seeds import seed_layouts

__all__ = ["fixed_layouts", "kept_layouts", "pins_layouts", "resident_inputs",
           "tie_outputs", "TracedCall", "typed_outputs", "typed_placement"]

log = logging.getLogger("shardc")


def resident_inputs(arg_trees, ties) -> frozenset[int]:
    """Flat inputs that stay on the devices from call to call besides the tied state: with
    no ties (a function that returns no new state, such as a decode loop
    ``decode(params, tokens)``), a first argument that is a pytree of several arrays (the
    model's parameters) when more arguments follow; a train step's state is its ties. The
    other inputs (a batch; plain arrays, ``f(x, y)``) are fed from the host every call,
    which the plan pays for."""
    trees = list(arg_trees)
    if ties or len(trees) < 2 or trees[0].num_leaves < 2:
        return frozenset()
    return frozenset(range(trees[0].num_leaves))


def tie_outputs(arg_trees, out_tree, graph=None) -> list[tuple[int, int]]:
    """(flat output, flat input) pairs of a step whose output is, or holds, a pytree shaped
    like one of its arguments (``(state, batch) -> (new_state, loss)``): the new state should
    be laid out as the state it replaces. ``arg_trees`` has one treedef per dynamic
    argument, in flattening order. With ``graph``, only leaves of equal shape and dtype are
    tied."""
    ins = list(arg_trees)
    outs = [out_tree] if out_tree in ins or not out_tree.children() else out_tree.children()
    in_off = [0]
    for t in ins:
        in_off.append(in_off[-1] + t.num_leaves)
    ties, out_start = [], 0
    for o in outs:
        for a, t in enumerate(ins):
            if t == o and t.num_leaves:
                ties += [(out_start + k, in_off[a] + k) for k in range(t.num_leaves)]
                break
        out_start += o.num_leaves
    if graph is not None:
        ties = [(j, i) for j, i in ties
                if (graph.outputs[j].shape, graph.outputs[j].dtype)
                == (graph.inputs[i].shape, graph.inputs[i].dtype)]
    return ties


@dataclass(frozen=True)
class TracedCall:
    """A traced signature: the program, its ties, and the layouts it must keep."""

    traced: Traced
    ties: tuple[tuple[int, int], ...]
    fixed: Fixed
    #: inputs that stay on the devices from call to call besides the tied state
    #: (:func:`resident_inputs`): no host feed is charged for them
    resident: frozenset[int] = frozenset()
    #: tied inputs planned in host memory between calls (:mod:`shardc.step.offload`)
    offloaded: frozenset[int] = frozenset()
    #: the results are typed on the user's mesh, as ``jax.jit`` types them (an argument
    #: typed by an Explicit placement, a ``jax.set_mesh`` context, the program's own
    #: ``reshard``); else they are placed on the mesh's Auto view, untyped, as ``jax.jit``
    #: leaves the results of plain arguments (:func:`typed_outputs`). Never for a program
    #: with a primitive whose lowering needs the devices (an ``io_callback``): JAX lowers it
    #: only with every sharding on one mesh, axis types included
    #: (:func:`shardc.lower.control.needs_devices`), so it runs wholly on the Auto view
    typed: bool = False


def pins_layouts(tr: TracedCall) -> bool:
    """Whether the program fixes layouts on the mesh's own axes (kept inputs, typed results,
    the user's constraints): then only that mesh is planned."""
    return bool(tr.fixed) or any(is_pinned(op) for op in tr.traced.graph.ops)


def typed_placement(x) -> bool:
    """Whether the argument leaf ``x``'s placement is part of its type: a sharding on a
    mesh with Explicit axes (an Auto view's, such as a result :func:`typed_outputs` leaves
    untyped, is a placement only)."""
    return typed_sharding(placement(x))


def kept_layouts(step, call: Call, *, every: bool = False) -> dict[int, NdSbp]:
    """The layouts of the arguments placed on the mesh (``NamedSharding``s of its axes)
    that the plan keeps under ``keep_input_shardings``: every one where the user asked
    for it (or ``every``), else, where Explicit axes imply it, those the placement types.
    """
    names = tuple(step.mesh.axis_names)
    every = every or bool(step.options.keep_input_shardings)
    out = {}
    for k, x in enumerate(call.leaves):
        sh = placement(x)
        if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names \
                and sh.mesh.shape_tuple == step.mesh.shape_tuple \
                and (every or typed_placement(x)):
            out[k] = from_partition_spec(sh.spec, len(x.shape), names)
    return out


def fixed_layouts(step, call: Call) -> tuple[Fixed, bool]:
    """The inputs the plan keeps (``in_shardings``, kept placements) and, on a mesh with
    Explicit axes, the outputs' layouts their types get under ``jax.jit``; the layouts of
    the other arguments already placed on the mesh (``placed``: they pay their
    conversion, not the host feed). And whether the results are typed on the user's mesh
    (:func:`typed_outputs`)."""
    inputs = {}
    if step.options.in_shardings is not None:
        dyn_args, _ = call.unflatten(call.leaves)
        inputs.update(seed_layouts("in_shardings", step.options.in_shardings,
                                   jax.tree.map(abstract_leaf, dyn_args),
                                   step.mesh.axis_names))
    if step.keep:
        inputs.update(kept_layouts(step, call))
    placed = kept_layouts(step, call, every=True)
    outputs, typed = typed_outputs(step, call)
    return Fixed(inputs, outputs,
                 placed={k: nd for k, nd in placed.items() if k not in inputs}), typed


def typed_outputs(step, call: Call) -> tuple[dict[int, NdSbp], bool]:
    """On a mesh with Explicit axes the results get types as ``jax.jit`` infers them
    (``jax.eval_shape``), from arguments typed with shardings of the mesh, a
    ``jax.set_mesh`` context and the program's own ``reshard`` / ``out_sharding``: results
    so typed are placed on the user's mesh, and combine with the user's arrays as
    ``jax.jit``'s would; with no argument typed, a result the program leaves replicated
    keeps the plan's layout. Where ``jax.jit`` types no result on the mesh (plain
    arguments, no mesh context), none is: the results are placed on the mesh's Auto view,
    so the user's own code (eager, or another ``jax.jit``) reads them as it reads
    ``jax.jit``'s, whatever layout the plan gave them.

    Returns:
        The results' layouts their types fix, by output index, and whether the results
        are typed on the user's mesh.
    """
    names = tuple(step.mesh.axis_names)
    if not explicit_axes(step.user_mesh):
        return {}, False
    typed = [typed_placement(x) for x in call.leaves]
    # a leaf placed untyped (an earlier call's result, on the mesh's Auto view) is read as
    # an unplaced one: jax.jit refuses arrays on meshes of different axis types together
    leaves = [x if t or not isinstance(placement(x), NamedSharding) else
              jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
              for x, t in zip(call.leaves, typed)]
    try:  # under the caller's mesh context, as jax.jit traces
        outs = jax.eval_shape(call.function(step.fn), *leaves)
    except Exception as exc:
        # arguments typed by the user may not type-check under jax.jit's rules, which
        # shardc's lowering (under auto_axes) does not need: the results then keep the
        # plan's layouts as their types
        if type(exc).__name__ != "ShardingTypeError":
            raise
        log.info("shardc: %s does not type-check with these argument shardings (%s); "
                 "its results are typed with the plan's layouts",
                 getattr(step.fn, "__name__", "fn"), str(exc).splitlines()[0])
        return {}, True
    fixed, on_mesh = {}, any(typed)
    for j, o in enumerate(jax.tree.leaves(outs)):
        sh = getattr(o, "sharding", None)
        if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names:
            on_mesh = True
            nd = from_partition_spec(sh.spec, len(o.shape), names)
            if any(typed) or any(not isinstance(p, Broadcast) for p in nd.sbps):
                fixed[j] = nd
    return fixed, on_mesh
