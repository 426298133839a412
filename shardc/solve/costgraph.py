"""The cost graph the solvers work on: its records and the passes on it.

One node per graph input (its choices: the NdSbps it may be laid out with) and per op (its
choices: the rule's strategies); one edge per producer→consumer value with a resharding
cost matrix ``R[a, b]`` (seconds). Memory is a list of sampled program points, each a sum of
per-node, per-choice byte vectors that must stay under the budget (:mod:`shardc.solve.memory`).
:class:`CostGraph` holds them with the records it is made of (:class:`Edge`, :class:`Settle`,
:class:`~shardc.solve.fixed.Fixed`); :func:`shardc.solve.problem.build` builds it from a
program, and :func:`check_cost_graph` checks what the solvers assume of it.

``merge_followers`` shrinks the problem before any search:

* an op whose inputs all come from one node *follows* it (Alpa): it takes the operand's
  layout as it is where a strategy allows (else its cheapest), so elementwise / reshape /
  transpose / softmax chains add no variables;
* an op with no inputs from other nodes (iota, broadcast constants) is absorbed into its only
  consumer, choosing its best layout per consumer choice (exact: nothing else depends on it).

References:
  Alpa (OSDI'22) §4.2 ILP formulation and follow-merging; OneFlow ``sbp_graph.cpp``
  (eliminating single-input nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU
from shardc.cost.comm import Conversion, conversion
from shardc.errors import CostGraphError as CostGraphError
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.sbp import Broadcast, NdSbp, Split
from shardc.solve.fixed import NOTHING_FIXED, Fixed

__all__ = ["by_lists", "CostGraph", "CostGraphError", "Edge", "Settle",
           "check_cost_graph"]


def by_lists(cache: dict, lists: tuple[list, list], rest: tuple, make: Callable[..., Any],
             *args) -> Any:
    """``make(*args)`` kept in ``cache`` per pair of choice lists (by identity) and ``rest``: the
    entry holds the two lists, so their ids are not reused while it lives, and an id that
    names another list now misses. Strategy lists are shared by the ops of one signature,
    the layers of a program and the programs a frontier builds
    (:class:`shardc.solve.problem.BuildShare`): what is computed between two lists is
    computed once."""
    key = (id(lists[0]), id(lists[1]), *rest)
    hit = cache.get(key)
    if hit is None or hit[0] is not lists[0] or hit[1] is not lists[1]:
        hit = cache[key] = (lists[0], lists[1], make(*args))
    return hit[2]


@dataclass
class Edge:
    u: int
    v: int
    cost: np.ndarray  # [len(choices[u]), len(choices[v])] seconds
    value: Value
    k: int = -1  # which input of the consumer op (-1: a tie back to a graph input)
    src: tuple[int, int] = (-1, 0)  # the (node, slot) whose layouts the rows are


@dataclass(frozen=True, eq=False)
class Settle:
    """The layout a value used more than once is converted to, once, before its uses.

    Every use of a value in the same layout reads one conversion (XLA emits one all-reduce of
    a gradient that two optimizer slots read, one all-gather of a parameter that the forward
    and the backward pass read); pricing each use's conversion alone would charge it per
    use. A settle node chooses that shared layout (never partial); its uses convert from it.
    """

    value: Value


@dataclass
class CostGraph:
    graph: Graph
    axis_sizes: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: Cluster
    #: the collective kinds the backend combines, whose latencies values share
    combined: frozenset[str] = XLA_CPU.kinds
    choices: list[list] = field(default_factory=list)  # NdSbp (inputs) or Strategy (ops)
    refs: list = field(default_factory=list)  # graph input Value or Op per node
    cost: list[np.ndarray] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    memory: list[dict[int, np.ndarray]] = field(default_factory=list)  # per sampled point
    producer: dict[int, tuple[int, int]] = field(default_factory=dict)  # value id -> node, slot
    follows: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # v -> (u, f[a])
    spans: list = field(default_factory=list)  # (first, last program point, node, slot, bytes)
    stack_spans: list = field(default_factory=list)  # (first, last, enter, node, slot, bytes)
    ys_spans: list = field(default_factory=list)  # (first, last, ys exit node, bytes)
    results: set = field(default_factory=set)  # indices of spans holding a graph result
    #: (t, op node, input k, node, slot, bytes, value id, made) per operand read, ``made``
    #: the program point that makes the value and ``combined`` whether its collectives join
    #: XLA's combined tuple collective (a tail value's: see ``cost/combine.py``)
    read_spans: list = field(default_factory=list)
    settle_spans: list = field(default_factory=list)  # (first, last, settle, node, slot, bytes)
    #: (ids of the values XLA fuses into their readers, value id -> its last read before a
    #: fused reader extends it, value id -> the program point making it): ``solve/lifetimes.py``
    fusion: tuple = (frozenset(), {}, {})
    conversions: dict = field(default_factory=dict)  # (src, dst) -> Conversion
    #: where a producer's and a consumer's layouts agree (:meth:`_agree`), per pair of
    #: choice lists (:func:`by_lists`), for :meth:`_same_layout`
    agreements: dict = field(default_factory=dict)
    terms: dict = field(default_factory=dict)  # (srcs, dsts) -> reshard_matrix's cost terms
    carried: set = field(default_factory=set)  # input nodes tied to an output (the state)
    resident: set = field(default_factory=set)  # other inputs kept on the devices: no feed
    offloaded: frozenset = frozenset()  # state inputs kept in host memory between steps
    settle: dict = field(default_factory=dict)  # value id -> its Settle node
    order: list = field(default_factory=list)  # every node, producers before their uses
    ties: list = field(default_factory=list)  # (output index, input index) pairs
    fixed: Fixed = NOTHING_FIXED
    adjacency: tuple = ()  # (edges, their count, node -> its edges): :mod:`shardc.solve.descent`
    #: (follows, its length, per node :meth:`resolve`'s answer): :meth:`decode`'s table,
    #: dropped by the pass that changes ``follows`` (:meth:`merge_followers`); a caller that
    #: replaced an entry of ``follows`` by hand, keeping its length, must drop it too
    resolved: tuple = ()
    #: (follows, its length, choices, the bytes each choice holds): the table of
    #: :func:`shardc.solve.descent.lean`'s ties, dropped with ``resolved``
    held: tuple = ()

    # ---- construction ---------------------------------------------------------------------
    def out_sbp(self, node: int, slot: int, choice: int) -> NdSbp:
        c = self.choices[node][choice]
        return c if isinstance(c, NdSbp) else c.outs[slot]

    def out_sbps(self, node: int, slot: int) -> list[NdSbp]:
        return [self.out_sbp(node, slot, a) for a in range(len(self.choices[node]))]

    def reshard_matrix(self, src: Sequence[NdSbp], dst: Sequence[NdSbp], nbytes: float,
                       alpha_scale: float = 1.0) -> np.ndarray:
        usrc, si = _unique(src)
        udst, di = _unique(dst)
        key = (tuple(usrc), tuple(udst))
        terms = self.terms.get(key)
        if terms is None:  # the pairs' distinct collectives, and how often each pair runs one
            convs = [self.conversion_of(a, b) for a in usrc for b in udst]
            steps: dict = {}
            for c in convs:
                for step in c.collectives:
                    steps.setdefault(step, len(steps))
            runs = np.zeros((len(convs), max(len(steps), 1)))
            for i, c in enumerate(convs):
                for step in c.collectives:
                    runs[i, steps[step]] += 1
            terms = (tuple(steps), runs)
            self.terms[key] = terms
        steps, runs = terms
        model = self.cluster.collective_model
        t = np.array([c.seconds(nbytes, model, alpha_scale, self.combined) for c in steps]
                     or [0.0])
        small = (runs @ t).reshape(len(usrc), len(udst))
        return small[np.ix_(si, di)]

    def conversion_of(self, a: NdSbp, b: NdSbp) -> Conversion:
        """:func:`shardc.cost.comm.conversion` of ``a`` to ``b`` on this graph's mesh and
        cluster, kept per graph (its copies share the dict)."""
        key = (a, b)
        hit = self.conversions.get(key)
        if hit is None:
            hit = conversion(a, b, self.axis_sizes, self.axis_names, self.cluster)
            self.conversions[key] = hit
        return hit

    @property
    def live(self) -> list[int]:
        """Nodes that are decided (not following another), producers first."""
        return [i for i in self.order if i not in self.follows]

    def resolve(self, node: int) -> tuple[int, np.ndarray]:
        """The variable node deciding ``node``, and the map from its choice to ``node``'s."""
        f = np.arange(len(self.choices[node]))
        while node in self.follows:
            node, g = self.follows[node]
            f = f[g]
        return node, f

    def decode(self, assignment: dict[int, int]) -> list[int]:
        """Choices of every node from the choices of the live ones (each node's leader and
        choice map found once per graph: a frontier decodes a few hundred plans)."""
        kept = self.resolved
        if not (kept and kept[0] is self.follows and kept[1] == len(self.follows)
                and len(kept[2]) == len(self.choices)):
            kept = self.resolved = (self.follows, len(self.follows),
                                    [self.resolve(i) for i in range(len(self.choices))])
        return [f.item(assignment[root]) for root, f in kept[2]]

    # ---- follow merging -------------------------------------------------------------------
    def _same_layout(self, ins: list[Edge], u: int, v: int) -> np.ndarray:
        """[|Su|, |Sv|] True where every edge from u into v needs no conversion at all."""
        ok = np.ones((len(self.choices[u]), len(self.choices[v])), dtype=bool)
        for e in ins:
            if e.k < 0:
                continue  # a tie or a re-pointed edge: no input slot of v to compare
            node, slot = e.src
            _, g = self.resolve(node)  # u's choice -> the producer's choice
            ok &= by_lists(self.agreements, (self.choices[node], self.choices[v]), (slot, e.k),
                           self._agree, node, slot, v, e.k)[g]
        return ok

    def _agree(self, node: int, slot: int, v: int, k: int) -> np.ndarray:
        """[|node's choices|, |v's|] True where ``node``'s result ``slot`` is laid out as
        ``v`` reads its operand ``k``."""
        index: dict = {}
        si = np.array([index.setdefault(x, len(index)) for x in self.out_sbps(node, slot)])
        di = np.array([index.setdefault(c.ins[k], len(index)) for c in self.choices[v]])
        return si[:, None] == di[None, :]

    def _generates(self, v: int, ins: list[Edge]) -> bool:
        """``v`` makes far more data than it reads from the node it would follow (random
        bits from a key, a bias broadcast over the batch): at least a device count's worth
        more. Following would fix its output to its tiny operand's layout (replicated), so
        the whole chain it starts runs replicated and is sliced where it meets split data;
        as a node of its own, its output takes the layout its consumers want, each device
        making its own slice."""
        made = sum(o.nbytes for o in self.refs[v].outputs)
        return made >= math.prod(self.axis_sizes) * sum(e.value.nbytes for e in ins) > 0

    def merge_followers(self) -> None:
        ins_of: dict[int, list[Edge]] = {}
        outs_of: dict[int, list[Edge]] = {}
        fresh_of: dict[tuple, np.ndarray] = {}
        at = self._memory_at()
        for e in self.edges:
            ins_of.setdefault(e.v, []).append(e)
            outs_of.setdefault(e.u, []).append(e)
        for v in self.order:
            ins = ins_of.get(v, [])
            if not ins or not isinstance(self.refs[v], Op):
                continue
            if len({e.u for e in ins}) > 1:
                if not facts(self.refs[v].name).elementwise:
                    continue
                # an elementwise op of several producers follows its largest operand (its
                # output layout is one of its operands'), one computed from the inputs
                # before a constant broadcast to the same size (the 1/N of a mean: following
                # it would replicate the loss's backward); the others' edges are re-pointed
                # to that operand's node (Alpa / XLA "follow")
                lead = max(ins, key=lambda e: (e.value.nbytes, bool(ins_of.get(e.u)), -e.k))
                u = lead.u
                others = [e for e in ins if e.u != u]
                ins = [e for e in ins if e.u == u]
            else:
                u, others = ins[0].u, []
            if self._generates(v, ins):
                continue  # its own layout is a decision: see _generates
            local = self.cost[v][None, :] + sum(e.cost for e in ins)  # [|Su|, |Sv|]
            # follow: take the operand's layout as it is (no conversion, not even a free
            # slice) and split nothing the operand does not (a broadcast_in_dim B -> S(d)
            # would save its own compute but make every consumer of a replicated chain
            # re-gather); the cheapest such strategy, else the cheapest keeping the layout,
            # else the cheapest
            same = self._same_layout(ins, u, v)
            if not same.any(axis=1).all():
                continue  # some layout of u must convert first: a decision of v's own
            f = np.argmin(local, axis=1)
            ks = tuple(sorted({e.k for e in ins if e.k >= 0}))
            key = (id(self.choices[v]), ks)  # ops of one signature share their strategy list
            if key not in fresh_of:
                fresh_of[key] = _fresh_splits(self.choices[v], ks)
            fresh = fresh_of[key]
            for allowed in (same, same & ~fresh[None, :]):
                masked = np.where(allowed, local, np.inf)
                g = np.argmin(masked, axis=1)
                ok = np.isfinite(masked[np.arange(len(g)), g])
                f[ok] = g[ok]
            self.cost[u] = self.cost[u] + local[np.arange(len(f)), f]
            self.follows[v] = (u, f)
            gone = {id(e) for e in ins}
            outs_of[u] = [e for e in outs_of.get(u, []) if id(e) not in gone]
            ins_of[v] = []
            for e in others:  # a -> v becomes a -> u, priced at v's choice for u's
                e.v, e.cost, e.k = u, e.cost[:, f], -2
                ins_of.setdefault(u, []).append(e)
            for e in outs_of.pop(v, []):
                e.u, e.cost = u, e.cost[f, :]
                if e.v == u:  # a tie back to u: a cost on u alone
                    self.cost[u] = self.cost[u] + np.diag(e.cost)
                    ins_of[u] = [x for x in ins_of[u] if x is not e]
                else:
                    outs_of[u].append(e)
            _move_memory(at, v, u, f)
        self.edges = [e for es in outs_of.values() for e in es]
        self._absorb_sources()
        self.resolved = self.held = ()

    def _absorb_sources(self) -> None:
        """Fold ops with no inputs from other nodes (iota, broadcasts of constants, and what
        follows them) into their only consumer: the best choice of such a source given its
        consumer's choice is exact, since nothing else depends on it."""
        ins_of: dict[int, list[Edge]] = {}
        outs_of: dict[int, list[Edge]] = {}
        at = self._memory_at()
        for e in self.edges:
            ins_of.setdefault(e.v, []).append(e)
            outs_of.setdefault(e.u, []).append(e)
        for u in self.live:
            outs = outs_of.get(u, [])
            if ins_of.get(u) or not outs or not isinstance(self.refs[u], Op):
                continue
            v = outs[0].v
            if any(e.v != v for e in outs) or v == u:
                continue
            total = self.cost[u][:, None] + sum(e.cost for e in outs)  # [|Su|, |Sv|]
            g = np.argmin(total, axis=0)
            self.cost[v] = self.cost[v] + total[g, np.arange(len(g))]
            self.follows[u] = (v, g)
            gone = {id(e) for e in outs}
            ins_of[v] = [e for e in ins_of.get(v, []) if id(e) not in gone]
            outs_of[u] = []
            _move_memory(at, u, v, g)
        self.edges = [e for es in outs_of.values() for e in es]

    def _memory_at(self) -> dict[int, list[dict]]:
        """Node -> the memory points that price it (an index: merging a node moves its
        share of each such point to the node it joins)."""
        at: dict[int, list[dict]] = {}
        for point in {id(p): p for p in self.memory}.values():  # each point once
            for node in point:
                at.setdefault(node, []).append(point)
        return at


def _move_memory(at: dict[int, list[dict]], src: int, dst: int, pick: np.ndarray) -> None:
    """Move ``src``'s share of every memory point pricing it onto ``dst`` (``src`` merged
    into ``dst``, taking choice ``pick[c]`` for each choice ``c`` of ``dst``)."""
    for point in at.pop(src, ()):
        vec = point.pop(src)[pick]
        if dst in point:
            point[dst] = point[dst] + vec
        else:
            point[dst] = vec
            at.setdefault(dst, []).append(point)


def check_cost_graph(cg: CostGraph) -> None:
    """Verify what the solvers assume of ``cg``; raise :class:`CostGraphError` naming the
    broken invariant. Run after building and after every pass that transforms a cost graph
    (follow-merging, folding into a quotient, restricting choices):

    * every node has a ref, a non-empty choice list and one finite, non-negative cost per
      choice;
    * ``order`` lists every node once; a follower follows a live node through a choice map
      map with one entry per leader choice, each one of the follower's own choices;
    * every edge joins two distinct live nodes with a ``[|S_u|, |S_v|]`` finite,
      non-negative cost matrix;
    * every memory point holds live nodes only, one byte count per choice.
    """
    sizes = [len(ch) for ch in cg.choices]
    _check_nodes(cg, sizes)
    _check_follows(cg, sizes)
    live = set(cg.live)
    _check_edges(cg, sizes, live)
    _check_memory(cg, sizes, live)


def _check_nodes(cg: CostGraph, sizes: list[int]) -> None:
    """Each node's ref, choices and costs, and the order (:func:`check_cost_graph`)."""
    n = len(cg.choices)
    if len(cg.refs) != n or len(cg.cost) != n:
        raise CostGraphError(f"{n} choice lists but {len(cg.refs)} refs and {len(cg.cost)} "
                             "cost vectors: every node needs one of each")
    # the costs' values are tested on all nodes (edges) at once; the search that names the
    # first one broken runs only when one is (a frontier checks every graph it cuts)
    i = next((i for i in range(n) if not sizes[i] or np.shape(cg.cost[i]) != (sizes[i],)),
             None)
    if i is not None:
        if not sizes[i]:
            raise CostGraphError(f"node {i} ({cg.refs[i]}) has no choices")
        raise CostGraphError(f"node {i} ({cg.refs[i]}): cost vector of shape "
                             f"{np.shape(cg.cost[i])} for {sizes[i]} choices")
    if n and not _finite_non_negative(cg.cost):
        i = next(i for i in range(n) if not _finite_non_negative([cg.cost[i]]))
        raise CostGraphError(f"node {i} ({cg.refs[i]}): costs must be finite and >= 0")
    if sorted(cg.order) != list(range(n)):
        raise CostGraphError(f"order must list each of the {n} nodes once, got "
                             f"{len(cg.order)} entries ({len(set(cg.order))} distinct)")


def _wrong_map(v: int, u: int, f: np.ndarray, sizes: list[int]) -> CostGraphError:
    return CostGraphError(f"node {v} follows {u} with a choice map of length {len(f)} "
                          f"into {sizes[v]} choices; it must map each of "
                          f"{u}'s {sizes[u]} choices to one of {v}'s")


def _check_follows(cg: CostGraph, sizes: list[int]) -> None:
    """Each follower's leader and choice map (:func:`check_cost_graph`)."""
    n = len(cg.choices)
    # the leaders and the maps' lengths are plain ints, each tested in turn; the maps'
    # entries all at once (a pinned copy of GPT-2's graph has 5,700 followers), the search
    # naming the first broken one running only when one is
    maps = list(cg.follows.items())
    for v, (u, f) in maps:
        if not (0 <= u < n) or u == v:
            raise CostGraphError(f"node {v} follows {u}, which is not another node")
        if len(f) != sizes[u]:
            raise _wrong_map(v, u, f, sizes)
    if maps:
        entries = np.concatenate([f for _, (_, f) in maps])
        bounds = np.repeat([sizes[v] for v, _ in maps], [len(f) for _, (_, f) in maps])
        if np.any(entries < 0) or np.any(entries >= bounds):
            raise _wrong_map(*next((v, u, f) for v, (u, f) in maps
                                   if np.any(f < 0) or np.any(f >= sizes[v])), sizes)


def _check_edges(cg: CostGraph, sizes: list[int], live: set[int]) -> None:
    """Each edge's ends and cost matrix (:func:`check_cost_graph`)."""
    for k, e in enumerate(cg.edges):
        if e.u not in live or e.v not in live:
            raise CostGraphError(f"edge {k} ({e.u} -> {e.v}, value {e.value}) touches a node "
                                 "that follows another: re-point it to the leader")
        if e.u == e.v:
            raise CostGraphError(f"edge {k} is a self-loop on node {e.u}: fold its diagonal "
                                 "into the node's cost")
        want = (sizes[e.u], sizes[e.v])
        if e.cost.shape != want:
            raise CostGraphError(f"edge {k} ({e.u} -> {e.v}): cost matrix {e.cost.shape}, "
                                 f"expected {want}")
    if cg.edges and not _finite_non_negative([e.cost.ravel() for e in cg.edges]):
        k, e = next((k, e) for k, e in enumerate(cg.edges)
                    if not _finite_non_negative([e.cost.ravel()]))
        raise CostGraphError(f"edge {k} ({e.u} -> {e.v}): costs must be finite and >= 0")


def _check_memory(cg: CostGraph, sizes: list[int], live: set[int]) -> None:
    """Each memory point's nodes and byte counts (:func:`check_cost_graph`)."""
    for t, point in enumerate(cg.memory):
        stray = point.keys() - live
        if stray:
            raise CostGraphError(f"memory point {t} counts node {min(stray)}, which is not "
                                 "live")
        bad = next(((i, vec) for i, vec in point.items() if np.shape(vec) != (sizes[i],)),
                   None)
        if bad is not None:
            i, vec = bad
            raise CostGraphError(f"memory point {t}, node {i}: {np.shape(vec)} byte "
                                 f"counts for {sizes[i]} choices")


def _finite_non_negative(arrays: Sequence[np.ndarray]) -> bool:
    """Every entry of ``arrays`` (1-D) finite and >= 0."""
    flat = np.concatenate(arrays)
    return bool(np.isfinite(flat).all() and (flat >= 0).all())


def _fresh_splits(strategies: Sequence, followed: Sequence[int]) -> np.ndarray:
    """Per strategy: True when some output is split along a mesh axis on which every
    ``followed`` input is broadcast (the op would cut a replicated value on its own)."""
    out = np.zeros(len(strategies), dtype=bool)
    for b, s in enumerate(strategies):
        for axis in range(len(s.outs[0]) if s.outs else 0):
            if (all(isinstance(s.ins[k].sbps[axis], Broadcast) for k in followed)
                    and any(isinstance(nd.sbps[axis], Split) for nd in s.outs)):
                out[b] = True
                break
    return out


def _unique(items: Sequence) -> tuple[list, np.ndarray]:
    index: dict = {}
    idx = np.array([index.setdefault(x, len(index)) for x in items], dtype=np.int64)
    return list(index), idx
