"""A call's traced signature: the program, the outputs tied to the inputs they replace
(a train step's new state), the inputs that stay on the devices, and the layouts the plan must
keep (``in_shardings``, kept placements, results typed on a mesh with Explicit axes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding

from shardc.ir.sbp import Broadcast, NdSbp, from_partition_spec
from shardc.ir.trace import Traced
from shardc.lower.program import explicit_axes
from shardc.rules.registry import is_pinned
from shardc.solve.fixed import Fixed
from shardc.step.calling import Call, abstract_leaf, placement
from shardc.step.seeds import seed_layouts

__all__ = ["fixed_layouts", "kept_layouts", "pins_layouts", "resident_inputs",
           "tie_outputs", "TracedCall", "typed_outputs"]

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


def pins_layouts(tr: TracedCall) -> bool:
    """Whether the program fixes layouts on the mesh's own axes (kept inputs, typed results,
    the user's constraints): then only that mesh is planned."""
    return bool(tr.fixed) or any(is_pinned(op) for op in tr.traced.graph.ops)


def kept_layouts(step, call: Call) -> dict[int, NdSbp]:
    """The layouts of the arguments placed on the mesh (``NamedSharding``s of its axes):
    what the plan keeps under ``keep_input_shardings``."""
    names = tuple(step.mesh.axis_names)
    out = {}
    for k, x in enumerate(call.leaves):
        sh = placement(x)
        if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names \
                and sh.mesh.shape_tuple == step.mesh.shape_tuple:
            out[k] = from_partition_spec(sh.spec, len(x.shape), names)
    return out


def fixed_layouts(step, call: Call) -> Fixed:
    """The inputs the plan keeps (``in_shardings``, kept placements) and, on a mesh with
    Explicit axes, the outputs' layouts their types get under ``jax.jit``; the layouts of
    the other arguments already placed on the mesh (``placed``: they pay their
    conversion, not the host feed)."""
    inputs = {}
    if step.options.in_shardings is not None:
        dyn_args, _ = call.unflatten(call.leaves)
        inputs.update(seed_layouts("in_shardings", step.options.in_shardings,
                                   jax.tree.map(abstract_leaf, dyn_args),
                                   step.mesh.axis_names))
    placed = kept_layouts(step, call)
    if step.keep:
        inputs.update(placed)
    return Fixed(inputs, typed_outputs(step, call),
                 placed={k: nd for k, nd in placed.items() if k not in inputs})


def typed_outputs(step, call: Call) -> dict[int, NdSbp]:
    """On a mesh with Explicit axes the results get types as ``jax.jit`` infers them
    (``jax.eval_shape``), from arguments typed with shardings of the mesh and from the
    program's own ``reshard`` / ``out_sharding``: results are placed so, and combine
    with the user's arrays as ``jax.jit``'s would. With no argument typed, a result
    the program leaves untyped (replicated) keeps the plan's layout."""
    names = tuple(step.mesh.axis_names)
    typed = [isinstance(sh := placement(x), NamedSharding) and
             tuple(sh.mesh.axis_names) == names for x in call.leaves]
    if not explicit_axes(step.user_mesh):
        return {}
    try:  # under the caller's mesh context, as jax.jit traces
        outs = jax.eval_shape(call.function(step.fn), *call.leaves)
    except Exception as exc:
        # arguments typed by an earlier plan's results (not by the user) may not type-check
        # under jax.jit's rules, which shardc's lowering (under auto_axes) does not need:
        # the results then keep the plan's layouts as their types
        if type(exc).__name__ != "ShardingTypeError":
            raise
        log.info("shardc: %s does not type-check with these argument shardings (%s); "
                 "its results are typed with the plan's layouts",
                 getattr(step.fn, "__name__", "fn"), str(exc).splitlines()[0])
        return {}
    fixed = {}
    for j, o in enumerate(jax.tree.leaves(outs)):
        sh = getattr(o, "sharding", None)
        if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names:
            nd = from_partition_spec(sh.spec, len(o.shape), names)
            if any(typed) or any(not isinstance(p, Broadcast) for p in nd.sbps):
                fixed[j] = nd
    return fixed
