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

import numpy as np

from shardc.ir.graph import Value
from shardc.solve.problem import CostGraph


def _adjacency(cg: CostGraph) -> dict[int, list]:
    adj: dict[int, list] = {i: [] for i in cg.live}
    for e in cg.edges:
        adj[e.u].append((e, True))
        adj[e.v].append((e, False))
    return adj


def _node_memory(cg: CostGraph) -> dict[int, np.ndarray]:
    mem: dict[int, np.ndarray] = {}
    for point in cg.memory:
        for i, vec in point.items():
            mem[i] = np.maximum(mem[i], vec) if i in mem else vec
    return mem


def descend(cg: CostGraph, start: dict[int, int], memory_weight: float = 0.0,
            max_sweeps: int = 50) -> dict[int, int]:
    adj = _adjacency(cg)
    mem = _node_memory(cg) if memory_weight else {}
    x = dict(start)
    for _ in range(max_sweeps):
        changed = False
        for i in cg.live:
            local = cg.cost[i].copy()
            for e, is_u in adj[i]:
                local += e.cost[:, x[e.v]] if is_u else e.cost[x[e.u], :]
            if i in mem:
                local += memory_weight * mem[i]
            best = int(np.argmin(local))
            if local[best] < local[x[i]] - 1e-15:
                x[i] = best
                changed = True
        if not changed:
            break
    return x


def objective(cg: CostGraph, x: dict[int, int]) -> float:
    t = sum(float(cg.cost[i][x[i]]) for i in cg.live)
    return t + sum(float(e.cost[x[e.u], x[e.v]]) for e in cg.edges)


def memory(cg: CostGraph, x: dict[int, int]) -> float:
    return max((sum(float(vec[x[i]]) for i, vec in p.items()) for p in cg.memory), default=0.0)


def greedy(cg: CostGraph, inputs: dict[int, int]) -> dict[int, int]:
    """Program-order greedy: graph inputs fixed, each op takes its cheapest choice given the
    choices already made upstream (a data-parallel plan falls out of a split batch)."""
    adj = _adjacency(cg)
    x = dict(inputs)
    for i in cg.live:
        if i in x:
            continue
        local = cg.cost[i].copy()
        for e, is_u in adj[i]:
            other = e.v if is_u else e.u
            if other in x:
                local += e.cost[:, x[other]] if is_u else e.cost[x[other], :]
        x[i] = int(np.argmin(local))
    return x


def _split_most(cg: CostGraph, i: int) -> int:
    """The input layout with the least bytes per device (first such: lowest mesh axes)."""
    return int(np.argmin([nd.shard_fraction(cg.axis_sizes) for nd in cg.choices[i]]))


def starts(cg: CostGraph) -> list[dict[int, int]]:
    """Start points: replicated, cheapest compute, and greedy passes from three input
    layouts: state replicated + batch split (data parallel), everything split (FSDP-like),
    everything replicated."""
    inputs = [i for i in cg.live if isinstance(cg.refs[i], Value)]
    carried = cg.carried
    dp = {i: (0 if i in carried else _split_most(cg, i)) for i in inputs}
    fsdp = {i: _split_most(cg, i) for i in inputs}
    rep = {i: 0 for i in inputs}
    replicated = {i: 0 for i in cg.live}
    cheapest = {i: int(np.argmin(cg.cost[i])) for i in cg.live}
    return [replicated, cheapest, greedy(cg, dp), greedy(cg, fsdp), greedy(cg, rep)]


def solve(cg: CostGraph, memory_budget: float | None = None) -> dict[int, int]:
    """Best descent end point; with a budget, raise the memory weight until it fits."""
    best, best_key = None, None
    for s in starts(cg):
        weight = 0.0
        for _ in range(12):
            x = descend(cg, s, weight)
            over = memory_budget is not None and memory(cg, x) > memory_budget
            if not over:
                break
            weight = max(weight * 4, 1e-3 * objective(cg, x) / memory_budget)
        key = (over, objective(cg, x))
        if best_key is None or key < best_key:
            best, best_key = x, key
    return best
