"""A plan assembled from a solved cost graph: :func:`assemble` turns the solver's per-node
choices into a :class:`~shardc.plan.record.Plan`.

It walks the program once in order, records every conversion a consumer reads a value
through (:class:`~shardc.plan.record.Reshard`, priced with :func:`shardc.cost.comm.conversion`;
the same conversion of the same value for another consumer is free, as XLA CSEs the
collectives), and then runs XLA's combiner on the collectives it recorded: each group
combined into one tuple collective is priced as that one collective (:func:`_joined`,
:func:`_combine`). The predicted figures are so recomputed from the final choices, not read
off the solver's objective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from shardc.cost.collectives import seconds
from shardc.cost.combine import alpha_scales, combiner_for
from shardc.cost.combiner import Pending, Use, combine_groups
from shardc.cost.kernels import compute_seconds
from shardc.cost.ring import looped, passed, ring_cost
from shardc.ir.flow import carry_exit, loop_tests, loop_ties, read_runs, reads, settle_runs
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Partial
from shardc.ir.trace import COND_ENTER, SCAN_ENTER
from shardc.plan.record import OpPlan, Plan, Predicted, Reshard, fingerprint, unreduced
from shardc.solve.costgraph import CostGraph
from shardc.solve.memory import memory_profile
from shardc.solve.problem import input_cost
from shardc.solve.reduced_ys import unreduced_ys, ys_exits, ys_shares

__all__ = ["assemble"]


def _combine(reshards: list, ops: list, comm: float, combined: dict, model: str
             ) -> tuple[list, list, float]:
    """Price each group of collectives XLA combines into one tuple collective
    (:func:`shardc.cost.combiner.combine_groups`; one of a kind per combined set, keyed
    ``(kind, group, runs, set)``) as that one collective: NCCL picks its algorithm and
    protocol for the whole buffer, and it pays one latency. Each member's reshard (and its
    reader's comm time) gets its part of the group's time in proportion to its bytes, in
    place of the share it was charged (a collective left alone: its full time)."""
    delta: dict[int, float] = {}
    for (kind, group, times, _), members in combined.items():
        whole = sum(b for _, b, _ in members)
        if not whole:  # a ring's sends (no buffer) keep the price their ring charged
            continue
        t = seconds(kind, group, whole, model) * times
        for index, nbytes, charged in members:
            delta[index] = delta.get(index, 0.0) + t * nbytes / whole - charged
    if not delta:
        return reshards, ops, comm
    by_op: dict[int, float] = {}
    out = list(reshards)
    for index, d in delta.items():
        r = out[index]
        out[index] = dataclasses.replace(r, time=r.time + d)
        if r.consumer is not None and r.consumer >= 0:
            by_op[r.consumer] = by_op.get(r.consumer, 0.0) + d
    ops = [dataclasses.replace(o, comm_time=o.comm_time + by_op[o.id]) if o.id in by_op else o
           for o in ops]
    return out, ops, comm + sum(delta.values())


def _joined(graph: Graph, uses: list, via: dict, pending: list, combiner, reshards: list
            ) -> dict[tuple, list[tuple[int, float, float]]]:
    """Run XLA's combiner on the plan's collectives (:func:`shardc.cost.combiner.
    combine_groups`): mark each reshard's collectives with the combined collective they join
    (``Reshard.combined``, in place) and return the members of each, keyed ``(kind, group,
    runs, set)``, as :func:`_combine` prices them (a collective left alone is a set of one)."""
    sets = combine_groups(graph, uses, via, [p for p, _ in pending], combiner)
    combined: dict[tuple, list[tuple[int, float, float]]] = {}
    joins = {k: list(r.combined) for k, r in enumerate(reshards)}
    for n, ((p, (kind, group, times, charged, buffer)), g) in enumerate(
            zip(pending, sets, strict=True)):
        key = (kind, group, times, g if g >= 0 else -1 - n)
        combined.setdefault(key, []).append((p.reshard, buffer, charged))
        if g >= 0:
            joins[p.reshard][p.position] = list(combined).index(key)
    for k, j in joins.items():
        if tuple(j) != reshards[k].combined:
            reshards[k] = dataclasses.replace(reshards[k], combined=tuple(j))
    return combined


def reassociated_adds(graph: Graph) -> frozenset[int]:
    """Ids of the adds of two values that nothing else reads: where both summands are
    reduced alike, a backend that reassociates (:attr:`shardc.cost.combine.Combiner.
    reassociates`) runs one reduction of their sum, which :func:`assemble` prices."""
    users = graph.consumers()
    returned = {v.id for v in graph.outputs}
    return frozenset(op.id for op in graph.ops if op.name in ("add", "add_any")
                     and len(op.inputs) == 2 and all(
                         not v.is_const and v.id not in returned
                         and len(users.get(v.id, ())) == 1 for v in op.inputs))


def _op_facts(graph: Graph) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Per op, what its :class:`OpPlan` records of the program alone: its types
    (``"f32[8,16],f32[16,32]->f32[8,32]"``), its inputs' ids (-1 a constant) and its
    outputs' (kept per graph: a frontier assembles dozens of plans of one program)."""
    return [(",".join(v.type_str() for v in op.inputs) + "->" +
             ",".join(v.type_str() for v in op.outputs),
             tuple(-1 if v.is_const else v.id for v in op.inputs),
             tuple(v.id for v in op.outputs)) for op in graph.ops]


def _body_of(graph: Graph, op) -> tuple[int, ...]:
    """The place (``Op.where``) of the innermost loop body or cond branch holding ``op``,
    () outside every one: XLA combines collectives within one computation, and each body
    and branch is one."""
    places = graph.memo("computation places", lambda g: frozenset(
        [o.where for o in g.ops if o.prim is SCAN_ENTER] +
        [(*o.where, o.params["branch"]) for o in g.ops if o.prim is COND_ENTER]))
    return next((op.where[:k] for k in range(len(op.where) - 1, 0, -1)
                 if op.where[:k] in places), ())


class _Recorder:
    """The conversions a plan's consumers read values through, recorded in program order
    (:class:`Reshard`), with what XLA's combiner needs to join their collectives."""

    def __init__(self, graph: Graph, cg: CostGraph, platform: str | None):
        self.cg, self.names, self.cluster = cg, cg.axis_names, cg.cluster
        self.scale = dict(graph.memo("alpha_scales", alpha_scales))  # a copy: updated
        self.reshards: list[Reshard] = []
        self.comm = self.wire = 0.0
        self.done: dict[tuple, int] = {}  # (value, src, dst) -> its reshard
        self.summands = graph.memo("reassociated_adds", reassociated_adds)
        self.summed: dict[tuple, int] = {}  # (add, src, dst) -> the reshard its summands share
        self.folded = graph.constants()  # read partial, one is made so (as in the cost graph)
        self.combiner = combiner_for(platform)
        self.uses: list[Use] = []  # per reshard, where it sits (for XLA's combiner)
        self.via: dict[tuple[int, int], int] = {}  # (consumer, value) -> the reshard it reads
        #: the collectives a combiner may join, with (kind, group, runs, seconds charged)
        self.pending: list[tuple[Pending, tuple]] = []

    def record(self, value, consumer, src, dst, times: int = 1, reduced: bool = False
               ) -> float:
        """Price converting ``value`` from ``src`` to ``dst`` for ``consumer``, ``times``
        per call (every iteration of a loop body). A constant read partial is free, as in
        the cost graph. The same conversion of the same value for another consumer is
        free: XLA's CSE merges the identical collectives (a parameter stored sharded and
        gathered for the forward and the backward dot compiles to one all-gather).
        ``reduced``: the consumer's results are all reduced where made (settled), so one
        it reads made partial here is read apart (:class:`shardc.cost.combiner.Use`)."""
        conv = self.cg.conversion_of(src, dst)
        if not conv.collectives or value.id in self.folded and dst.has_partial:
            return 0.0
        done, summed, via = self.done, self.summed, self.via
        if (value.id, src, dst) in done:
            via.setdefault((consumer, value.id), done[(value.id, src, dst)])
            return 0.0
        if consumer in self.summands and src.has_partial and all(
                c.kind in self.combiner.reassociates for c in conv.collectives):
            # the add's other summand reduced alike: XLA reduces the sum once
            if (consumer, src, dst) in summed:
                via[(consumer, value.id)] = summed[(consumer, src, dst)]
                return 0.0
            summed[(consumer, src, dst)] = len(self.reshards)
        done[(value.id, src, dst)] = via[(consumer, value.id)] = len(self.reshards)
        self.uses.append(Use(value.id, consumer, reduced and any(
            isinstance(d, Partial) and s != d for s, d in zip(src.sbps, dst.sbps))))
        share = self.scale.get(value.id, 1.0)
        t = conv.time(value.nbytes, share) * times
        self._pend(value, src, conv, times, share)
        self.comm += t
        self.wire += conv.wire_bytes(value.nbytes) * times
        self.reshards.append(Reshard(
            value.id, consumer, src, dst, t, conv.wire_bytes(value.nbytes) * times,
            tuple(f"{c.kind}@{'+'.join(self.names[a] for a in c.axes)}"
                  for c in conv.collectives),
            tuple(c.bytes_factor * value.nbytes * times for c in conv.collectives),
            (-1,) * len(conv.collectives)))
        return t

    def ring(self, op, strat) -> float:
        """Record the ring of ``op``'s strategy ``strat``, if any (:mod:`shardc.cost.ring`):
        its sends as a reshard of the value passed round, from and to the layout the
        strategy holds it in, charged what they add to the product. As the lowering runs
        it (:mod:`shardc.lower.local`): a loop's one ``collective-permute`` of ``n - 1``
        blocks, or ``n - 1`` unrolled ones, which rings passing the same value in the same
        layout share (XLA's CSE merges identical sends: the keys' blocks feed the scores
        and the recomputed scores). An unrolled ring's sends may each join another ring's
        round the same axis in the same loop body (XLA:GPU's permute combiner,
        :func:`_body_of`); they keep the price their ring charged."""
        ring = ring_cost(self.cluster, self.cg.graph, op, strat, self.cg.axis_sizes,
                         self.names)
        if ring is None:
            return 0.0
        value, nd = passed(self.cg.graph, op, strat)
        sends = 1 if looped(op, strat) else ring.steps
        key = ("ring", value.id, nd, ring.axis)
        shared = sends > 1 and key in self.done
        if sends > 1:
            self.done.setdefault(key, len(self.reshards))
        t = ring.products + (0.0 if shared else ring.sends)
        each = 0.0 if shared else ring.steps * ring.block_bytes * op.weight / sends
        if sends > 1 and not shared and self.combiner.family("collective-permute"):
            # each send round the axis may join another ring's (the same pairs), where
            # neither waits for the other: XLA:GPU's permute combiner
            key = ("collective-permute", (ring.axis,), None, _body_of(self.cg.graph, op),
                   op.weight)
            self.pending += [(Pending(len(self.reshards), k, key, ring.block_bytes),
                              ("collective-permute", None, op.weight, 0.0, 0.0))
                             for k in range(sends)]
        self.uses.append(Use(value.id, op.id, ring=self.done[key] if shared else
                             len(self.reshards)))
        self.comm += t
        self.wire += each * sends
        self.reshards.append(Reshard(
            value.id, op.id, nd, nd, t, each * sends,
            () if shared else (f"collective-permute@{self.names[ring.axis]}",) * sends,
            () if shared else (each,) * sends, () if shared else (-1,) * sends))
        return t

    def _pend(self, value, src: NdSbp, conv, times: int, share: float) -> None:
        """The collectives of the conversion being recorded that a combiner may join."""
        combiner = self.combiner
        for k, c in enumerate(conv.collectives):
            family = combiner.family(c.kind)
            if c.group is None or family is None:
                continue
            op = next((s.reduction for a in c.axes
                       if isinstance(s := src.sbps[a], Partial)), "sum")
            # a reduction combines with its own element type only; XLA:GPU's all-gather
            # combiner joins gathers of any (a GPT-2 step's f32 activations and s32
            # tokens compile to one all-gather of both)
            dtype = None if family == "all-gather" else value.type_str().split("[")[0]
            key = (family, c.axes, op, dtype, times)
            # the combiners' limit is on result bytes: a reduce-scatter's is its
            # buffer over the group, where it runs as one (not as an all-reduce);
            # NCCL prices the buffer
            buffer = c.buffer_factor * value.nbytes
            result = buffer / (c.group.ranks if c.kind == "reduce-scatter" and
                               not combiner.scatter_as_all_reduce else 1)
            self.pending.append((Pending(len(self.reshards), k, key, result),
                                 (c.kind, c.group, times,
                                  c.seconds(value.nbytes, self.cluster.collective_model,
                                            share) * times, buffer)))


def assemble(graph: Graph, cg: CostGraph, choice: Sequence[int], ties: Sequence[tuple[int, int]],
             solver: dict, remat: tuple[int, ...] = (), segments: int = 0,
             platform: str | None = None) -> Plan:
    """Build the Plan from per-node choices of a cost graph ``cg`` (solve.problem.CostGraph)
    of ``graph``, a program that recomputes its segments ``remat`` of ``segments``, compiled
    for ``platform`` (whose combiners join collectives: :func:`shardc.cost.combiner.
    combiner_for`; XLA:CPU's when None)."""
    sizes, names, cluster = cg.axis_sizes, cg.axis_names, cg.cluster
    rec = _Recorder(graph, cg, platform)
    values: dict[int, NdSbp] = {v.id: cg.choices[k][choice[k]]
                                for k, v in enumerate(graph.inputs)}
    settled = {vid: cg.choices[w][choice[w]] for vid, w in cg.settle.items()}
    ops, compute = _walk(graph, cg, choice, rec, values, settled)
    outputs = _outputs(graph, cg, ties, rec, values, settled)
    combined = _joined(graph, rec.uses, rec.via, rec.pending, rec.combiner, rec.reshards)
    reshards, ops, comm = _combine(rec.reshards, ops, rec.comm, combined,
                                   cluster.collective_model)
    peak = float(np.max(memory_profile(cg, choice)))  # the profile budgets are held to
    moved = [float(input_cost(cg, k, [values[v.id]])[0]) for k, v in enumerate(graph.inputs)]
    feed = sum(t for k, t in enumerate(moved) if k not in cg.offloaded)
    host = sum(t for k, t in enumerate(moved) if k in cg.offloaded)
    return Plan(mesh_axes=tuple(zip(names, sizes)), cluster=cluster,
                inputs=tuple(values[v.id] for v in graph.inputs), outputs=tuple(outputs),
                values=values, ops=tuple(ops), reshards=tuple(reshards),
                predicted=Predicted(comm, compute, rec.wire, peak, feed, host),
                solver=dict(solver), fingerprint=graph.memo("fingerprint", fingerprint),
                input_ranks=tuple(v.ndim for v in graph.inputs),
                output_ranks=tuple(v.ndim for v in graph.outputs), settled=settled,
                input_ids=tuple(v.id for v in graph.inputs),
                input_types=tuple(v.type_str() for v in graph.inputs),
                output_types=tuple(v.type_str() for v in graph.outputs), remat=tuple(remat),
                segments=segments, offloaded=tuple(sorted(cg.offloaded)),
                offloaded_outputs=tuple(sorted(j for j, i in ties if i in cg.offloaded)))


def _walk(graph: Graph, cg: CostGraph, choice: Sequence[int], rec: _Recorder,
          values: dict[int, NdSbp], settled: dict[int, NdSbp]) -> tuple[list[OpPlan], float]:
    """The ops' plans in program order (and their compute time), recording each read's
    conversion, each settling and the loops' carries and predicates; fills ``values``."""
    n_in, record = len(graph.inputs), rec.record
    runs, settling = graph.runs(), settle_runs(graph)
    reduced_ys = ys_exits(graph)
    rec.scale.update(ys_shares(graph, reduced_ys))  # the after-loop all-reduces, combined
    ops, compute = [], 0.0

    def settle(v) -> None:
        if v.id in settled:
            record(v, None, values[v.id], settled[v.id], settling.get(v.id, 1))

    def read(v) -> NdSbp:
        return settled.get(v.id, values[v.id])

    for v in graph.inputs:
        settle(v)
    facts = graph.memo("op_plan_facts", _op_facts)
    for j, op in enumerate(graph.ops):
        strat = cg.choices[n_in + j][choice[n_in + j]]
        op_comm = 0.0
        reduced = bool(op.outputs) and all(v.id in settled for v in op.outputs)
        for k, v in reads(op):
            if not v.is_const:
                op_comm += record(v, op.id, values[v.id] if carry_exit(op) else read(v),
                                  strat.ins[k], read_runs(runs, v, op), reduced)
        if op.id in reduced_ys and (held := unreduced_ys(strat)) is not None:
            op_comm += record(op.outputs[0], op.id, held, strat.outs[0])  # after the loop
        for v, nd in zip(op.outputs, strat.outs):
            values[v.id] = nd
            settle(v)
        types, ins, outs = facts[j]
        op_comm += rec.ring(op, strat)
        seconds = compute_seconds(cg.cluster, graph, op, strat.flops) * op.weight
        ops.append(OpPlan(op.id, op.name, types, strat.ins, strat.outs, seconds, op_comm,
                          ins, outs, op.source, op.where))
        compute += seconds
    for enter, v in loop_ties(graph):  # a scan's carry back to its carried layout
        record(v, enter.id, read(v), values[enter.outputs[0].id], runs.get(v.id, 1))
    for v in loop_tests(graph):  # a while's predicate, read replicated every iteration
        record(v, None, read(v), NdSbp((B,) * len(cg.axis_sizes)), runs.get(v.id, 1))
    return ops, compute


def _outputs(graph: Graph, cg: CostGraph, ties, rec: _Recorder, values: dict[int, NdSbp],
             settled: dict[int, NdSbp]) -> list[NdSbp]:
    """Each result's layout (fixed, its tied input's, else its own reduced), recording
    its conversion there."""
    tied = dict(ties)
    outputs = []
    for j, v in enumerate(graph.outputs):
        if v.is_const:
            src = NdSbp((B,) * len(cg.axis_sizes))
        elif j in tied and graph.inputs[tied[j]].id == v.id:
            src = values[v.id]  # the state passed through unchanged
        else:
            src = settled.get(v.id, values[v.id])
        if j in cg.fixed.outputs:
            dst = cg.fixed.outputs[j]
        else:
            dst = values[graph.inputs[tied[j]].id] if j in tied else unreduced(src)
        if not v.is_const:
            rec.record(v, -1 - j, src, dst)
        outputs.append(dst)
    return outputs
