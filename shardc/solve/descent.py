"""Coordinate descent over the cost graph (iterated conditional modes).

Each live node in turn takes the choice that minimises its own cost plus the cost of its
edges with the neighbours held fixed, plus ``memory_weight`` times its bytes at the sampled
memory points; sweeps repeat until nothing changes. Several starts (all-replicated, and each
node at its cheapest compute) are tried and the cheapest end point is kept. Used to warm-start
the ILP and to plan graphs the ILP cannot hold.

References:
  OneFlow ``auto_parallel/sbp_graph.cpp`` (block coordinate descent over SBP choices);
  AutoDDL (Chen et al., 2023) coordinate descent over SBP strategies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from shardc.ir.flow import tail_values
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.sbp import NdSbp
from shardc.solve.costgraph import CostGraph, Settle

__all__ = ["batch_nodes", "completions", "descend", "fixed_inputs", "from_inputs", "greedy",
           "lean", "LEAN_WEIGHT", "memory", "objective", "REACH_DEPTH", "solve", "starts",
           "tail_nodes", "TIE_WEIGHT"]


class _Adjacency:
    """Per live node, its edges seen from it: ``near[i]`` lists ``(other, rows, into)`` per
    edge, ``rows[x[other]]`` the edge's costs over ``i``'s choices given ``other``'s choice
    (the edge's matrix, or its transpose where ``i`` is the edge's ``u``) and ``into``
    whether the edge comes into ``i``; ``settles`` the live nodes that settle a value;
    :meth:`uses` ``(v, matrix)`` per edge out of a node, :meth:`ins` ``(u, matrix)`` per
    edge into it (made on first use: only the greedy reads them). Descent reads these a
    million times a frontier: built once per edge list."""

    __slots__ = ("near", "settles", "_uses", "_ins", "_flat")

    def __init__(self, cg: CostGraph):
        near: dict[int, list] = {i: [] for i in cg.live}
        for e in cg.edges:
            near[e.u].append((e.v, e.cost.T, False))
            near[e.v].append((e.u, e.cost, True))
        self.near = near
        self.settles = frozenset(i for i in near if isinstance(cg.refs[i], Settle))
        self._uses: dict[int, list] | None = None
        self._ins: dict[int, list] | None = None
        self._flat: tuple | None = None

    def flat(self, cg: CostGraph) -> tuple:
        """The live nodes' and the edges' costs in one array each, with each node's and
        each edge's offset and each edge's ends and row length (:func:`objective` sums a
        plan's entries of them in two gathers; a frontier asks a few hundred times, each a
        Python sum over some 6,000 nodes and edges before)."""
        if self._flat is None:
            live = np.array(list(self.near), dtype=np.int64)
            node_cost = [cg.cost[i] for i in live.tolist()]
            node_at = np.cumsum([0] + [len(c) for c in node_cost])[:-1]
            edges = cg.edges
            u = np.array([e.u for e in edges], dtype=np.int64)
            v = np.array([e.v for e in edges], dtype=np.int64)
            cols = np.array([e.cost.shape[1] for e in edges], dtype=np.int64)
            edge_at = np.cumsum([0] + [e.cost.size for e in edges])[:-1]
            self._flat = (live, np.concatenate(node_cost) if node_cost else np.zeros(0),
                          np.asarray(node_at, dtype=np.int64), u, v, cols,
                          np.concatenate([e.cost.ravel() for e in edges]) if edges
                          else np.zeros(0), np.asarray(edge_at, dtype=np.int64),
                          len(cg.choices))
        return self._flat

    def uses(self, i: int) -> list:
        if self._uses is None:
            self._uses = {node: [(j, rows.T) for j, rows, into in near if not into]
                          for node, near in self.near.items()}
        return self._uses[i]

    def ins(self, i: int) -> list:
        if self._ins is None:
            self._ins = {node: [(j, rows) for j, rows, into in near if into]
                         for node, near in self.near.items()}
        return self._ins[i]


def _adjacency(cg: CostGraph) -> _Adjacency:
    """``cg``'s :class:`_Adjacency`, kept with it while its edge list is the same list of
    the same length (a solve descends a hundred times on one graph; a pass that changes the
    edges makes a new list, and one that appends to it changes its length) and shared: not
    to be changed."""
    kept = cg.adjacency
    if kept and kept[0] is cg.edges and kept[1] == len(cg.edges):
        return kept[2]
    adj = _Adjacency(cg)
    cg.adjacency = (cg.edges, len(cg.edges), adj)
    return adj


def _node_memory(cg: CostGraph) -> dict[int, np.ndarray]:
    mem: dict[int, np.ndarray] = {}
    for point in cg.memory:
        for i, vec in point.items():
            mem[i] = np.maximum(mem[i], vec) if i in mem else vec
    return mem


def descend(cg: CostGraph, start: dict[int, int], memory_weight: float = 0.0,
            max_sweeps: int = 50, mem: Mapping[int, np.ndarray] | None = None,
            kept: Collection[int] = ()) -> dict[int, int]:
    """Coordinate descent from ``start`` on time plus ``memory_weight`` x each node's bytes
    (``mem``: per node, per choice; by default its bytes at the sampled memory points); the
    nodes in ``kept`` keep their choices."""
    adj = _adjacency(cg)
    near, cost = adj.near, cg.cost
    if mem is None:
        mem = _node_memory(cg) if memory_weight else {}
    x = dict(start)
    order = cg.live
    # a node is looked at again only once a neighbour has moved: otherwise its local cost
    # is what it was, and it would stay (the sweeps' end point is unchanged); a node of one
    # choice (an input pinned to its layout) never moves, so is never looked at
    movable = {i for i in order if len(cost[i]) > 1}.difference(kept)
    dirty = set(movable)
    for _ in range(max_sweeps):
        changed = False
        for i in order:
            if i not in dirty:
                continue
            dirty.discard(i)
            local = cost[i].copy()
            for j, rows, _ in near[i]:
                local += rows[x[j]]
            if i in mem:
                local += memory_weight * mem[i]
            best = int(local.argmin())
            if local[best] < local[x[i]] - 1e-15:
                x[i] = best
                changed = True
                dirty.update(j for j, _, _ in near[i] if j in movable)
        if not changed:
            break
    return x


def objective(cg: CostGraph, x: dict[int, int]) -> float:
    """The predicted seconds of the plan ``x`` (a choice per live node): its nodes' costs
    and its edges' (:meth:`_Adjacency.flat`)."""
    live, node_cost, node_at, u, v, cols, edge_cost, edge_at, n = _adjacency(cg).flat(cg)
    at = np.zeros(n, dtype=np.int64)
    at[np.fromiter(x.keys(), np.int64, len(x))] = np.fromiter(x.values(), np.int64, len(x))
    return float(node_cost[node_at + at[live]].sum() +
                 edge_cost[edge_at + at[u] * cols + at[v]].sum())


def memory(cg: CostGraph, x: dict[int, int]) -> float:
    return max((sum(float(vec[x[i]]) for i, vec in p.items()) for p in cg.memory), default=0.0)


def greedy(cg: CostGraph, inputs: dict[int, int], first: Sequence[int] = (),
           kept: frozenset[int] = frozenset()) -> dict[int, int]:
    """Program-order greedy: graph inputs fixed, each op takes its cheapest choice given the
    choices already made and what its undecided uses will pay for it, one use ahead
    (:func:`_uses_cost`; a data-parallel plan falls out of a split batch). The nodes in
    ``first`` decide before the rest, in the order given. Where ``kept`` names nodes, an op
    first keeps the layouts of those it reads (no conversion of their values), then takes
    the cheapest of the choices that do (:func:`from_inputs`)."""
    adj = _adjacency(cg)
    near, cost = adj.near, cg.cost
    x = dict(inputs)
    for i in [*first, *cg.live]:
        if i in x:
            continue
        local = cost[i].copy()
        moved = None  # the conversions of kept values' reads (none: no choice is held back)
        for j, rows, into in near[i]:
            if j in x:
                row = rows[x[j]]
                local += row
                if into and j in kept:
                    moved = row.copy() if moved is None else moved + row
        # and what its uses will pay for it (a slice of a replicated weight split for
        # free is gathered again by the dot that reads it)
        ahead = _uses_cost(cg, adj, x, i)
        total = local if ahead is None else local + ahead
        if moved is not None:
            total = np.where(moved <= moved.min() * (1 + 1e-9) + 1e-15, total, np.inf)
        x[i] = int(total.argmin())
    return x


def batch_nodes(cg: CostGraph) -> frozenset[int]:
    """Live nodes whose value depends on an input the step does not update: the batch and
    what the step computes from it (activations, their gradients), as against the state
    (an input the tail reads, :func:`shardc.ir.flow.tail_values`) and what is computed
    from the state alone (a parameter's transpose or cast)."""
    of_batch = cg.graph.memo("batch values", _batch_values)
    out = set()
    for i in cg.live:
        ref = cg.refs[i]
        vid = ref.value.id if isinstance(ref, Settle) else \
            ref.outputs[0].id if isinstance(ref, Op) else ref.id
        if vid in of_batch:
            out.add(i)
    return frozenset(out)


def _batch_values(graph: Graph) -> frozenset[int]:
    """Ids of the values that depend on an input the step does not update (the graph's
    alone: kept with it, for every placement's :func:`batch_nodes`)."""
    tail = tail_values(graph)
    consumers = graph.consumers()
    state = {v.id for v in graph.inputs
             if any(facts(u.name).tail and u.outputs[0].id in tail
                    for u, _ in consumers.get(v.id, ()))}
    of_batch = {v.id for v in graph.inputs if v.id not in state}
    for op in graph.ops:
        if any(v.id in of_batch for v in op.inputs if not v.is_const):
            of_batch.update(v.id for v in op.outputs)
    return frozenset(of_batch)


def _uses_cost(cg: CostGraph, adj: _Adjacency, x: Mapping[int, int], i: int,
               through_settle: bool = True) -> np.ndarray | None:
    """Per choice of node ``i``: its undecided uses at their cheapest, each given the
    edge from ``i`` and its other inputs decided in ``x`` (a use that is a shared value's
    settle, with that value's own uses, once); None where it has none (what it adds is
    summed in the order of ``i``'s edges, as a running total from zero would be)."""
    total = None
    for v, matrix in adj.uses(i):
        if v in x or v == i:
            continue
        own = cg.cost[v]
        for u, matrix_in in adj.ins(v):
            if u != i and u in x:
                own = own + matrix_in[x[u]]
        if through_settle and v in adj.settles:
            more = _uses_cost(cg, adj, x, v, through_settle=False)
            if more is not None:
                own = own + more
        cheapest = np.minimum.reduce(matrix + own, axis=1)
        total = cheapest if total is None else total + cheapest
    return total


def tail_nodes(cg: CostGraph) -> list[int]:
    """Live nodes of the step's tail (:func:`shardc.ir.flow.tail_values`: the optimizer
    update and the settles of the gradients entering it) in reverse program order: from the
    new state back to the gradients."""
    tail = tail_values(cg.graph)
    out = []
    for i in reversed(cg.live):
        ref = cg.refs[i]
        if isinstance(ref, Settle):
            vid = ref.value.id
        elif isinstance(ref, Op) and facts(ref.name).tail:
            vid = ref.outputs[0].id
        else:
            continue
        if vid in tail:
            out.append(i)
    return out


def from_inputs(cg: CostGraph, layouts: Mapping[int, NdSbp]) -> dict[int, int] | None:
    """The plan a hand-written one (``in_shardings``) leads to, what XLA's sharding
    propagation does from pinned inputs and outputs: graph input ``k`` fixed to
    ``layouts[k]``; the tail (the optimizer update) greedy backwards from the state it
    writes, which is tied to the state it reads (so a replicated state's gradients are
    all-reduced once, not reduce-scattered and re-gathered); every other node greedy in
    program order; then coordinate descent, with the fixed inputs kept and free. The greedy
    pass runs twice, each op taking its cheapest choice, and keeping the layouts of the
    batch and its activations where a choice can (:func:`batch_nodes`: the state's values
    are converted instead, as XLA all-gathers an FSDP weight for a batch-split dot where
    the cheapest choice alone moves the activation: GPT-2 small's FSDP seed on 8 H100s,
    predicted 6.34 against 8.72 ms, compiles to 18 collectives against 234, where XLA
    compiles the expert to 20); the cheapest end point is the seed's plan
    (:func:`completions`). Inputs whose layout is not one of their choices (uneven) are
    left to the greedy passes; None when no input could be fixed."""
    inputs = fixed_inputs(cg, layouts)
    if not inputs:
        return None
    ends = completions(cg, inputs)
    return ends[0]


def completions(cg: CostGraph, inputs: Mapping[int, int]) -> list[dict[int, int]]:
    """The end points :func:`from_inputs` chooses between, for graph-input nodes fixed
    to the choices ``inputs``: each greedy pass descended with those inputs kept (what
    XLA's propagation does from pinned inputs) and free (an input moves where its uses pay
    for it), each distinct one once, cheapest first (a search under a memory budget keeps
    each, as the leaner may be the one that fits). Descent is path-dependent: from a wide
    ResNet's ZeRO-1 seed on (2, 4) H100s the free descent moved the replicated parameters
    to HSDP's split and stopped there (0.002568 s by the objective); kept, the
    optimizer's update stays sharded and its small parameters' gathers join the large
    ones' (0.002547 s, 5 all-gathers against 6, as XLA compiles the expert)."""
    tail = tail_nodes(cg)
    starts = [greedy(cg, dict(inputs), tail, kept)
              for kept in (frozenset(), batch_nodes(cg))]
    ends: dict[tuple, dict[int, int]] = {}  # distinct end points, first kept
    for x in starts:
        for held in (inputs, ()):
            end = descend(cg, x, kept=held)
            ends.setdefault(tuple(sorted(end.items())), end)
    return sorted(ends.values(), key=lambda x: objective(cg, x))


def fixed_inputs(cg: CostGraph, layouts: Mapping[int, NdSbp]) -> dict[int, int]:
    """Graph-input node -> choice for the ``layouts`` (by input index) that are one of
    their node's choices (an uneven layout is left out)."""
    inputs = {}
    for k, nd in layouts.items():
        node = cg.producer[cg.graph.inputs[k].id][0]
        if cg.resolve(node)[0] == node and nd in cg.choices[node]:
            inputs[node] = cg.choices[node].index(nd)
    return inputs


def _split_most(cg: CostGraph, i: int, reach) -> int:
    """The input layout with the least bytes per device; among several, the one its uses
    take most cheaply (``reach``, :func:`_reach`: a stacked micro-batch array is split on
    its batch dim, which the loop reads, not on the dim the loop steps over), then the first
    (lowest mesh axes)."""
    frac = np.array([nd.shard_fraction(cg.axis_sizes) for nd in cg.choices[i]])
    least = np.flatnonzero(frac <= frac.min() * (1 + 1e-9))
    if len(least) == 1:
        return int(least[0])
    return int(least[np.argmin(reach(i, REACH_DEPTH)[least])])


#: edges :func:`_split_most` looks ahead from a graph input
REACH_DEPTH = 3


def _reach(cg: CostGraph):
    """``reach(i, d)[a]``: what node ``i`` in choice ``a`` costs its uses, ``d`` edges ahead:
    per out-edge, the consumer's cheapest choice given ``a`` (its own cost, the edge's, and
    its own uses' ``d - 1`` ahead). Memoised per (node, depth)."""
    outs: dict[int, list] = {i: [] for i in cg.live}
    for e in cg.edges:
        outs[e.u].append(e)
    memo: dict[tuple[int, int], np.ndarray] = {}

    def reach(i: int, depth: int) -> np.ndarray:
        if depth <= 0:
            return np.zeros(len(cg.choices[i]))
        key = (i, depth)
        if key not in memo:
            total = np.zeros(len(cg.choices[i]))
            for e in outs[i]:
                ahead = cg.cost[e.v] + (reach(e.v, depth - 1) if depth > 1 else 0.0)
                total += (e.cost + ahead[None, :]).min(axis=1)
            memo[key] = total
        return memo[key]

    return reach


def starts(cg: CostGraph) -> list[dict[int, int]]:
    """Start points: replicated, cheapest compute, and greedy passes from three input
    layouts: state replicated + batch split (data parallel), everything split (FSDP-like),
    everything replicated; each in program order and with the tail first (see
    :func:`from_inputs`)."""
    inputs = [i for i in cg.live if isinstance(cg.refs[i], Value)]
    carried = cg.carried
    reach = _reach(cg)
    split = {i: _split_most(cg, i, reach) for i in inputs}
    dp = {i: (0 if i in carried else split[i]) for i in inputs}
    fsdp = split
    rep = {i: 0 for i in inputs}
    replicated = {i: 0 for i in cg.live}
    cheapest = {i: int(np.argmin(cg.cost[i])) for i in cg.live}
    tail = tail_nodes(cg)
    return [replicated, cheapest, *(greedy(cg, ins, first) for ins in (dp, fsdp, rep)
                                    for first in ((), tail))]


#: seconds a byte per device weighs in :func:`lean`: far above any step time a byte could
#: save, so memory decides and time only breaks ties
LEAN_WEIGHT = 1.0
#: seconds a byte a node's results hold weighs in :func:`lean`: far below a byte at the
#: sampled memory points, far above any step time
TIE_WEIGHT = 1e-3


def lean(cg: CostGraph, fixed: Mapping[int, int] | None = None) -> dict[int, int]:
    """The leanest plan descent finds: every input split as far as it goes, the rest
    greedy (tail first), then descent on bytes at the sampled memory points; ties there go
    to the choice whose results hold fewer bytes (:data:`TIE_WEIGHT`), time breaking the
    rest. (With time alone breaking them, an optimizer update whose buffers the sampled
    points miss stayed replicated where NCCL's latency made that the faster step.)
    ``fixed``: graph-input node -> choice kept throughout (a hand-written plan's layouts,
    :func:`fixed_inputs`), the other inputs split as far as they go: the seed's leanest
    completion, where :func:`completions` gives its fastest. Deterministic, so the budget
    it meets holds when asked for again."""
    reach = _reach(cg)
    fixed = dict(fixed or {})
    inputs = {i: fixed[i] if i in fixed else _split_most(cg, i, reach)
              for i in cg.live if isinstance(cg.refs[i], Value)}
    mem = _node_memory(cg)
    for i, held in _held_bytes(cg).items():  # ties at the sampled points go to the smaller
        mem[i] = mem[i] + TIE_WEIGHT * held if i in mem else TIE_WEIGHT * held
    return descend(cg, greedy(cg, inputs, tail_nodes(cg)), LEAN_WEIGHT, mem=mem,
                   kept=fixed)


def _held_bytes(cg: CostGraph) -> dict[int, np.ndarray]:
    """Per live node, per choice: the bytes per device that its results and those of the
    nodes following it hold (kept with ``cg`` while its followers and choices are the same
    objects: a frontier asks for it at every lean start; not to be changed)."""
    kept = cg.held
    if kept and kept[0] is cg.follows and kept[1] == len(cg.follows) and \
            kept[2] is cg.choices:
        return kept[3]
    out: dict[int, np.ndarray] = {}
    for i, ref in enumerate(cg.refs):
        if isinstance(ref, Op):
            held = np.array([sum(v.nbytes * nd.shard_fraction(cg.axis_sizes)
                                 for v, nd in zip(ref.outputs, c.outs))
                             for c in cg.choices[i]])
        elif isinstance(ref, Value | Settle):
            value = ref if isinstance(ref, Value) else ref.value
            held = np.array([value.nbytes * nd.shard_fraction(cg.axis_sizes)
                             for nd in cg.choices[i]])
        else:
            continue
        root, f = cg.resolve(i)
        out[root] = out[root] + held[f] if root in out else held[f]
    cg.held = (cg.follows, len(cg.follows), cg.choices, out)
    return out


def solve(cg: CostGraph, memory_budget: float | None = None, memo: dict | None = None
          ) -> dict[int, int]:
    """Best descent end point; with a budget, raise the memory weight until it fits.

    Args:
        cg: the cost graph.
        memory_budget: bytes per device at the sampled memory points, or None.
        memo: a dict the caller keeps across calls on ``cg`` while its costs and edges stay
            as they are (its memory points may grow, as a search's rounds add them): the
            starts and each descent from them are computed once, for the same inputs give
            the same end point (the rounds of a budgeted search descended again from the
            same starts at the same weights).

    Returns:
        A choice per live node.
    """
    memo = {} if memo is None else memo
    if "starts" not in memo:
        memo["starts"] = starts(cg)
    mem, mem_key = None, None
    best, best_key = None, None
    for k, s in enumerate(memo["starts"]):
        weight = 0.0
        for _ in range(12):
            if weight and mem is None:
                mem = _node_memory(cg)
                mem_key = _digest(mem)
            key = (k, weight, mem_key if weight else None)
            if key not in memo:
                memo[key] = descend(cg, s, weight, mem=mem if weight else None)
            x = memo[key]
            over = memory_budget is not None and memory(cg, x) > memory_budget
            if not over or weight > objective(cg, x):
                # fits; or a byte already outweighs the whole step, so more weight moves
                # nothing (a budget below every plan: 1 byte, as the frontier asks first)
                break
            weight = max(weight * 4, 1e-3 * objective(cg, x) / memory_budget)
        key = (over, objective(cg, x))
        if best_key is None or key < best_key:
            best, best_key = x, key
    return dict(best)


def _digest(mem: Mapping[int, np.ndarray]) -> bytes:
    """A digest of per-node byte vectors (what a memory-weighted descent reads)."""
    h = hashlib.blake2b(np.fromiter(mem.keys(), np.int64, len(mem)).tobytes(), digest_size=16)
    for vec in mem.values():
        h.update(np.ascontiguousarray(vec, dtype=np.float64).tobytes())
    return h.digest()
