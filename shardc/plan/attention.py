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
- ``sequence, all-to-all to heads``: the queries and keys split over the heads where the
  values they are made from were split along the sequence (an all-to-all over the axis
  between the two, as in DeepSpeed-Ulysses);
- ``heads`` or ``batch``: split over a batch dimension of the scores (heads, or the batch
  when its size is the program's batch), as tensor or data parallelism split it;
- ``sequence, keys split``: the key sequence split (partial scores reduced afterwards);
- ``replicated``: not split over the axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir.graph import Graph, Op
from shardc.ir.prims import facts
from shardc.ir.sbp import Split
from shardc.plan.record import Plan

__all__ = ["Attention", "attention_forms", "find_attention"]

#: ops a softmax between the scores and the probabilities is made of, besides elementwise
_SOFTMAX_OPS = frozenset({"reduce_max", "reduce_sum", "broadcast_in_dim", "stop_gradient",
                          "select_n", "reshape", "convert_element_type", "max", "exp",
                          "sub", "div", "mul", "add", "custom_jvp_call", "transpose",
                          "sharding_constraint"})
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
        if op.name != "dot_general" or not op.params["dimension_numbers"][1][0]:
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
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    q, k = op.inputs[0].ndim, op.inputs[1].ndim
    q_free = [d for d in range(q) if d not in lc and d not in lb]
    k_free = [d for d in range(k) if d not in rc and d not in rb]
    return (q_free[0] if q_free else -1), (k_free[0] if k_free else -1), tuple(lb)


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
        forms = {}
        for a, name in enumerate(plan.axis_names):
            q, k = lay.ins[0].sbps[a], lay.ins[1].sbps[a]
            src = plan.values.get(made.id) if made is not None else None
            along = src is not None and isinstance(src.sbps[a], Split) and \
                made.shape[src.sbps[a].dim] == shape[qs]
            forms[name] = _form(q, k, qs, ks, batch_dims, shape, batch, along)
        out.append({"source": att.source, "scores": att.scores, "axes": forms})
    return out


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
