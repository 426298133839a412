"""Planning driver: cost graph → follow-merge → coordinate descent → CP-SAT → choices.

The descent result seeds the ILP as a hint; the ILP's answer is kept only when it is no
worse. A time-limited ILP returns its best incumbent and the plan says so.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import tail_values
from shardc.explain import fmt_bytes
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp
from shardc.solve import descent
from shardc.solve.fold import expand, fold, members, restrict
from shardc.solve.ilp import problem_size, solve_ilp
from shardc.solve.problem import (
    NOTHING_FIXED,
    CostGraph,
    Fixed,
    build,
    memory_point,
    memory_profile,
)

MEMORY_ROUNDS = 6  # re-solves adding the worst violated program point
ILP_FULL_TERMS = 40_000  # model terms up to which one ILP covers the whole graph
BLOCK_TERMS = 6_000  # model terms per block when refining a larger graph block by block
TAIL_BLOCK_TERMS = 200  # model terms per block of the tail's update chains
BLOCK_SHARE = 0.3  # share of time_limit the block refinement of a large graph may spend
FOLD_SHARE = 0.5  # share of time_limit the ILP of a large graph's folded quotient may spend
FLAT_SHARE = 0.6  # share of time_limit a multi-axis mesh spends on its 1-D seeds
AXIS_SHARE = 0.5  # share of the rest a multi-axis mesh spends on axis-wise quotient ILPs
AXIS_ROUNDS = 3  # sweeps over the mesh axes


class MemoryBudgetError(ValueError):
    """No plan fits ``memory_budget``; ``needed`` is the smallest budget (bytes per device)
    for which one was found: planning again with it succeeds."""

    def __init__(self, budget: float, needed: int):
        self.budget, self.needed = budget, needed
        super().__init__(
            f"no plan fits memory_budget={fmt_bytes(budget)} per device; the leanest plan "
            f"found needs {fmt_bytes(needed, up=True)} (memory_budget={needed}). Raise the "
            "budget to that, use more devices, or shrink the batch.")


@dataclass(frozen=True)
class SolveOptions:
    """What the solver is asked for: a per-device byte budget, seconds of search, whether
    to run the ILP, and hand-written plans to start from (by name: graph-input layouts)."""

    memory_budget: float | None = None
    time_limit: float = 10.0
    use_ilp: bool = True
    seeds: Mapping[str, Mapping[int, NdSbp]] = field(default_factory=dict)


class Status(enum.StrEnum):
    """How a plan was settled (a ``str``: it is stored as its value in plan files)."""

    OPTIMAL = "optimal"  # one ILP over the whole cost graph proved its optimum
    TIME_LIMIT = "time-limit"  # that ILP's best incumbent when its budget ran out
    REFINED = "refined"  # too large for one ILP: the descent plan refined by smaller ILPs
    DESCENT_ONLY = "descent-only"  # no ILP ran or none found a plan: coordinate descent's
    INFEASIBLE = "infeasible-ilp"  # the ILP proved the memory budget cannot be met


@dataclass(frozen=True)
class Solution:
    choice: list[int]  # per cost-graph node
    status: Status
    objective: float  # seconds, the cost graph's objective
    stats: dict = field(default_factory=dict)  # "stages" says what refined a REFINED plan


def solve(cg: CostGraph, options: SolveOptions = SolveOptions(), *,
          blocks: bool = True) -> Solution:
    """Plan ``cg``; ``blocks=False`` skips the block refinement of a large graph (for
    seeds, which the caller refines anyway). ``options.seeds`` are hand-written plans, by
    name, as layouts of graph inputs (:func:`shardc.solve.descent.from_inputs`): the plan
    costs no more than any of them that fits the budget, and ``stats["seeds"]`` gives their
    costs. With a memory budget the leanest plan descent finds (:func:`descent.lean`,
    deterministic) is a candidate too, so the budget a :class:`MemoryBudgetError` names
    is met when asked for."""
    memory_budget, time_limit = options.memory_budget, options.time_limit
    use_ilp = options.use_ilp
    t0 = time.perf_counter()
    n_all = len(cg.choices)
    cg.merge_followers()
    t1 = time.perf_counter()
    work = 0.0  # CP-SAT deterministic time: the budget is counted in it, never in wall time
    x = descent.solve(cg, memory_budget)
    seed_plans = {}
    for name, layouts in options.seeds.items():
        y = descent.from_inputs(cg, layouts)
        if y is not None:
            seed_plans[name] = y
    starts = list(seed_plans.values())
    if memory_budget is not None:
        starts.append(descent.lean(cg))
    for y in starts:
        x = _better(cg, x, y, memory_budget)
    if len(cg.axis_sizes) > 1 and use_ilp and time_limit > 0:
        # the 1-D seeds may take FLAT_SHARE of the limit; what they leave goes to the ILP
        # (a small graph's seeds are proved at once, and its whole ILP needs the time), which
        # keeps its own share when a large graph's seeds overrun theirs
        seeds, spent = sub_mesh_seeds(cg, memory_budget, time_limit * FLAT_SHARE)
        work += spent
        for seed in seeds:
            x = _better(cg, x, seed, memory_budget)
        time_limit = max(time_limit - spent, time_limit * (1 - FLAT_SHARE))
    t2 = time.perf_counter()
    status, stages, ilp_time = Status.DESCENT_ONLY, "", 0.0
    for _ in range(MEMORY_ROUNDS):
        x, status, stages, t_ilp, w = _solve_once(cg, x, memory_budget, time_limit, use_ilp,
                                                  blocks)
        ilp_time += t_ilp
        work += w
        if memory_budget is None or _peak(cg, x) <= memory_budget:
            break
        profile = memory_profile(cg, cg.decode(x))
        cg.memory.append(memory_point(cg, int(np.argmax(profile))))  # constrain it too
        x = descent.solve(cg, memory_budget)
        for y in starts:
            x = _better(cg, x, y, memory_budget)
    if memory_budget is not None and _peak(cg, x) > memory_budget:
        # the sampled points let through a plan the exact profile rejects: keep the cheapest
        # start that fits exactly (the lean plan fits any budget an error ever named)
        fits = [y for y in starts if _peak(cg, y) <= memory_budget]
        if not fits:
            needed = min(_peak(cg, y) for y in (x, *starts))
            raise MemoryBudgetError(memory_budget, math.ceil(needed))
        x = min(fits, key=lambda y: descent.objective(cg, y))
    stats = {"nodes": n_all, "live_nodes": len(cg.live), "edges": len(cg.edges),
             "merge_s": t1 - t0, "descent_s": t2 - t1, "ilp_s": ilp_time, "work": work}
    if stages:
        stats["stages"] = stages
    if seed_plans:
        stats["seeds"] = {name: descent.objective(cg, y) for name, y in seed_plans.items()}
    return Solution(cg.decode(x), status, descent.objective(cg, x), stats)


def _peak(cg: CostGraph, x: dict[int, int]) -> float:
    """Exact per-device peak bytes of the plan ``x`` (every program point)."""
    return float(np.max(memory_profile(cg, cg.decode(x))))


def _solve_once(cg: CostGraph, x: dict[int, int], memory_budget, time_limit, use_ilp,
                blocks: bool = True):
    """Improve the descent point ``x`` with the ILP; keep whichever is better and fits.
    A graph too large for one ILP is folded (:mod:`shardc.solve.fold`), its quotient solved
    (on an nd mesh axis by axis), and the expanded plan refined block by block."""
    if not use_ilp or time_limit <= 0:
        return x, Status.DESCENT_ONLY, "", 0.0, 0.0
    if problem_size(cg) > ILP_FULL_TERMS:
        t0 = time.perf_counter()
        folding = fold(cg)
        x, folded, work = fold_refine(cg, x, memory_budget, time_limit * FOLD_SHARE, folding)
        if len(cg.axis_sizes) > 1 and not folded:
            x, folded, w = axis_refine(cg, x, memory_budget, time_limit * AXIS_SHARE, folding)
            work += w
        parts = [f"folded ({folded})"] if folded else []
        if blocks:
            x, refined, w = block_refine(cg, x, memory_budget, time_limit)
            work += w
            parts.append(refined)
        stages = " + ".join(parts)
        return x, (Status.REFINED if stages else Status.DESCENT_ONLY), stages, \
            time.perf_counter() - t0, work
    res = solve_ilp(cg, time_limit=time_limit, memory_budget=memory_budget, hint=x)
    if res.assignment is None:
        return x, (Status.INFEASIBLE if res.status == "INFEASIBLE" else Status.DESCENT_ONLY), \
            "", res.wall_time, res.work
    return _better(cg, x, res.assignment, memory_budget), \
        (Status.OPTIMAL if res.status == "OPTIMAL" else Status.TIME_LIMIT), "", \
        res.wall_time, res.work


def _better(cg: CostGraph, x: dict[int, int], y: dict[int, int], memory_budget) -> dict:
    """``y`` if it fits the budget and costs no more than ``x`` (or ``x`` does not fit)."""
    y_fits = memory_budget is None or descent.memory(cg, y) <= memory_budget
    x_fits = memory_budget is None or descent.memory(cg, x) <= memory_budget
    cheaper = descent.objective(cg, y) <= descent.objective(cg, x) + 1e-12
    return y if y_fits and (cheaper or not x_fits) else x


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
    """Blocks of the step's tail (:func:`shardc.cost.combine.tail_values`: gradients on
    their way through the optimizer) with the state they update: its connected components,
    small ones packed together up to ``TAIL_BLOCK_TERMS``. A parameter's update chain (the
    gradient's conversion, the optimizer slots, the new value tied back to the old) must
    change layout all at once to go from, say, reduce-scatter + sharded update + all-gather
    to all-reduce + replicated update; no single-node move can, and program order puts the
    state (graph inputs) far from its update. Nodes with one choice (scalars: the step
    count, learning-rate schedules) join nothing, or every chain would be one component.
    The components are kept small on purpose: the ILP's relaxation of a layout problem is
    weak (fractional layouts pair up for free), so CP-SAT proves small blocks at once and
    large ones not at all."""
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


def sub_mesh_seeds(cg: CostGraph, memory_budget, time_limit: float
                   ) -> tuple[list[dict[int, int]], float]:
    """Plans of a multi-axis mesh from 1-D problems: the whole mesh seen as one flat axis,
    then each mesh axis alone with the others idle. The 1-D problems are a fraction of the
    size (their dots have a handful of strategies, not their square), so each is solved
    well; data parallel or FSDP over the whole mesh is a flat plan, and Megatron over the
    fast axis (or any plan that leaves the slow axis idle) is a one-axis plan, which the
    axis-wise refinement then extends over the other axes. Only axes faster than the
    slowest get a seed of their own. Returns the seeds and the solver work they took."""
    names = cg.axis_names
    slow = (min(cg.cluster.bandwidth(a) for a in names),
            -max(cg.cluster.latency(a) for a in names))
    # an axis alone is worth a seed only when its link beats the slowest: otherwise the flat
    # problem (more devices, priced at that same link) covers it
    subsets = [tuple(range(len(names)))] + [
        (k,) for k, a in enumerate(names)
        if (cg.cluster.bandwidth(a), -cg.cluster.latency(a)) > slow]
    seeds = [axes_seed(cg, axes, memory_budget, time_limit / len(subsets)) for axes in subsets]
    return [x for x, _ in seeds], sum(w for _, w in seeds)


def axes_seed(cg: CostGraph, axes: Sequence[int], memory_budget,
              time_limit: float) -> tuple[dict[int, int], float]:
    """The plan of the 1-D problem over the mesh axes ``axes`` taken as one axis (their
    devices, priced at their slowest link), mapped back: each 1-D ``S(d)`` / ``B`` / ``P``
    becomes the same on every axis in ``axes`` (a dim split over all of them, in mesh
    order) and ``B`` on the others; with the solver work it took."""
    n = math.prod(cg.axis_sizes[k] for k in axes)
    names = [cg.axis_names[k] for k in axes]
    flat = dataclasses.replace(
        cg.cluster, axis_bandwidth={"flat": min(cg.cluster.bandwidth(a) for a in names)},
        axis_latency={"flat": max(cg.cluster.latency(a) for a in names)})
    one = build(cg.graph, (n,), ("flat",), flat, cg.ties, pin=False)
    sol = solve(one, SolveOptions(memory_budget, time_limit))

    def spread(nd: NdSbp) -> NdSbp:
        return NdSbp(tuple(nd.sbps[0] if k in axes else B
                           for k in range(len(cg.axis_sizes))))

    index: dict[int, dict] = {}
    x = {}
    for i in cg.live:
        choices = cg.choices[i]
        if id(choices) not in index:
            index[id(choices)] = {(c if isinstance(c, NdSbp) else (c.ins, c.outs)): a
                                  for a, c in enumerate(choices)}
        c = one.choices[i][sol.choice[i]]
        key = spread(c) if isinstance(c, NdSbp) else (tuple(map(spread, c.ins)),
                                                      tuple(map(spread, c.outs)))
        # a node pinned to a layout the 1-D problem could not name keeps its own (first)
        x[i] = index[id(choices)].get(key, 0)
    return x, sol.stats["work"]


def fold_refine(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float,
                folding: tuple[CostGraph, dict[int, int]] | None = None
                ) -> tuple[dict[int, int], str, float]:
    """Solve the repeated-layer quotient of ``cg`` (descent, then the ILP for ``time_limit``
    seconds), expand it, refine it by descent on the full graph, and keep it if it beats
    ``x``. Returns the plan, the quotient ILP's status ("" when nothing folds) and the
    solver work.
    ``folding`` is ``fold(cg)`` when the caller has it."""
    q, cls = folding or fold(cg)
    if len(q.choices) * 2 > len(cls):
        return x, "", 0.0  # less than 2 members per class on average: no repeated layers
    if problem_size(q) > ILP_FULL_TERMS:
        return x, "", 0.0  # still too large for one ILP (a 2-D mesh squares the choices)
    xq = descent.solve(q, memory_budget)
    res = solve_ilp(q, time_limit=time_limit, memory_budget=memory_budget, hint=xq)
    if res.assignment is not None:
        xq = _better(q, xq, res.assignment, memory_budget)
    y = descent.descend(cg, expand(cls, xq))
    return _better(cg, x, y, memory_budget), res.status.lower(), res.work


def _without_axis(c, k: int):
    """A choice's SBPs on every mesh axis but ``k``."""
    if isinstance(c, NdSbp):
        return c.sbps[:k] + c.sbps[k + 1:]
    return tuple(nd.sbps[:k] + nd.sbps[k + 1:] for nd in (*c.ins, *c.outs))


def axis_refine(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float,
                folding: tuple[CostGraph, dict[int, int]] | None = None
                ) -> tuple[dict[int, int], str, float]:
    """Coordinate descent over mesh axes on the repeated-layer quotient (AutoDDL's
    per-axis search, made exact per step): hold every node's SBPs on all axes but one and
    solve that axis exactly with the ILP, for each axis in turn. One axis's choice sets are
    the size of a 1-D problem's, so each step is exact where the whole nd quotient is too
    large for one ILP; a step moves a plan from, say, data parallel over both axes to data
    parallel over the slow one with sharded state over the fast one (the gradient then
    reduce-scatters on the fast link and all-reduces 1/n of it on the slow one)."""
    q, cls = folding or fold(cg)
    xq = {c: x[m[0]] for c, m in enumerate(members(cls))}
    xq, status, work = _axis_sweeps(q, xq, memory_budget, time_limit)
    y = descent.descend(cg, expand(cls, xq))
    return _better(cg, x, y, memory_budget), f"axes {status}", work


def _axis_sweeps(q: CostGraph, xq: dict[int, int], memory_budget, budget: float
                 ) -> tuple[dict[int, int], str, float]:
    """:func:`axis_refine`'s sweeps over the mesh axes of ``q`` from ``xq``, until a sweep
    moves nothing or the solver work reaches ``budget``."""
    status, work = "optimal", 0.0
    for _ in range(AXIS_ROUNDS):
        moved = False
        for k in reversed(range(len(q.axis_sizes))):
            left = budget - work
            if left <= 0:
                return xq, "time-limit", work
            allowed = {}
            for i, ch in enumerate(q.choices):
                keep = _without_axis(ch[xq[i]], k)
                allowed[i] = [a for a, c in enumerate(ch) if _without_axis(c, k) == keep]
            sub = restrict(q, allowed)
            hint = {i: allowed[i].index(xq[i]) for i in allowed}
            res = solve_ilp(sub, time_limit=left, memory_budget=memory_budget, hint=hint)
            work += res.work
            if res.assignment is None:
                continue
            if res.status != "OPTIMAL":
                status = "time-limit"
            y = {i: allowed[i][b] for i, b in res.assignment.items()}
            if descent.objective(q, y) < descent.objective(q, xq) - 1e-12 and \
                    _better(q, xq, y, memory_budget) is y:
                xq, moved = y, True
        if not moved:
            break
    return xq, status, work


def block_refine(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float):
    """Block coordinate descent with exact ILP blocks: the graph is cut into blocks of
    consecutive nodes (the tail's update chains with their state, program order, then
    breadth-first order so a layer's forward and backward meet), and each block is re-solved
    exactly with everything else held fixed. Spends at most ``BLOCK_SHARE`` of
    ``time_limit`` (in solver work); stops after a pass that finds nothing. Returns the
    plan, its status and the work spent."""
    budget, work = time_limit * BLOCK_SHARE, 0.0
    tail = _tail_blocks(cg)
    for blocks in (tail, _blocks(cg, cg.live), _blocks(cg, _bfs_order(cg))):
        before = descent.objective(cg, x)
        for block in blocks:
            left = budget - work
            if left <= 0:
                return x, "blocks", work
            res = solve_ilp(cg, time_limit=min(left, 1.0), memory_budget=memory_budget,
                            hint=x, free=block)
            work += res.work
            if res.assignment is not None:
                x = _better(cg, x, res.assignment, memory_budget)
        if descent.objective(cg, x) >= before - 1e-12 and blocks is not tail:
            break
    return x, "blocks", work


def plan_graph(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
               cluster: Cluster, options: SolveOptions = SolveOptions(), *,
               ties: Sequence[tuple[int, int]] = (),
               fixed: Fixed = NOTHING_FIXED) -> tuple[CostGraph, Solution]:
    """Build the cost graph of ``graph`` on the mesh and solve it. ``fixed`` pins graph
    inputs and outputs to the layouts given."""
    t0 = time.perf_counter()
    cg = build(graph, axis_sizes, axis_names, cluster, ties, fixed=fixed)
    build_s = time.perf_counter() - t0
    sol = solve(cg, options)
    return cg, dataclasses.replace(sol, stats={**sol.stats, "build_s": build_s})
