"""Plan → executable: the user's own jaxpr, re-bound equation by equation with the plan's
layouts, under ``jax.jit``.

What runs is the jaxpr ``fn`` traced to, not a replay of the planner's flat graph: every
equation is bound again with its own primitive and params (``get_bind_params``, as JAX's
``eval_jaxpr`` does), in program order, so effects keep their order and count. A call the
planner saw inlined (a :class:`~shardc.ir.trace.Region`: remat with its policy,
``custom_jvp_call`` / ``custom_vjp_call`` with their rules, an inner ``jit``) stays a call:
its body jaxpr is rewritten by tracing this same interpreter over it, with the plan's
constraints inside, and the call is bound with the new body. So the program differentiates,
vmaps and recomputes exactly like ``jax.jit(fn)``. A platform-dependent ``cond`` the trace
resolved (:class:`~shardc.ir.trace.Inlined`) runs its platform's branch in place.

The plan's layouts become ``with_sharding_constraint`` on every planned, non-partial value.
Partial values have no spelling on Auto mesh axes, so they are left unconstrained: XLA
places the reduction where the next constrained value needs it (the partial sums a loop
keeps apart per device are held stacked instead: :mod:`shardc.lower.stacking`). Where an op
wants an input in another layout than its producer made, the input is constrained to the
wanted layout too, each step of the planned conversion pinned, so the resharding happens
where the plan put it. A user's own ``with_sharding_constraint`` is a fixed layout of the
plan (``rules/fixed.py``) and is emitted as the plan's constraint.

:mod:`shardc.lower.program` puts the result under ``jax.jit``, called like the user's
function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from shardc.cost.comm import conversion
from shardc.ir.flow import carry_exit, loop_ties, reads, unrolled_sums
from shardc.ir.prims import facts
from shardc.ir.remat import is_gate
from shardc.ir.sbp import B, NdSbp, P, Split, to_partition_spec
from shardc.ir.trace import Fork, Inlined, Loop, Region, Traced
from shardc.lower.control import ControlFlow, bind_eqn, untyped_aval
from shardc.lower.local import per_device, ring_source, run_ring
from shardc.lower.partial import (
    Stacked,
    stack,
    sum_axes,
    unstack,
    widen,
)
from shardc.lower.stacking import StackedSums, own_ops
from shardc.pipeline.lowering import Stacks, made_by
from shardc.rules.conv import local_groups
from shardc.rules.dot import ring_of

__all__ = ["DEVICE", "HOST", "conversion_steps", "evaluator", "sharding", "to_memory"]


def _split_whole(planned) -> bool:
    """Some operand is split and nothing is partial: each device's pieces are whole values
    of the op on its own (what running it per device needs)."""
    nds = (*planned.ins, *planned.outs)
    return not any(nd.has_partial for nd in nds) and any(
        isinstance(s, Split) for nd in planned.ins for s in nd.sbps)


def sharding(mesh: Mesh, nd: NdSbp, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, to_partition_spec(nd, ndim, mesh.axis_names))


def conversion_steps(plan, src: NdSbp | None, dst: NdSbp) -> list[NdSbp]:
    """The layouts a value is pinned to, in turn, to convert it from ``src`` to ``dst`` as
    the plan priced (each intermediate layout, then ``dst``); none when they agree. A
    conversion's own layouts end with ``dst`` when its last step is a collective, and
    ``dst`` is not pinned twice then: a second constraint would change nothing but is one
    more instruction to partition (a ViT's lowering had 346 of them in 2505)."""
    if src is None or src == dst:
        return []
    steps = conversion(src, dst, plan.axis_sizes, plan.axis_names, plan.cluster).layouts
    return list(steps) if steps and steps[-1] == dst else [*steps, dst]


def _read_as_made(graph, plan, by_op) -> set[int]:
    """Ids of values that every use (ops and graph outputs) reads in the layout they are
    made in: no settling, no conversion (a scan body's carry results are converted back to
    the carried layout every iteration)."""
    made = plan.values
    bad = set(plan.settled) | {v.id for _, v in loop_ties(graph)}
    for op in graph.ops:
        planned = by_op.get(op.id)
        for k, v in enumerate(op.inputs):
            if planned is None or carry_exit(op) or planned.ins[k] != made.get(v.id):
                bad.add(v.id)
    for v, nd in zip(graph.outputs, plan.outputs):
        if nd != made.get(v.id):
            bad.add(v.id)
    return {v.id for op in graph.ops for v in op.outputs} - bad


class _Lowering(ControlFlow, StackedSums):
    """The interpreter: a plan, the Auto mesh it runs on, its ops by id, and the values
    left unconstrained (:meth:`~shardc.ir.graph.Graph.constants`)."""

    __slots__ = ("plan", "mesh", "graph", "by_op", "free", "read_whole", "shardings",
                 "stacked", "converted", "stacks", "sums", "whole", "made")

    def __init__(self, plan, mesh: Mesh, graph):
        self.plan = plan
        self.mesh = mesh
        self.graph = graph
        #: value id -> the value as lowered (rings pass some in place of their repeated
        #: copies: :func:`shardc.lower.local.ring_source`)
        self.made: dict = {}
        self.by_op = {o.id: o for o in plan.ops}
        self.free = graph.constants()
        self.read_whole = _read_as_made(graph, plan, self.by_op)
        self.shardings: dict = {}  # (NdSbp, rank) -> NamedSharding, made once
        #: value id -> mesh axes: the partial sums of loop bodies held stacked
        #: (:mod:`shardc.lower.partial`), filled per loop by :meth:`stack_plan`
        self.stacked: dict[int, tuple[int, ...]] = {}
        #: (id of a traced value, source, target) -> (that value, its converted copy)
        self.converted: dict = {}
        #: the layer stacks run as the plan's pipeline (:mod:`shardc.pipeline.lowering`)
        self.stacks = Stacks(plan.pipeline, mesh, self.by_op,
                             plan.solver.get("pipeline", {}).get("batch_axes")) \
            if plan.pipeline is not None else None
        self.sums = unrolled_sums(graph)  # a Python loop's sums, which may stay partial
        #: the plan splits nothing: with its inputs pinned whole, the partitioner has no
        #: split to propagate, so no op's output needs a constraint of its own
        self.whole = plan.pipeline is None and all(
            nd.is_replicated for o in plan.ops for nd in (*o.ins, *o.outs))
        if self.stacks is not None:  # the layer state's update, as the stages hold it
            self.free |= set(plan.solver.get("pipeline", {}).get("free", ()))

    def sharding_of(self, nd: NdSbp, ndim: int) -> NamedSharding:
        """``nd`` on the run mesh for a value of rank ``ndim`` (made once)."""
        key = (nd, ndim)
        sh = self.shardings.get(key)
        if sh is None:
            sh = self.shardings[key] = sharding(self.mesh, nd, ndim)
        return sh

    def constrain(self, x, nd: NdSbp | None):
        if nd is None or nd.has_partial or not hasattr(x, "shape"):
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding_of(nd, x.ndim))

    def convert(self, x, src: NdSbp | None, dst: NdSbp):
        """Pin each layout of the planned conversion in turn (:mod:`shardc.cost.comm`), so
        XLA runs the collectives the plan priced, one mesh axis at a time. A value
        converted alike for several readers is converted once, its copy shared (as the
        memory model counts it): the partitioner merges the first steps of identical
        conversions, but not the later ones, whose operands are distinct constraints (a
        cotangent gathered over both axes of a (2, 4) mesh for three readers held three
        gathered copies)."""
        steps = conversion_steps(self.plan, src, dst)
        if not steps:
            return x
        key = (id(x), src, dst)
        hit = self.converted.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        y = x
        for nd in steps:
            y = self.constrain(y, nd)
        self.converted[key] = (x, y)  # x held: its id is not reused while the entry lives
        return y

    def source(self, v) -> NdSbp | None:
        """The layout ``v``'s uses read it from; None for a constant (left to XLA)."""
        return None if v.is_const or v.id in self.free else self.plan.read_as(v.id)

    def to_layout(self, x, src: NdSbp | None, dst: NdSbp):
        """``x`` (held stacked or not; ``src`` its layout, None for a constant) converted to
        ``dst``, held stacked over ``dst``'s partial-sum axes if it has any. Stacked over
        the same axes, it stays so (its other axes converted); otherwise it is summed, then
        converted, then stacked again."""
        want = sum_axes(dst)
        if isinstance(x, Stacked) and src is not None and set(x.axes) < set(want) and all(
                src.sbps[a] == B for a in want if a not in x.axes):
            # read partial over more axes, replicated along them: stacked wider, not summed
            x = widen(x, want, self.plan.axis_sizes)
            src = NdSbp(tuple(P if a in want else s for a, s in enumerate(src.sbps)))
        if isinstance(x, Stacked) and x.axes == want:
            arr = x.x
            for nd in conversion_steps(self.plan, src, dst):
                arr = self.constrain_stacked(arr, want, nd)
            return Stacked(arr, want)
        x = self._unstack(x, src)
        if not want:
            return x if src is None else self.convert(x, src, dst)
        whole = NdSbp(tuple(B if a in want else s for a, s in enumerate(dst.sbps)))
        if src is not None:
            x = self.convert(x, src, whole)
        arr = stack(x, want, self.plan.axis_sizes)
        return Stacked(self.constrain_stacked(arr, want, dst), want)

    def settle(self, vid: int, x):
        """Convert a value used more than once to the layout its uses read, once (a free
        value is read as it comes); kept in :attr:`made`."""
        nd = self.plan.settled.get(vid)
        if nd is not None and vid not in self.free:
            x = self.convert(x, self.plan.values.get(vid), nd)
        self.made[vid] = x
        return x

    def op(self, eqn, op, args: list) -> list:
        planned = self.by_op.get(op.id)
        if planned is None or op.outputs and all(v.id in self.free for v in op.outputs):
            return bind_eqn(eqn, [unstack(x) for x in args])  # dead in the plan, or a constant
        if op.outputs and op.outputs[0].id in self.stacked:
            return [self._stacked_op(eqn, op, planned, args)]
        if is_gate(eqn):
            return self._gate(eqn, op, planned, args)
        args = [x if v.is_const or v.id in self.free
                else self.convert(self._unstack(x, self.plan.read_as(v.id)),
                                  self.plan.read_as(v.id), planned.ins[k])
                for k, (v, x) in enumerate(zip(op.inputs, args))]
        if facts(op.name).fixed and op.name == "sharding_constraint":
            outs = args  # the user's layout is the plan's: constrained just below
        elif facts(op.name).per_device and _split_whole(planned):
            outs = self._per_device(eqn, op, planned, args)
        elif (ring := ring_of(op, planned.ins, planned.outs)) is not None:
            outs = run_ring(self.mesh, eqn, op, planned, args, ring,
                            ring_source(self.graph, self.made, op, planned.ins, ring[1], args))
        elif _split_whole(planned) and (local := local_groups(
                op, planned.ins[0], self.plan.axis_sizes)) is not None:
            outs = self._per_device(eqn, op, planned, args, local)
        else:
            outs = bind_eqn(eqn, args)
        if self._follows(op, planned):  # XLA propagates the layout its operands have
            return [self.settle(v.id, x) for v, x in zip(op.outputs, outs)]
        return [self.settle(v.id, self.constrain(x, nd))
                for v, x, nd in zip(op.outputs, outs, planned.outs)]

    def _per_device(self, eqn, op, planned, args: list, params: dict | None = None) -> list:
        """``eqn`` (with ``params`` in place of its own, if given) run on each device's
        pieces (``shard_map`` over the planned layouts): for a primitive XLA would gather
        whole instead (:attr:`shardc.ir.prims.Prim.per_device`), and for a grouped
        convolution split along its groups (:func:`shardc.rules.conv.local_groups`)."""
        return per_device(self.mesh, lambda *xs: bind_eqn(eqn, list(xs), params), op,
                          planned, args)

    def _gate(self, eqn, op, planned, args: list) -> list:
        """A recomputation's gate (:func:`shardc.ir.remat.is_gate`): the select runs in the
        layout its gated operand is read from, and its result is converted to the plan's:
        the same collective the plan priced on the operand, run after the gate."""
        here = self.source(op.inputs[2])
        if here is None:
            here = planned.ins[2]
        args = [x if v.is_const or v.id in self.free
                else self.convert(unstack(x), self.plan.read_as(v.id), here)
                for v, x in zip(op.inputs, args)]
        out = self.convert(bind_eqn(eqn, args)[0], here, planned.outs[0])
        return [self.settle(op.outputs[0].id, out)]

    def _follows(self, op, planned) -> bool:
        """The partitioner gives this op's output its planned layout on its own, so the
        lowering need not pin it (a constraint per value made a GPT's program half again as
        large and a third slower to compile): an elementwise op whose operands of its shape
        were read in its output's layout, a layout op (reshape, transpose, broadcast) whose
        output splits exactly the mesh axes its operand splits, or a dot or reduction whose
        output splits only axes an operand splits; any op of a plan that splits nothing.
        Otherwise only for a value every use reads as it is made: one converted later keeps
        its constraint, or the partitioner may move the conversion upstream (seven extra
        all-gathers in the MLP on two nodes)."""
        if self.whole:
            return True
        if len(op.outputs) != 1 or op.outputs[0].id not in self.read_whole:
            return False
        out, nd = op.outputs[0], planned.outs[0]
        read = [(v, planned.ins[k]) for k, v in enumerate(op.inputs)
                if not (v.is_const or v.id in self.free)]
        if not read or nd.has_partial or any(s.has_partial for _, s in read):
            return False
        if facts(op.name).elementwise:
            same = [s for v, s in read if v.shape == out.shape]
            return bool(same) and all(s == nd for s in same)
        if facts(op.name).passes_partial or op.name == "broadcast_in_dim":
            src = planned.ins[0]
            return all(isinstance(a, Split) == isinstance(b, Split)
                       for a, b in zip(src.sbps, nd.sbps))
        if facts(op.name).splits_from_operands:  # every output split is an operand's
            return all(any(isinstance(s.sbps[a], Split) for _, s in read)
                       for a, b in enumerate(nd.sbps) if isinstance(b, Split))
        return False

    def call(self, eqn, region: Region, args: list) -> list:
        """Bind a call with its body rewritten: this interpreter traced over the body; a
        layer stack's call, with a pipeline planned, runs as the pipeline."""
        outs = self.stacks.call(eqn, region, args) if self.stacks is not None else None
        if outs is not None:  # as the pipeline leaves them: read without the plan's source
            self.free |= made_by(region)
            return outs
        key = facts(eqn.primitive.name).call
        sub = eqn.params[key]
        consts = tuple(sub.consts) if hasattr(sub, "consts") else ()
        body = jax.make_jaxpr(lambda *xs: [unstack(x) for x in self.region(region, consts, xs)])(
            *(untyped_aval(v.aval) for v in region.jaxpr.invars))
        if hasattr(sub, "consts"):
            new = body
        else:  # an open jaxpr (remat): the body is traced over its invars and closes over none
            assert not body.consts, f"{eqn.primitive.name}: rewritten body closes over consts"
            new = body.jaxpr
        return bind_eqn(eqn, args, {**eqn.params, key: new})

    def _pass(self, op, x, into: bool):
        """``x`` through a loop's or a cond's edge op (``scan_enter`` / ``scan_exit``,
        ``cond_enter`` / ``cond_exit``): converted to the layout the op reads (``into``),
        or pinned to the one it makes (and settled)."""
        planned = self.by_op.get(op.id)
        if planned is None:
            return x
        if into:
            v = reads(op)[0][1]
            src = self.plan.values.get(v.id) if carry_exit(op) else self.plan.read_as(v.id)
            return x if v.is_const or v.id in self.free else \
                self.convert(x, src, planned.ins[0])
        return self.settle(op.outputs[0].id, self.constrain(x, planned.outs[0]))

    def loop(self, eqn, loop: Loop, args: list) -> list:
        """Bind a scan with its body rewritten: operands converted to the layouts the body
        reads them in, before the loop; inside, the body's ops as planned, each carry
        converted back to its carried layout and each ys to its stacked one every
        iteration; the results pinned after the loop. A carry the plan keeps partial is
        held stacked (:mod:`shardc.lower.partial`): its summands enter the loop, stay apart
        through it and are reduced once after it."""
        p = eqn.params
        nc, nk = p["num_consts"], p["num_carry"]
        carried = loop.enters[nc:nc + nk]
        ys = loop.exits[nk:]
        ys_held = self.stack_plan(loop, carried, ys)
        held = [()] * nc + [self.stacked.get(e.outputs[0].id, ()) for e in carried]
        held += [()] * (len(loop.enters) - len(held))

        def body(*xs):
            ins = [Stacked(self.constrain_stacked(x, axes, self.by_op[e.id].outs[0]), axes)
                   if axes else self._pass(e, x, into=False)
                   for e, x, axes in zip(loop.enters, xs, held)]
            outs = self.region(loop.body, p["jaxpr"].consts, ins)
            back = []
            for e, x, axes in zip(carried, outs[:nk], held[nc:]):
                tie = e.params["tie"]
                if e.id not in self.by_op or tie.is_const:
                    back.append(unstack(x))
                    continue
                y = self.to_layout(x, self.plan.read_as(tie.id), self.by_op[e.id].outs[0])
                back.append(y.x if axes else y)
            return back + [self._ys(e, x, axes) for e, x, axes in zip(ys, outs[nk:], ys_held)]

        sizes = self.plan.axis_sizes
        avals = [jax.ShapeDtypeStruct(tuple(sizes[a] for a in axes) + v.aval.shape,
                                      v.aval.dtype) if axes else untyped_aval(v.aval)
                 for v, axes in zip(loop.body.jaxpr.invars, held)]
        closed = jax.make_jaxpr(body)(*avals)
        ins = []
        for e, x, axes in zip(loop.enters, args, held):
            if axes:
                x = self.to_layout(x, self.source(reads(e)[0][1]), self.by_op[e.id].ins[0]).x
            else:
                x = self._pass(e, x, into=True)
            ins.append(x)
        outs = bind_eqn(eqn, ins, {**p, "jaxpr": closed})
        result = []
        for j, (e, x) in enumerate(zip(loop.exits, outs)):
            if j < nk:  # a carry: read as the loop keeps it (summed if held stacked)
                axes = held[nc + j]
                x = self._pass(e, unstack(Stacked(x, axes)) if axes else x, into=True)
            elif ys_held[j - nk]:  # a ys held stacked: reduced once for all iterations
                x = self._reduce_ys(e, x, ys_held[j - nk])
            result.append(self._pass(e, x, into=False))
        return result

    def region(self, region: Region, consts: Sequence, args: Sequence) -> list:
        env: dict = {}
        jaxpr = region.jaxpr
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for eqn, step in zip(jaxpr.eqns, region.steps):
            ins = [read(a) for a in eqn.invars]
            if isinstance(step, Region) and any(v.id in self.stacked for op in
                                                own_ops(step.steps) for v in op.outputs):
                # it makes a value held stacked: inlined, so that value leaves it stacked
                # (a call's body returns whole values; XLA would reduce it in the call)
                sub = eqn.params[facts(eqn.primitive.name).call]
                outs = self.region(step, tuple(sub.consts) if hasattr(sub, "consts") else (),
                                   ins)
            elif isinstance(step, Region):
                outs = self.call(eqn, step, [unstack(x) for x in ins])
            elif isinstance(step, Loop) and step.test is not None:
                outs = self.while_loop(eqn, step, [unstack(x) for x in ins])
            elif isinstance(step, Loop):
                outs = self.loop(eqn, step, [unstack(x) for x in ins])
            elif isinstance(step, Fork):
                outs = self.fork(eqn, step, [unstack(x) for x in ins])
            elif isinstance(step, Inlined):  # the platform's branch, in place of the cond
                outs = self.region(step.body, eqn.params["branches"][step.branch].consts,
                                   ins[1:])
            else:
                outs = self.op(eqn, step, ins)
            for var, x in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = x
        return [read(a) for a in jaxpr.outvars]


def evaluator(traced: Traced, plan, mesh: Mesh) -> Callable[..., list]:
    """A function of the flat inputs that runs ``traced``'s program with the plan's layouts
    on ``mesh`` (Auto axes) and returns the flat outputs in the plan's output layouts."""
    graph = traced.graph
    low = _Lowering(plan, mesh, graph)
    offloaded = set(plan.offloaded)

    def run(*flat):
        # pin the inputs: a no-op for arguments already placed, the input layout when this
        # runs inside another transformation (jax.grad / jax.vmap / jax.jit of the step)
        flat = [to_memory(x, low.sharding_of(nd, x.ndim), DEVICE) if k in offloaded else x
                for k, (x, nd) in enumerate(zip(flat, plan.inputs))]
        ins = [low.settle(v.id, low.constrain(x, nd))
               for v, x, nd in zip(graph.inputs, flat, plan.inputs)]
        low.stack_top(traced.region)
        outs = low.region(traced.region, traced.consts, ins)
        if low.stacks is not None:
            low.stacks.check_used()
        result = []
        for v, x, nd in zip(graph.outputs, outs, plan.outputs):
            if v.is_const or not hasattr(x, "shape"):
                result.append(x)
            else:
                src = low.source(v)  # None: a free value, pinned as it comes
                result.append(low.constrain(low._unstack(x, src), nd) if src is None
                              else low.convert(low._unstack(x, src), src, nd))
        for j in plan.offloaded_outputs:  # the new state back to host memory
            result[j] = to_memory(result[j], low.sharding_of(plan.outputs[j], result[j].ndim),
                                  HOST)
        return result

    return run


#: the memory kinds of a device's own memory and of the host memory it reads directly
DEVICE, HOST = "device", "pinned_host"


def to_memory(x, sh: NamedSharding, kind: str):
    """``x`` moved to memory ``kind`` with sharding ``sh`` inside the traced program (an
    offloaded state leaf to the devices where read, its new state back to the host)."""
    return jax.device_put(x, sh.with_memory_kind(kind))
