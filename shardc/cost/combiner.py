"""XLA's collective combiners, run on a plan: which planned collectives compile to one.

XLA merges collectives of one kind, reduction, element type and device groups into one
tuple collective where none depends on another (``CombineInstructionsByKey``, greedy in
post order). The cost model's shares (:mod:`shardc.cost.combine`) price that during the
search; the plan's predicted figures and collective counts are made here, by running the
combiner's own rule on the plan's collectives and the program's dependences, so the
predicted count is the compiled one (``Plan.verify``).

Which kinds combine, and up to what size, is the backend's
(:class:`shardc.cost.combine.Combiner`).

References:
  XLA ``collective_combiner_utils.h`` (``CombineInstructionsByKey``), ``all_reduce_key.cc``
  (the all-reduce key), ``hlo_computation.cc`` (``MakeInstructionPostOrder``: operands
  first, first operand first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.cost.combine import Combiner
from shardc.ir.flow import reads
from shardc.ir.graph import Graph

__all__ = ["Pending", "Use", "combine_groups", "post_order"]


@dataclass(frozen=True, slots=True)
class Pending:
    """A planned collective a combiner may join: the ``position``-th collective of reshard
    ``reshard``; ``key`` what must match to join (family, mesh axes, reduction, dtype, loop
    level; a ring's sends: family, axis, None, the loop body or branch holding the ring,
    loop level), ``nbytes`` its result bytes."""

    reshard: int
    position: int
    key: tuple
    nbytes: float


@dataclass(frozen=True, slots=True)
class Use:
    """Where a planned reshard sits in the program: it converts value ``value`` for
    ``consumer`` (an op id, ``-1 - j`` for output ``j``, or None where the value itself is
    settled in the new layout for all its readers). ``apart``: it makes a partial operand
    of a sum whose result is reduced where it is made (the lowering leaves that operand
    unconstrained): XLA reduces the sum's partial summands before it instead, and those
    reductions do not wait for this one. ``ring``: the sends of a ring ``consumer`` runs
    (:mod:`shardc.cost.ring`), the index of the reshard that carries them (this one's, or
    an earlier ring's passing the same blocks, which this one reuses): the product waits
    for them, though it reads ``value`` (or a repeat of it) through no conversion."""

    value: int
    consumer: int | None
    apart: bool = False
    ring: int | None = None


def post_order(graph: Graph, uses: Sequence[Use], via: dict[tuple[int, int], int],
               links: tuple[dict[int, list[int]], dict[int, list[int]]] | None = None
               ) -> list[int]:
    """The reshards (indices into ``uses``) in the order XLA's
    ``HloComputation::MakeInstructionPostOrder`` visits the collectives they compile to: a
    depth-first walk from the outputs, in order, each instruction after its operands, first
    operand first. ``via[(consumer, value id)]`` is the reshard a read goes through (one
    converted the same way for several readers is one, as XLA's CSE makes it). ``links``:
    :func:`_links` of ``uses``, where the caller has them."""
    producer = graph.producers()
    ops = graph.memo("ops by id", lambda g: {op.id: op for op in g.ops})
    settles, rings = links or _links(graph, uses)

    def made(vid: int) -> tuple | None:
        chain = settles.get(vid)
        if chain:
            return ("r", chain[-1])
        return ("o", producer[vid].id) if vid in producer else None

    def operands(node: tuple) -> list[tuple]:
        kind, key = node
        if kind == "r":
            u = uses[key]
            chain = settles.get(u.value, [])
            if key in chain:
                at = chain.index(key)
                before = ("r", chain[at - 1]) if at else (
                    ("o", producer[u.value].id) if u.value in producer else None)
                return [before] if before else []
            return [n for n in [made(u.value)] if n]
        out = []
        for _, v in reads(ops[key]):
            if v.is_const:
                continue
            n = ("r", via[(key, v.id)]) if (key, v.id) in via else made(v.id)
            if n:
                out.append(n)
        return out + [("r", r) for r in rings.get(key, ())]

    roots = [("r", via[(-1 - j, v.id)]) if (-1 - j, v.id) in via else made(v.id)
             for j, v in enumerate(graph.outputs) if not v.is_const]
    roots += [("r", i) for i in range(len(uses))] + [("o", op.id) for op in graph.ops]
    seen: set = set()
    order: list[int] = []
    for root in roots:
        if root is None or root in seen:
            continue
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                if node[0] == "r":
                    order.append(node[1])
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            stack.extend((n, False) for n in reversed(operands(node)) if n not in seen)
    return order


def combine_groups(graph: Graph, uses: Sequence[Use], via: dict[tuple[int, int], int],
                   pending: Sequence[Pending], combiner: Combiner) -> list[int]:
    """Per pending collective, the combined collective it joins (an id shared by its
    members) or -1 where it runs alone: XLA's ``CombineInstructionsByKey`` run on the plan.
    In post order (:func:`post_order`), the first collective not yet taken opens a set;
    the later ones of its key join it until one depends on a member, would pass the byte
    limit, or the set is full; repeat until every collective is taken. A combined set then
    depends on what each of its members depended on.

    References:
      XLA ``collective_combiner_utils.h`` (``CombineInstructionsByKey``),
      ``all_reduce_key.cc`` (the key: reduction, element type, replica groups).
    """
    links = _links(graph, uses)
    order = post_order(graph, uses, via, links)
    rank = {r: k for k, r in enumerate(order)}
    seq = sorted(range(len(pending)),
                 key=lambda i: (rank.get(pending[i].reshard, len(order)), pending[i].position))
    by_reshard: dict[int, list[int]] = {}
    for i in seq:
        by_reshard.setdefault(pending[i].reshard, []).append(i)
    anc = _ancestors(graph, uses, via, pending, by_reshard, links)
    group = [-1] * len(pending)
    left, gid = seq, 0
    while left:
        take, mask, total, key, kept, stop = [], 0, 0.0, None, [], False
        for i in left:
            p = pending[i]
            key = p.key if key is None else key
            if stop or p.key != key:
                kept.append(i)
            elif p.nbytes > combiner.threshold_bytes:
                continue  # never combined
            elif total + p.nbytes > combiner.threshold_bytes or anc[i] & mask:
                stop = True
                kept.append(i)
            else:
                take.append(i)
                mask |= 1 << i
                total += p.nbytes
                stop = len(take) >= combiner.threshold_count
        if len(take) > 1:
            for i in take:
                group[i] = gid
            gid += 1
            joint = mask
            for i in take:
                joint |= anc[i]
            for j in range(len(anc)):
                if anc[j] & mask or j in take:
                    anc[j] |= joint & ~(1 << j)
        left = kept
    return group


def _links(graph: Graph, uses: Sequence[Use]
           ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(:func:`_settles`, :func:`_rings`) of ``uses``: what orders and chains the reshards
    beside the program's own dataflow, found once per combine."""
    return _settles(graph, uses), _rings(uses)


def _settles(graph: Graph, uses: Sequence[Use]) -> dict[int, list[int]]:
    """value id -> the reshards (indices into ``uses``) that settle it for all its readers,
    in order: those of no one reader, or read by the op making the value."""
    producer = graph.producers()
    settles: dict[int, list[int]] = {}
    for i, u in enumerate(uses):
        p = producer.get(u.value)
        if u.consumer is None or p is not None and u.consumer == p.id:
            settles.setdefault(u.value, []).append(i)
    return settles


def _rings(uses: Sequence[Use]) -> dict[int, list[int]]:
    """op id -> the reshards (indices into ``uses``) carrying its rings' sends."""
    rings: dict[int, list[int]] = {}
    for u in uses:
        if u.ring is not None:
            rings.setdefault(u.consumer, []).append(u.ring)
    return rings


def _ancestors(graph: Graph, uses: Sequence[Use], via: dict[tuple[int, int], int],
               pending: Sequence[Pending], by_reshard: dict[int, list[int]],
               links: tuple[dict[int, list[int]], dict[int, list[int]]]) -> list[int]:
    """Per pending collective, the bit set of the pending collectives it depends on
    (``links``: :func:`_links` of ``uses``)."""
    own = {r: sum(1 << i for i in ids) for r, ids in by_reshard.items()}
    settles, rings = links
    made: dict[int, int] = {}  # value id -> what it depends on, as its readers see it
    done: dict[int, int] = {}  # reshard -> what its result depends on

    def reshard(r: int, before: int) -> int:
        if r not in done:
            done[r] = before | own.get(r, 0)
        return done[r]

    def settled(vid: int, base: int) -> int:
        for r in settles.get(vid, []):
            base = reshard(r, base)
        return base

    for v in graph.inputs:
        made[v.id] = settled(v.id, 0)
    for op in graph.ops:
        deps = 0
        for _, v in reads(op):
            if v.is_const:
                continue
            base = made.get(v.id, 0)
            r = via.get((op.id, v.id))
            after = reshard(r, base) if r is not None else base
            deps |= base if r is not None and uses[r].apart else after
        for r in rings.get(op.id, ()):
            deps |= reshard(r, made.get(uses[r].value, 0))
        for v in op.outputs:
            made[v.id] = settled(v.id, deps)
    anc = [0] * len(pending)
    for r, ids in by_reshard.items():
        u = uses[r]
        base = done.get(r, made.get(u.value, 0)) & ~own[r]
        for k, i in enumerate(ids):
            anc[i] = base | sum(1 << j for j in ids[:k])
    return anc
