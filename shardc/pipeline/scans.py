"""Which part of a traced program a pipeline splits into stages: its scans over layers.

A model whose layers repeat, scanned (``lax.scan`` / ``nn.scan`` / ``nnx.scan`` over
parameters stacked along a leading layer axis), traces to a forward ``scan`` of ``L``
iterations and its transposed (backward) ``scan`` of the same length, each inlined once
with its ops weighted by ``L`` (:mod:`shardc.ir.trace`). Those scans are the *layer
scans*: the length of the scan doing the most FLOPs, and every top-level scan of that
length. The *stacked* values are the layers' parameters, their gradients and optimizer
state: whatever has the leading layer axis and is computed from stacked values alone (the
optimizer's update of a stacked parameter). A pipeline holds 1/S of each per stage.

The *batch* is the leading dimension of the layer carry (the activation passed from layer
to layer, and from stage to stage) where the carry is made from inputs fed each step (not
carried from step to step, not resident) that lead with it; the other inputs fed (a
learning rate, per-layer keys, a forward-only step's weights) are not the batch. Values
computed from the batch that are not shaped like a layer's parameter are *per-sample*:
their bytes shrink with the micro-batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shardc.ir.flops import op_flops
from shardc.ir.graph import Graph, Op
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT

__all__ = ["Layers", "find_layers"]


@dataclass(frozen=True, slots=True)
class Layers:
    """The layer scans of a program and the facts a pipeline is priced from.

    ``scans``: the ``where`` of each layer scan, forward first; ``ops``: ids of the ops
    inside them (their enters and exits included); ``stacked``: ids of the stacked values;
    ``outside``: ids of the ops outside the scans that make stacked values (the
    optimizer's update of the layers); ``per_sample``: ids of the per-sample values;
    ``carry``: value ids of the forward scan's carries as its body reads them (what one
    stage sends the next); ``saved``: value ids of the forward scan's stacked results (the
    activations kept for the backward pass)."""

    length: int
    batch: int
    scans: tuple[tuple[int, ...], ...]
    ops: frozenset[int]
    stacked: frozenset[int]
    outside: frozenset[int]
    per_sample: frozenset[int]
    carry: tuple[int, ...]
    saved: tuple[int, ...]
    rerun: tuple[tuple[int, ...], ...] = ()
    params: frozenset[int] = frozenset()

    def layer_part(self, op_id: int) -> bool:
        """The op runs in the stages (a layer scan's, or a stacked value's update)."""
        return op_id in self.ops or op_id in self.outside


def _inside(op: Op, where: tuple[int, ...]) -> bool:
    return op.where[:len(where)] == where


def _scan_regions(graph: Graph) -> dict[tuple[int, ...], int]:
    """Top-level scans (not inside another loop): where -> length."""
    out: dict[tuple[int, ...], int] = {}
    for op in graph.ops:
        if op.prim is SCAN_ENTER and "loop" not in op.params and op.weight == 1:
            out.setdefault(op.where, op.params["length"])
    return out


def _ancestors(graph: Graph, ids: Collection[int]) -> set[int]:
    out = set(ids)
    for op in reversed(graph.ops):
        if any(v.id in out for v in op.outputs):
            out.update(v.id for v in op.inputs)
    return out


def _batch_inputs(graph: Graph, ties: Sequence[tuple[int, int]], resident: Collection[int],
                  forward: Sequence[Op], batch: int) -> set[int]:
    """Ids of the batch: the inputs fed each step (not tied to an output, a train step's
    state; not resident) that lead with ``batch``, the layer carry's leading dim, when one
    of them is read by the carry's first value; those read only by the layers' parameters
    are not. A learning rate, per-layer keys or, in a forward-only step, the weights are
    fed too; they are not the batch. Empty when no fed input makes the carry."""
    carried = {i for _, i in ties} | set(resident)
    lead = {v.id for k, v in enumerate(graph.inputs)
            if k not in carried and v.ndim and v.shape[0] == batch}

    def feeding(kind: str) -> set[int]:
        return _ancestors(graph, {v.id for op in forward if op.params["kind"] == kind
                                  for v in op.inputs})
    carry = feeding("carry")
    if not lead & carry:
        return set()
    return lead - (feeding("xs") - carry)


def find_layers(graph: Graph, ties: Sequence[tuple[int, int]] = (),
                resident: Collection[int] = ()) -> Layers | None:
    """The program's layer scans and stacked values; None when it has no scan over at
    least two layers whose carry leads with the batch: a leading dim shared by the
    carry's leaves and an input fed each step that their first value is computed from
    (:func:`_batch_inputs`)."""
    regions = _scan_regions(graph)
    if not regions:
        return None
    work = {w: sum(op_flops(op) * op.weight for op in graph.ops
                   if op.where[:len(w)] == w and len(op.where) > len(w)) for w in regions}
    length = regions[max(work, key=lambda w: (work[w], w))]
    scans = tuple(sorted(w for w, n in regions.items() if n == length))
    if length < 2:
        return None
    ops = frozenset(op.id for op in graph.ops if any(_inside(op, w) for w in scans))
    forward = scans[0]
    enters = [op for op in graph.ops if op.prim is SCAN_ENTER and op.where == forward]
    carry = tuple(op.outputs[0].id for op in enters if op.params["kind"] == "carry")
    values = {v.id: v for v in graph.values()}
    leads = {values[c].shape[0] if values[c].ndim else None for c in carry}
    if len(leads) != 1 or None in leads:
        return None
    batch = leads.pop()
    from_batch = _batch_inputs(graph, ties, resident, enters, batch)
    if not from_batch:
        return None
    for op in graph.ops:
        if any(v.id in from_batch for v in op.inputs):
            from_batch.update(v.id for v in op.outputs)
    params = [v for op in graph.ops if op.where in scans and op.prim is SCAN_ENTER
              and op.params["kind"] == "xs" for v in op.inputs
              if not v.is_const and v.id not in from_batch]
    shapes = {v.shape for v in params} | {v.shape[1:] for v in params}
    per_sample = frozenset(i for i in from_batch if values[i].shape not in shapes)
    saved = tuple(op.outputs[0].id for op in graph.ops if op.prim is SCAN_EXIT
                  and op.where in scans and op.params["kind"] == "ys"
                  and op.outputs[0].id in per_sample)
    saving = {op.where for op in graph.ops if op.prim is SCAN_EXIT and op.params["kind"] == "ys"
              and op.outputs[0].id in saved}
    rerun = tuple(w for w in scans[1:] if w in saving) if forward not in saving else ()
    stacked, outside = _stacked(graph, scans, length, {v.id for v in params}, per_sample)
    return Layers(length, batch, scans, ops, frozenset(stacked), frozenset(outside),
                  per_sample, carry, saved, rerun, frozenset(v.id for v in params))


def _stacked(graph: Graph, scans: Sequence[tuple[int, ...]], length: int,
             params: set[int], per_sample: Collection[int]) -> tuple[set[int], set[int]]:
    """(stacked value ids, ids of the ops outside the scans making them): the layer scans'
    stacked parameters (``params``) and their results that are not per-sample (the
    parameters' gradients), then, to a fixpoint, the outputs of an op outside the scans
    whose operands lead with the layer axis (or are scalars) and which reads or makes a
    stacked value; its other operands that lead with the layer axis (optimizer state) are
    stacked too."""
    stacked = set(params)
    for op in graph.ops:
        if op.where in scans and op.prim is SCAN_EXIT and op.params["kind"] == "ys":
            stacked.update(v.id for v in op.outputs if v.id not in per_sample)
    outside: set[int] = set()

    def lead(v) -> bool:
        return v.ndim >= 1 and v.shape[0] == length and v.id not in per_sample

    changed = True
    while changed:
        changed = False
        for op in graph.ops:
            if op.id in outside or any(_inside(op, w) for w in scans) or not op.outputs:
                continue
            ins = [v for v in op.inputs if not v.is_const]
            if not any(v.id in stacked for v in (*ins, *op.outputs)) or \
                    not all(lead(v) or v.ndim == 0 for v in ins) or \
                    not all(lead(v) for v in op.outputs):
                continue
            outside.add(op.id)
            stacked.update(v.id for v in ins if lead(v))
            stacked.update(v.id for v in op.outputs)
            changed = True
    return stacked, outside
