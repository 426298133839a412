"""A plan split by what a pipeline does with each part (:class:`Parts`): the layer scans'
compute and their conversions of per-sample values (run per micro-batch and tick), the
layer part's once-per-step rest, the stacked state, the saved activations, the carry a
stage sends the next, and what the ops outside the layer part hold. The pipelined step is
priced from two such splits, the whole plan's and the stage plan's
(:func:`shardc.pipeline.cost.price`, whose docstring says how each part runs)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from shardc.cost.comm import Conversion, conversion
from shardc.ir.graph import Graph
from shardc.ir.sbp import Split, shared_dim_splits
from shardc.ir.trace import SCAN_EXIT
from shardc.pipeline.scans import Layers
from shardc.plan.record import Plan, Reshard
from shardc.solve.lifetimes import fused_values
from shardc.solve.memory import host

__all__ = ["Parts", "head_ops", "own_bytes", "parts", "rest_reshards"]


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
    param_bytes = tuple(nbytes[i] * plan.values[i].shard_fraction(sizes)
                        for i in sorted(layers.params))
    return Parts(plan.predicted.step_time, plan.predicted.peak_memory,
                 compute + scans + once, compute, tuple(sample), once, state, other, saved,
                 carry, min(len(layers.scans), 2), rerun, rest, outside,
                 spans, sum(param_bytes), _cotangent(graph, layers),
                 sum(op.compute_time for op in plan.ops if op.id in head),
                 float(head_weights),
                 sum(r.time for r in plan.reshards if r.value in made or r.consumer in head),
                 tuple((plan.axis_names[k], n) for k, n in enumerate(sizes) if n > 1 and any(
                     isinstance(plan.values[i].sbps[k], Split) for i in layers.params)),
                 sum(graph.outputs[j].nbytes * plan.outputs[j].shard_fraction(sizes)
                     for j, k in ties if graph.inputs[k].id in layers.stacked),
                 param_bytes, own_bytes(plan, graph, layers, ties),
                 sum(param_bytes) / layers.length)


def own_bytes(plan: Plan, graph: Graph, layers: Layers, ties=()) -> float:
    """Bytes per device the ops outside the layer part hold at ``plan``'s layouts beside the
    pipeline: the results they make and are not the stacked state's updated copy (held for
    the whole step), and the peak of the values they make and read, each from its op to its
    last reader outside the layer part (a value only the layer scans read is the stack's
    input, a carry the stages hold), less those that die before a result is written: they
    live in its buffer (:func:`shardc.solve.memory.host`, as a plan's own profile counts
    them). Values XLA fuses into their readers hold no buffer
    (:func:`shardc.solve.lifetimes.fused_values`)."""
    sizes = plan.axis_sizes
    fused = graph.memo("fused_values", fused_values)
    tied = {j for j, k in ties if graph.inputs[k].id in layers.stacked}
    results = {v.id for j, v in enumerate(graph.outputs) if j not in tied}
    point = {op.id: t for t, op in enumerate(graph.ops)}
    made = graph.producers()
    written = [(graph.outputs[j].nbytes * plan.outputs[j].shard_fraction(sizes),
                point[made[v.id].id])
               for j, v in enumerate(graph.outputs)
               if j not in tied and v.id in made and not layers.layer_part(made[v.id].id)]
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
    # those read by another op outside the layer part
    temps = host([(t, last[i], size[i]) for i, t in born.items() if last[i] > t], written)
    held = sum(b for b, _ in written)
    delta = [0.0] * (len(graph.ops) + 1)
    for first, end, b in temps:
        delta[first] += b
        delta[end + 1] -= b
    return held + max(0.0, *accumulate(delta))


def head_ops(graph: Graph, layers: Layers) -> frozenset[int]:
    """Ids of the ops in the calls a stack's scans are in (a stack's ``jit`` calls), outside
    the scans and the stacked values' updates: a loss stack's loss. None for scans that
    are in no call."""
    calls = {w[:-1] for w in layers.scans if len(w) > 1}
    return frozenset(op.id for op in graph.ops
                     if any(op.where[:len(c)] == c for c in calls)
                     and not layers.layer_part(op.id))
