"""The ILP stages that refine a plan of a cost graph too large for one ILP.

:func:`quotient_refine` solves the repeated-layer quotient (:mod:`shardc.solve.fold`): one
exact ILP when it is small or on a 1-D mesh; else from its 1-D seeds
(:func:`sub_mesh_seeds`), axis by axis (:func:`axis_sweeps`), then in cross neighbourhoods
(:func:`cross_sweeps`); then block coordinate descent with exact ILP blocks
(:func:`block_refine`, one held axis at a time on three or more axes:
:func:`held_axis_blocks`), the expansion refined by descent on the full graph. The driver
(:func:`shardc.solve.search.solve`) calls it between its memory rounds; every stage keeps a
candidate only when it fits the budget and costs no more (:func:`better`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial

from shardc.ir.flow import tail_values
from shardc.ir.sbp import B, NdSbp
from shardc.solve import descent
from shardc.solve.beside import beside
from shardc.solve.costgraph import CostGraph
from shardc.solve.fold import expand, members, restrict
from shardc.solve.ilp import problem_size, solve_ilp

__all__ = ["AXIS_ROUNDS", "BLOCK_TERMS", "CROSS_ROUNDS", "ILP_FULL_TERMS", "TAIL_BLOCK_TERMS",
           "axes_choices", "axis_sweeps", "best_of", "better", "block_refine", "cross_sweeps",
           "held_axis_blocks", "quotient_refine", "sub_mesh_seeds"]


ILP_FULL_TERMS = 40_000  # model terms up to which one ILP covers the whole graph
BLOCK_TERMS = 40_000  # model terms per block when refining a larger graph block by block
TAIL_BLOCK_TERMS = 200  # model terms per block of the tail's update chains
AXIS_ROUNDS = 3  # sweeps over the mesh axes (:func:`axis_sweeps`)
CROSS_ROUNDS = 6  # rounds of :func:`cross_sweeps`


def better(cg: CostGraph, x: dict[int, int], y: dict[int, int], memory_budget) -> dict:
    """``y`` if it fits the budget and costs no more than ``x`` (or ``x`` does not fit)."""
    return best_of(cg, x, (y,), memory_budget)


def best_of(cg: CostGraph, x: dict[int, int], ys: Sequence[dict[int, int]], memory_budget
            ) -> dict:
    """:func:`better` folded over ``ys`` from ``x``: each plan's objective and bytes found
    once (a solve weighs a dozen starts against its plan: the objective's sum over every
    node and edge was a twentieth of the GPT-2 frontier's time, asked again per start)."""
    def facts(z: dict[int, int]) -> tuple[bool, float]:
        return (memory_budget is None or descent.memory(cg, z) <= memory_budget,
                descent.objective(cg, z))

    fx = facts(x)
    for y in ys:
        fy = facts(y)
        if fy[0] and (fy[1] <= fx[1] + 1e-12 or not fx[0]):
            x, fx = y, fy
    return x


def _pack(cg: CostGraph, groups: Sequence[Sequence[int]], terms: int) -> list[list[int]]:
    """Consecutive groups of nodes packed into blocks of about ``terms`` model terms."""
    weight = {i: len(cg.choices[i]) for i in cg.live}
    for e in cg.edges:
        weight[e.u] += e.cost.size // 2
        weight[e.v] += e.cost.size // 2
    blocks, cur, size = [], [], 0
    for group in groups:
        cur += group
        size += sum(weight[i] for i in group)
        if size >= terms:
            blocks.append(cur)
            cur, size = [], 0
    if cur:
        blocks.append(cur)
    return blocks


def _blocks(cg: CostGraph, order: Sequence[int]) -> list[list[int]]:
    return _pack(cg, [[i] for i in order], BLOCK_TERMS)


def _bfs_order(cg: CostGraph) -> list[int]:
    adj: dict[int, list[int]] = {i: [] for i in cg.live}
    for e in cg.edges:
        adj[e.u].append(e.v)
        adj[e.v].append(e.u)
    seen, order = set(), []
    for root in cg.live:
        if root in seen:
            continue
        seen.add(root)
        queue = deque([root])
        while queue:
            i = queue.popleft()
            order.append(i)
            for j in sorted(adj[i]):
                if j not in seen:
                    seen.add(j)
                    queue.append(j)
    return order


def _tail_blocks(cg: CostGraph) -> list[list[int]]:
    """Blocks of the step's tail (:func:`shardc.ir.flow.tail_values`: gradients on
    their way through the optimizer) with the state they update: its connected components,
    small ones packed together up to ``TAIL_BLOCK_TERMS``. A parameter's update chain (the
    gradient's conversion, the optimizer slots, the new value tied back to the old) must
    change layout all at once to go from, say, reduce-scatter + sharded update + all-gather
    to all-reduce + replicated update; no single-node move can, and program order puts the
    state (graph inputs) far from its update. Nodes with one choice (scalars: the step
    count, learning-rate schedules) join nothing, or every chain would be one component."""
    tail = tail_values(cg.graph)
    nodes = {cg.resolve(cg.producer[vid][0])[0] for vid in tail if vid in cg.producer}
    nodes |= {cg.resolve(i)[0] for i in cg.carried}
    nodes = {i for i in nodes if len(cg.choices[i]) > 1}
    adj: dict[int, list[int]] = {i: [] for i in nodes}
    for e in cg.edges:
        if e.u in nodes and e.v in nodes:
            adj[e.u].append(e.v)
            adj[e.v].append(e.u)
    seen: set[int] = set()
    comps: list[list[int]] = []
    for root in sorted(nodes):
        if root in seen:
            continue
        seen.add(root)
        comp, stack = [], [root]
        while stack:
            i = stack.pop()
            comp.append(i)
            fresh = {j for j in adj[i] if j not in seen}
            stack += sorted(fresh)
            seen |= fresh
        comps.append(comp)
    return _pack(cg, comps, TAIL_BLOCK_TERMS)


def quotient_refine(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float,
                    folding: tuple[CostGraph, dict[int, int]]) -> tuple[dict[int, int], str]:
    """Solve the repeated-layer quotient of ``cg`` from ``x``, expand it, refine it by
    descent on the full graph, and keep it if it beats ``x``. A quotient small enough (or
    on a 1-D mesh) is one exact ILP; a larger nd one starts from its 1-D seeds
    (:func:`sub_mesh_seeds`) and is solved axis by axis (:func:`axis_sweeps`), then in
    cross neighbourhoods (:func:`cross_sweeps`); the blocks (:func:`block_refine`) refine
    the plan the axis sweeps reach beside the cross neighbourhoods' LP. Returns the plan
    and how the quotient was settled. ``folding`` is ``fold(cg)``."""
    q, cls = folding
    xq = {c: x[m[0]] for c, m in enumerate(members(cls))}
    # a tail block of every layer is one block of the quotient
    tail = list(map(list, dict.fromkeys(tuple(sorted({cls[i] for i in block}))
                                        for block in _tail_blocks(cg))))

    def blocks(xq: dict[int, int]) -> tuple[dict[int, int], str]:
        if len(q.axis_sizes) > 2:
            return held_axis_blocks(q, xq, memory_budget, time_limit, tail)
        return block_refine(q, xq, memory_budget, time_limit, tail)

    if len(q.axis_sizes) == 1 or problem_size(q) <= ILP_FULL_TERMS:
        res = solve_ilp(q, time_limit=time_limit, memory_budget=memory_budget, hint=xq)
        if res.assignment is not None:
            xq = better(q, xq, res.assignment, memory_budget)
        status = {"OPTIMAL": "optimal", "INFEASIBLE": "infeasible",
                  "LAGRANGIAN": "lagrangian"}.get(res.status, "time-limit")
        xq, refined = blocks(xq)
    else:
        for seed in sub_mesh_seeds(q, memory_budget, time_limit):
            xq = better(q, xq, seed, memory_budget)
        # one axis at a time first, then the cross neighbourhoods from there: each stops
        # where the other does not, and under a memory budget the axis steps' MIPs are a
        # fraction of a cross neighbourhood's (without a budget one pass over the axes: a
        # cross round holds every axis move)
        xq, status = axis_sweeps(q, xq, memory_budget, time_limit,
                                 AXIS_ROUNDS if memory_budget is not None else 1)
        # the blocks refine the axis sweeps' plan beside the cross neighbourhoods' LP
        # (:mod:`shardc.solve.beside`: that LP is HiGHS's, the blocks mostly Python's);
        # where a cross round moves the plan, the blocks refine the moved one after
        (blocked, refined), (moved, crossed) = beside(
            [partial(blocks, xq), partial(cross_sweeps, q, xq, memory_budget, time_limit)])
        xq, refined = (blocked, refined) if moved == xq else blocks(moved)
        status = f"axes {'time-limit' if 'time-limit' in (status, crossed) else status}"
    # descent on the full graph knows no budget: where it leaves the budget's rows, the
    # expansion itself is the candidate
    raw = expand(cls, xq)
    y = better(cg, raw, descent.descend(cg, raw), memory_budget)
    return better(cg, x, y, memory_budget), f"folded ({status}) + {refined}"


def sub_mesh_seeds(q: CostGraph, memory_budget, time_limit: float) -> list[dict[int, int]]:
    """Plans of a multi-axis mesh from 1-D problems: the whole mesh seen as one flat axis,
    then each mesh axis alone with the others idle. Each is ``q`` (a graph without
    followers, such as a quotient) with every node cut to its choices that are one 1-D
    choice spread over those axes (:func:`axes_choices`), solved exactly: the cut problems
    have the choice sets of a 1-D problem (a dot's handful of strategies, not their
    square) but keep the nd graph's prices, so the flat seed prices a split over both axes
    at both links. Data parallel or FSDP over the whole mesh is a flat plan; Megatron over
    the fast axis (or any plan that leaves the slow axis idle) is a one-axis plan, which
    the axis-wise refinement then extends over the other axes. Only axes faster than the
    slowest get a seed of their own."""
    names = q.axis_names
    slow = (min(q.cluster.bandwidth(a) for a in names),
            -max(q.cluster.latency(a) for a in names))
    # an axis alone is worth a seed only when its link beats the slowest: otherwise the flat
    # problem (more devices, priced at that same link) covers it
    subsets = [tuple(range(len(names)))] + [
        (k,) for k, a in enumerate(names)
        if (q.cluster.bandwidth(a), -q.cluster.latency(a)) > slow]
    def seed(axes: tuple[int, ...]) -> dict[int, int] | None:
        allowed = {i: axes_choices(ch, axes) or list(range(len(ch)))
                   for i, ch in enumerate(q.choices)}
        res = solve_ilp(restrict(q, allowed), time_limit=time_limit,
                        memory_budget=memory_budget)
        if res.assignment is None:
            return None
        return {i: allowed[i][b] for i, b in res.assignment.items()}

    # the 1-D problems are apart: solved beside each other (:mod:`shardc.solve.beside`)
    return [x for x in beside([partial(seed, axes) for axes in subsets])
            if x is not None]


def axes_choices(choices: Sequence, axes: Sequence[int]) -> list[int]:
    """Indices of the choices that are one 1-D choice spread over the mesh axes ``axes``:
    every layout the same ``S(d)`` / ``B`` / ``P`` on each axis in ``axes`` (a dim split
    over all of them, in mesh order) and ``B`` on the others."""
    def spread(nd: NdSbp) -> bool:
        first = nd.sbps[axes[0]]
        return all(sbp == first if k in axes else sbp == B for k, sbp in enumerate(nd.sbps))

    return [a for a, c in enumerate(choices)
            if all(map(spread, (c,) if isinstance(c, NdSbp) else (*c.ins, *c.outs)))]


def _without_axis(c, k: int):
    """A choice's SBPs on every mesh axis but ``k``."""
    if isinstance(c, NdSbp):
        return c.sbps[:k] + c.sbps[k + 1:]
    return tuple(nd.sbps[:k] + nd.sbps[k + 1:] for nd in (*c.ins, *c.outs))


def cross_sweeps(q: CostGraph, xq: dict[int, int], memory_budget, time_limit: float
                 ) -> tuple[dict[int, int], str]:
    """Large-neighbourhood descent over mesh axes on ``q`` (a graph without followers, such
    as the repeated-layer quotient), each step exact: every node may change its SBPs on any
    one mesh axis, keeping the others (different nodes may change different axes), and that
    neighbourhood of ``xq`` is solved with the ILP; rounds repeat until one moves nothing
    (at most ``CROSS_ROUNDS``). The neighbourhood is about the mesh's
    axis count times a 1-D problem's size, where the whole nd quotient has the square of a
    1-D node's choices. It moves a plan from, say, data parallel over both axes to data
    parallel over the slow one with sharded state over the fast one (the gradient then
    reduce-scatters on the fast link and all-reduces 1/n of it on the slow one), and, unlike
    one axis at a time (AutoDDL's per-axis search), it moves one layer's dots along one
    axis while their neighbours move along the other: on the 12-layer GPT-2 on (2, 4)
    axis-at-a-time sweeps stopped at 7.793 ms predicted, these reach the quotient's proven
    optimum, 7.272 ms. Only relaxations are solved: a round whose relaxation is fractional
    (a memory budget's rows) ends the sweeps. Returns the plan and its status
    (:func:`_stage_status`)."""
    status = "optimal"
    axes = range(len(q.axis_sizes))
    for _ in range(CROSS_ROUNDS):
        allowed = {}
        for i, ch in enumerate(q.choices):
            keep = [_without_axis(ch[xq[i]], k) for k in axes]
            allowed[i] = [a for a, c in enumerate(ch)
                          if any(_without_axis(c, k) == keep[k] for k in axes)]
        hint = {i: allowed[i].index(xq[i]) for i in allowed}
        res = solve_ilp(restrict(q, allowed), time_limit=time_limit,
                        memory_budget=memory_budget, hint=hint, relaxation_only=True)
        if res.assignment is None:  # FRACTIONAL: a memory budget's rows (see quotient_refine)
            break
        status = _stage_status(status, res.status)
        y = {i: allowed[i][b] for i, b in res.assignment.items()}
        if not (descent.objective(q, y) < descent.objective(q, xq) - 1e-12
                and better(q, xq, y, memory_budget) is y):
            break
        xq = y
    return xq, status


def _stage_status(status: str, solved: str) -> str:
    """A stage's status after one more ILP that ended ``solved``: "time-limit" once the
    clock cut one, else "lagrangian" once a budget's rows were settled by their Lagrangian
    search, else what it was ("optimal")."""
    if status == "time-limit" or solved in ("FEASIBLE", "UNKNOWN"):
        return "time-limit"
    return "lagrangian" if solved == "LAGRANGIAN" else status


def axis_sweeps(q: CostGraph, xq: dict[int, int], memory_budget, time_limit: float,
                rounds: int = AXIS_ROUNDS) -> tuple[dict[int, int], str]:
    """Coordinate descent over mesh axes on ``q`` (a graph without followers, such as the
    repeated-layer quotient; AutoDDL's per-axis search, made exact per step): hold every
    node's SBPs on all axes but one and solve that axis exactly with the ILP, for each axis
    in turn, until a sweep moves nothing (at most ``rounds``).
    One axis's choice sets are the size of a 1-D problem's, so each step is exact where the
    whole nd quotient is too large for one ILP; a step moves a plan from, say, data
    parallel over both axes to data parallel over the slow one with sharded state over the
    fast one (the gradient then reduce-scatters on the fast link and all-reduces 1/n of it
    on the slow one). Returns the plan and its status (:func:`_stage_status`)."""
    status = "optimal"
    moves, solved_at = 0, {}  # axis -> the move count when it was last solved
    for _ in range(rounds):
        moved = False
        for k in reversed(range(len(q.axis_sizes))):
            if solved_at.get(k) == moves:
                continue  # nothing moved since this axis was solved: its optimum is xq
            solved_at[k] = moves
            allowed = {}
            for i, ch in enumerate(q.choices):
                keep = _without_axis(ch[xq[i]], k)
                allowed[i] = [a for a, c in enumerate(ch) if _without_axis(c, k) == keep]
            sub = restrict(q, allowed)
            hint = {i: allowed[i].index(xq[i]) for i in allowed}
            res = solve_ilp(sub, time_limit=time_limit, memory_budget=memory_budget, hint=hint)
            if res.assignment is None:
                continue
            status = _stage_status(status, res.status)
            y = {i: allowed[i][b] for i, b in res.assignment.items()}
            if descent.objective(q, y) < descent.objective(q, xq) - 1e-12 and \
                    better(q, xq, y, memory_budget) is y:
                xq, moved, moves = y, True, moves + 1
                solved_at[k] = moves
        if not moved:
            break
    return xq, status


def held_axis_blocks(q: CostGraph, xq: dict[int, int], memory_budget, time_limit: float,
                     tail: list[list[int]]) -> tuple[dict[int, int], str]:
    """:func:`block_refine` on a mesh of three or more axes, one held axis at a time: every
    node keeps its SBP on mesh axis ``k`` and the blocks re-solve the others, for each axis
    in turn. A block over all axes at once has the cube of a 1-D node's choices (a dot's
    edge alone can exceed ``BLOCK_TERMS``), so the blocks held too few nodes to move
    anything and did not finish in the time limit; with one axis held they are the size
    of a 2-D mesh's. Returns the plan and the stage's name."""
    stage = "blocks"
    for k in reversed(range(len(q.axis_sizes))):
        allowed = {i: [a for a, c in enumerate(ch) if _on_axis(c, k) == _on_axis(ch[xq[i]], k)]
                   for i, ch in enumerate(q.choices)}
        hint = {i: allowed[i].index(xq[i]) for i in allowed}
        y, stage = block_refine(restrict(q, allowed), hint, memory_budget, time_limit, tail)
        xq = better(q, xq, {i: allowed[i][b] for i, b in y.items()}, memory_budget)
        if "time-limit" in stage:
            break
    return xq, f"{stage} (axes held in turn)"


def _on_axis(c, k: int):
    """A choice's SBPs on mesh axis ``k``."""
    if isinstance(c, NdSbp):
        return c.sbps[k]
    return tuple(nd.sbps[k] for nd in (*c.ins, *c.outs))


def block_refine(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float,
                 tail: list[list[int]]) -> tuple[dict[int, int], str]:
    """Block coordinate descent with exact ILP blocks: the graph is cut into blocks of
    consecutive nodes (the tail's update chains with their state, program order, then
    breadth-first order so a layer's forward and backward meet), and each block is re-solved
    exactly with everything else held fixed. Stops after a pass that finds nothing.
    Returns the plan and the stage's name ("blocks (time-limit)" where the clock cut a
    block's solve)."""
    status = "optimal"
    for blocks in (tail, _blocks(cg, cg.live), _blocks(cg, _bfs_order(cg))):
        before = descent.objective(cg, x)
        for block in blocks:
            res = solve_ilp(cg, time_limit=time_limit, memory_budget=memory_budget, hint=x,
                            free=block)
            status = _stage_status(status, res.status)
            if res.assignment is not None:
                x = better(cg, x, res.assignment, memory_budget)
        if descent.objective(cg, x) >= before - 1e-12 and blocks is not tail:
            break
    return x, "blocks (time-limit)" if status == "time-limit" else "blocks"
