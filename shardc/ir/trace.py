"""Trace a JAX function to a shardc :class:`Graph`, and the :class:`Region` tree that ties
the graph back to the jaxpr it came from.

``make_jaxpr`` gives nested jaxprs. For *planning*, call-like primitives (``jit``/``pjit``,
``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``/remat; the
``call`` facts of :mod:`shardc.ir.prims`) are inlined, so every op the planner sees is a
real computation. A ``scan``'s body is inlined too, once, its ops weighted by the trip
count (``Op.weight``) and framed by ``scan_enter`` / ``scan_exit`` ops, so the body is
planned op by op like straight code. A ``cond``'s branches are inlined the same way, each
framed by ``cond_enter`` ops (one per operand) and joined by one ``cond_exit`` op per result
(:meth:`_Builder.cond`); a ``while`` loop's predicate and body like a scan's body, weighted
by its trip count where static, else an estimate (:meth:`_Builder.while_loop`). A ``cond`` whose
index is a ``platform_index`` (``jax.lax.platform_dependent``: ``jnp.diagonal``,
``jnp.linalg.det``) is resolved here: the branch the program's platform lowers to is
inlined as straight code (:func:`platform_branch`). Dead ops are removed, except ops with
side effects (callbacks, prints) and what they read.

For *running*, nothing is inlined: the :class:`Region` of a jaxpr lists, per equation, the
graph :class:`Op` it became, the Region of a call's body, the :class:`Inlined` branch of a
platform-dependent ``cond``, the :class:`Fork` of a ``cond`` or the :class:`Loop` of a scan,
so the lowering can rewrite the user's own jaxpr (the remat policy, the custom derivative
rules, the inner jits and the loops kept) with the plan's layouts placed inside the
bodies.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore

from shardc.errors import GraphError, OptionsError
from shardc.ir.flops import op_flops
from shardc.ir.graph import Graph, Op, Value, check_graph
from shardc.ir.prims import facts
from shardc.ir.remat import Segment, gate_checkpoints, rematerialize, segments
from shardc.ir.trips import DEFAULT_WHILE_TRIPS, while_trips

__all__ = ["call_body", "COND_ENTER", "COND_EXIT", "eliminate_dead_ops", "Fork",
           "graph_from_jaxpr", "Inlined", "Loop", "lowering_platforms", "platform_branch",
           "PACKAGE_DIR", "Region", "rematerialized", "SCAN_ENTER", "SCAN_EXIT", "source_line",
           "trace", "Traced"]

try:  # the frames of an equation's traceback; jax.extend exports only ``summarize``
    from jax._src.source_info_util import is_user_filename, raw_frame_to_frame
except ImportError:  # pragma: no cover - a jax without them: the summary's first frame
    is_user_filename = raw_frame_to_frame = None

_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

#: shardc's own package directory (with a trailing separator): a frame in it is shardc's
#: (its layer stack's scan, a routed ``jax.lax.scan``), not the user's line
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def source_line(eqn) -> str:
    """``path:line`` of the user's code that made ``eqn``: the innermost frame of its
    traceback outside JAX and the standard library (``source_info_util``'s user frame) and
    outside installed libraries (optax, flax: the line that called them) and shardc itself
    (:data:`PACKAGE_DIR`: the line that called ``layers`` or ``jax.lax.scan``), else the
    innermost user frame; "" when the equation has no traceback."""
    tb = eqn.source_info.traceback
    if tb is None:
        return ""
    if raw_frame_to_frame is None:
        summary = jax.extend.source_info_util.summarize(eqn.source_info)
        return summary.split(" (")[0].rsplit(":", 1)[0] if summary != "unknown" else ""
    code, lasti = tb.raw_frames()
    user = [k for k, c in enumerate(code) if is_user_filename(c.co_filename)]
    if not user:
        return ""
    k = next((k for k in user if not _library_file(code[k].co_filename)), user[0])
    frame = raw_frame_to_frame(code[k], lasti[k])
    return f"{frame.file_name}:{frame.start_line}"


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    """``filename`` is an installed library's or shardc's (:func:`source_line`); kept per
    name: a trace asks about the same few files once per equation."""
    return any(lib in filename for lib in _LIBRARIES) or \
        os.path.abspath(filename).startswith(PACKAGE_DIR)


def _loop_line(eqn, body) -> str:
    """``source_line`` of a loop ``eqn``; for one shardc made (a layer stack's scan, its
    line in shardc's own package), the first line of the user's code in its ``body``
    (the layer function's)."""
    line = source_line(eqn)
    if line and not os.path.abspath(line).startswith(PACKAGE_DIR):
        return line
    return next((inner for e in body.eqns if (inner := source_line(e))
                 and not os.path.abspath(inner).startswith(PACKAGE_DIR)), line)


class Region:
    """One jaxpr as the trace walked it: ``steps[i]`` is what ``jaxpr.eqns[i]`` became, the
    planner's :class:`Op`, the Region of a call's body the planner saw inlined, or a
    :class:`Loop` (a scan), a :class:`Fork` (a ``cond``) or an :class:`Inlined` branch.
    Ops of a Region may be dead in the graph (no plan entry): they run unconstrained."""

    __slots__ = ("jaxpr", "steps")

    def __init__(self, jaxpr, steps: Sequence):
        self.jaxpr = jaxpr
        self.steps = tuple(steps)
        if len(self.steps) != len(jaxpr.eqns):
            raise AssertionError(f"Region: {len(self.steps)} steps for {len(jaxpr.eqns)} "
                                 "equations; the trace must record one per equation")


@dataclass(frozen=True)
class Traced:
    graph: Graph
    in_tree: Any
    out_tree: Any
    region: Region  # the top-level jaxpr, for the lowering
    consts: tuple  # its closed-over constants
    #: the program as traced, before any remat: :func:`rematerialized` rewrites it
    jaxpr: Any = None
    #: its forward segments whose activations can be recomputed (:mod:`shardc.ir.remat`)
    segments: tuple[Segment, ...] = ()
    #: the segments this program recomputes (indices into ``segments``)
    remat: tuple[int, ...] = ()
    #: the platform its platform-dependent code was resolved for (None: the default's)
    platform: str | None = None
    #: the trip count its while loops without static bounds are planned for
    while_trips: int = DEFAULT_WHILE_TRIPS


def call_body(eqn) -> tuple[Any, tuple]:
    """(open jaxpr, consts) of the body of a call-like equation, or (None, ()) when the
    equation is not a call the planner inlines."""
    key = facts(eqn.primitive.name).call
    sub = eqn.params.get(key) if key else None
    if sub is None:
        return None, ()
    return (sub.jaxpr, tuple(sub.consts)) if hasattr(sub, "consts") else (sub, ())


#: pseudo-primitives the trace puts around a scan body the planner sees inline: never bound
#: (the lowering rebuilds the scan), planned by the rules in ``rules/control.py``
SCAN_ENTER = jcore.Primitive("scan_enter")
SCAN_EXIT = jcore.Primitive("scan_exit")


#: pseudo-primitives framing the branches of a ``cond`` the planner sees inline: never bound
#: (the lowering rebuilds the cond), planned by the rules in ``rules/control.py``
COND_ENTER = jcore.Primitive("cond_enter")
COND_EXIT = jcore.Primitive("cond_exit")


class Fork:
    """A ``cond`` equation as the trace walked it: per branch, one ``cond_enter`` op per
    operand and the Region of its body (``enters[b]``, ``bodies[b]``); one ``cond_exit`` op
    per result, reading the index and each branch's value of it."""

    __slots__ = ("enters", "bodies", "exits")

    def __init__(self, enters: Sequence[Sequence[Op]], bodies: Sequence[Region],
                 exits: Sequence[Op]):
        self.enters = tuple(tuple(e) for e in enters)
        self.bodies = tuple(bodies)
        self.exits = tuple(exits)


class Inlined:
    """A platform-dependent ``cond`` as the trace walked it: the Region of the branch the
    program's platform runs (``branch``, its index), inlined; the lowering runs that branch
    in place of the ``cond``."""

    __slots__ = ("branch", "body")

    def __init__(self, branch: int, body: Region):
        self.branch = branch
        self.body = body


def lowering_platforms(platform: str | None) -> frozenset[str]:
    """The lowering platform names of a device platform (``"gpu"``: ``"cuda"`` or
    ``"rocm"``, the one present; ``"cpu"``, ``"tpu"`` as they are); None: the default
    backend's, as ``jax.jit`` would compile for."""
    platform = platform or jax.default_backend()
    try:
        from jax._src.xla_bridge import canonicalize_platform, expand_platform_alias
    except ImportError:  # pragma: no cover - a jax without them: the name as it is
        return frozenset({platform})
    try:
        return frozenset({canonicalize_platform(platform)})
    except RuntimeError:  # no backend of that platform here (an abstract mesh's)
        return frozenset(expand_platform_alias(platform))


def platform_branch(eqn, index: Value, platforms: frozenset[str]) -> int | None:
    """The branch a ``cond`` runs on ``platforms`` when its index is a ``platform_index``
    (``jax.lax.platform_dependent``), else None: the first branch listing one of them, or
    the default (``None``) branch, as ``cond``'s lowering picks it.

    References:
      ``jax._src.lax.control_flow.conditionals``: ``_cond_lowering`` with
      ``branches_platforms``, and ``_platform_index_lowering``."""
    choices = eqn.params.get("branches_platforms")
    if choices is None or index.producer is None or index.producer.name != "platform_index":
        return None
    for k, names in enumerate(choices):
        if names is None or platforms & set(names):
            return k
    raise GraphError(f"{eqn.primitive.name}: no branch of this platform-dependent code "
                     f"runs on {sorted(platforms)} (branches for {choices}); plan on a mesh "
                     "of a platform it supports")


class Loop:
    """A ``scan`` or ``while`` equation as the trace walked it: one ``scan_enter`` op per
    body input (a scan's const, carry or xs operand; a while's predicate consts, body
    consts, then carries, which predicate and body both read), the Region of its body, one
    ``scan_exit`` op per result (carry or ys); a while's predicate's Region (``test``)."""

    __slots__ = ("enters", "body", "exits", "test")

    def __init__(self, enters: Sequence[Op], body: Region, exits: Sequence[Op],
                 test: Region | None = None):
        self.enters = tuple(enters)
        self.body = body
        self.exits = tuple(exits)
        self.test = test


class _Builder:
    def __init__(self, platforms: frozenset[str], trips: int):
        self.ids = itertools.count()
        self.ops: list[Op] = []
        self.platforms = platforms  # what platform-dependent code is resolved for
        self.trips = trips  # a while loop's trip count where its jaxprs give none
        # the user's line of each equation around the one walked, innermost last: an
        # equation of a body traced without one (JAX's own jitted functions, jnp.sort or
        # jnp.linalg.norm, keep no user frame) is placed at its call's line
        self.lines: list[str] = [""]

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

    def op(self, prim, params: dict, ins: list[Value], avals, weight: int,
           effects=frozenset(), source: str = "", where: tuple[int, ...] = ()) -> Op:
        op = Op(len(self.ops), prim, params, ins, [], effects=effects, weight=weight,
                source=source, where=where)
        op.outputs = [self.value(a, producer=op) for a in avals]
        self.ops.append(op)
        return op

    def emit(self, jaxpr, consts, invals: list[Value], weight: int = 1,
             where: tuple[int, ...] = ()) -> tuple[list[Value], Region]:
        """The ops of ``jaxpr``'s equations; ``where`` is the jaxpr's place in the
        program (the equation indices of the calls around it, outermost first)."""
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c)
        for var, v in zip(jaxpr.invars, invals):
            env[var] = v
        steps: list[Op | Region | Loop | Fork | Inlined] = []
        for i, eqn in enumerate(jaxpr.eqns):
            self.lines.append(source_line(eqn) or self.lines[-1])
            ins = [self.read(env, a) for a in eqn.invars]
            body, body_consts = call_body(eqn)
            branch = platform_branch(eqn, ins[0], self.platforms) \
                if eqn.primitive.name == "cond" else None
            if branch is not None:
                chosen = eqn.params["branches"][branch]
                outs, region = self.emit(chosen.jaxpr, chosen.consts, ins[1:], weight,
                                         (*where, i))
                steps.append(Inlined(branch, region))
            elif body is not None:
                outs, region = self.emit(body, body_consts, ins[len(ins) - len(body.invars):],
                                         weight, (*where, i))
                steps.append(region)
            elif eqn.primitive.name == "scan":
                outs, loop = self.scan(eqn, ins, weight, (*where, i))
                steps.append(loop)
            elif eqn.primitive.name == "cond":
                outs, fork = self.cond(eqn, ins, weight, (*where, i))
                steps.append(fork)
            elif eqn.primitive.name == "while":
                outs, loop = self.while_loop(eqn, ins, weight, (*where, i))
                steps.append(loop)
            else:
                op = self.op(eqn.primitive, dict(eqn.params), ins,
                             [v.aval for v in eqn.outvars], weight, eqn.effects,
                             self.lines[-1], (*where, i))
                steps.append(op)
                outs = op.outputs
            self.lines.pop()
            for var, v in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = v
        return [self.read(env, a) for a in jaxpr.outvars], Region(jaxpr, steps)

    def scan(self, eqn, ins: list[Value], weight: int, where: tuple[int, ...]
             ) -> tuple[list[Value], Loop]:
        """A scan's body inline, run ``length`` times: ``scan_enter`` ops give the body its
        inputs (a carry's enter ``tie``s it to the carry the body returns), ``scan_exit``
        ops give the results (a carry's is the loop-carried value, ``enter``; ys stack the
        body's per-iteration values)."""
        p = eqn.params
        closed, nc, nk, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        kinds = ["const"] * nc + ["carry"] * nk + ["xs"] * (len(ins) - nc - nk)
        source = _loop_line(eqn, closed.jaxpr) or self.lines[-1]
        enters = [self.op(SCAN_ENTER, {"kind": kind, "length": length}, [outer],
                          [var.aval], weight, source=source, where=where)
                  for kind, outer, var in zip(kinds, ins, closed.jaxpr.invars)]
        outs, body = self.emit(closed.jaxpr, closed.consts, [e.outputs[0] for e in enters],
                               weight * length, where)
        for k in range(nk):  # the value the next iteration reads as this carry
            enters[nc + k].params["tie"] = outs[k]
        exits = [self.op(SCAN_EXIT, {"kind": "carry", "enter": enters[nc + j].outputs[0]}
                         if j < nk else {"kind": "ys", "length": length}, [v], [var.aval],
                         weight, source=source, where=where)
                 for j, (v, var) in enumerate(zip(outs, eqn.outvars))]
        return [e.outputs[0] for e in exits], Loop(enters, body, exits)


    def while_loop(self, eqn, ins: list[Value], weight: int, where: tuple[int, ...]
                   ) -> tuple[list[Value], Loop]:
        """A while loop's predicate and body inline, run ``trips`` times (read off the
        jaxprs where static, else the builder's estimate: :mod:`shardc.ir.trips`), framed
        like a scan's: ``scan_enter`` ops (``loop="while"``) give both their consts and
        the carries (a carry's enter ``tie``s it to the value the body returns, and names
        the predicate, ``test``, which every device must compute alike), ``scan_exit`` ops
        give the carries after the loop."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        trips = while_trips(eqn, ins, self.trips)
        source = self.lines[-1]
        nk = len(ins) - cn - bn
        kinds = ["const"] * (cn + bn) + ["carry"] * nk
        avals = [v.aval for v in cond.jaxpr.invars[:cn]] + [v.aval for v in body.jaxpr.invars]
        enters = [self.op(SCAN_ENTER, {"kind": kind, "length": trips, "loop": "while"}, [v],
                          [aval], weight, source=source, where=where)
                  for kind, v, aval in zip(kinds, ins, avals)]
        vals = [e.outputs[0] for e in enters]
        carries = vals[cn + bn:]
        (test,), test_region = self.emit(cond.jaxpr, cond.consts, vals[:cn] + carries,
                                         weight * trips, where)
        outs, body_region = self.emit(body.jaxpr, body.consts, vals[cn:], weight * trips,
                                      where)
        for k in range(nk):
            enters[cn + bn + k].params.update(tie=outs[k], test=test)
        exits = [self.op(SCAN_EXIT, {"kind": "carry", "enter": carries[j], "loop": "while"},
                         [v], [var.aval], weight, source=source, where=where)
                 for j, (v, var) in enumerate(zip(outs, eqn.outvars))]
        return [e.outputs[0] for e in exits], Loop(enters, body_region, exits, test_region)

    def cond(self, eqn, ins: list[Value], weight: int, where: tuple[int, ...]
             ) -> tuple[list[Value], Fork]:
        """A cond's branches inline: per branch, a ``cond_enter`` op per operand gives the
        branch its inputs (the operand converted before the cond, in the layout that branch
        reads it), then the branch's ops; a ``cond_exit`` op per result reads the index and
        every branch's value of it, all in the result's layout. One branch runs per call:
        the costliest (most FLOPs, the first of equals) keeps the cond's ``weight`` and the
        others weigh 0, so the cond is priced by its costlier branch. The others' layouts
        still pay for what crosses their edges (an operand read in another layout than it
        is made, a result converted to the cond's), where the enters and exits run at the
        cond's weight. A branch's ops are placed at ``(*where, b, j)``: the cond's place,
        the branch's index, the equation's in the branch."""
        index, operands = ins[0], ins[1:]
        source = self.lines[-1]
        enters, bodies, results, spans = [], [], [], []
        for b, branch in enumerate(eqn.params["branches"]):
            ops = [self.op(COND_ENTER, {"branch": b}, [v], [var.aval], weight, source=source,
                           where=where)
                   for v, var in zip(operands, branch.jaxpr.invars)]
            start = len(self.ops)
            outs, body = self.emit(branch.jaxpr, branch.consts, [e.outputs[0] for e in ops],
                                   weight, (*where, b))
            spans.append(self.ops[start:])
            enters.append(ops)
            bodies.append(body)
            results.append(outs)
        flops = [sum(op_flops(op) * op.weight for op in span) for span in spans]
        heavy = flops.index(max(flops))
        for b, span in enumerate(spans):
            if b != heavy:
                for op in span:  # the builder's ops, not yet in a Graph: weighed once here
                    op.weight = 0
        exits = [self.op(COND_EXIT, {"branches": len(results)},
                         [index, *(outs[j] for outs in results)], [var.aval], weight,
                         source=source, where=where)
                 for j, var in enumerate(eqn.outvars)]
        return [e.outputs[0] for e in exits], Fork(enters, bodies, exits)


def eliminate_dead_ops(graph: Graph) -> Graph:
    """Drop ops nothing observes: kept are the ops an output depends on, the ops with side
    effects, and what those read; a live loop carry keeps what the body returns for it
    (its ``tie``) and a while's predicate (its ``test``), to a fixed point."""
    live = {v.id for v in graph.outputs}
    while True:
        kept: list[Op] = []
        before = len(live)
        for op in reversed(graph.ops):
            if op.effects or any(v.id in live for v in op.outputs):
                kept.append(op)
                live.update(v.id for v in op.inputs)
                if op.prim is SCAN_ENTER:  # a live carry: what the loop computes it from
                    live.update(v.id for k in ("tie", "test")
                                if (v := op.params.get(k)) is not None)
        if len(live) == before:
            break
    kept.reverse()
    return Graph(graph.inputs, graph.outputs, kept)


def _build(closed_jaxpr, platform: str | None = None, trips: int = DEFAULT_WHILE_TRIPS
           ) -> tuple[Graph, Region]:
    b = _Builder(lowering_platforms(platform), trips)
    inputs = [b.value(v.aval) for v in closed_jaxpr.jaxpr.invars]
    outputs, region = b.emit(closed_jaxpr.jaxpr, closed_jaxpr.consts, inputs)
    graph = eliminate_dead_ops(Graph(inputs, outputs, b.ops))
    check_graph(graph)
    return graph, region


def graph_from_jaxpr(closed_jaxpr, platform: str | None = None) -> Graph:
    """The planner's graph of a closed jaxpr (calls inlined, dead ops removed)."""
    return _build(closed_jaxpr, platform)[0]


def trace(fn: Callable, *args, platform: str | None = None,
          while_trips: int = DEFAULT_WHILE_TRIPS) -> Traced:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct`` leaves) to a Graph;
    platform-dependent code is resolved for ``platform`` (a device's ``platform``: the
    mesh's devices'), None: the default backend's (an abstract mesh's); a ``while`` loop
    whose bounds are not static is planned for ``while_trips`` iterations."""
    in_tree = jax.tree.structure(args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    closed = gate_checkpoints(closed)
    graph, region = _build(closed, platform, while_trips)
    return Traced(graph, in_tree, jax.tree.structure(out_shape), region, tuple(closed.consts),
                  closed, segments(closed), platform=platform, while_trips=while_trips)


def rematerialized(traced: Traced, remat: Sequence[int]) -> Traced:
    """``traced`` with the activations of its segments ``remat`` recomputed in the backward
    pass (:func:`shardc.ir.remat.rematerialize`), traced again to a Graph; ``traced``
    itself when ``remat`` is empty."""
    remat = tuple(sorted(set(remat)))
    if remat == traced.remat:
        return traced
    bad = [k for k in remat if not 0 <= k < len(traced.segments)]
    if bad:
        n = len(traced.segments)
        raise OptionsError(f"remat segment(s) {bad} do not exist: this program has {n} "
                           f"segment{'' if n == 1 else 's'} that can be recomputed")
    closed = rematerialize(traced.jaxpr, traced.segments, remat)
    graph, region = _build(closed, traced.platform, traced.while_trips)
    return dataclasses.replace(traced, graph=graph, region=region, remat=remat)
