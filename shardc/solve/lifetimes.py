"""When each buffer of a program lives, as the memory model counts it
(:mod:`shardc.solve.memory`).

The cost graph's spans (:func:`_lifetimes`): every graph input is held for the whole step;
an op's value lives from the op to its last reader, except the values XLA fuses into their
readers (:func:`fused_values`), which hold no buffer, and a branch's value of a ``cond``
result, which is written in the result's buffer (:func:`joined`); beside them, each
operand's read (with the tail bits that say which collectives XLA may combine), each shared
value's settled copy, a scan's stacks read in another layout (:func:`stacked_reads`) and its
ys held unreduced (:func:`partial_ys`). They depend on the graph alone, not on a plan:
:mod:`shardc.solve.memory` prices them per choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.ir.flow import carry_exit, reads, tail_values
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.trace import COND_ENTER, COND_EXIT, SCAN_ENTER, SCAN_EXIT

if TYPE_CHECKING:
    from shardc.solve.costgraph import CostGraph

__all__ = ["FUSING_REDUCTIONS", "fused_values", "joined", "offloaded_spans", "partial_ys",
           "read_points", "stacked_reads"]


FUSING_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
"""Reductions XLA fuses their elementwise operands into (an input fusion): a softmax's
``exp`` read by its sum and its normalisation is never stored."""


def joined(graph: Graph) -> tuple[set[int], dict[int, int]]:
    """The buffers a ``cond`` shares with its branches: (ids of the values a branch makes
    and returns, which it writes in the cond's result buffer and hold none of their own;
    ``{id of a cond result: the program point of the first branch value written in it}``,
    where that buffer starts). References: XLA's ``conditional`` whose branch computations'
    roots are assigned the conditional's output buffer (``buffer_assignment.cc``)."""
    made = {v.id: t for t, op in enumerate(graph.ops) for v in op.outputs
            if op.prim is not COND_ENTER}
    inside: set[int] = set()
    born: dict[int, int] = {}
    for op in graph.ops:
        if op.prim is COND_EXIT:
            ts = [made[v.id] for v in op.inputs[1:] if v.id in made]
            inside.update(v.id for v in op.inputs[1:] if v.id in made)
            if ts:
                born[op.outputs[0].id] = min(ts)
    return inside, born


def fused_values(graph: Graph) -> set[int]:
    """Ids of the values XLA never stores: made by an elementwise op or a broadcast and read
    only by such ops or by a reduction (:data:`FUSING_REDUCTIONS`), not a result. XLA's
    fusion pass computes such a value inside each consumer's loop (a loop or input fusion;
    several consumers each recompute it or share a multi-output fusion), so no buffer holds
    it, and its operands are read where its consumers run instead. An optimizer's chains
    (Adam's bias-corrected moments and update) are made of these: counted as buffers, a
    train step's tail held two extra copies of the parameters that the compiled program
    never allocates; so are a loss's logits-sized broadcasts and ``exp``."""
    outs = {v.id for v in graph.outputs}
    readers: dict[int, list[Op]] = {}
    for op in graph.ops:
        for v in op.inputs:
            readers.setdefault(v.id, []).append(op)

    def made_in_loop(name: str) -> bool:
        return facts(name).elementwise or name == "broadcast_in_dim"

    return {v.id for op in graph.ops if made_in_loop(op.name) for v in op.outputs
            if v.id not in outs and v.id in readers
            and all(made_in_loop(r.name) or r.name in FUSING_REDUCTIONS
                    for r in readers[v.id])}


def _lifetimes(cg: CostGraph) -> None:
    """Graph inputs (parameters, optimizer state, batch) live throughout; an op's outputs
    from the op to their last use (graph outputs: to the end); a fused value
    (:func:`fused_values`) has no buffer, and its operands live to its last use instead. A
    ``cond_enter`` holds no buffer (the branch reads the operand in place), nor does a
    branch's value of a cond result (it is the result's buffer, :func:`joined`). They
    depend on the graph alone (its node numbering too), so each graph's are computed once
    (:meth:`shardc.ir.graph.Graph.memo`: a frontier builds one program's cost graph many
    times) and shared, not to be changed."""
    (cg.fusion, cg.spans, cg.results, cg.read_spans, cg.settle_spans, cg.ys_spans,
     cg.stack_spans) = cg.graph.memo("lifetimes", lambda _: _spans(cg))
    if cg.offloaded:
        cg.spans, cg.results = offloaded_spans(cg)


def read_points(graph: Graph) -> tuple[dict[int, int], dict[int, int]]:
    """``(first, last)``: value id -> the program point of its first read, and of its last
    (values no op reads absent)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, op in enumerate(graph.ops):
        for v in op.inputs:
            first.setdefault(v.id, t)
            last[v.id] = t
    return first, last


def offloaded_spans(cg: CostGraph) -> tuple[list, set]:
    """The spans and result spans of ``cg`` with its offloaded inputs (``cg.offloaded``,
    kept in host memory between steps) and the new state tied to them held on the devices
    only while used: an offloaded input from its first read to its last (moved in before
    it), and its tied result from the op making it to its last read there (moved out after
    it), no longer an argument or a result buffer of the device. An offloaded input no op
    reads holds nothing. New lists: the graph's own spans are shared."""
    graph = cg.graph
    first, last = read_points(graph)
    spans = list(cg.spans)
    for k in cg.offloaded:
        v = graph.inputs[k]
        _, _, node, slot, nbytes = spans[k]
        spans[k] = (first[v.id], last[v.id], node, slot, nbytes) if v.id in first \
            else (0, -1, node, slot, 0)
    made = cg.fusion[2]  # value id -> the program point making it (:func:`_spans`)
    moved_out = {cg.producer[out.id]: out.id for j, i in cg.ties if i in cg.offloaded
                 and (out := graph.outputs[j]).id in cg.producer
                 and out.id != graph.inputs[i].id}  # (node, slot) -> the new state's id
    results = set(cg.results)
    for k in list(results):
        start, _, node, slot, nbytes = spans[k]
        vid = moved_out.get((node, slot))
        if vid is not None and k >= len(graph.inputs):
            results.discard(k)
            spans[k] = (start, max(made[vid], last.get(vid, made[vid])), node, slot, nbytes)
    return spans, results


def _spans(cg: CostGraph) -> tuple:
    """:func:`_lifetimes`' fields of ``cg``, in the order it sets them."""
    graph = cg.graph
    n = len(graph.ops)
    last = {v.id: n for v in graph.outputs}
    for t, op in enumerate(graph.ops):
        for v in op.inputs:
            last[v.id] = max(last.get(v.id, t), t)
    # a branch reads the cond's operand in place: its ``cond_enter`` holds no copy; nor
    # does a loop's body its loop-invariant operands (a const ``scan_enter``)
    fused = graph.memo("fused_values", fused_values) | \
        {op.outputs[0].id for op in graph.ops if op.prim is COND_ENTER or (
            op.prim is SCAN_ENTER and op.params["kind"] == "const")}
    made = {v.id: t for t, op in enumerate(graph.ops) for v in op.outputs}
    cg.fusion = (frozenset(fused), dict(last), made)
    for t in range(n - 1, -1, -1):  # consumers first: a chain of fused values extends back
        op = graph.ops[t]
        end = max((last[v.id] for v in op.outputs if v.id in fused), default=t)
        for v in op.inputs:
            last[v.id] = max(last[v.id], end)
    _in_place(graph, last, fused)
    cg.spans = []
    for v in graph.inputs:
        node, _ = cg.producer[v.id]
        cg.spans.append((0, n, node, 0, v.nbytes))
    results = {v.id for v in graph.outputs}
    cg.results = set()
    inside, born = joined(graph)
    for t, op in enumerate(graph.ops):
        for slot, v in enumerate(op.outputs):
            if v.id in results:
                cg.results.add(len(cg.spans))
            if v.id not in fused and v.id not in inside:
                cg.spans.append((born.get(v.id, t), last.get(v.id, t), cg.producer[v.id][0],
                                 slot, v.nbytes))
    first_read: dict[int, int] = {}
    tail = tail_values(graph)
    after = _tail_after(graph, tail)
    cg.read_spans = []
    for t, op in enumerate(graph.ops):
        for k, val in reads(op):
            if val.is_const:
                continue
            first_read.setdefault(val.id, t)
            u, slot = cg.producer[val.id] if carry_exit(op) or val.id not in cg.settle \
                else (cg.settle[val.id], 0)
            cg.read_spans.append((t, len(graph.inputs) + t, k, u, slot, val.nbytes, val.id,
                                  made.get(val.id, 0), after.get(val.id)))
    cg.settle_spans = []
    for vid, w in cg.settle.items():
        if vid in first_read:
            node, slot = cg.producer[vid]
            val = cg.refs[w].value
            cg.settle_spans.append((first_read[vid], last.get(vid, n), w, node, slot,
                                    val.nbytes))
    cg.ys_spans = [(start, t - 1, cg.producer[op.outputs[0].id][0], op.outputs[0].nbytes)
                   for start, t, op in partial_ys(graph)]
    cg.stack_spans = []
    for t, end, val in stacked_reads(graph):
        u, slot = (cg.settle[val.id], 0) if val.id in cg.settle else cg.producer[val.id]
        cg.stack_spans.append((t, end, len(graph.inputs) + t, u, slot, val.nbytes))
    return (cg.fusion, cg.spans, cg.results, cg.read_spans, cg.settle_spans, cg.ys_spans,
            cg.stack_spans)


#: ops XLA runs in place, their result written over their first operand's buffer where
#: that operand is read last there: an update of a slice (a KV cache's), a loop's carry
#: taking its initial value (XLA's ``dynamic-update-slice`` and ``scatter`` in place,
#: a ``while``'s init buffer shared with the loop's)
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "dynamic_update_slice"})


#: the primitives whose values are a control-flow op's buffers (a ``while``'s or a
#: ``conditional``'s, shared with its body's): XLA writes no elementwise result over them
#: (a scanned MLP's stacked gradients, leaving its loop, stay beside the new weights)
CONTROL_BUFFERS = frozenset({SCAN_EXIT, COND_EXIT})


def _in_place(graph: Graph, last: dict[int, int], fused: set[int]) -> None:
    """Shorten ``last`` (value id -> program point of its last read) for the operands an
    in-place op (:data:`IN_PLACE`, a carry's ``scan_enter``) reads last, and for the one
    of each elementwise op writing a result (:func:`_shared_operand`; between
    temporaries, where XLA's fusions differ from the graph's ops, not counted): they die
    just before it, as its result takes their buffer."""
    results = {v.id for v in graph.outputs}
    for t, op in enumerate(graph.ops):
        if op.name in IN_PLACE or op.prim is SCAN_ENTER and op.params["kind"] == "carry":
            v, out = op.inputs[0], op.outputs[0]
            if v.producer is not None and v.id not in fused and last.get(v.id) == t \
                    and v.nbytes == out.nbytes and out.id not in fused:
                last[v.id] = t - 1
        elif facts(op.name).elementwise and len(op.outputs) == 1 \
                and op.outputs[0].id not in fused and op.outputs[0].id in results:
            v = _shared_operand(op, t, last, fused)
            if v is not None:
                last[v.id] = t - 1


def _shared_operand(op: Op, t: int, last: dict[int, int], fused: set[int]) -> Value | None:
    """The stored value whose buffer the elementwise ``op`` (program point ``t``) writes
    its value in: the first it reads elementwise, directly or through the elementwise
    values fused into it, for the last time, of its value's shape and dtype, and not a
    control-flow op's (:data:`CONTROL_BUFFERS`). XLA lets a loop fusion write over an
    operand every use of which inside it is elementwise
    (``HloDataflowAnalysis::CanShareOperandBufferWithUser``): an SGD step's new embedding
    table is written over its gradient (a scatter-add into zeros), and the compiled step
    holds the table twice, not three times (counted three times, a 262144-row table's
    step was predicted 1.5x its compiled peak). None where there is none."""
    out = op.outputs[0]
    todo = list(op.inputs)
    seen: set[int] = set()
    while todo:
        v = todo.pop(0)
        if v.is_const or v.id in seen:
            continue
        seen.add(v.id)
        if v.id in fused:
            if v.producer is not None and facts(v.producer.name).elementwise:
                todo.extend(v.producer.inputs)
            continue
        if v.producer is not None and v.producer.prim not in CONTROL_BUFFERS \
                and last.get(v.id) == t and v.shape == out.shape and v.dtype == out.dtype:
            return v
    return None


def _tail_after(graph: Graph, tail: set[int]) -> dict[int, tuple[int, int]]:
    """Per tail value (:func:`shardc.ir.flow.tail_values`), ``(its bit, the bits of the
    tail values computed from it)``: a tail value's collective can join XLA's combined one
    with another's unless one is computed from the other (``CombineInstructionsByKey``
    combines independent collectives only)."""
    bit = {vid: 1 << k for k, vid in enumerate(sorted(tail))}
    after: dict[int, int] = {}
    for op in reversed(graph.ops):
        down = 0
        for v in op.outputs:
            if v.id in bit:
                down |= bit[v.id] | after.get(v.id, 0)
        for v in op.inputs:
            if v.id in bit:
                after[v.id] = after.get(v.id, 0) | down
    return {vid: (b, after.get(vid, 0)) for vid, b in bit.items()}


def stacked_reads(graph: Graph) -> list[tuple[int, int, Value]]:
    """``(t, end, stacked value)`` per scan ``xs`` input (op ``t``, its ``scan_enter``):
    the loop reads the whole stack in the enter's layout, so where that differs from the
    stack's own (a stacked weight stored sharded, its slices read gathered) the converted
    stack is a buffer of its own from the enter to the loop's last exit (``end``): XLA
    gathers the stack before the loop, not a layer per iteration."""
    exits = {op.where: k for k, op in enumerate(graph.ops) if op.prim is SCAN_EXIT}
    return [(t, max(t, exits.get(op.where, t)), op.inputs[0])
            for t, op in enumerate(graph.ops)
            if op.prim is SCAN_ENTER and op.params.get("kind") == "xs"
            and not op.inputs[0].is_const]


def partial_ys(graph: Graph) -> list[tuple[int, int, Op]]:
    """``(first op of its loop, t, exit)`` per scan ys ``scan_exit`` (op ``t``): where the
    plan reads its body's value partial, reducing it after the loop
    (:func:`shardc.solve.reduced_ys.stacked_ys`), the loop holds the whole stack of every
    device's summands, unreduced (the full value on every device), from the loop's start
    to its exit. A loop's ops are those whose ``where`` extends its exits'."""
    first: dict[tuple[int, ...], int] = {}
    out = []
    for t, op in enumerate(graph.ops):
        for k in range(1, len(op.where) + 1):
            first.setdefault(op.where[:k], t)
        if op.prim is SCAN_EXIT and op.params["kind"] == "ys":
            out.append((first[op.where], t, op))
    return out
