"""What a pipelined step costs, priced from plans the planner already makes.

A pipeline over mesh axis ``a`` (S = size(a) stages, M micro-batches, V virtual stages per
device) runs the program's layer scans (:mod:`shardc.pipeline.layers`) in stages, each
stage on the devices of the other axes, and everything else (embedding, head, loss, the
other parameters' updates) over the whole mesh. Its step is priced from two plans of the
program:

* the *whole* plan (on the whole mesh, no pipeline) prices the rest: its step less its
  layer part;
* the *stage* plan (the same program on the mesh with axis ``a`` cut to one device)
  prices the stages: each holds L / S of its layers, so 1 / S of its layer part.

Of the stage plan's layer part, the layer scans' compute and their conversions of
per-sample values run once per micro-batch and tick: the stage does ``1 / (S M V)`` of them
per tick (each conversion re-priced at ``1 / M`` of its bytes, so its latency is paid per
micro-batch), over ``M V + S - 1`` ticks each way, forward and backward (GPipe; the bubble
share ``(S - 1) / (M V + S - 1)`` is the idle part). The conversions of the layers'
parameters and gradients inside the scans, and the stacked parameters' updates, run once
per step: a stage's gradient reductions span its own devices only, never the stage axis.

Every tick each stage sends the next its micro-batch's carry (the activation forward,
its gradient backward), and the buffer of micro-batches waiting to enter and leave the
pipeline rotates one slot across the stage axis (MaxText's ``shift`` and ``state_io``);
a circular schedule with more micro-batches than stages also moves the last stage's
output into the storage it waits in for its next round (``circ_storage``). Each is one
collective-permute over axis ``a`` of one micro-batch's carry (its per-device bytes at
the stage plan's layout, ``1 / M`` of the batch), priced on the link ``a`` crosses
(:meth:`shardc.cost.cluster.Cluster.send_seconds`: a pair on two nodes sends over one
NIC). Communication adds to compute, as the planner prices any plan.

Per-stage peak memory: the stacked state (parameters and optimizer moments) at 1 / S, the
rest of the state as the whole plan holds it, the activations the forward pass saves for
``in_flight`` micro-batches of L / S layers, and the whole plan's working memory besides
state and saved activations (the head's logits, the gradients being formed).

References:
  Huang et al., "GPipe" (NeurIPS 2019): M + S - 1 ticks per pass, the bubble.
  Narayanan et al., "Efficient large-scale language model training on GPU clusters using
    Megatron-LM" (SC 2021) §2.2: 1F1B holds at most S micro-batches per stage; the
    interleaved schedule runs M V + S - 1 ticks of 1 / V the work, one point-to-point
    transfer per tick.
  MaxText ``layers/pipeline.py`` (``get_new_loop_state``): per iteration one ``ppermute``
    over the stage axis each of ``shift``, the ``state_io`` slice and, circular with more
    micro-batches than stages, ``circ_storage``; M V + S - 1 iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.cluster import Cluster
from shardc.cost.comm import Conversion, conversion
from shardc.explain import fmt_bytes, fmt_time
from shardc.ir.graph import Graph
from shardc.pipeline.layers import Layers
from shardc.pipeline.schedule import Pipeline
from shardc.plan import Plan

__all__ = ["Parts", "PipelinePrice", "parts", "permutes_per_tick", "price"]


@dataclass(frozen=True, slots=True)
class Parts:
    """A plan's predicted step and memory, split by what a pipeline does with each part
    (seconds per step, bytes per device).

    ``layers``: the layer part's seconds (the layer scans' ops and the stacked values'
    updates, with the conversions they read); ``compute``: the layer scans' compute;
    ``sample``: per conversion of a per-sample value in the layer scans, ``(conversion,
    bytes, seconds charged)``; ``once``: the rest of the layer part. ``state`` /
    ``other_state``: the stacked / other state the plan holds; ``saved``: the forward
    scan's saved activations; ``carry``: the layer carry at the plan's layout;
    ``passes``: the layer scans' passes over the stages (2 for a training step, forward and
    backward; 1 for a forward-only program)."""

    step: float
    peak: float
    layers: float
    compute: float
    sample: tuple[tuple[Conversion, float, float], ...]
    once: float
    state: float
    other_state: float
    saved: float
    carry: float
    passes: int = 2

    def sample_seconds(self, microbatches: int) -> float:
        """The per-sample conversions' seconds when each runs once per micro-batch on
        ``1 / microbatches`` of its bytes."""
        total = 0.0
        for conv, nbytes, charged in self.sample:
            whole = conv.time(nbytes)
            total += charged if whole <= 0 else \
                charged * microbatches * conv.time(nbytes / microbatches) / whole
        return total


def parts(plan: Plan, graph: Graph, layers: Layers, ties=(), resident=()) -> Parts:
    """Split ``plan`` (of ``graph``) into :class:`Parts` by ``layers``."""
    sizes = plan.axis_sizes
    producer = {v.id: op.id for op in graph.ops for v in op.outputs}
    nbytes = {v.id: v.nbytes for v in graph.values()}
    compute = scans = outside = 0.0
    for op in plan.ops:
        if op.id in layers.ops:
            compute += op.compute_time
        elif op.id in layers.outside:
            outside += op.compute_time
    sample, once = [], outside
    for r in plan.reshards:
        owner = r.consumer if r.consumer is not None and r.consumer >= 0 \
            else producer.get(r.value)
        if owner is None:
            if r.value in layers.stacked:
                once += r.time
            continue
        if owner in layers.ops and r.value in layers.per_sample:
            conv = conversion(r.src, r.dst, sizes, plan.axis_names, plan.cluster)
            sample.append((conv, float(nbytes[r.value]), r.time))
            scans += r.time
        elif layers.layer_part(owner):
            once += r.time
    carried = {i for _, i in ties} | set(resident)
    state = other = 0.0
    for k, (v, nd) in enumerate(zip(graph.inputs, plan.inputs)):
        if k in carried:
            held = v.nbytes * nd.shard_fraction(sizes)
            if v.id in layers.stacked:
                state += held
            else:
                other += held
    saved = sum(nbytes[i] * plan.values[i].shard_fraction(sizes) for i in layers.saved)
    carry = sum(nbytes[i] * plan.values[i].shard_fraction(sizes) for i in layers.carry)
    return Parts(plan.predicted.step_time, plan.predicted.peak_memory,
                 compute + scans + once, compute, tuple(sample), once, state, other, saved,
                 carry, min(len(layers.scans), 2))


@dataclass(frozen=True, slots=True)
class PipelinePrice:
    """A pipelined step's prediction (seconds per step, bytes per device).

    ``rest``: the parts over the whole mesh; ``layers``: the stages' ticks, the
    ``bubble`` among them; ``transfers``: the point-to-point sends between stages,
    ``permutes`` collective-permutes over the stage axis per step (forward and backward),
    of ``permute_bytes`` each per device; ``once``: the stages' once-per-step part;
    ``peak_memory``: a stage's peak; ``mesh``: the view of the devices it runs on
    (axis names and sizes; the stage axis is one of them)."""

    pipeline: Pipeline
    step_time: float
    rest: float
    layers: float
    bubble: float
    transfers: float
    once: float
    permutes: int
    permute_bytes: float
    peak_memory: float
    mesh: tuple[tuple[str, int], ...] = ()

    def summary(self) -> str:
        """One line: the pipeline, its step, the bubble's share of the step, the sends and
        a stage's peak."""
        p = self.pipeline
        virtual = f" x {p.virtual} virtual" if p.virtual > 1 else ""
        return (f"{p.stages} stages over {p.axis}{virtual}, {p.microbatches} micro-batches, "
                f"{p.schedule}: {fmt_time(self.step_time)} per step (bubble "
                f"{fmt_time(self.bubble)}, {self.bubble / self.step_time:.0%}; "
                f"{self.permutes} sends of {fmt_bytes(self.permute_bytes)}: "
                f"{fmt_time(self.transfers)}); {fmt_bytes(self.peak_memory)} per device")


def price(pipeline: Pipeline, whole: Parts, stage: Parts, cluster: Cluster,
          mesh: tuple[tuple[str, int], ...] = ()) -> PipelinePrice:
    """The step of ``pipeline`` on ``mesh`` (priced by ``cluster``) from the whole plan's
    :class:`Parts` and the stage plan's (see the module doc)."""
    s, m, v = pipeline.stages, pipeline.microbatches, pipeline.virtual
    ticks = m * v + s - 1
    work = (stage.compute + stage.sample_seconds(m)) / s
    layers = work * ticks / (m * v)
    step_bytes = stage.carry / m
    permutes = stage.passes * ticks * permutes_per_tick(pipeline)
    transfers = permutes * cluster.send_seconds([(pipeline.axis, s)], step_bytes)
    once = stage.once / s
    rest = whole.step - whole.layers
    working = max(0.0, whole.peak - whole.state - whole.other_state - whole.saved)
    peak = (stage.state / s + whole.other_state + working
            + stage.saved * pipeline.in_flight / (m * s))
    return PipelinePrice(pipeline, rest + layers + transfers + once, rest, layers,
                         layers - work, transfers, once, permutes, step_bytes, peak, mesh)


def permutes_per_tick(pipeline: Pipeline) -> int:
    """Collective-permutes over the stage axis per tick and direction: the carry to the
    next stage, the input/output buffer's rotation, and for a circular schedule with more
    micro-batches than stages the move into the storage between rounds (module doc)."""
    storage = pipeline.schedule == "circular" and pipeline.microbatches > pipeline.stages
    return 3 if storage else 2
