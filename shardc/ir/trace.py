"""Trace a JAX function to a shardc :class:`Graph`, and the :class:`Region` tree that ties
the graph back to the jaxpr it came from.

``make_jaxpr`` gives nested jaxprs. For *planning*, call-like primitives (``jit``/``pjit``,
``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``/remat; the
``call`` facts of :mod:`shardc.ir.prims`) are inlined, so every op the planner sees is a
real computation; loops (``scan``, ``while``) and ``cond`` stay single ops holding their
sub-jaxpr. Dead ops are removed, except ops with side effects (callbacks, prints) and what
they read.

For *running*, nothing is inlined: the :class:`Region` of a jaxpr lists, per equation, the
graph :class:`Op` it became or, for a call, the Region of its body, so the lowering can
rewrite the user's own jaxpr (the remat policy, the custom derivative rules and the inner
jits kept) with the plan's layouts placed inside the bodies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore

from shardc.ir.graph import Graph, Op, Value, check_graph
from shardc.ir.prims import facts


class Region:
    """One jaxpr as the trace walked it: ``steps[i]`` is what ``jaxpr.eqns[i]`` became, the
    planner's :class:`Op` or, for a call the planner saw inlined, the Region of its body.
    Ops of a Region may be dead in the graph (no plan entry): they run unconstrained."""

    __slots__ = ("jaxpr", "steps")

    def __init__(self, jaxpr, steps: Sequence[Op | Region]):
        self.jaxpr = jaxpr
        self.steps = tuple(steps)
        if len(self.steps) != len(jaxpr.eqns):
            raise ValueError(f"Region: {len(self.steps)} steps for {len(jaxpr.eqns)} "
                             "equations; the trace must record one per equation")

    def ops(self):
        """Every Op of the region and its nested call bodies, in program order."""
        for step in self.steps:
            if isinstance(step, Region):
                yield from step.ops()
            else:
                yield step


@dataclass(frozen=True)
class Traced:
    graph: Graph
    in_tree: Any
    out_tree: Any
    region: Region  # the top-level jaxpr, for the lowering
    consts: tuple  # its closed-over constants


def call_body(eqn) -> tuple[Any, tuple]:
    """(open jaxpr, consts) of the body of a call-like equation, or (None, ()) when the
    equation is not a call the planner inlines."""
    key = facts(eqn.primitive.name).call
    sub = eqn.params.get(key) if key else None
    if sub is None:
        return None, ()
    return (sub.jaxpr, tuple(sub.consts)) if hasattr(sub, "consts") else (sub, ())


class _Builder:
    def __init__(self):
        self.ids = itertools.count()
        self.ops: list[Op] = []

    def value(self, aval, producer=None, const=None) -> Value:
        shape = getattr(aval, "shape", ())
        dtype = getattr(aval, "dtype", None)
        return Value(next(self.ids), shape, dtype, producer, const)

    def const(self, data, aval=None) -> Value:
        return self.value(aval if aval is not None else jax.typeof(data), const=data)

    def read(self, env: dict, atom) -> Value:
        if isinstance(atom, jcore.Literal):
            return self.const(atom.val, atom.aval)
        return env[atom]

    def emit(self, jaxpr, consts, invals: list[Value]) -> tuple[list[Value], Region]:
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c)
        for var, v in zip(jaxpr.invars, invals):
            env[var] = v
        steps: list[Op | Region] = []
        for eqn in jaxpr.eqns:
            ins = [self.read(env, a) for a in eqn.invars]
            body, body_consts = call_body(eqn)
            if body is not None:
                outs, region = self.emit(body, body_consts, ins[len(ins) - len(body.invars):])
                steps.append(region)
            else:
                op = Op(len(self.ops), eqn.primitive, dict(eqn.params), ins, [],
                        effects=eqn.effects)
                op.outputs = [self.value(v.aval, producer=op) for v in eqn.outvars]
                self.ops.append(op)
                steps.append(op)
                outs = op.outputs
            for var, v in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = v
        return [self.read(env, a) for a in jaxpr.outvars], Region(jaxpr, steps)


def eliminate_dead_ops(graph: Graph) -> Graph:
    """Drop ops nothing observes: kept are the ops an output depends on, the ops with side
    effects, and what those read."""
    live = {v.id for v in graph.outputs}
    kept: list[Op] = []
    for op in reversed(graph.ops):
        if op.effects or any(v.id in live for v in op.outputs):
            kept.append(op)
            live.update(v.id for v in op.inputs)
    kept.reverse()
    return Graph(graph.inputs, graph.outputs, kept)


def _build(closed_jaxpr) -> tuple[Graph, Region]:
    b = _Builder()
    inputs = [b.value(v.aval) for v in closed_jaxpr.jaxpr.invars]
    outputs, region = b.emit(closed_jaxpr.jaxpr, closed_jaxpr.consts, inputs)
    graph = eliminate_dead_ops(Graph(inputs, outputs, b.ops))
    check_graph(graph)
    return graph, region


def graph_from_jaxpr(closed_jaxpr) -> Graph:
    """The planner's graph of a closed jaxpr (calls inlined, dead ops removed)."""
    return _build(closed_jaxpr)[0]


def trace(fn: Callable, *args) -> Traced:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct`` leaves) to a Graph."""
    in_tree = jax.tree.structure(args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    graph, region = _build(closed)
    return Traced(graph, in_tree, jax.tree.structure(out_shape), region, tuple(closed.consts))
