"""Repeated-layer folding: tie nodes with the same local structure into one decision.

A 12-layer transformer's cost graph is twelve copies of one layer's nodes, plus the
embedding, head and loss. Nodes that play the same part in every layer get the same colour
from a few rounds of Weisfeiler-Lehman colour refinement (the colour of a node: its kind,
op, shapes, choice list and cost vector, then the multiset of its neighbours' colours along
edges of each kind); each colour class becomes one node of a *quotient* cost graph whose
objective is the original objective under the constraint that the class's members choose
alike. The quotient is a fraction of the size, small enough for the exact ILP, and every
layer-uniform plan (data parallel, FSDP, Megatron, their products) is one of its plans.

The refinement stops after ``rounds`` rounds, not at its fixpoint: at the fixpoint a
node's colour would encode its distance from the ends of the stack and nothing would be
tied. Folding is lossy where the best plan is not uniform (a memory budget met by sharding
some layers only, a stack whose layers alternate); the full graph is refined from the
expanded plan afterwards, so folding only ever provides a start.

References:
  TAP (Shi et al., 2023) and PyTorch ``autoparallel``: fold repeated subgraphs, O(N) ->
  O(N / K); Weisfeiler & Leman (1968) colour refinement.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from shardc.ir.graph import Op, Value
from shardc.solve.costgraph import CostGraph, Edge, Settle

__all__ = ["colour_classes", "expand", "fold", "folding_ratio", "members", "quotient",
           "restrict", "ROUNDS"]

ROUNDS = 3  # WL rounds: how far (in edges) two nodes' neighbourhoods must agree


def _initial_colour(cg: CostGraph, i: int, names: dict[int, tuple[str, ...]]) -> tuple:
    """Node ``i``'s colour before refinement (a key equal for nodes alike); ``names``
    memoises the printed choice lists, by list (nodes of one op signature share theirs)."""
    ref = cg.refs[i]
    if isinstance(ref, Op):
        kind = ("op", ref.name, tuple(v.type_str() for v in (*ref.inputs, *ref.outputs)))
    elif isinstance(ref, Settle):
        kind = ("settle", ref.value.type_str())
    else:
        assert isinstance(ref, Value)
        kind = ("input", ref.type_str(), i in cg.carried)
    cost = np.round(cg.cost[i] * 1e12).astype(np.int64).tobytes()  # picoseconds
    key = id(cg.choices[i])
    if key not in names:
        names[key] = tuple(map(str, cg.choices[i]))
    return kind, names[key], cost


def colour_classes(cg: CostGraph, rounds: int = ROUNDS) -> dict[int, int]:
    """Live node -> class id (dense, in program order of first members). Each round's
    colours are interned to small integers, so nodes share a colour exactly when their keys
    are equal."""
    live = cg.live
    names: dict[int, tuple[str, ...]] = {}
    ids: dict = {}
    colour = {i: ids.setdefault(_initial_colour(cg, i, names), len(ids)) for i in live}
    nbrs: dict[int, list[tuple[bool, int, int]]] = defaultdict(list)  # (out, edge, node)
    edge_ids: dict = {}
    for e in cg.edges:
        k = edge_ids.setdefault((e.value.type_str(), e.k, e.cost.shape,
                                 np.round(e.cost * 1e12).astype(np.int64).tobytes()),
                                len(edge_ids))
        nbrs[e.u].append((True, k, e.v))
        nbrs[e.v].append((False, k, e.u))
    for _ in range(rounds):
        ids = {}
        colour = {i: ids.setdefault((colour[i], tuple(sorted(
            (out, k, colour[j]) for out, k, j in nbrs[i]))), len(ids)) for i in live}
    return colour


def quotient(cg: CostGraph, cls: dict[int, int]) -> CostGraph:
    """The cost graph of the class decisions: one node per class, unary costs and edge
    matrices summed over members (an edge inside a class adds its diagonal)."""
    n = max(cls.values()) + 1
    first: dict[int, int] = {}
    for i in cg.live:
        first.setdefault(cls[i], i)
    q = CostGraph(cg.graph, cg.axis_sizes, cg.axis_names, cg.cluster, cg.combined)
    q.choices = [cg.choices[first[c]] for c in range(n)]
    q.refs = [cg.refs[first[c]] for c in range(n)]
    q.cost = [np.zeros(len(ch)) for ch in q.choices]
    for i in cg.live:
        q.cost[cls[i]] = q.cost[cls[i]] + cg.cost[i]
    pairs: dict[tuple[int, int], Edge] = {}
    for e in cg.edges:
        a, b = cls[e.u], cls[e.v]
        if a == b:
            q.cost[a] = q.cost[a] + np.diag(e.cost)
        elif (b, a) in pairs:
            pairs[(b, a)].cost = pairs[(b, a)].cost + e.cost.T
        elif (a, b) in pairs:
            pairs[(a, b)].cost = pairs[(a, b)].cost + e.cost
        else:
            pairs[(a, b)] = Edge(a, b, e.cost.copy(), e.value, e.k)
    q.edges = list(pairs.values())
    for point in cg.memory:
        folded: dict[int, np.ndarray] = {}
        for i, vec in point.items():
            c = cls[i]
            folded[c] = folded[c] + vec if c in folded else vec
        q.memory.append(folded)
    q.carried = {cls[i] for i in cg.carried if i in cls}
    q.order = list(range(n))
    return q


def restrict(cg: CostGraph, allowed: dict[int, list[int]]) -> CostGraph:
    """``cg`` (a graph without followers, such as a quotient) with node ``i``'s choices cut
    to ``allowed[i]`` (indices into ``cg.choices[i]``); a choice ``b`` of the result is
    choice ``allowed[i][b]`` of ``cg``."""
    assert not cg.follows, "restrict() works on graphs without followers"
    r = CostGraph(cg.graph, cg.axis_sizes, cg.axis_names, cg.cluster, cg.combined)
    r.refs, r.order, r.carried = cg.refs, cg.order, cg.carried
    r.choices = [[ch[a] for a in allowed[i]] for i, ch in enumerate(cg.choices)]
    r.cost = [c[allowed[i]] for i, c in enumerate(cg.cost)]
    r.edges = [Edge(e.u, e.v, e.cost[np.ix_(allowed[e.u], allowed[e.v])], e.value, e.k)
               for e in cg.edges]
    r.memory = [{i: vec[allowed[i]] for i, vec in point.items()} for point in cg.memory]
    return r


def expand(cls: dict[int, int], x: dict[int, int]) -> dict[int, int]:
    """Choices of the live nodes from the choices of their classes."""
    return {i: x[c] for i, c in cls.items()}


def fold(cg: CostGraph, rounds: int = ROUNDS) -> tuple[CostGraph, dict[int, int]]:
    """``(quotient, classes)`` of ``cg``'s live nodes."""
    cls = colour_classes(cg, rounds)
    return quotient(cg, cls), cls


def folding_ratio(cls: dict[int, int]) -> float:
    """Live nodes per class (1.0: nothing repeats)."""
    return len(cls) / max(1, len(set(cls.values())))


def members(cls: dict[int, int]) -> Sequence[list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for i, c in cls.items():
        out[c].append(i)
    return [out[c] for c in sorted(out)]
