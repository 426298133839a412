"""The conversions a pipelined program runs, as a plan's reshards: what ``plan.verify()``
compares with the compiled collectives and what the pipelined plan's communication is.

A plan that runs a pipeline (:func:`shardc.pipeline.choose.adopt`) is planned as the
unpipelined program with its layer state pinned as the stages hold it; its lowering runs
the layer stacks as :func:`~shardc.pipeline.runtime.pipeline_scan`. What that program
converts:

* the plan's conversions outside the layer part (:func:`shardc.pipeline.cost.rest_reshards`);
* at the stacks' edges, the carry into the forward pipeline and the carry's cotangent into
  the backward one, converted from the layout the plan reads them in to the pipeline's
  (the batch dim split over the axes each micro-batch is split over, whole over the
  others: :mod:`shardc.pipeline.lowering`), and the pipelines' results, from the
  pipeline's layout to the one the plan makes them in (where the plan's readers convert
  them further, from the pipeline's layout straight to theirs, as the lowering reads
  them). A stack's recomputed forward (:attr:`~shardc.pipeline.scans.Layers.rerun`) does
  not run: the backward pipeline keeps its forward's residuals;
* the pipeline's own: the sends each way (one collective-permute per pass, run every
  tick), the closing all-reduces over the stage axis, and the stages' gradient
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

from shardc.cost import comm
from shardc.cost.comm import conversion
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Split
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT
from shardc.pipeline.cost import PipelinePrice, rest_reshards
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


def _edges(plan: Plan, graph: Graph, layers: Layers, at: NdSbp, rest: list[Reshard]
           ) -> list[Reshard]:
    """``rest`` with the stacks' edges converted to and from the pipeline's layout ``at``
    (module doc): the carry enters of the forward and backward scans, and their carry
    exits (their readers' conversions re-priced from ``at``)."""
    run = (layers.scans[0], layers.scans[-1]) if len(layers.scans) > 1 else layers.scans[:1]
    enters = [op for op in graph.ops if op.prim is SCAN_ENTER and op.where in run
              and op.params.get("kind") == "carry"]
    exits = {op.outputs[0].id: op.outputs[0] for op in graph.ops
             if op.prim is SCAN_EXIT and op.where in run and op.params.get("kind") == "carry"}
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
        if not v.is_const:
            out += filter(None, [_converted(plan, v, op.id, plan.read_as(v.id), at)])
    return out


def _layout(plan: Plan, layers: Layers, axis: str) -> NdSbp:
    """The pipeline's layout of a carry: its batch dim split over the mesh axes the plan's
    forward scan reads it split over (the stage axis aside), whole over the others."""
    nd = plan.values[layers.carry[0]]
    return NdSbp(tuple(Split(0) if isinstance(s, Split) and s.dim == 0 and name != axis
                       else B for name, s in zip(plan.axis_names, nd.sbps)))


def pipelined_reshards(plan: Plan, graph: Graph, layers: Layers, pipeline: Pipeline,
                       best: PipelinePrice) -> list[Reshard]:
    """The conversions the program of ``plan`` (of ``graph``) runs with ``pipeline``,
    priced ``best`` (module doc)."""
    p = pipeline
    carry = layers.carry[0]
    at = _layout(plan, layers, p.axis)
    out = _edges(plan, graph, layers, at, rest_reshards(plan, graph, layers))

    def one(kind: str, spans, nbytes: float, seconds: float, runs: int = 1,
            group: int = -1) -> Reshard:
        axes = "+".join(n for n, _ in spans)
        wire = comm.wire_bytes(kind, math.prod(k for _, k in spans), nbytes) * runs
        return Reshard(carry, None, at, at, seconds, wire, (f"{kind}@{axes}",), (wire,),
                       (group,))

    stage = ((p.axis, p.stages),)
    passes = best.permutes // (p.microbatches * p.virtual + p.stages - 1)
    runs = best.permutes // passes
    out += [one("collective-permute", stage, best.permute_bytes, best.transfers / passes,
                runs) for _ in range(passes)]
    out += [one("all-reduce", stage, best.reduce_bytes, best.gathers / best.reduces)
            for _ in range(best.reduces)]
    if best.grads:
        name = "all-reduce@" + "+".join(n for n, _ in best.grad_spans)
        out, group = _joined(out, name)
        out.append(one("all-reduce", best.grad_spans, best.grad_bytes,
                       _marginal(plan, out, name, group, best), group=group))
    return out


def _marginal(plan: Plan, out: list[Reshard], name: str, group: int,
              best: PipelinePrice) -> float:
    """Seconds the stages' gradient all-reduce adds to the combined all-reduce it joins
    (``group``; -1: it runs alone, priced ``best.grads``): one collective of every
    member's buffer, less what the members were charged (:func:`shardc.plan.assemble.assemble`
    prices a combined collective so, one latency for the whole buffer)."""
    if group < 0:
        return best.grads
    n = math.prod(k for _, k in best.grad_spans)
    factor = comm.wire_bytes("all-reduce", n, 1.0)
    wire = charged = 0.0
    for r in out:
        for c, g, b in zip(r.collectives, r.combined or (), r.collective_bytes):
            if c == name and g == group:
                wire += b
                charged += r.time * b / sum(r.collective_bytes)
    whole = plan.cluster.collective_seconds("all-reduce", best.grad_spans,
                                            wire / factor + best.grad_bytes)
    return max(0.0, whole - charged)


def _joined(out: list[Reshard], name: str) -> tuple[list[Reshard], int]:
    """(``out``, the combined collective a new ``name`` collective joins): the one an
    earlier ``name`` collective is in, else a new one that the first such collective
    joins too (XLA's all-reduce combiner joins all-reduces over the same devices; -1:
    there is none)."""
    for r in out:
        for c, g in zip(r.collectives, r.combined or ()):
            if c == name and g >= 0:
                return out, g
    fresh = 1 + max((g for r in out for g in r.combined or ()), default=-1)
    for k, r in enumerate(out):
        if name in r.collectives:
            joins = list(r.combined or (-1,) * len(r.collectives))
            joins[r.collectives.index(name)] = fresh
            out = [*out[:k], dataclasses.replace(r, combined=tuple(joins)), *out[k + 1:]]
            return out, fresh
    return out, -1
