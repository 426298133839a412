"""Per-device memory of a plan, as XLA's buffer assignment counts it
(``memory_analysis()``: arguments + results + temporaries).

:func:`memory_profile` walks the program in order: every argument and result is held for the
whole step; an op's value lives from the op to its last reader, except the values XLA fuses
into their readers (:func:`shardc.solve.lifetimes.fused_values`), which hold no buffer; a
value converted by a collective is a copy of its own (one per layout, however many ops read
it: XLA's CSE), the gradients' all-reduces one combined collective (:func:`combined`), and a
conversion of several steps holds two consecutive layouts at once (:func:`_steps_over`);
temporaries that die before a result is written live in that result's buffer
(:func:`host`). The solvers constrain a few sampled program points (:func:`memory_points`,
:func:`memory_point`); a plan's predicted peak is the whole profile's maximum. When each
value lives, which depends on the graph alone, is :mod:`shardc.solve.lifetimes`; this
module counts a plan's bytes over it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardc.cost.combine import COMBINED_KINDS, XLA_CPU
from shardc.cost.ring import ring_workspace
from shardc.ir.sbp import NdSbp
from shardc.rules.dot import batched_dot
from shardc.solve.lifetimes import _lifetimes

if TYPE_CHECKING:
    from shardc.solve.costgraph import CostGraph

__all__ = ["combined", "host", "memory_cut", "memory_point", "memory_points",
           "memory_profile"]

MEMORY_POINTS = 4  # program points sampled for the memory constraint (Alpa samples too)


def _value_mem(cg: CostGraph, node: int, slot: int, nbytes: int) -> np.ndarray:
    return np.array([nbytes * nd.shard_fraction(cg.axis_sizes) for nd in cg.out_sbps(node, slot)])


def _cut_fusion(cg: CostGraph, choice: Sequence[int], vid: int, at: int, made: list,
                made_at: dict) -> list[tuple[int, int, float]]:
    """A value counted as fused into its readers
    (:func:`shardc.solve.lifetimes.fused_values`) that the plan reads through a collective
    only: a collective's operand is a buffer (returned, from its op to ``at``, where the
    collective runs), and its fusion ends there, so the values its fused chain reads die by
    ``at`` (``made`` shortened in place; ``made_at``: the temporary of each (node, slot)
    making a value). On a micro-batched step the gradients summed before one all-reduce die
    there, not at the optimizer's end."""
    fused, own, born = cg.fusion
    node, slot = cg.producer[vid]
    op = cg.refs[node]
    start = born.get(vid, at)
    nbytes = op.outputs[slot].nbytes * cg.out_sbp(node, slot, choice[node]).shard_fraction(
        cg.axis_sizes)
    todo = [op]
    while todo:
        op = todo.pop()
        for u in op.inputs:
            if u.is_const or u.id not in cg.producer:
                continue
            k = made_at.get(cg.producer[u.id])
            if k is not None:
                s0, e0, b0 = made[k]
                made[k] = (s0, min(e0, max(own.get(u.id, s0), at, s0)), b0)
            if u.id in fused and u.producer is not None:
                todo.append(u.producer)
    return [(start, max(start, at), nbytes)]


def _unreduced(cg: CostGraph, node: int, nbytes: int) -> np.ndarray:
    """Per choice of a ys exit, the bytes of the unreduced stack it holds in the loop."""
    return np.array([float(nbytes) if s.ins[0].has_partial else 0.0 for s in cg.choices[node]])


def memory_point(cg: CostGraph, t: int) -> dict[int, np.ndarray]:
    """Per-device bytes live at program point ``t``, as per-choice vectors of live nodes."""
    point: dict[int, np.ndarray] = {}
    live = [(node, _value_mem(cg, node, slot, nbytes))
            for start, end, node, slot, nbytes in cg.spans if start <= t <= end]
    live += [(node, _unreduced(cg, node, nbytes))
             for start, end, node, nbytes in cg.ys_spans if start <= t <= end]
    for node, mem in live:
        root, f = cg.resolve(node)
        vec = mem[f]
        point[root] = point[root] + vec if root in point else vec
    return point


def memory_cut(cg: CostGraph, x: Mapping[int, int], t: int, peak: float
               ) -> dict[int, np.ndarray]:
    """Program point ``t``'s row (:func:`memory_point`) with the collectives' copies live
    there under the plan ``x``: each copy (a stack converted for its loop, a shared value's
    settled layout, an operand converted for its reader) is priced on the node that asks
    for it, per choice of that node, its source held at ``x``'s layout, so the row knows
    that reading the stored layout holds no copy. :func:`memory_point` prices values only:
    a 70B decoder's stacked weights gathered before its layer loop held 240 GiB the rows
    never saw, and a constant gap in their place (what ``x`` held beyond them) asked the
    same 240 GiB of every other plan, which pushed the budgeted search to its lean start.
    What the copies leave unpriced (a conversion's intermediate steps) is added as that
    gap, and ``peak`` is ``x``'s profile at ``t``."""
    point = memory_point(cg, t)
    choice = cg.decode(x)
    for node, vec in _copies_at(cg, choice, t):
        root, f = cg.resolve(node)
        point[root] = point[root] + vec[f] if root in point else vec[f]
    gap = peak - sum(float(vec[x[i]]) for i, vec in point.items())
    if gap > 0 and point:
        first = min(point)
        point[first] = point[first] + gap
    return point


def _copy_bytes(cg: CostGraph, src: NdSbp, wants: Sequence[NdSbp], nbytes: int
                ) -> np.ndarray:
    """Per wanted layout, the bytes of the copy converting ``src`` to it (0 where no
    collective runs)."""
    return np.array([nbytes * w.shard_fraction(cg.axis_sizes) if _moves(cg, src, w) else 0.0
                     for w in wants])


def _copies_at(cg: CostGraph, choice: Sequence[int], t: int
               ) -> list[tuple[int, np.ndarray]]:
    """The copies :func:`memory_profile` holds at point ``t`` under ``choice``, each as
    (the node asking for it, its bytes per choice of that node, the source held as
    ``choice`` makes it)."""
    out = []
    for start, end, enter, node, slot, nbytes in cg.stack_spans:
        if start <= t <= end:
            src = cg.out_sbp(node, slot, choice[node])
            out.append((enter, _copy_bytes(cg, src, [c.ins[0] for c in cg.choices[enter]],
                                           nbytes)))
    for start, end, w, node, slot, nbytes in cg.settle_spans:
        if start <= t <= end:
            out.append((w, _copy_bytes(cg, cg.out_sbp(node, slot, choice[node]),
                                       cg.choices[w], nbytes)))
    copies, askers, _ = _operand_copies(cg, choice)
    for (first, last, _), (op_node, k, src, nbytes) in zip(combined(copies), askers):
        if first <= t <= last:
            out.append((op_node, _copy_bytes(cg, src, [c.ins[k] for c in cg.choices[op_node]],
                                             nbytes)))
    return out


def _operand_copies(cg: CostGraph, choice: Sequence[int]
                    ) -> tuple[list[list], list[tuple], dict[int, list]]:
    """Operands converted for their ops under ``choice``, one copy per (value, wanted
    layout): ``[first read, last read, bytes, made, joins, bytes held while made]`` each
    (:func:`combined`; ``joins``: the tail bits of a copy XLA's combined collective may
    make, else None); beside each (its first reader's node, the operand's slot, its source
    layout, the value's bytes); and per value, for each of its reads, the copy it reads
    (None: the value itself)."""
    copies: dict[tuple[int, NdSbp], list] = {}
    askers: dict[tuple[int, NdSbp], tuple] = {}
    read_via: dict[int, list] = {}
    for t, op_node, k, node, slot, nbytes, vid, born, tail in cg.read_spans:  # tail: bits
        want = cg.choices[op_node][choice[op_node]].ins[k]
        src = cg.out_sbp(node, slot, choice[node])
        if _moves(cg, src, want):
            held_copy = copies.get((vid, want))
            if held_copy is None:
                joins = tail if tail and all(
                    c.kind in COMBINED_KINDS for c in cg.conversion_of(src, want).collectives) \
                    else None
                held_copy = copies[(vid, want)] = [
                    t, t, nbytes * want.shard_fraction(cg.axis_sizes), born, joins,
                    _steps_over(cg, src, want, nbytes)]
                askers[(vid, want)] = (op_node, k, src, nbytes)
            else:
                held_copy[1] = t
            read_via.setdefault(vid, []).append(held_copy)
        else:
            read_via.setdefault(vid, []).append(None)
    return list(copies.values()), list(askers.values()), read_via


def memory_profile(cg: CostGraph, choice: Sequence[int]) -> np.ndarray:
    """Per-device bytes at every program point for full per-node ``choice``, as XLA's
    buffer assignment counts them (``memory_analysis()``: arguments + results +
    temporaries): every argument and every result (XLA reserves a result's buffer for the
    whole program), and the temporaries live at the point that no result buffer holds
    (:func:`host`). A temporary is an op's value that is not a result, or a value's copy
    a collective converted (a shared value's settled layout, an operand's for its op, a
    stack's for its loop); the collectives' copies are never held in a result buffer: XLA's
    combined all-reduce of a data-parallel step's gradients (ViT on 8 devices) lands in
    the temporary pool, not in the buffers the optimizer writes later. An operand converted
    alike for several ops is one copy, from its first reader to its last: XLA's CSE merges
    the identical collectives, so an activation gathered for a forward dot stays gathered
    until the backward's weight-gradient dot reads it (a plan splitting the hidden dim)."""
    n = max(len(cg.graph.ops), 1)
    nin = len(cg.graph.inputs)
    held = 0.0
    results = []  # (bytes, first point)
    made = []  # an op's temporaries: (first, last, bytes)
    moved = []  # the collectives' copies: (first, last, bytes)
    made_at: dict[tuple[int, int], int] = {}  # (node, slot) making a value -> its temporary
    for k, (start, end, node, slot, nbytes) in enumerate(cg.spans):
        b = nbytes * cg.out_sbp(node, slot, choice[node]).shard_fraction(cg.axis_sizes)
        if (k < nin and k not in cg.offloaded) or k in cg.results:
            held += b
            if k >= nin:
                results.append((b, start))
        else:
            made_at[(node, slot)] = len(made)
            made.append((start, end, b))
    for start, end, node, nbytes in cg.ys_spans:  # a stack of summands, reduced after
        if cg.choices[node][choice[node]].ins[0].has_partial:
            made.append((start, end, float(nbytes)))
    for start, end, enter, node, slot, nbytes in cg.stack_spans:  # stacks converted for a loop
        read = cg.choices[enter][choice[enter]].ins[0]
        if read != cg.out_sbp(node, slot, choice[node]):
            moved.append((start, end, nbytes * read.shard_fraction(cg.axis_sizes)))
    for start, end, w, node, slot, nbytes in cg.settle_spans:  # a shared value's converted copy
        kept = cg.choices[w][choice[w]]
        src = cg.out_sbp(node, slot, choice[node])
        if _moves(cg, src, kept):
            moved.append((start, end, nbytes * kept.shard_fraction(cg.axis_sizes)))
            moved.append((start, start, _steps_over(cg, src, kept, nbytes)))
    copies, _, read_via = _operand_copies(cg, choice)  # operands converted for ops
    moved.extend(combined(copies))
    moved += [(c[0], c[0], c[5]) for c in copies if c[5]]  # held while made
    for vid, via in read_via.items():  # read only through combined collectives: the value
        k = made_at.get(cg.producer.get(vid, (-1, 0)))  # dies once they have run
        if k is not None and all(c is not None and c[4] for c in via):
            start, end, b = made[k]
            made[k] = (start, max(start, min(end, max(c[0] for c in via))), b)
        elif vid in cg.fusion[0] and all(c is not None for c in via):
            made += _cut_fusion(cg, choice, vid, max(c[0] for c in via), made, made_at)
        elif vid in cg.fusion[0] and vid in cg.producer and \
                cg.out_sbp(*cg.producer[vid], choice[cg.producer[vid][0]]).has_partial:
            # a partial sum the lowering holds stacked: pinned, so XLA fuses it into none
            # of its readers; it lives to its last read, as do the values it is made from
            (start, _, b), = _cut_fusion(cg, choice, vid, 0, made, made_at)
            made.append((start, max(start, cg.fusion[1].get(vid, start)), b))
    for t, node in cg.graph.memo("ring_dots", _ring_dots):  # a ring's blocks and slices
        if (ws := ring_workspace(cg.graph, cg.refs[node], cg.choices[node][choice[node]],
                                 cg.axis_sizes)):
            moved.append((t, t, ws))
    delta = np.zeros(n + 2)
    for start, end, b in host(made, results) + moved:
        delta[start] += b
        delta[end + 1] -= b
    return held + np.cumsum(delta)[:n]


def _ring_dots(graph) -> list[tuple[int, int]]:
    """``(program point, node)`` of the dots that may run a ring (those with batch dims,
    :mod:`shardc.rules.dot`): op ``t`` is node ``len(graph.inputs) + t``."""
    nin = len(graph.inputs)
    return [(t, nin + t) for t, op in enumerate(graph.ops) if batched_dot(op)]


COMBINE_COUNT = 256
"""Collectives per combined tuple collective: XLA:CPU's all-reduce combiner joins any
number of bytes, at most 256 operands (``cpu_compiler.cc``: ``kCombineBytes`` = int64 max,
``kCombineCount`` = 256; XLA:GPU stops at 30 MiB, ``xla_gpu_all_reduce_combine_threshold_
bytes``)."""


def combined(copies: list[list]) -> list[tuple[int, int, float]]:
    """``(first, last, bytes)`` of each converted copy ``[first read, last read, bytes,
    made, joins, ...]``, its first point moved to where it is made. The copies that join
    XLA's combined collective (a tail value's all-reduce: the gradients on their way into
    the optimizer; ``joins``: its bit and those of the tail values computed from it,
    :func:`shardc.solve.lifetimes._tail_after`) are made by one tuple collective per
    :data:`COMBINE_COUNT`, which runs once its last operand is made, and all live from there
    to their last reads (their readers wait for it): on a data-parallel step the whole
    gradient sits in temporaries at once, where separate all-reduces would each live at
    their reader. A copy from which another member is computed cannot wait for it: it runs
    alone."""
    group = [c for c in copies if c[4]]
    while group:  # drop the copies another member is computed from
        bits = 0
        for c in group:
            bits |= c[4][0]
        early = [c for c in group if c[4][1] & bits & ~c[4][0]]
        if not early:
            break
        for c in early:
            c[4] = None
        group = [c for c in group if c[4]]
    group.sort(key=lambda c: c[3])
    for i in range(0, len(group), COMBINE_COUNT):
        chunk = group[i:i + COMBINE_COUNT]
        at = max(c[3] for c in chunk) + 1
        for c in chunk:
            c[0], c[1] = at, max(c[1], at)
    return [(c[0], c[1], c[2]) for c in copies]


def host(temps: list[tuple[int, int, float]], results: list[tuple[float, int]]
         ) -> list[tuple[int, int, float]]:
    """The temporaries ``(first, last, bytes)`` no result buffer ``(bytes, first point)``
    holds. XLA's buffer assignment puts a temporary that dies before a result is written
    into that result's buffer when it fits and overlaps no other temporary held there (on a
    data-parallel train step, the forward pass's activations live in the buffers of the
    parameters the optimizer writes at the end); like its heap, largest temporary first,
    each into the smallest buffer that takes it."""
    order = sorted(range(len(results)), key=lambda j: results[j][0])
    sizes = [results[j][0] for j in order]
    written = [results[j][1] for j in order]  # the point each buffer's result is made
    busy: list[list[tuple[int, int]]] = [[] for _ in order]  # each buffer's held spans
    out = []
    for first, last, b in sorted(temps, key=lambda x: -x[2]):
        start, key = bisect.bisect_left(sizes, b), (first, -1)
        for j in range(start, len(order)):
            if written[j] <= last:
                continue
            spans = busy[j]
            p = bisect.bisect_left(spans, key)
            if (p == len(spans) or spans[p][0] > last) and (p == 0 or spans[p - 1][1] < first):
                spans.insert(p, (first, last))
                break
        else:
            out.append((first, last, b))
    return out


def _steps_over(cg: CostGraph, src: NdSbp, dst: NdSbp, nbytes: int) -> float:
    """Bytes a conversion holds while it runs beyond its result: a step's input and
    output live together, so a conversion of several steps (a gather in two, one mesh axis
    each) peaks at the largest two consecutive layouts, more than its result alone (a
    GPT's logits gathered over both axes of a (2, 4) mesh: a quarter and the whole at
    once). On a backend that runs a reduce-scatter as an all-reduce and a slice
    (``Combiner.scatter_as_all_reduce``: XLA:CPU, whose buffers ``memory_analysis()``
    counts), the step's result is the whole reduced buffer, in a buffer of its own beside
    its operand's (the micro-batched step's combined reduce-scatters: every gradient twice,
    whole, before the slices), sliced after. The source is counted as its own value."""
    conv = cg.conversion_of(src, dst)
    sizes = [nbytes * nd.shard_fraction(cg.axis_sizes) for nd in conv.layouts]
    peaks = [a + b for a, b in zip(sizes, sizes[1:])]
    if XLA_CPU.scatter_as_all_reduce:
        peaks += [c.buffer_factor * nbytes
                  for c in conv.collectives if c.kind == "reduce-scatter" and c.group]
    if not peaks:
        return 0.0
    last = sizes[-1] if sizes else nbytes * dst.shard_fraction(cg.axis_sizes)
    return max(0.0, max(peaks) - last)


def _moves(cg: CostGraph, src: NdSbp, dst: NdSbp) -> bool:
    """Converting ``src`` to ``dst`` runs a collective: its result is a buffer of its own
    (a local slice is fused into its reader)."""
    return src != dst and bool(cg.conversion_of(src, dst).collectives)


def memory_points(cg: CostGraph) -> list[dict[int, np.ndarray]]:
    """The program points with the most live data when everything is replicated."""
    _lifetimes(cg)
    replicated = [0] * len(cg.choices)  # choice 0 is all-broadcast everywhere
    live = memory_profile(cg, replicated)
    picks = sorted(np.argsort(-live, kind="stable")[:MEMORY_POINTS].tolist())
    return [memory_point(cg, t) for t in picks]
