"""The conversions a pipelined program runs, as a plan's reshards: what ``plan.verify()``
compares with the compiled collectives and what the pipelined plan's communication is.

A plan that runs a pipeline (:func:`shardc.pipeline.choose.adopt`) is planned as the
unpipelined program with its layer state pinned as the stages hold it; its lowering runs
the layer stacks as :func:`~shardc.pipeline.runtime.pipeline_scan`. What that program
converts:

* the plan's conversions outside the layer part (:func:`shardc.pipeline.parts.rest_reshards`);
* at the stacks' edges, the carry into the forward pipeline and the carry's cotangent into
  the backward one, converted from the layout the plan reads them in to the pipeline's
  (the batch dim split over the axes each micro-batch is split over, whole over the
  others: :mod:`shardc.pipeline.lowering`), and the pipelines' results, from the
  pipeline's layout to the one the plan makes them in (where the plan's readers convert
  them further, from the pipeline's layout straight to theirs, as the lowering reads
  them). A stack's recomputed forward (:attr:`~shardc.pipeline.scans.Layers.rerun`) does
  not run: the backward pipeline keeps its forward's residuals;
* the pipeline's own: the sends each way (one collective-permute per pass, run every
  tick), the closing all-reduces over the stage axis (for 1F1B, also the loss's and its
  weights' gradient, over the stage axis and the batch's), the circular schedule's
  all-to-alls laying the stacked parameters out by chunk (and their gradients back), and
  the stages' gradient
  all-reduce over the axes splitting each micro-batch, which XLA's all-reduce combiner
  joins with the rest's over the same axes where there is one (the same tuple
  collective: charged what it adds to it), charged to the forward scan's first carry.

References:
  :mod:`shardc.pipeline.runtime` (what one step compiles to); :func:`shardc.plan.assemble.assemble`
  (a reshard per conversion, as recorded here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from shardc.cost import comm
from shardc.cost.combine import XLA_CPU, Combiner
from shardc.cost.comm import conversion
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Split
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT
from shardc.pipeline.cost import PipelinePrice, combined_sets
from shardc.pipeline.parts import head_ops, parts, rest_reshards
from shardc.pipeline.scans import Layers
from shardc.pipeline.schedule import Pipeline
from shardc.plan.record import Plan, Reshard

__all__ = ["pipelined_reshards"]


def _converted(plan: Plan, value, consumer: int | None, src: NdSbp, dst: NdSbp
               ) -> Reshard | None:
    """The reshard of ``value`` converted from ``src`` to ``dst`` (None: no collective), as
    :func:`shardc.plan.assemble.assemble` records one."""
    conv = conversion(src, dst, plan.axis_sizes, plan.axis_names, plan.cluster)
    if not conv.collectives:
        return None
    n = float(value.nbytes)
    return Reshard(value.id, consumer, src, dst, conv.time(n), conv.wire_bytes(n),
                   tuple(f"{c.kind}@{'+'.join(plan.axis_names[a] for a in c.axes)}"
                         for c in conv.collectives),
                   tuple(c.bytes_factor * n for c in conv.collectives),
                   (-1,) * len(conv.collectives))


def _edges(plan: Plan, graph: Graph, layers: Layers, at: NdSbp, rest: list[Reshard],
           head: frozenset[int], loss: set[int]) -> list[Reshard]:
    """``rest`` with the stacks' edges converted to and from the pipeline's layout ``at``
    (module doc): the carry enters of the forward and backward scans (but a cotangent a
    stack's loss makes, ``loss``), and their carry exits (their readers' conversions
    re-priced from ``at``; but an exit only a stack's loss reads, of the ops ``head``):
    the pipelined program runs a stack's loss on what the pipeline gives it."""
    run = (layers.scans[0], layers.scans[-1]) if len(layers.scans) > 1 else layers.scans[:1]
    enters = [op for op in graph.ops if op.prim is SCAN_ENTER and op.where in run
              and op.params.get("kind") == "carry"]
    exits = {op.outputs[0].id: op.outputs[0] for op in graph.ops
             if op.prim is SCAN_EXIT and op.where in run and op.params.get("kind") == "carry"}
    if head:
        outer = {v.id for op in graph.ops if op.id not in head for v in op.inputs} | \
            {v.id for v in graph.outputs}
        exits = {i: v for i, v in exits.items() if i in outer}
    out = []
    for r in rest:  # a pipeline's result is read from the pipeline's layout
        if r.value in exits:
            r = _converted(plan, exits[r.value], r.consumer, at, r.dst)
        if r is not None:
            out.append(r)
    read = {r.value for r in rest}
    for v in exits.values():
        if v.id not in read:
            out += filter(None, [_converted(plan, v, None, at, plan.read_as(v.id))])
    for op in enters:
        v = op.inputs[0]
        if not v.is_const and v.id not in loss:
            out += filter(None, [_converted(plan, v, op.id, plan.read_as(v.id), at)])
    return out


def _layout(plan: Plan, best: PipelinePrice) -> NdSbp:
    """The pipeline's layout of a carry: its batch dim split over the mesh axes each
    micro-batch is split over inside the stages (``best.batch_spans``), whole over the
    others."""
    split = {name for name, _ in best.batch_spans}
    return NdSbp(tuple(Split(0) if name in split else B for name in plan.axis_names))


def pipelined_reshards(plan: Plan, graph: Graph, layers: Layers, pipeline: Pipeline,
                       best: PipelinePrice, combiner: Combiner = XLA_CPU) -> list[Reshard]:
    """The conversions the program of ``plan`` (of ``graph``) runs with ``pipeline``,
    priced ``best`` (module doc), on the backend whose collectives ``combiner`` joins."""
    p = pipeline
    carry = layers.carry[0]
    at = _layout(plan, best)
    head = head_ops(graph, layers)
    loss = {v.id for op in graph.ops if op.id in head for v in op.outputs}
    rest = rest_reshards(plan, graph, layers)
    if best.loss_reduce:  # 1F1B: the loss and its gradients are summed inside the pipeline
        rest = [r for r in rest if r.value not in loss and r.consumer not in head]
    out = _edges(plan, graph, layers, at, rest, head, loss)

    def one(kind: str, spans, nbytes: float, seconds: float, runs: int = 1,
            group: int = -1) -> Reshard:
        axes = "+".join(n for n, _ in spans)
        wire = comm.wire_bytes(kind, math.prod(k for _, k in spans), nbytes) * runs
        return Reshard(carry, None, at, at, seconds, wire, (f"{kind}@{axes}",), (wire,),
                       (group,))

    stage = ((p.axis, p.stages),)
    passes = best.permutes // best.ticks
    out += [one("collective-permute", stage, best.permute_bytes, best.transfers / passes,
                best.ticks) for _ in range(passes)]
    out += [one("all-reduce", stage, best.reduce_bytes, best.gathers / best.reduces)
            for _ in range(best.reduces)]
    if best.loss_reduce:  # 1F1B: the loss and its weights' gradient, from the last stage
        out.append(one("all-reduce", best.loss_spans, best.loss_bytes, best.loss_reduce))
    out += [one("all-to-all", stage, b, plan.cluster.collective_seconds("all-to-all", stage, b))
            for b in best.relayout_bytes]
    out += _inside(best, layers, graph)
    if best.grads:
        name = "all-reduce@" + "+".join(n for n, _ in best.grad_spans)
        sets = combined_sets(best.grad_parts, combiner.threshold_bytes)
        if len(sets) > 1:  # over the combiner's limit: its sets, each run on its own
            out += [one("all-reduce", best.grad_spans, b, plan.cluster.collective_seconds(
                "all-reduce", best.grad_spans, b)) for b in sets]
            return out
        out, group = _joined(out, name, best.grad_bytes, combiner.threshold_bytes,
                             _grad_wire(best))
        out.append(one("all-reduce", best.grad_spans, best.grad_bytes,
                       _marginal(plan, out, name, group, best), group=group))
    return out


def _inside(best: PipelinePrice, layers: Layers, graph: Graph) -> list[Reshard]:
    """The stages' conversions of their activations, from the stage plan's (module doc):
    each of its reshards run ``T / (M S V)`` as often per step (``T`` ticks of ``K`` of
    its ``L`` layers, on a micro-batch), seconds as :meth:`Parts.sample_runs` prices them,
    spread the same way, each on its own (in the loop, XLA combines none of them)."""
    plan, p = best.stage_plan, best.pipeline
    if plan is None or not best.sample_comm:
        return []
    share = best.ticks / (p.microbatches * p.virtual * p.stages)
    runs = parts(plan, graph, layers).sample_runs(p.microbatches, rerun=p.virtual > 1)
    return [dataclasses.replace(r, time=t * share, wire_bytes=r.wire_bytes * share,
                                collective_bytes=tuple(b * share for b in r.collective_bytes),
                                combined=(-1,) * len(r.collectives))
            for r, t in runs]


def _marginal(plan: Plan, out: list[Reshard], name: str, group: int,
              best: PipelinePrice) -> float:
    """Seconds the stages' gradient all-reduce adds to the combined all-reduce it joins
    (``group``; -1: it runs alone, priced ``best.grads``): one collective of every
    member's buffer, less what the members were charged (:func:`shardc.plan.assemble.assemble`
    prices a combined collective so, one latency for the whole buffer)."""
    if group < 0:
        return best.grads
    members = list(_members(out, name, group))
    wire = sum(b for _, b in members)
    charged = sum(r.time * b / sum(r.collective_bytes) for r, b in members)
    whole = plan.cluster.collective_seconds("all-reduce", best.grad_spans,
                                            wire / _grad_wire(best) + best.grad_bytes)
    return max(0.0, whole - charged)


def _members(out: list[Reshard], name: str, group: int) -> Iterator[tuple[Reshard, float]]:
    """Each ``name`` collective of ``out`` in combined collective ``group``: its reshard
    and its wire bytes."""
    for r in out:
        for c, g, b in zip(r.collectives, r.combined or (), r.collective_bytes):
            if c == name and g == group:
                yield r, b


def _grad_wire(best: PipelinePrice) -> float:
    """Wire bytes per buffer byte of the stages' gradient all-reduce over ``grad_spans``."""
    return comm.wire_bytes("all-reduce", math.prod(k for _, k in best.grad_spans), 1.0)


def _joined(out: list[Reshard], name: str, nbytes: float, limit: float, factor: float
            ) -> tuple[list[Reshard], int]:
    """(``out``, the combined collective a new ``name`` collective of ``nbytes`` joins):
    the one an earlier ``name`` collective is in, else a new one that the first such
    collective joins too (XLA's all-reduce combiner joins all-reduces over the same
    devices), in either case only while the joined buffer stays within ``limit`` bytes (the
    combiner's threshold; ``factor``: a ``name`` collective's wire bytes per buffer byte);
    -1: it runs alone."""
    for r in out:
        for c, g in zip(r.collectives, r.combined or ()):
            if c == name and g >= 0:
                held = sum(b for _, b in _members(out, name, g)) / factor
                return out, (g if held + nbytes <= limit else -1)
    fresh = 1 + max((g for r in out for g in r.combined or ()), default=-1)
    for k, r in enumerate(out):
        if name in r.collectives:
            j = r.collectives.index(name)
            if r.collective_bytes[j] / factor + nbytes > limit:
                return out, -1
            joins = list(r.combined or (-1,) * len(r.collectives))
            joins[j] = fresh
            out = [*out[:k], dataclasses.replace(r, combined=tuple(joins)), *out[k + 1:]]
            return out, fresh
    return out, -1
