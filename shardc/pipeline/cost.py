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

1F1B (a stack ending in its loss, :func:`shardc.pipeline.stack.layers_loss`) runs ``M + 2S
- 2`` ticks of a permute each way, each tick on every stage a micro-batch's forward,
backward and loss (:func:`head_ops`, on a stage's devices: ``S / M`` of the whole plan's
loss compute), as :mod:`shardc.pipeline.onefb` compiles it; it keeps the finished
micro-batches on the last stage (no all-reduce of them) and ends with one all-reduce of
the loss's weights' gradient over the stage axis and the batch's, in place of the whole
plan's conversions of the loss's values.

Per-stage peak memory, as the runtime holds it: the stacked state (parameters and
optimizer moments) at 1 / S, its updated copy (a result) alike, the rest of the state as
the whole plan holds it, what the ops outside the layer part hold at the whole plan's
layouts (their results, and the peak of the values they make and read among themselves:
the head's logits, the rest's gradients; :func:`own_bytes`), the stage's weights at work,
and what the backward reads. The weights at work, as XLA:CPU's buffer assignment holds
them (``memory_analysis()`` and its buffer dump of each schedule, data and tensor
parallelism inside the stages): in a training step one buffer of the stage's weights'
bytes (1 / S of the stack at the stage plan's layout: the gradient summed over the loop;
for the circular schedule the weights laid out again in its order, the summed gradient
then landing in the updated copy's buffer), and the weights the loop slices out of the
stack with their gradient: one layer's for GPipe and 1F1B; for the circular schedule a
chunk's (``L / (S V)`` layers) and its gradient, and a layer's besides where a chunk holds
several. What the backward reads: autodiff's residuals of ``T = M V + S - 1`` steps of ``L
/ (S V)`` layers on a micro-batch, ``T / (S V M)`` of the stage plan's saved activations
(GPipe); for 1F1B, those of ``min(M, 2S - 1)`` micro-batches (:mod:`shardc.pipeline.onefb`);
for the circular schedule, whose chunks are recomputed in the backward, ``T`` chunk inputs
(``T / M`` carries) and one chunk's residuals instead. Besides, the micro-batched input and
the finished micro-batches, a carry each (and for the circular schedule the buffer of
micro-batches coming round, a third). The stored stack is read where it is held (the layer
dim split over the stage axis): no gathered copy of it (``tests/test_pipeline_plan.py``,
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

from dataclasses import dataclass, field

from shardc.cost.cluster import Cluster
from shardc.cost.comm import Conversion, conversion
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.graph import Graph
from shardc.ir.sbp import Split, shared_dim_splits
from shardc.ir.trace import SCAN_EXIT
from shardc.pipeline.onefb import in_flight
from shardc.pipeline.onefb import ticks as onefb_ticks
from shardc.pipeline.scans import Layers
from shardc.pipeline.schedule import Pipeline
from shardc.plan.record import Plan, Reshard
from shardc.solve.lifetimes import fused_values
from shardc.solve.memory import host

__all__ = ["Parts", "PipelinePrice", "head_ops", "own_bytes", "parts", "price"]


@dataclass(frozen=True, slots=True)
class Parts:
    """A plan's predicted step and memory, split by what a pipeline does with each part
    (seconds per step, bytes per device).

    ``layers``: the layer part's seconds (the layer scans' ops and the stacked values' updates,
    with the conversions they read); ``compute``: the layer scans' compute; ``sample``: per
    conversion of a per-sample value in the layer scans, ``(conversion, bytes, the plan's
    reshard, whether a recomputed forward runs it, whether it spans an axis of
    ``batch_spans``)`` (a stage plan's tensor parallelism: its all-reduces of activations);
    ``once``: the rest of the layer part. ``state`` / ``other_state``: the stacked / other state
    the plan holds; ``saved``: the forward scan's saved activations; ``carry``: the layer carry
    at the plan's layout; ``passes``: the layer scans' passes over the stages (2 for a training
    step, forward and backward; 1 for a forward-only program); ``rerun``: the compute of the
    scans that recompute the forward for the backward (:attr:`Layers.rerun`); ``rest_comm``: the
    seconds of the conversions outside the layer part (:func:`rest_reshards`); ``update``: the
    compute of the stacked values' updates; ``batch_spans``: the mesh axes (and sizes) the plan
    splits the layer carry's batch dim over, where every carry agrees (what a pipeline's stages
    split each micro-batch over, :mod:`shardc.pipeline.lowering`); ``weights``: the bytes per
    device of the stacked parameters the layer scans read, at the plan's layout (a stage plan's:
    whole but over the axes its tensor parallelism splits them over,
    :func:`shardc.pipeline.choose.best_pipeline`); ``cotangent``: the backward scan's carry
    cotangent (the stack input's) is read (the input is differentiated: one more closing
    all-reduce); ``head``: the compute of the ops of the stacks' own calls outside their scans (a
    :func:`~shardc.pipeline.stack.layers_loss` stack's loss, forward and backward; next to
    nothing for a :func:`~shardc.pipeline.stack.layers` stack) and ``head_weights``: the bytes
    of the step's inputs they read that are not fed per step (the loss's weights, whole);
    ``head_comm``: the seconds of the conversions of the values those ops make or read (the
    loss's gradient summed over the batch's axes: 1F1B sums it inside the pipeline instead);
    ``tensor_spans``: the mesh axes (and sizes) the plan splits any of those stacked parameters
    over (in a stage plan, its tensor parallelism); ``results``: the stacked state's updated
    copy (the results tied to it) as the plan lays it out; ``param_bytes``: per stacked
    parameter the layer scans read, its bytes per device at the plan's layout (``weights``
    is their sum); ``own``: the peak of what the ops outside the layer part hold beside
    it (:func:`own_bytes`); ``layer``: one layer's stacked parameters, bytes per device at
    the plan's layout (``weights`` / the layer count)."""

    step: float
    peak: float
    layers: float
    compute: float
    sample: tuple[tuple[Conversion, float, Reshard, bool, bool], ...]
    once: float
    state: float
    other_state: float
    saved: float
    carry: float
    passes: int = 2
    rerun: float = 0.0
    rest_comm: float = 0.0
    update: float = 0.0
    batch_spans: tuple[tuple[str, int], ...] = ()
    weights: float = 0.0
    cotangent: bool = True
    head: float = 0.0
    head_weights: float = 0.0
    head_comm: float = 0.0
    tensor_spans: tuple[tuple[str, int], ...] = ()
    results: float = 0.0
    param_bytes: tuple[float, ...] = ()
    own: float = 0.0
    layer: float = 0.0

    @property
    def working(self) -> float:
        """The peak's bytes besides the state and the saved activations (gradients being
        formed, the head's logits, gathered copies)."""
        return max(0.0, self.peak - self.state - self.other_state - self.saved)

    def sample_runs(self, microbatches: int, rerun: bool = True
                    ) -> list[tuple[Reshard, float]]:
        """Per per-sample conversion a pipeline's stage runs (those of a recomputed
        forward too, with ``rerun``): the plan's reshard and its seconds when it runs once
        per micro-batch on ``1 / microbatches`` of its bytes. None spans an axis
        splitting the micro-batches: the stage is manual over those (each device runs the
        layers on its part of a micro-batch, :mod:`shardc.pipeline.runtime`)."""
        out = []
        for conv, nbytes, r, again, batch in self.sample:
            if again and not rerun or batch:
                continue
            # its runs (a layer scan's trips) from its wire bytes, each priced alone: in a
            # pipeline's loop it joins no combined collective (the plan's may have)
            wire = conv.wire_bytes(nbytes)
            out.append((r, r.time if wire <= 0 else
                        r.wire_bytes / wire * microbatches * conv.time(nbytes / microbatches)))
        return out

    def sample_seconds(self, microbatches: int, rerun: bool = True) -> float:
        """The per-sample conversions' seconds (:meth:`sample_runs`)."""
        return sum(t for _, t in self.sample_runs(microbatches, rerun))


def _owner(r, graph: Graph) -> int | None:
    """The op a conversion is charged to: its reader, else the op making the value (None:
    a graph input's settling, or a graph output's)."""
    if r.consumer is not None and r.consumer >= 0:
        return r.consumer
    op = graph.producers().get(r.value)
    return None if op is None else op.id


def rest_reshards(plan: Plan, graph: Graph, layers: Layers) -> list:
    """The conversions of ``plan`` that a pipeline runs as the plan does, over the whole
    mesh: those of no layer scan's op, no stacked value's update and no stacked value's
    settling."""
    out = []
    for r in plan.reshards:
        owner = _owner(r, graph)
        if owner is None and r.value in layers.stacked or \
                owner is not None and layers.layer_part(owner):
            continue
        out.append(r)
    return out


def _batch_spans(plan: Plan, layers: Layers) -> tuple[tuple[str, int], ...]:
    """The mesh axes (of more than one device) every layer carry's batch dim is split over
    (:func:`shardc.pipeline.lowering.batch_axes` reads the same), in mesh order."""
    big = [k for k, n in enumerate(plan.axis_sizes) if n > 1]
    return tuple((plan.axis_names[k], plan.axis_sizes[k])
                 for k in shared_dim_splits((plan.values[c] for c in layers.carry), big))


def _cotangent(graph: Graph, layers: Layers) -> bool:
    """Whether a value the last layer scan's carry exits make is read (by an op or as a
    result): in a training step, the stack input's cotangent."""
    exits = {v.id for op in graph.ops if op.prim is SCAN_EXIT and op.where == layers.scans[-1]
             and op.params.get("kind") == "carry" for v in op.outputs}
    return any(v.id in exits for op in graph.ops for v in op.inputs) or \
        any(v.id in exits for v in graph.outputs)


def parts(plan: Plan, graph: Graph, layers: Layers, ties=(), resident=()) -> Parts:
    """Split ``plan`` (of ``graph``) into :class:`Parts` by ``layers``."""
    sizes = plan.axis_sizes
    nbytes = {v.id: v.nbytes for v in graph.values()}
    compute = scans = outside = rerun = 0.0
    reruns = {op.id for op in graph.ops
              if any(op.where[:len(w)] == w for w in layers.rerun)}
    for op in plan.ops:
        if op.id in layers.ops:
            compute += op.compute_time
            rerun += op.compute_time if op.id in reruns else 0.0
        elif op.id in layers.outside:
            outside += op.compute_time
    spans = _batch_spans(plan, layers)
    batch = {plan.axis_names.index(name) for name, _ in spans}
    sample, once, rest = [], outside, 0.0
    for r in plan.reshards:
        owner = _owner(r, graph)
        if owner is None and r.value not in layers.stacked or \
                owner is not None and not layers.layer_part(owner):
            rest += r.time
        if owner is None:
            if r.value in layers.stacked:
                once += r.time
            continue
        if owner in layers.ops and r.value in layers.per_sample:
            conv = conversion(r.src, r.dst, sizes, plan.axis_names, plan.cluster)
            sample.append((conv, float(nbytes[r.value]), r, owner in reruns,
                           any(batch.intersection(c.axes) for c in conv.collectives)))
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
    head = head_ops(graph, layers)
    fed = {v.id for k, v in enumerate(graph.inputs) if k not in carried}
    read = {v.id for op in graph.ops if op.id in head for v in op.inputs}
    head_weights = sum(v.nbytes for v in graph.inputs
                       if v.id in read and v.id not in fed and v.id not in layers.stacked)
    made = {v.id for op in graph.ops if op.id in head for v in op.outputs}
    return Parts(plan.predicted.step_time, plan.predicted.peak_memory,
                 compute + scans + once, compute, tuple(sample), once, state, other, saved,
                 carry, min(len(layers.scans), 2), rerun, rest, outside,
                 spans,
                 sum(nbytes[i] * plan.values[i].shard_fraction(sizes) for i in layers.params),
                 _cotangent(graph, layers),
                 sum(op.compute_time for op in plan.ops if op.id in head),
                 float(head_weights),
                 sum(r.time for r in plan.reshards if r.value in made or r.consumer in head),
                 tuple((plan.axis_names[k], n) for k, n in enumerate(sizes) if n > 1 and any(
                     isinstance(plan.values[i].sbps[k], Split) for i in layers.params)),
                 sum(graph.outputs[j].nbytes * plan.outputs[j].shard_fraction(sizes)
                     for j, k in ties if graph.inputs[k].id in layers.stacked),
                 tuple(nbytes[i] * plan.values[i].shard_fraction(sizes)
                       for i in sorted(layers.params)),
                 own_bytes(plan, graph, layers, ties),
                 sum(nbytes[i] * plan.values[i].shard_fraction(sizes)
                     for i in layers.params) / layers.length)


def own_bytes(plan: Plan, graph: Graph, layers: Layers, ties=()) -> float:
    """Bytes per device the ops outside the layer part hold at ``plan``'s layouts beside the
    pipeline: the results they make and are not the stacked state's updated copy (held for
    the whole step), and the peak of the values they make and read, each from its op to its
    last reader outside the layer part (a value only the layer scans read is the stack's
    input, a carry the stages hold). Values XLA fuses into their readers hold no buffer
    (:func:`shardc.solve.lifetimes.fused_values`)."""
    sizes = plan.axis_sizes
    fused = fused_values(graph)
    tied = {j for j, k in ties if graph.inputs[k].id in layers.stacked}
    results = {v.id for j, v in enumerate(graph.outputs) if j not in tied}
    at = {v.id: t for t, op in enumerate(graph.ops) for v in op.outputs}
    written = [(graph.outputs[j].nbytes * plan.outputs[j].shard_fraction(sizes), at[v.id])
               for j, v in enumerate(graph.outputs)
               if j not in tied and v.id in at
               and not layers.layer_part(graph.producers()[v.id].id)]
    born, last, size = {}, {}, {}
    for t, op in enumerate(graph.ops):
        if layers.layer_part(op.id):
            continue
        for v in op.inputs:
            if v.id in born:
                last[v.id] = t
        for v in op.outputs:
            if v.id not in fused and v.id not in results:
                born[v.id], last[v.id] = t, t
                size[v.id] = v.nbytes * plan.values[v.id].shard_fraction(sizes)
    # read by another op outside the layer part; those that die before a result is
    # written live in its buffer
    temps = host([(t, last[i], size[i]) for i, t in born.items() if last[i] > t], written)
    held = sum(b for b, _ in written)
    delta = [0.0] * (len(graph.ops) + 1)
    for first, end, b in temps:
        delta[first] += b
        delta[end + 1] -= b
    peak = live = 0.0
    for d in delta:
        live += d
        peak = max(peak, live)
    return held + peak


def head_ops(graph: Graph, layers: Layers) -> frozenset[int]:
    """Ids of the ops in the calls a stack's scans are in (a stack's ``jit`` calls), outside
    the scans and the stacked values' updates: a loss stack's loss. None for scans that
    are in no call."""
    calls = {w[:-1] for w in layers.scans if len(w) > 1}
    return frozenset(op.id for op in graph.ops
                     if any(op.where[:len(c)] == c for c in calls)
                     and not layers.layer_part(op.id))


@dataclass(frozen=True, slots=True)
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
    weights whole), ``grad_bytes`` per device; ``rest_comm``: the communication of
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


def price(pipeline: Pipeline, whole: Parts, stage: Parts, cluster: Cluster,
          mesh: tuple[tuple[str, int], ...] = (), stage_plan: Plan | None = None
          ) -> PipelinePrice:
    """The step of ``pipeline`` on ``mesh`` (priced by ``cluster``) from the whole plan's
    :class:`Parts` and the stage plan's (``stage_plan``'s, see the module doc)."""
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
    if stage.batch_spans and stage.passes > 1:
        # the stage holds its weights whole on the axes splitting each micro-batch, so its
        # gradients are summed over them once, after the backward loop (runtime doc), in
        # place of the stage plan's conversions of the stacked values
        grad_bytes = stage.weights / s
        grads = cluster.collective_seconds("all-reduce", stage.batch_spans, grad_bytes)
        once = stage.update / s + grads
    else:
        once = stage.once / s
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
    relayout, relaid = 0.0, ()
    if v > 1:
        # the stored stack's layer dim is split over the stages in blocks, and the circular
        # schedule runs chunk v S + s on stage s: each step lays every stacked parameter out
        # again over the stage axis, and its gradient back (one all-to-all each way)
        relaid = tuple(b / s for b in stage.param_bytes) * stage.passes
        relayout = sum(cluster.collective_seconds("all-to-all", spans, b) for b in relaid)
    peak = stage.state / s + whole.other_state + working + held
    return PipelinePrice(pipeline, rest + layers + transfers + gathers + once + loss_reduce +
                         relayout,
                         rest, layers, bubble, transfers, gathers, once, permutes,
                         stage.carry / m, reduces, stage.carry, peak, mesh, grads, grad_bytes,
                         whole.rest_comm, ticks, stage.batch_spans, loss_reduce, loss_bytes,
                         loss_spans, stage.tensor_spans, sample, stage_plan, relayout,
                         relaid)
