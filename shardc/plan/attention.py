"""Attention in a program, and how a plan splits it: over the batch, the heads, or the
sequence (context parallelism), and for the sequence in which form.

Attention is found by its shape, not by its name, so the einsum-softmax-einsum users write
(causal or not, grouped-query heads repeated or not) and ``jax.nn.dot_product_attention``
(which traces to the same ops) are both found: a ``dot_general`` (the scores, ``q . k``)
with batch dims (batch and heads) whose result reaches a second ``dot_general`` (``p . v``)
through elementwise ops,
reductions and broadcasts with an ``exp`` among them (the softmax). The second is the first
such reader in program order: the backward pass reads the same probabilities later (the
value gradient ``p^T . do``).

Per mesh axis, the plan's layout of the scores' operands says how that axis splits the
attention (:func:`attention_forms`):

- ``sequence, K/V all-gathered``: the queries split along their sequence, the keys whole
  (gathered over the axis for it): each device attends its query block to every key;
- ``sequence, K/V ring``: the queries and the keys split along their sequences, the key
  (and value) blocks passed round the axis while each device computes with the block it
  holds (ring attention: a ring signature, :mod:`shardc.rules.dot`), each block's product
  hiding the next block's transfer where the cluster overlaps them;
- ``sequence, all-to-all to heads``: the queries and keys split over the heads where the
  values they are made from were split along the sequence (an all-to-all over the axis
  between the two, as in DeepSpeed-Ulysses);
- ``heads`` or ``batch``: split over a batch dimension of the scores (heads, or the batch
  when its size is the program's batch), as tensor or data parallelism split it;
- ``sequence, keys split``: the key sequence split (partial scores reduced afterwards);
- ``replicated``: not split over the axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardc.cost.comm import reshard_time
from shardc.cost.kernels import compute_seconds
from shardc.cost.ring import repeated
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.flops import op_flops
from shardc.ir.graph import Graph, Op
from shardc.ir.prims import facts
from shardc.ir.sbp import B, NdSbp, Split
from shardc.plan.record import Plan
from shardc.rules.dot import batched_dot, dot_dims, result_dim, ring_of

__all__ = ["Attention", "attention_forms", "find_attention", "sequence_dims"]

#: ops a softmax between the scores and the probabilities is made of, besides elementwise
_SOFTMAX_OPS = frozenset({"reduce_max", "reduce_sum", "broadcast_in_dim", "stop_gradient",
                          "select_n", "reshape", "convert_element_type", "max", "exp",
                          "sub", "div", "mul", "add", "custom_jvp_call", "transpose",
                          "sharding_constraint"})
#: ops whose operands' dims are their result's, in place (sizes may differ along others)
_IN_PLACE_DIMS = frozenset({"convert_element_type", "concatenate", "slice", "split", "pad",
                            "dynamic_slice", "rev"})
#: how far from the scores the probabilities may be (ops on the path)
_DEPTH = 24


@dataclass(frozen=True)
class Attention:
    """One attention found in a program: the ops of its scores (``q . k``) and of its
    output (``p . v``), by op id, and the user's line that made the scores."""

    scores: int
    output: int
    source: str


def _passes(op: Op) -> bool:
    return op.name in _SOFTMAX_OPS or facts(op.name).elementwise


def find_attention(graph: Graph) -> list[Attention]:
    """The attentions of ``graph`` in program order (module docstring)."""
    readers: dict[int, list[Op]] = {}
    order = {op.id: t for t, op in enumerate(graph.ops)}
    for op in graph.ops:
        for v in op.inputs:
            readers.setdefault(v.id, []).append(op)
    found = []
    for op in graph.ops:
        if not batched_dot(op):
            continue  # per (batch, head) scores have batch dims; a classifier head has none
        output = _first_reader(op, readers, order)
        if output is not None:
            found.append(Attention(op.id, output.id, op.source))
    return found


def _first_reader(scores: Op, readers: dict[int, list[Op]], order: dict[int, int]
                  ) -> Op | None:
    """The first ``dot_general`` reading a value made from ``scores``'s result through a
    softmax (an ``exp`` on the path), or None."""
    frontier = [(v.id, False) for v in scores.outputs]
    seen: set[tuple[int, bool]] = set()
    best = None
    for _ in range(_DEPTH):
        nxt = []
        for vid, exped in frontier:
            for r in readers.get(vid, ()):
                if r.name == "dot_general" and exped and r.id != scores.id:
                    if best is None or order[r.id] < order[best.id]:
                        best = r
                elif _passes(r):
                    for out in r.outputs:
                        key = (out.id, exped or r.name == "exp")
                        if key not in seen:
                            seen.add(key)
                            nxt.append(key)
        if not nxt:
            break
        frontier = nxt
    return best


def _dims(op: Op) -> tuple[int, int, tuple[int, ...]]:
    """The scores' query sequence dim (of ``q``), key sequence dim (of ``k``) and the
    batch dims of ``q`` (batch and heads): the dims that are neither contracted nor
    batched."""
    _, _, lb, _, q_free, k_free = dot_dims(op)
    return (q_free[0] if q_free else -1), (k_free[0] if k_free else -1), lb


def attention_forms(graph: Graph, plan: Plan, batch: int | None = None) -> list[dict]:
    """Per attention of ``graph`` (:func:`find_attention`), how ``plan`` splits it over
    each mesh axis (the module docstring's forms), as ``{"source", "scores", "axes":
    {axis: form}}``. ``batch``: the program's batch size, to tell a batch split from a
    heads split (None: every batch dim is called heads but a leading one)."""
    by_id = {op.id: op for op in graph.ops}
    planned = {o.id: o for o in plan.ops}
    out = []
    for att in find_attention(graph):
        op, lay = by_id[att.scores], planned.get(att.scores)
        if lay is None:
            continue
        qs, ks, batch_dims = _dims(op)
        shape = op.inputs[0].shape
        made = _projection(op)  # the queries as their projection made them
        forms, why = {}, {}
        ring = ring_of(op, lay.ins, lay.outs)
        for a, name in enumerate(plan.axis_names):
            q, k = lay.ins[0].sbps[a], lay.ins[1].sbps[a]
            src = plan.values.get(made.id) if made is not None else None
            along = src is not None and isinstance(src.sbps[a], Split) and \
                made.shape[src.sbps[a].dim] == shape[qs]
            if ring is not None and ring[0] == a:
                forms[name] = "sequence, K/V ring"
            else:
                forms[name] = _form(q, k, qs, ks, batch_dims, shape, batch, along)
            if forms[name] in ("sequence, K/V ring", "sequence, K/V all-gathered"):
                why[name] = _ring_or_gather(graph, plan, op, lay, a)
        out.append({"source": att.source, "scores": att.scores, "axes": forms, "why": why})
    return out


def _ring_or_gather(graph: Graph, plan: Plan, op: Op, lay, axis: int) -> str:
    """Why the keys reach the query blocks on ``axis`` as planned (``lay``: the scores'
    planned op): the ring's sends against one block's product, and the all-gather of the
    keys, on the plan's cluster."""
    sizes, names, cluster = plan.axis_sizes, plan.axis_names, plan.cluster
    n, keys = sizes[axis], op.inputs[1]
    ks = _dims(op)[1]
    split = lay.ins[1].sbps[axis]
    held = lay.ins[1] if isinstance(split, Split) else NdSbp(
        tuple(Split(ks) if a == axis else s for a, s in enumerate(lay.ins[1].sbps)))
    whole = NdSbp(tuple(B if a == axis else s for a, s in enumerate(held.sbps)))
    flops = op_flops(op) * lay.outs[0].shard_fraction(sizes)
    # the ring passes the keys as the smaller value they repeat, where they repeat one
    block = (repeated(graph, keys, held) or keys).nbytes * held.shard_fraction(sizes)
    send = cluster.send_seconds([(names[axis], n)], block)
    step = compute_seconds(cluster, graph, op, flops / n)
    gather = reshard_time(held, whole, keys.nbytes, sizes, names, cluster)
    if not cluster.overlap:
        sends = "paid in full (this cluster does not overlap communication: no ring)"
    else:
        sends = ("hidden behind" if send <= step else "outlasting") + \
            f" a block's product of {fmt_time(step)}"
    return (f"ring: {n - 1} sends of {fmt_bytes(block)}, each {fmt_time(send)} {sends}; "
            f"all-gather of the keys: {fmt_time(gather)}")


def _projection(scores: Op):
    """The value the queries come from: followed back from the scores' first operand
    through the ops that reshape, rotate or repeat it, to a ``dot_general``'s result (the
    query projection); None where none is near."""
    v = scores.inputs[0]
    for _ in range(_DEPTH):
        op = v.producer
        if op is None:
            return None
        if op.name == "dot_general":
            return v
        v = op.inputs[0]
    return None


def _form(q, k, qs: int, ks: int, batch_dims: tuple[int, ...], shape, batch: int | None,
          along: bool) -> str:
    """One axis's form (module docstring) from the layouts of the scores' operands;
    ``along``: the queries' projection split along the sequence on this axis."""
    if isinstance(q, Split) and q.dim == qs:
        return "sequence, K/V all-gathered" if not isinstance(k, Split) else \
            "sequence, keys split"
    if isinstance(k, Split) and k.dim == ks:
        return "sequence, keys split"
    if isinstance(q, Split) and q.dim in batch_dims:
        if along:
            return "sequence, all-to-all to heads"
        is_batch = shape[q.dim] == batch if batch is not None else q.dim == batch_dims[0]
        return "batch" if is_batch else "heads"
    return "replicated"


def sequence_dims(graph: Graph) -> dict[int, tuple[tuple[frozenset[int], ...],
                                                   tuple[frozenset[int], ...]]]:
    """Where each attention of ``graph`` runs along its sequence, for a plan that may not
    split it there (``auto_shard(context_parallel=False)``): op id -> the dims of its
    inputs and of its outputs that run along a sequence.

    Those are the scores' query and key sequence dims (the K/V all-gathered and keys-split
    forms split them), the softmax between them and the output product (its values of
    the scores' rank along both sequences, those reduced over the keys along the
    queries'), the output product's probabilities, values and result, and the queries',
    keys' and values' way from their projections (the all-to-all form splits those along
    the sequence and converts to heads): each op on it, the projection included, along
    the dim that becomes the sequence.
    """
    by_id = {op.id: op for op in graph.ops}
    consumers = graph.consumers()
    out: dict[int, tuple[list[frozenset[int]], list[frozenset[int]]]] = {}

    def add(op: Op, ins: dict[int, set[int]], outs: dict[int, set[int]]) -> None:
        have = out.setdefault(op.id, ([frozenset()] * len(op.inputs),
                                      [frozenset()] * len(op.outputs)))
        for side, more in ((0, ins), (1, outs)):
            for k, dims in more.items():
                have[side][k] = have[side][k] | dims

    for att in find_attention(graph):
        scores, product = by_id[att.scores], by_id[att.output]
        qs, ks, batch = _dims(scores)
        q_dim, k_dim = result_dim(scores, 0, qs), result_dim(scores, 1, ks)
        add(scores, {0: {qs}, 1: {ks}}, {0: {q_dim, k_dim}})
        along = _softmax_dims(scores, q_dim, k_dim, consumers, add)
        p = 0 if product.inputs[0].id in along else 1  # which operand is the probabilities
        seq = along.get(product.inputs[p].id, frozenset())
        lc, rc, _, _, *frees = dot_dims(product)
        mine, other = (lc, rc) if p == 0 else (rc, lc)
        vc = [o for m, o in zip(mine, other) if m in seq]  # the values' sequence dims
        out_q = {result_dim(product, p, d) for d in frees[p] if d in seq}
        add(product, {p: set(seq), 1 - p: set(vc)}, {0: out_q})
        for v, dim in ((scores.inputs[0], qs), (scores.inputs[1], ks),
                       (product.inputs[1 - p], vc[0] if vc else -1)):
            for op, d in _made_along(v, dim):
                add(op, {}, {0: {d}})
    return {i: (tuple(ins), tuple(outs)) for i, (ins, outs) in out.items()}


def _softmax_dims(scores: Op, q_dim: int, k_dim: int, consumers: dict, add
                  ) -> dict[int, frozenset[int]]:
    """The softmax's ops and its gradient's: from the scores' result (its query and key
    sequence dims ``q_dim``, ``k_dim``), every value reached through the ops a softmax is
    made of, forward to their readers and back to the operands they combine with (the
    backward pass's ``dP``, made by a ``dot_general``), each output held along the dims
    the sequences become there. Returns value id -> those dims."""
    along = {scores.outputs[0].id: frozenset({q_dim, k_dim})}
    work = [scores.outputs[0]]
    for _ in range(_DEPTH * 4):
        if not work:
            break
        v = work.pop()
        dims = along[v.id]
        for op, k in consumers.get(v.id, ()):
            if op.name == "dot_general" or not _passes(op) or len(op.outputs) != 1:
                continue
            made = _carried(op, v, dims)
            _hold(op.outputs[0], made, along, work, add)
            for j, x in enumerate(op.inputs):  # what it combines with, held alike
                if j != k and not x.is_const and x.id not in along:
                    _hold(x, _carried_back(op, x, made), along, work, add)
    return along


def _hold(v, dims: frozenset[int], along: dict, work: list, add) -> None:
    """``v`` held along ``dims`` too: its producer's output restricted, and ``v`` walked
    on from (from its producer's operands as well, unless a ``dot_general`` made it)."""
    have = along.get(v.id, frozenset())
    if not dims or dims <= have or v.producer is None:
        return
    along[v.id] = have | dims
    add(v.producer, {}, {v.producer.outputs.index(v): set(dims)})
    work.append(v)
    op = v.producer
    if op.name != "dot_general" and _passes(op):
        for x in op.inputs:
            if not x.is_const:
                _hold(x, _carried_back(op, x, along[v.id]), along, work, add)


def _carried_back(op: Op, x, dims: frozenset[int]) -> frozenset[int]:
    """The dims of ``op``'s operand ``x`` that become ``dims`` of its result."""
    out = op.outputs[0]
    if op.name == "transpose":
        perm = op.params["permutation"]
        return frozenset(perm[d] for d in dims)
    if op.name == "broadcast_in_dim":
        bd = list(op.params["broadcast_dimensions"])
        return frozenset(bd.index(d) for d in dims if d in bd and x.shape[bd.index(d)] > 1)
    if op.name in ("reduce_max", "reduce_sum", "reduce_min", "argmax"):
        axes = set(op.params.get("axes", ()))
        kept = [d for d in range(x.ndim) if d not in axes]
        return frozenset(kept[d] for d in dims if d < len(kept))
    if op.name == "reshape":
        got = {_reshaped_from(x.shape, out.shape, d) for d in dims}
        return frozenset(d for d in got if d >= 0)
    if x.shape == out.shape:  # elementwise, a convert, a select: dims in place
        return dims
    if op.name in _IN_PLACE_DIMS and x.ndim == out.ndim and \
            all(x.shape[d] == out.shape[d] for d in dims):
        return dims  # a slice, a split or a concatenate along another dim
    return frozenset()


def _carried(op: Op, v, dims: frozenset[int]) -> frozenset[int]:
    """The dims of ``op``'s result that ``dims`` of its operand ``v`` become."""
    out = op.outputs[0]
    if op.name == "transpose":
        perm = op.params["permutation"]
        return frozenset(i for i, p in enumerate(perm) if p in dims)
    if op.name == "broadcast_in_dim":
        bd = op.params["broadcast_dimensions"]
        return frozenset(bd[d] for d in dims if d < len(bd))
    if op.name in ("reduce_max", "reduce_sum", "reduce_min", "argmax"):
        axes = set(op.params.get("axes", ()))
        kept = [d for d in range(v.ndim) if d not in axes]
        return frozenset(kept.index(d) for d in dims if d in kept)
    if op.name == "reshape":
        got = {_reshaped_from(out.shape, v.shape, d) for d in dims}
        return frozenset(d for d in got if d >= 0)
    if out.shape == v.shape:  # elementwise, a convert, a select: dims in place
        return dims
    return frozenset()


def _made_along(v, dim: int) -> list[tuple[Op, int]]:
    """The ops that made ``v`` from a ``dot_general`` (its projection) through reshapes,
    transposes, broadcasts and elementwise ops, each with the dim of its result that
    becomes ``v``'s ``dim``, the projection last; none where the path leaves those ops or
    the dim cannot be followed. Each step back follows the first operand whose dim this
    one is (:func:`_carried_back`: rotary embeddings split and concatenate along the head
    dim, not the sequence)."""
    path: list[tuple[Op, int]] = []
    for _ in range(_DEPTH):
        op = v.producer
        if op is None or dim < 0:
            return []
        path.append((op, dim))
        if op.name == "dot_general":
            return path
        if not (op.name in ("transpose", "broadcast_in_dim", "reshape")
                or facts(op.name).elementwise or op.name in _IN_PLACE_DIMS):
            return []
        back = next(((x, d) for x in op.inputs if not x.is_const
                     for d in _carried_back(op, x, frozenset({dim}))), None)
        if back is None:
            return []
        v, dim = back
    return []


def _reshaped_from(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int:
    """The dim of ``src`` that a reshape between it and ``dst`` keeps whole as ``dst``'s
    ``dim`` (same size, same elements before it); -1 where there is none."""
    before = math.prod(dst[:dim])
    for d, size in enumerate(src):
        if size == dst[dim] and math.prod(src[:d]) == before:
            return d
    return -1
