"""What a pipelined step costs, priced from plans the planner already makes.

A pipeline over mesh axis ``a`` (S = size(a) stages, M micro-batches, V virtual stages per
device) runs the program's layer scans (:mod:`shardc.pipeline.scans`) in stages, each
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
share ``(S - 1) / (M V + S - 1)`` is the idle part). A scan that recomputes the forward
for the backward (a :func:`shardc.pipeline.layers` stack's) does not run under GPipe, which
keeps the forward's residuals; the circular schedule recomputes each chunk. The
conversions of the layers' parameters and gradients inside the scans, and the stacked
parameters' updates, run once per step: a stage's gradient reductions span its own
devices only, never the stage axis. Where the stage plan splits the carry's batch dim over
other axes, the runtime splits each micro-batch over them and holds the stage's weights
whole there (data parallelism within the stage): its weights' conversions are none, and
its gradients are summed over those axes by one all-reduce of the stage's weights' bytes
after the backward loop, which is priced in place of the stage plan's conversions.

Each tick every stage sends the next its micro-batch's carry: one collective-permute over
axis ``a`` of ``1 / M`` of the carry's per-device bytes at the stage plan's layout, ``M V +
S - 1`` ticks forward and as many backward (the transposed permute). After the forward loop
one all-reduce over ``a`` of the whole carry hands the last stage's finished micro-batches to
every stage; after the backward loop one more sums the stack input's cotangent over ``a``
(:mod:`shardc.pipeline.runtime` states what it compiles to). The permutes are priced on
the link ``a`` crosses (:meth:`shardc.cost.cluster.Cluster.send_seconds`: a pair on two
nodes sends over one NIC), the all-reduces as any collective over ``a``. Communication adds
to compute, as the planner prices any plan.

1F1B (a stack ending in its loss, :func:`shardc.pipeline.stack.layers_loss`) runs ``M +
2S - 2`` ticks of a permute each way, each tick on every stage a micro-batch's forward,
backward and loss (:func:`shardc.pipeline.parts.head_ops`, on a stage's devices: ``S /
M`` of the whole plan's loss compute), as :mod:`shardc.pipeline.onefb` compiles it; it
keeps the finished micro-batches on the last stage (no all-reduce of them) and ends with
one all-reduce of the loss's weights' gradient over the stage axis and the batch's, in
place of the whole plan's conversions of the loss's values.

Per-stage peak memory, as the runtime holds it: the stacked state (parameters and
optimizer moments) at 1 / S, its updated copy (a result) alike, the rest of the state as
the whole plan holds it, what the ops outside the layer part hold at the whole plan's
layouts (their results, and the peak of the values they make and read among themselves:
the head's logits, the rest's gradients; :func:`shardc.pipeline.parts.own_bytes`), the
stage's weights at work, and what the backward reads. The weights at work, as XLA:CPU's
buffer assignment holds them (``memory_analysis()`` and its buffer dump of each schedule,
data and tensor parallelism inside the stages): in a training step one buffer of the
stage's weights' bytes (1 / S of the stack at the stage plan's layout: the gradient
summed over the loop; for the circular schedule the weights laid out again in its order,
the summed gradient then landing in the updated copy's buffer), and the weights the loop
slices out of the stack with their gradient: one layer's for GPipe and 1F1B; for the
circular schedule a chunk's (``L / (S V)`` layers) and its gradient, and a layer's
besides where a chunk holds several. What the backward reads: autodiff's residuals of ``T
= M V + S - 1`` steps of ``L / (S V)`` layers on a micro-batch, ``T / (S V M)`` of the
stage plan's saved activations (GPipe); for 1F1B, those of ``min(M, 2S - 1)``
micro-batches (:mod:`shardc.pipeline.onefb`); for the circular schedule, whose chunks are
recomputed in the backward, ``T`` chunk inputs (``T / M`` carries) and one chunk's
residuals instead. Besides, the micro-batched input and the finished micro-batches, a
carry each (and for the circular schedule the buffer of micro-batches coming round, a
third). The stored stack is read where it is held (the layer dim split over the stage
axis): no gathered copy of it (``tests/test_pipeline_plan.py``,
``tests/test_pipeline_tensor.py`` and ``tests/test_pipeline_onefb.py`` check the total
against ``memory_analysis()``).

References:
  Huang et al., "GPipe" (NeurIPS 2019): M + S - 1 ticks per pass, the bubble.
  Narayanan et al., "Efficient large-scale language model training on GPU clusters using
    Megatron-LM" (SC 2021) §2.2: 1F1B holds at most S micro-batches per stage; the
    interleaved schedule runs M V + S - 1 ticks of 1 / V the work, one point-to-point
    transfer per tick.
  MaxText ``layers/pipeline.py``: M V + S - 1 iterations.
  :mod:`shardc.pipeline.runtime`: one ``ppermute`` per step each way, the closing
    all-reduces, what a stage holds for the backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardc.cost.cluster import Cluster
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.pipeline.onefb import in_flight
from shardc.pipeline.onefb import ticks as onefb_ticks
from shardc.pipeline.parts import Parts
from shardc.pipeline.schedule import Pipeline
from shardc.plan.record import Plan

__all__ = ["combined_sets", "PipelinePrice", "price"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePrice:
    """A pipelined step's prediction (seconds per step, bytes per device).

    ``rest``: the parts over the whole mesh; ``layers``: the stages' ticks, the
    ``bubble`` among them; ``transfers``: the sends between stages, ``permutes``
    collective-permutes over the stage axis per step (forward and backward), of
    ``permute_bytes`` each per device; ``gathers``: the closing all-reduces over the stage
    axis, ``reduces`` of ``reduce_bytes`` each per device (the finished micro-batches,
    and in a training step the stack input's cotangent); ``once``: the stages'
    once-per-step part, ``grads`` among it: the all-reduce of a stage's weight gradients
    over ``grad_spans`` (the axes splitting each micro-batch, where the stage holds its
    weights whole), ``grad_bytes`` per device (``grad_parts``: per stacked parameter, in
    the order of the program's inputs); ``rest_comm``: the communication of
    ``rest``; ``sample_comm``: the seconds of the stages' conversions of their
    activations among ``layers`` (tensor parallelism inside a stage, per micro-batch and
    tick); ``peak_memory``: a stage's peak; ``mesh``: the view of the devices it runs
    on (axis names and sizes; the stage axis is one of them); ``tensor_spans``: the axes
    a stage splits its weights over (tensor parallelism inside it); ``stage_plan``: the
    plan it was priced from (the layouts inside a stage); ``relayout``: the circular
    schedule's all-to-alls over the stage axis laying the stacked parameters out as its
    chunks run (and their gradients back), one per parameter each way, ``relayout_bytes``
    per device each."""

    pipeline: Pipeline
    step_time: float
    rest: float
    layers: float
    bubble: float
    transfers: float
    gathers: float
    once: float
    permutes: int
    permute_bytes: float
    reduces: int
    reduce_bytes: float
    peak_memory: float
    mesh: tuple[tuple[str, int], ...] = ()
    grads: float = 0.0
    grad_bytes: float = 0.0
    grad_parts: tuple[float, ...] = ()
    rest_comm: float = 0.0
    ticks: int = 0
    batch_spans: tuple[tuple[str, int], ...] = ()
    loss_reduce: float = 0.0
    loss_bytes: float = 0.0
    loss_spans: tuple[tuple[str, int], ...] = ()
    tensor_spans: tuple[tuple[str, int], ...] = ()
    sample_comm: float = 0.0
    stage_plan: Plan | None = field(default=None, repr=False, compare=False)
    relayout: float = 0.0
    relayout_bytes: tuple[float, ...] = ()

    @property
    def grad_spans(self) -> tuple[tuple[str, int], ...]:
        """The axes the stages' gradient all-reduce spans: the batch's, where there is
        one."""
        return self.batch_spans if self.grads else ()

    @property
    def comm(self) -> float:
        """Seconds of the step's communication: the sends, the closing all-reduces, the
        stages' gradient all-reduce and conversions of activations, and the rest's
        conversions."""
        return self.transfers + self.gathers + self.grads + self.rest_comm + \
            self.loss_reduce + self.sample_comm + self.relayout

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


def combined_sets(parts: Sequence[float], limit: float) -> list[float]:
    """The bytes of each combined all-reduce XLA makes of the stage's weight gradients
    (``parts``, one per stacked parameter, in the program's order): each set takes the next
    gradients until one more would pass ``limit`` (the combiner's greedy rule,
    :func:`shardc.cost.combiner.combine_groups`; a gradient over the limit runs alone):
    one set where they all fit, none where none are listed (the design notes compare it
    with XLA:GPU's compile of the deep zoo Llama)."""
    sets: list[float] = []
    for b in parts:
        if sets and sets[-1] + b <= limit:
            sets[-1] += b
        else:
            sets.append(b)
    return sets


def price(pipeline: Pipeline, whole: Parts, stage: Parts, cluster: Cluster,
          mesh: tuple[tuple[str, int], ...] = (), stage_plan: Plan | None = None,
          combine_limit: float = math.inf) -> PipelinePrice:
    """The step of ``pipeline`` on ``mesh`` (priced by ``cluster``) from the whole plan's
    :class:`~shardc.pipeline.parts.Parts` and the stage plan's (``stage_plan``'s, see the
    module doc); ``combine_limit``: the bytes the backend's all-reduce combiner joins at
    most (the stage's weight gradients run as its sets, :func:`combined_sets`)."""
    s, m, v = pipeline.stages, pipeline.microbatches, pipeline.virtual
    ticks = m * v + s - 1
    onefb = pipeline.schedule == "1f1b" and stage.passes > 1  # forward only: GPipe's
    # GPipe and 1F1B keep their forward's residuals (no rerun); circular recomputes each
    # chunk
    sample = stage.sample_seconds(m, rerun=v > 1) / s
    work = (stage.compute - (stage.rerun if v == 1 else 0.0)) / s + sample
    layers = work * ticks / (m * v)
    bubble = layers - work
    spans = [(pipeline.axis, s)]
    loss_reduce = loss_bytes = 0.0
    loss_spans: tuple[tuple[str, int], ...] = ()
    rest = whole.step - whole.layers
    if onefb:
        # every tick every stage runs a forward, a backward and the loss of a micro-batch
        # on its devices (S / M of the whole plan's loss, which the rest ran once); the
        # loss's gradient is summed inside the pipeline, not by the rest's conversions
        ticks = onefb_ticks(pipeline)
        layers = work * ticks / m
        bubble = layers - work
        layers += whole.head * (ticks * s / m - 1)
        rest -= whole.head_comm
        reduces = int(stage.cotangent)
        loss_spans = ((pipeline.axis, s), *stage.batch_spans)
        loss_bytes = stage.head_weights + 4.0  # the gradient and the float32 loss
        loss_reduce = cluster.collective_seconds("all-reduce", loss_spans, loss_bytes)
    else:
        reduces = 1 + (stage.passes > 1 and stage.cotangent)
    sample *= ticks / (m * v)  # the share of the stages' ticks that is their conversions
    permutes = stage.passes * ticks
    transfers = permutes * cluster.send_seconds(spans, stage.carry / m)
    gathers = reduces * cluster.collective_seconds("all-reduce", spans, stage.carry)
    grads = grad_bytes = 0.0
    grad_parts: tuple[float, ...] = ()
    if stage.batch_spans and stage.passes > 1:
        # the stage holds its weights whole on the axes splitting each micro-batch, so its
        # gradients are summed over them once, after the backward loop (runtime doc), in
        # place of the stage plan's conversions of the stacked values
        grad_bytes = stage.weights / s
        grad_parts = tuple(b / s for b in stage.param_bytes)
        sets = combined_sets(grad_parts, combine_limit)
        grads = sum(cluster.collective_seconds("all-reduce", stage.batch_spans, b)
                    for b in (sets if len(sets) > 1 else [grad_bytes]))
        once = stage.update / s + grads
    else:
        once = stage.once / s
    relayout, relaid = 0.0, ()
    if v > 1:
        # the stored stack's layer dim is split over the stages in blocks, and the circular
        # schedule runs chunk v S + s on stage s: each step lays every stacked parameter out
        # again over the stage axis, and its gradient back (one all-to-all each way)
        relaid = tuple(b / s for b in stage.param_bytes) * stage.passes
        relayout = sum(cluster.collective_seconds("all-to-all", spans, b) for b in relaid)
    peak = _peak(pipeline, whole, stage, ticks, onefb)
    return PipelinePrice(
        pipeline=pipeline,
        step_time=rest + layers + transfers + gathers + once + loss_reduce + relayout,
        rest=rest, layers=layers, bubble=bubble, transfers=transfers, gathers=gathers,
        once=once, permutes=permutes, permute_bytes=stage.carry / m, reduces=reduces,
        reduce_bytes=stage.carry, peak_memory=peak, mesh=mesh, grads=grads,
        grad_bytes=grad_bytes, grad_parts=grad_parts, rest_comm=whole.rest_comm,
        ticks=ticks, batch_spans=stage.batch_spans, loss_reduce=loss_reduce,
        loss_bytes=loss_bytes, loss_spans=loss_spans, tensor_spans=stage.tensor_spans,
        sample_comm=sample, stage_plan=stage_plan, relayout=relayout, relayout_bytes=relaid)


def _peak(pipeline: Pipeline, whole: Parts, stage: Parts, ticks: int, onefb: bool) -> float:
    """A stage's peak bytes per device: its share of the stacked state, the rest's state,
    what the step works with and the activations held between passes."""
    s, m, v = pipeline.stages, pipeline.microbatches, pipeline.virtual
    # what the rest holds, the stacked state's updated copy, and the stage's weights at
    # work: in a training step a buffer of the stage's weights' bytes (the gradient summed
    # over the loop; for the circular schedule the weights laid out in its order, the
    # summed gradient landing in the updated copy's buffer), and the layer's weights the
    # loop slices out, with its gradient; the circular schedule slices out a chunk's
    # weights, and forms their gradient, before a layer's (XLA:CPU's buffer assignment)
    training = stage.passes > 1
    if v > 1:
        chunk = stage.weights / (s * v)
        at_work = stage.weights / s + chunk * (1 + training) + \
            (stage.layer if chunk > stage.layer else 0.0)
    else:
        at_work = stage.weights / s * training + stage.layer
    # the buffers of the stacked state's updated copy beyond the parameters' (the optimizer
    # moments': the gradient summed over the loop lands in the parameters') hold those
    # weights at work, which die before the update writes them
    working = whole.own + stage.results / s + \
        max(0.0, at_work - max(0.0, stage.results - stage.weights) / s)
    if v > 1:  # chunk inputs kept, one chunk recomputed at a time; the returning buffer
        held = stage.carry * ticks / m + stage.saved / (s * v * m) + 3 * stage.carry
    elif onefb:  # the residuals of the micro-batches in flight; the input, its cotangent
        held = stage.saved * in_flight(pipeline) / (s * m) + 2 * stage.carry
    else:
        held = stage.saved * ticks / (s * m) + 2 * stage.carry
    return stage.state / s + whole.other_state + working + held
