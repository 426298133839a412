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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner
from shardc.errors import MemoryBudgetError as MemoryBudgetError
from shardc.ir.graph import Graph
from shardc.ir.sbp import NdSbp
from shardc.solve import descent
from shardc.solve.collector import gc_paused
from shardc.solve.costgraph import CostGraph
from shardc.solve.fixed import NOTHING_FIXED, Fixed
from shardc.solve.fold import expand, quotient
from shardc.solve.ilp import DEFAULT_TIME_LIMIT, problem_size, solve_ilp
from shardc.solve.memory import memory_cut, memory_profile
from shardc.solve.problem import build
from shardc.solve.refine import ILP_FULL_TERMS, best_of, better, quotient_refine
from shardc.solve.reuse import Reuse, Starts, exact_peak

__all__ = ["DEFAULT_TIME_LIMIT", "MEMORY_ROUNDS", "MemoryBudgetError", "plan_graph", "Solution",
           "solve", "SolveOptions", "Status"]

MEMORY_ROUNDS = 6  # re-solves adding the worst violated program point


@dataclass(frozen=True)
class SolveOptions:
    """What the solver is asked for: a per-device byte budget, a wall-clock guard on each
    ILP solve (seconds; 0 runs coordinate descent alone), whether to run the ILP, and
    hand-written plans to start from (by name: graph-input layouts), and the backend's
    collective combiners."""

    memory_budget: float | None = None
    time_limit: float = DEFAULT_TIME_LIMIT
    use_ilp: bool = True
    seeds: Mapping[str, Mapping[int, NdSbp]] = field(default_factory=dict)
    #: the combiners of the backend the plan compiles for: the collectives they join share
    #: latencies in the objective (:func:`shardc.cost.combine.alpha_scales`)
    combiner: Combiner = XLA_CPU
    #: state inputs kept in host memory between steps (input indices; tied inputs only)
    offloaded: frozenset[int] = frozenset()


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
    memo: dict = {}  # descent's on ``cg`` (:func:`descent.solve`), kept through the rounds
    x = _descent(cg, folding, memory_budget, memo)
    seed_plans, starts = _seed_starts(kept, options.seeds, memory_budget)
    if memory_budget is not None:
        starts.append(kept.lean())
    x = best_of(cg, x, starts, memory_budget)
    t2 = time.perf_counter()
    x, status, stages, found = _rounds(cg, x, kept, starts, memory_budget,
                                       options.time_limit if use_ilp else None, folding, memo)
    x = _fit_exactly(cg, x, kept, starts, memory_budget, found)
    stats = {"nodes": n_all, "live_nodes": len(cg.live), "edges": len(cg.edges),
             "merge_s": t1 - t0, "descent_s": t2 - t1, "ilp_s": time.perf_counter() - t2}
    if stages:
        stats["stages"] = stages
    if seed_plans:
        stats["seeds"] = {name: kept.objective(y) for name, y in seed_plans.items()}
    seed_choices = {name: cg.decode(y) for name, y in seed_plans.items()
                    if memory_budget is None or kept.peak(y) <= memory_budget}
    return Solution(cg.decode(x), status, descent.objective(cg, x), stats, seed_choices)


def _seed_starts(kept: Starts, seeds: Mapping[str, Mapping[int, NdSbp]], memory_budget
                 ) -> tuple[dict[str, dict[int, int]], list[dict[int, int]]]:
    """Each seed's own plan (the cheapest that fits the budget, else the cheapest) by
    name, and every completion of the seeds as a start."""
    seed_plans, starts = {}, []
    for name, layouts in seeds.items():
        ends = kept.seed(layouts)  # cheapest first; under a budget the leaner may fit
        lean = kept.seed_lean(layouts) if memory_budget is not None else None
        if lean is not None:
            # and its leanest completion: the cheapest ones spend bytes for time (a
            # seed's cheapest completions can hold more than its lean one)
            ends = [*ends, lean]
        fit = [y for y in ends if memory_budget is None or kept.peak(y) <= memory_budget]
        if ends:
            seed_plans[name] = (fit or ends)[0]
        starts += ends
    return seed_plans, starts


def _rounds(cg: CostGraph, x: dict[int, int], kept: Starts, starts: list, memory_budget,
            time_limit: float | None, folding: tuple[CostGraph, dict[int, int]] | None,
            memo: dict) -> tuple[dict[int, int], Status, str, float]:
    """The stages solved once, or under a budget up to :data:`MEMORY_ROUNDS` times, each
    round constraining the worst program point over the budget; returns the plan, its
    status and stages and the least peak over the budget seen (inf: none). ``memo``: the
    descents on ``cg`` so far (:func:`descent.solve`)."""
    status, stages, found = Status.DESCENT_ONLY, "", math.inf
    # below what the inputs alone hold no round can fit: the leanest plan reached names the
    # budget (the frontier's first ask, 1 byte, would run every round's ILPs for nothing)
    hopeless = memory_budget is not None and memory_budget < _floor(cg)
    fallback = memory_budget is not None and any(kept.peak(y) <= memory_budget for y in starts)
    for _ in range(0 if hopeless else MEMORY_ROUNDS):
        x, status, stages = _solve_once(cg, x, memory_budget, time_limit, folding)
        if memory_budget is None:
            break
        profile = memory_profile(cg, cg.decode(x))
        t = int(np.argmax(profile))
        if profile[t] <= memory_budget:
            break
        found = min(found, float(profile[t]))
        if descent.memory(cg, x) > memory_budget and fallback:
            # no stage found a plan within the rows, and a start fits: a cut only narrows
            # the rows, so the rounds left would find none either; the starts settle it.
            # Where none fits, the rounds go on: the leaner plans they reach name the
            # budget the error asks for
            break
        cg.memory.append(memory_cut(cg, x, t, profile[t]))  # constrain it too
        # the quotient's memory points were stale (its classes are not: costs and edges)
        if folding is not None:
            folding = (quotient(cg, kept.classes()), kept.classes())
        x = _descent(cg, folding, memory_budget, memo)
        x = best_of(cg, x, starts, memory_budget)
    return x, status, stages, found


def _fit_exactly(cg: CostGraph, x: dict[int, int], kept: Starts, starts: list,
                 memory_budget, found: float) -> dict[int, int]:
    """``x``, or where its exact memory profile exceeds the budget the cheapest start that
    fits exactly; :class:`MemoryBudgetError` where none does."""
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
    return x


def _descent(cg: CostGraph, folding: tuple[CostGraph, dict[int, int]] | None,
             memory_budget, memo: dict) -> dict[int, int]:
    """Coordinate descent's plan of ``cg``: from its starts on the graph itself, or, when
    folding at least halves it, on the repeated-layer quotient (a layer's work, not the
    program's), expanded and refined on the full graph. The quotient's stages settle the
    plan from there (:func:`quotient_refine`); the start only leads them. Where folding ties
    little (a scanned model: its layers are one body already), the graph's own descent
    costs no more and leads better. ``memo``: the descents on ``cg`` so far (a quotient is
    rebuilt each round: its own are not kept)."""
    if folding is None or 2 * len(folding[0].live) > len(cg.live):
        return descent.solve(cg, memory_budget, memo)
    q, cls = folding
    return descent.descend(cg, expand(cls, descent.solve(q, memory_budget)))


def _floor(cg: CostGraph) -> float:
    """Bytes per device no plan goes below: every graph input held for the whole step
    (:func:`shardc.solve.memory.memory_profile`), each at its most split layout."""
    return sum(nbytes * min(nd.shard_fraction(cg.axis_sizes) for nd in cg.out_sbps(node, slot))
               for k, (_, _, node, slot, nbytes) in enumerate(cg.spans[:len(cg.graph.inputs)])
               if k not in cg.offloaded)


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
    return better(cg, x, res.assignment, memory_budget), status, ""


@gc_paused()
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
                   resident=resident, combiner=options.combiner, offloaded=options.offloaded)
        kept = None
    else:
        cg, kept = reuse.cost_graph(graph, axis_sizes, axis_names, cluster, ties, fixed,
                                    resident, options.combiner, options.offloaded)
    build_s = time.perf_counter() - t0
    sol = solve(cg, options, kept)
    return cg, dataclasses.replace(sol, stats={**sol.stats, "build_s": build_s})
