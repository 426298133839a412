"""Planning driver: cost graph → follow-merge → coordinate descent → ILP → choices.

The descent result seeds the ILP as a hint; the ILP's answer is kept only when it is no
worse. Every stage runs to its end (a proven ILP optimum, a memory budget's Lagrangian
search, a sweep that moves nothing, each bounded by a count of rounds, never by the clock),
so the plan depends on the program, mesh and cluster only; ``time_limit`` is a wall-clock
guard on each ILP solve (an LP takes a fraction of a second, so only a machine thousands of
times slower meets it): a solve it cuts keeps its best plan so far and the plan's status
says so.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.units import fmt_bytes
from shardc.ir.flow import tail_values
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp
from shardc.solve import descent
from shardc.solve.costgraph import NOTHING_FIXED, CostGraph, Fixed
from shardc.solve.fold import expand, members, quotient, restrict
from shardc.solve.ilp import problem_size, solve_ilp
from shardc.solve.memory import memory_cut, memory_profile
from shardc.solve.problem import build
from shardc.solve.reuse import Reuse, Starts, exact_peak

MEMORY_ROUNDS = 6  # re-solves adding the worst violated program point
ILP_FULL_TERMS = 40_000  # model terms up to which one ILP covers the whole graph
BLOCK_TERMS = 40_000  # model terms per block when refining a larger graph block by block
TAIL_BLOCK_TERMS = 200  # model terms per block of the tail's update chains
AXIS_ROUNDS = 3  # sweeps over the mesh axes (:func:`axis_sweeps`)
CROSS_ROUNDS = 6  # rounds of :func:`cross_sweeps`


class MemoryBudgetError(ValueError):
    """No plan fits ``memory_budget``; ``needed`` is the smallest budget (bytes per device)
    for which one was found: planning again with it succeeds. ``found``: the smallest peak
    the search reached (at most ``needed``; planning at it is likely, not sure, to succeed:
    the planner tries it before naming a budget, :meth:`AutoSharded._solve`)."""

    def __init__(self, budget: float, needed: int, found: float | None = None):
        self.budget, self.needed = budget, needed
        self.found = needed if found is None else min(found, needed)
        super().__init__(
            f"no plan fits memory_budget={fmt_bytes(budget)} per device; the leanest plan "
            f"found needs {fmt_bytes(needed, up=True)} (memory_budget={needed}). Raise the "
            "budget to that, use more devices, or shrink the batch.")


@dataclass(frozen=True)
class SolveOptions:
    """What the solver is asked for: a per-device byte budget, a wall-clock guard on each
    ILP solve (seconds; 0 runs coordinate descent alone), whether to run the ILP, and
    hand-written plans to start from (by name: graph-input layouts)."""

    memory_budget: float | None = None
    time_limit: float = 10.0
    use_ilp: bool = True
    seeds: Mapping[str, Mapping[int, NdSbp]] = field(default_factory=dict)


class Status(enum.StrEnum):
    """How a plan was settled (a ``str``: it is stored as its value in plan files)."""

    OPTIMAL = "optimal"  # one ILP over the whole cost graph proved its optimum
    TIME_LIMIT = "time-limit"  # the best plan found when the time limit cut the search
    LAGRANGIAN = "lagrangian"  # one ILP under a binding memory budget, settled by its
    # Lagrangian search (:class:`shardc.solve.ilp._Budgeted`): deterministic, not proven
    REFINED = "refined"  # too large for one ILP: the descent plan refined by smaller ILPs
    DESCENT_ONLY = "descent-only"  # no ILP ran or none found a plan: coordinate descent's
    INFEASIBLE = "infeasible-ilp"  # the ILP proved the memory budget cannot be met


@dataclass(frozen=True)
class Solution:
    choice: list[int]  # per cost-graph node
    status: Status
    objective: float  # seconds, the cost graph's objective
    stats: dict = field(default_factory=dict)  # "stages" says what refined a REFINED plan
    #: every seed's own plan that fits the budget, as per-node choices: the objective prices
    #: XLA's combined collectives by shares, so the caller checks them once more on the
    #: plan's own prediction
    seed_choices: dict = field(default_factory=dict)


def solve(cg: CostGraph, options: SolveOptions = SolveOptions(), kept: Starts | None = None
          ) -> Solution:
    """Plan ``cg``. ``options.seeds`` are hand-written plans, by name, as layouts of graph
    inputs (:func:`shardc.solve.descent.from_inputs`): the plan costs no more than any of
    them that fits the budget, and ``stats["seeds"]`` gives their costs. With a memory
    budget the leanest plan descent finds (:func:`descent.lean`, deterministic) is a
    candidate too, so the budget a :class:`MemoryBudgetError` names is met when asked for.
    ``kept``: ``cg`` is a copy of a merged cost graph, and these its starts
    (:class:`shardc.solve.reuse.Reuse`); else ``cg``'s followers are merged here."""
    memory_budget = options.memory_budget
    use_ilp = options.use_ilp and options.time_limit > 0
    t0 = time.perf_counter()
    n_all = len(cg.choices)  # merging keeps the nodes (followers are marked, not removed)
    if kept is None:
        cg.merge_followers()
        kept = Starts(cg)
    t1 = time.perf_counter()
    large = use_ilp and problem_size(cg) > ILP_FULL_TERMS  # folded, its quotient solved
    folding = (quotient(cg, kept.classes()), kept.classes()) if large else None
    x = _descent(cg, folding, memory_budget)
    seed_plans, starts = {}, []
    for name, layouts in options.seeds.items():
        ends = kept.seed(layouts)  # cheapest first; under a budget the leaner may fit
        fit = [y for y in ends if memory_budget is None or kept.peak(y) <= memory_budget]
        if ends:
            seed_plans[name] = (fit or ends)[0]
        starts += ends
    if memory_budget is not None:
        starts.append(kept.lean())
    for y in starts:
        x = _better(cg, x, y, memory_budget)
    t2 = time.perf_counter()
    status, stages, found = Status.DESCENT_ONLY, "", math.inf
    # below what the inputs alone hold no round can fit: the leanest plan reached names the
    # budget (the frontier's first ask, 1 byte, ran every round's ILPs for nothing)
    hopeless = memory_budget is not None and memory_budget < _floor(cg)
    for _ in range(0 if hopeless else MEMORY_ROUNDS):
        x, status, stages = _solve_once(cg, x, memory_budget,
                                        options.time_limit if use_ilp else None, folding)
        if memory_budget is None:
            break
        profile = memory_profile(cg, cg.decode(x))
        t = int(np.argmax(profile))
        if profile[t] <= memory_budget:
            break
        found = min(found, float(profile[t]))
        cg.memory.append(memory_cut(cg, x, t, profile[t]))  # constrain it too
        # the quotient's memory points were stale (its classes are not: costs and edges)
        folding = (quotient(cg, kept.classes()), kept.classes()) if large else None
        x = _descent(cg, folding, memory_budget)
        for y in starts:
            x = _better(cg, x, y, memory_budget)
    peak = exact_peak(cg, x) if memory_budget is not None else 0.0
    if memory_budget is not None and peak > memory_budget:
        # the sampled points let through a plan the exact profile rejects: keep the cheapest
        # start that fits exactly (the lean plan fits any budget an error ever named)
        peaks = [kept.peak(y) for y in starts]
        fits = [y for y, p in zip(starts, peaks) if p <= memory_budget]
        if not fits:
            # named from the starts alone: they are planned again at any budget (a plan the
            # search reached may not be), so the budget named is met when asked for
            raise MemoryBudgetError(memory_budget, math.ceil(min(peaks)), min(found, peak))
        x = min(fits, key=kept.objective)
    stats = {"nodes": n_all, "live_nodes": len(cg.live), "edges": len(cg.edges),
             "merge_s": t1 - t0, "descent_s": t2 - t1, "ilp_s": time.perf_counter() - t2}
    if stages:
        stats["stages"] = stages
    if seed_plans:
        stats["seeds"] = {name: kept.objective(y) for name, y in seed_plans.items()}
    seed_choices = {name: cg.decode(y) for name, y in seed_plans.items()
                    if memory_budget is None or kept.peak(y) <= memory_budget}
    return Solution(cg.decode(x), status, descent.objective(cg, x), stats, seed_choices)


def _descent(cg: CostGraph, folding: tuple[CostGraph, dict[int, int]] | None,
             memory_budget) -> dict[int, int]:
    """Coordinate descent's plan of ``cg``: from its starts on the graph itself, or, when
    folding at least halves it, on the repeated-layer quotient (a layer's work, not the
    program's: 0.8 of the 12-layer GPT-2's 4.5 s of planning was descent on the full
    graph), expanded and refined on the full graph. The quotient's stages settle the plan
    from there (:func:`quotient_refine`); the start only leads them. Where folding ties
    little (a scanned model: its layers are one body already), the graph's own descent
    costs no more and leads better: the 70B decoder on (128, 8) planned to 10.49 s per
    step from it, 10.61 s from the quotient's."""
    if folding is None or 2 * len(folding[0].live) > len(cg.live):
        return descent.solve(cg, memory_budget)
    q, cls = folding
    return descent.descend(cg, expand(cls, descent.solve(q, memory_budget)))


def _floor(cg: CostGraph) -> float:
    """Bytes per device no plan goes below: every graph input held for the whole step
    (:func:`shardc.solve.memory.memory_profile`), each at its most split layout."""
    return sum(nbytes * min(nd.shard_fraction(cg.axis_sizes) for nd in cg.out_sbps(node, slot))
               for _, _, node, slot, nbytes in cg.spans[:len(cg.graph.inputs)])


def _solve_once(cg: CostGraph, x: dict[int, int], memory_budget, time_limit: float | None,
                folding: tuple[CostGraph, dict[int, int]] | None
                ) -> tuple[dict[int, int], Status, str]:
    """Improve the descent point ``x`` with the ILP (``time_limit`` None: no ILP); keep
    whichever is better and fits. ``folding`` is ``fold(cg)`` for a graph too large for one
    ILP (:mod:`shardc.solve.fold`): its quotient is solved (:func:`quotient_refine`).
    ``time_limit`` guards each ILP solve (wall seconds). Returns the plan, its status and
    the stages."""
    if time_limit is None:
        return x, Status.DESCENT_ONLY, ""
    if folding is not None:
        x, stages = quotient_refine(cg, x, memory_budget, time_limit, folding)
        return x, Status.TIME_LIMIT if "time-limit" in stages else Status.REFINED, stages
    res = solve_ilp(cg, time_limit=time_limit, memory_budget=memory_budget, hint=x)
    if res.assignment is None:
        return x, (Status.INFEASIBLE if res.status == "INFEASIBLE" else Status.DESCENT_ONLY), ""
    status = {"OPTIMAL": Status.OPTIMAL, "LAGRANGIAN": Status.LAGRANGIAN}.get(
        res.status, Status.TIME_LIMIT)
    return _better(cg, x, res.assignment, memory_budget), status, ""


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
    cross neighbourhoods (:func:`cross_sweeps`). Returns the plan and how the quotient was
    settled. ``folding`` is ``fold(cg)``."""
    q, cls = folding
    xq = {c: x[m[0]] for c, m in enumerate(members(cls))}
    if len(q.axis_sizes) == 1 or problem_size(q) <= ILP_FULL_TERMS:
        res = solve_ilp(q, time_limit=time_limit, memory_budget=memory_budget, hint=xq)
        if res.assignment is not None:
            xq = _better(q, xq, res.assignment, memory_budget)
        status = {"OPTIMAL": "optimal", "INFEASIBLE": "infeasible",
                  "LAGRANGIAN": "lagrangian"}.get(res.status, "time-limit")
    else:
        for seed in sub_mesh_seeds(q, memory_budget, time_limit):
            xq = _better(q, xq, seed, memory_budget)
        # one axis at a time first, then the cross neighbourhoods from there: each stops
        # where the other does not (the 12-layer GPT-2: axis sweeps 7.793 ms, then cross
        # 7.272; the MoE on two nodes x 8: cross from the seed 7.124, axis sweeps 6.700,
        # which cross keeps); and under a memory budget the axis steps' MIPs are a fraction
        # of a cross neighbourhood's (seconds on the 70B decoder on 1024 devices)
        # (without a budget one pass over the axes: a cross round holds every axis move)
        xq, status = axis_sweeps(q, xq, memory_budget, time_limit,
                                 AXIS_ROUNDS if memory_budget is not None else 1)
        xq, crossed = cross_sweeps(q, xq, memory_budget, time_limit)
        status = f"axes {'time-limit' if 'time-limit' in (status, crossed) else status}"
    # a tail block of every layer is one block of the quotient
    tail = list(map(list, dict.fromkeys(tuple(sorted({cls[i] for i in block}))
                                        for block in _tail_blocks(cg))))
    if len(q.axis_sizes) > 2:
        xq, refined = held_axis_blocks(q, xq, memory_budget, time_limit, tail)
    else:
        xq, refined = block_refine(q, xq, memory_budget, time_limit, tail)
    # descent on the full graph knows no budget: where it leaves the budget's rows, the
    # expansion itself is the candidate (the 70B decoder under 80 GiB: expanded 10.45 s at
    # 78 GiB of rows, descended 10.41 s at 159)
    raw = expand(cls, xq)
    y = _better(cg, raw, descent.descend(cg, raw), memory_budget)
    return _better(cg, x, y, memory_budget), f"folded ({status}) + {refined}"


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
    seeds = []
    for axes in subsets:
        allowed = {i: axes_choices(ch, axes) or list(range(len(ch)))
                   for i, ch in enumerate(q.choices)}
        res = solve_ilp(restrict(q, allowed), time_limit=time_limit,
                        memory_budget=memory_budget)
        if res.assignment is not None:
            seeds.append({i: allowed[i][b] for i, b in res.assignment.items()})
    return seeds


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
                and _better(q, xq, y, memory_budget) is y):
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
                    _better(q, xq, y, memory_budget) is y:
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
        xq = _better(q, xq, {i: allowed[i][b] for i, b in y.items()}, memory_budget)
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
                x = _better(cg, x, res.assignment, memory_budget)
        if descent.objective(cg, x) >= before - 1e-12 and blocks is not tail:
            break
    return x, "blocks (time-limit)" if status == "time-limit" else "blocks"


def plan_graph(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
               cluster: Cluster, options: SolveOptions = SolveOptions(), *,
               ties: Sequence[tuple[int, int]] = (),
               fixed: Fixed = NOTHING_FIXED,
               resident: Collection[int] = (),
               reuse: Reuse | None = None) -> tuple[CostGraph, Solution]:
    """Build the cost graph of ``graph`` on the mesh and solve it. ``fixed`` pins graph
    inputs and outputs to the layouts given; ``resident`` inputs pay no host feed.
    ``reuse``: the cost graph is built once there for every solve of the same problem
    (at another budget: the same plans, :mod:`shardc.solve.reuse`)."""
    t0 = time.perf_counter()
    if reuse is None:
        cg = build(graph, axis_sizes, axis_names, cluster, ties, fixed=fixed,
                   resident=resident)
        kept = None
    else:
        cg, kept = reuse.cost_graph(graph, axis_sizes, axis_names, cluster, ties, fixed,
                                    resident)
    build_s = time.perf_counter() - t0
    sol = solve(cg, options, kept)
    return cg, dataclasses.replace(sol, stats={**sol.stats, "build_s": build_s})
