"""Solving a traced call: the meshes to plan on (the physical one, or every logical view
with ``mesh_search``), the fastest plan within the memory budget (recomputing forward segments
where the budget binds) and the error naming the smallest budget that plans (the pipeline
the planner chooses on top: :mod:`shardc.step.pipelining`). Each function takes the step
(:class:`shardc.step.auto_shard.AutoSharded`) for its mesh, options and traced programs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner, combiner_for
from shardc.cost.units import fmt_bytes
from shardc.ir.remat import levels
from shardc.ir.sbp import NdSbp
from shardc.plan.assemble import assemble
from shardc.plan.attention import attention_forms
from shardc.plan.overlap import ranking_time
from shardc.plan.record import Plan
from shardc.rules.registry import has_rule, warn_missing
from shardc.solve.costgraph import CostGraph
from shardc.solve.fixed import Fixed
from shardc.solve.reuse import Reuse
from shardc.solve.search import MemoryBudgetError, SolveOptions, plan_graph
from shardc.step.ahead import peak_ahead
from shardc.step.calling import Call
from shardc.step.offload import offloadable
from shardc.step.options import Options, platform_of
from shardc.step.ranking import compiled_best
from shardc.step.seeds import view_seeds
from shardc.step.signature import TracedCall, pins_layouts
from shardc.tradeoff.views import View, views

log = logging.getLogger("shardc")

__all__ = ["BUDGET_ROUNDS", "Objective", "checked", "compiled_within", "fastest", "leanest",
           "mesh_views", "objectives", "problem", "solve", "solve_views"]


def problem(step, call: Call, tr: TracedCall
             ) -> tuple[list[View], list[dict[str, dict[int, NdSbp]]]]:
    """What a solve of this call needs besides its options: the meshes to plan on and
    the seeds of each; warns once per primitive without a rule (it runs replicated)."""
    warn_missing([op for op in tr.traced.graph.ops if not has_rule(op.name)])
    candidates = mesh_views(step, tr)
    return candidates, view_seeds(step, call, candidates)


def mesh_views(step, tr: TracedCall) -> list[View]:
    """The meshes to plan on: the physical one, and with ``mesh_search`` (unless the
    program fixes layouts on the physical axes) every other logical view of it."""
    opts = step.options
    shape, names = tuple(step.mesh.axis_sizes), tuple(step.mesh.axis_names)
    if opts.mesh_search and not pins_layouts(tr):
        return views(shape, names, opts.cluster)
    return [View(shape, names, opts.cluster)]


def solve(step, call: Call, tr: TracedCall, candidates: list[View],
           seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
           compiled: bool = True) -> Plan:
    """The fastest plan within ``opts.memory_budget`` (:func:`fastest`); where none
    fits, the error names the smallest budget that plans (:func:`leanest`). With
    ``compiled``, held to the budget on its compiled program too (:func:`checked`);
    without, where a pipeline may replace it (the pipeline's peak is checked on its own,
    :mod:`shardc.step.pipelining`)."""
    reuse = Reuse()  # the cost graphs, built once for every budget planned below
    try:
        try:
            plan = fastest(step, call, tr, candidates, seeds, opts, reuse)
        except MemoryBudgetError as exc:
            raise leanest(step, call, tr, candidates, seeds, opts, exc, reuse) from None
        return checked(step, call, tr, candidates, seeds, opts, plan, reuse) if compiled \
            else plan
    except MemoryBudgetError as exc:
        if not tr.fixed.whole or exc.hint:
            raise
        raise exc.hinted(_WHOLE_SEQUENCE) from None


#: the fix a budget error adds where ``context_parallel=False`` kept attention whole
_WHOLE_SEQUENCE = ("Or allow context parallelism (context_parallel=True, the default): "
                   "context_parallel=False keeps every attention's sequence whole.")


def checked(step, call: Call, tr: TracedCall, candidates: list[View],
            seeds: list[dict[str, dict[int, NdSbp]]], opts: Options, plan: Plan,
            reuse: Reuse | None = None) -> Plan:
    """``plan`` (made by :func:`solve`) where no budget was asked for or the mesh is
    abstract (nothing compiles); else held to the budget on its compiled program: compiled,
    and planned again where it holds more (:func:`compiled_within`)."""
    if opts.memory_budget is None or step.abstract:
        return plan
    return compiled_within(step, call, tr, candidates, seeds, opts, plan, reuse)


#: plans made again under a lowered budget where the one before compiled over the budget
BUDGET_ROUNDS = 3


def compiled_within(step, call: Call, tr: TracedCall, candidates: list[View],
                    seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
                    plan: Plan, reuse: Reuse | None = None) -> Plan:
    """``plan`` (the fastest predicted within ``opts.memory_budget``) where its compiled
    program's peak fits the budget too; else the first plan whose compiled peak fits,
    each made under the budget scaled by the last plan's predicted over compiled peak
    (``budget * predicted / compiled``: what its prediction would have to be, were the
    next plan's missed alike; below the last plan's, so each round plans anew), at most
    :data:`BUDGET_ROUNDS` times. The memory model misses what XLA's passes move: on a
    KV-cache decode loop a plan predicted at 0.67 MiB under a 0.70 MiB budget compiled to
    0.94 (the loop's weight gathers hoisted out of it, all held for the whole loop). The
    step's first call runs the kept plan's compile (:func:`shardc.step.ahead.compile_ahead`).
    ``plan.solver["budget_rounds"]`` lists each plan's budget asked, predicted and
    compiled peak; ``solver["compiled_peak"]`` is the kept one's.

    Raises:
        MemoryBudgetError: where no round's plan compiles within the budget, naming the
            leanest compiled peak and a budget raised by what its prediction missed (or
            recompute activations).
    """
    budget, asked, rounds = opts.memory_budget, opts.memory_budget, []
    while True:
        peak = peak_ahead(step, call, plan)
        rounds.append({"budget": asked, "predicted": plan.predicted.peak_memory,
                       "compiled": peak})
        if peak is None or peak <= budget:
            return dataclasses.replace(plan, solver={
                **plan.solver, "compiled_peak": peak, "budget_rounds": rounds})
        log.info("shardc: the plan under %s compiled to %s (predicted %s)", fmt_bytes(asked),
                 fmt_bytes(peak), fmt_bytes(plan.predicted.peak_memory))
        if len(rounds) > BUDGET_ROUNDS:
            break
        asked = budget * plan.predicted.peak_memory / peak
        try:
            plan = fastest(step, call, tr, candidates, seeds,
                           dataclasses.replace(opts, memory_budget=asked), reuse)
        except MemoryBudgetError:
            break
    lean = min(rounds, key=lambda r: r["compiled"])
    raise MemoryBudgetError(budget, math.ceil(budget + lean["compiled"] - lean["predicted"]),
                            lean["compiled"], predicted=lean["predicted"])


def fastest(step, call: Call, tr: TracedCall, candidates: list[View],
             seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
             reuse: Reuse | None = None) -> Plan:
    """The fastest plan within ``opts.memory_budget``. Where the budget binds (no plan
    that keeps every activation for the backward pass fits, or the one that does is
    slower than the plan at no budget), the programs recomputing forward segments are
    planned too (:func:`shardc.ir.remat.levels`: all of them, then the half that saves
    the most bytes per recomputed FLOP), and the fastest plan that fits wins; the error
    names the smallest peak any of them reached. Where none fits, state read in a short
    stretch of the step may live in host memory (:func:`offloaded_plans`)."""
    recomputed = levels(tr.traced.segments)
    budget = opts.memory_budget
    moved = offloadable(tr) if opts.offload and budget is not None else frozenset()
    try:
        plan = solve_views(step, tr, candidates, seeds, opts, reuse)
    except MemoryBudgetError as exc:
        if budget is None or not (recomputed or moved):
            raise
        plan, failure = None, exc
    if budget is None or not (recomputed or moved) or plan is not None and not recomputed:
        return plan
    if plan is not None:
        free = solve_views(step, tr, candidates, seeds,
                           dataclasses.replace(opts, memory_budget=None), reuse)
        if ranking_time(plan) <= ranking_time(free):
            return plan  # the budget does not bind
    fits = [] if plan is None else [plan]
    for remat in recomputed:  # most recomputed first: fewer fit no better
        log.info("shardc: the budget %s binds; planning with %d of %d forward segments "
                 "recomputed", fmt_bytes(budget), len(remat), len(tr.traced.segments))
        try:
            fits.append(solve_views(step, step._traced(call, remat)[1], candidates,
                                    seeds, opts, reuse))
        except MemoryBudgetError as again:
            if plan is None:
                failure = MemoryBudgetError(budget, min(failure.needed, again.needed),
                                            min(failure.found, again.found))
            break
    if not fits and moved:  # below the leanest plan on the devices: state in host memory
        fits, lean = offloaded_plans(step, call, tr, candidates, seeds, opts, reuse, moved)
        if lean is not None:
            failure = MemoryBudgetError(budget, min(failure.needed, lean.needed),
                                        min(failure.found, lean.found))
    if not fits:
        raise failure
    return min(fits, key=ranking_time)


def offloaded_plans(step, call: Call, tr: TracedCall, candidates: list[View],
                    seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
                    reuse: Reuse | None, moved: frozenset[int]
                    ) -> tuple[list[Plan], MemoryBudgetError | None]:
    """The plans keeping the state ``moved`` in host memory (:mod:`shardc.step.offload`)
    that fit ``opts.memory_budget``: with every activation kept, and where none fits so,
    with every forward segment recomputed. Where neither fits, no plan and the error
    naming the leanest either reached (what the budget's error names, these being leaner
    than any plan on the devices)."""
    failure = None
    for remat in ((), *levels(tr.traced.segments)[:1]):
        here = tr if not remat else step._traced(call, remat)[1]
        log.info("shardc: the budget %s binds; planning with %d state leaves in host memory"
                 "%s", fmt_bytes(opts.memory_budget), len(moved),
                 " and every forward segment recomputed" if remat else "")
        try:
            return [solve_views(step, dataclasses.replace(here, offloaded=moved), candidates,
                                seeds, opts, reuse)], None
        except MemoryBudgetError as exc:
            failure = exc if failure is None else MemoryBudgetError(
                exc.budget, min(exc.needed, failure.needed), min(exc.found, failure.found))
    return [], failure


def leanest(step, call: Call, tr: TracedCall, candidates: list[View],
             seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
             failure: MemoryBudgetError, reuse: Reuse | None = None) -> MemoryBudgetError:
    """The error for a budget no plan fits, naming the smallest budget found to plan: the
    smallest peak the search reached, where planning at it succeeds (the leanest plans
    are the search's, not its lean start's: on a residual MLP, 2.6 MiB against 4.9
    MiB), else the lean start's peak, which always does; then the peak of the plan made
    at that budget, where planning at it succeeds too (the search meets a budget it can
    leaner than it gets under one it cannot: an MLP stack on 8 devices plans at 5.2 MiB
    under a 6 MiB budget, and under 5 MiB reached only its lean start's 8.0). On a mesh
    with devices the plan made at the budget named is compiled, and where it compiles over
    it, the budget named is raised by what its prediction missed (:func:`compiled_within`
    holds a budget to the compiled peak): a two-dot program's leanest plan, predicted at
    512 B, compiled to 548."""

    def plan_at(budget: int) -> Plan | None:
        log.info("shardc: no plan fits %s; checking that one fits %s",
                 fmt_bytes(opts.memory_budget), fmt_bytes(budget))
        try:
            return fastest(step, call, tr, candidates, seeds,
                           dataclasses.replace(opts, memory_budget=budget), reuse)
        except MemoryBudgetError:
            return None

    needed, found = failure.needed, math.ceil(failure.found)
    plan = plan_at(found) if found < needed else None
    if plan is None:
        found, plan = needed, plan_at(needed)
    if plan is not None and (peak := math.ceil(plan.predicted.peak_memory)) < found:
        leaner = plan_at(peak)
        if leaner is not None:
            found, plan = peak, leaner
    compiled = None if plan is None or step.abstract else peak_ahead(step, call, plan)
    if compiled is not None and compiled > found:  # raised by what the prediction missed
        found = _held(step, call, tr, candidates, seeds, opts, reuse,
                      math.ceil(found + compiled - plan.predicted.peak_memory))
    return MemoryBudgetError(failure.budget, found)


def _held(step, call: Call, tr: TracedCall, candidates: list[View],
          seeds: list[dict[str, dict[int, NdSbp]]], opts: Options, reuse: Reuse | None,
          budget: int) -> int:
    """``budget``, a budget raised by what a prediction missed, checked: planned at and
    held to on the compiled program (:func:`checked`), and where that fails raised to what
    the failure names, at most :data:`BUDGET_ROUNDS` times (the plan made under a higher
    budget may use more of it: a 2-layer attention's leanest plan compiled 3.46 -> 4.70
    MiB, and the one planned under the 3.62 MiB that named compiled over it again)."""
    for _ in range(BUDGET_ROUNDS):
        at = dataclasses.replace(opts, memory_budget=budget)
        try:
            checked(step, call, tr, candidates, seeds, at,
                    fastest(step, call, tr, candidates, seeds, at, reuse), reuse)
            return budget
        except MemoryBudgetError as again:
            budget = max(budget + 1, again.needed)
    return budget


def solve_views(step, tr: TracedCall, candidates: list[View],
                 seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
                 reuse: Reuse | None = None) -> Plan:
    """The fastest plan of ``tr``'s program over the meshes ``candidates`` (``reuse``:
    where cost graphs built for other budgets are kept, :mod:`shardc.solve.reuse`)."""
    names = tuple(step.mesh.axis_names)
    t0 = time.perf_counter()
    best, tried, failure, priced = None, [], None, {}
    pool: list[Plan] = []  # every plan assembled: what rank_compiled compiles the best of
    for view, seeds_here in zip(candidates, seeds, strict=True):
        t = time.perf_counter()
        is_physical = view.names == names
        plan = None
        try:
            own = None  # the view's own cost graph (the first search's)
            for k, search in enumerate(objectives(step.mesh, view.cluster)):
                sopts = SolveOptions(memory_budget=opts.memory_budget,
                                     time_limit=opts.time_limit, seeds=seeds_here,
                                     combiner=search.combiner, offloaded=tr.offloaded)
                try:
                    mine, costs, assembled, cg = _view_plan(step, tr, view, sopts,
                                                            is_physical, reuse, search, own)
                except MemoryBudgetError:
                    if k == 0:
                        raise
                    continue  # the backend's own search found a plan within the budget
                if k == 0:
                    own = cg
                    for name, cost in costs.items():
                        priced[name if is_physical else f"{name} on {view.label}"] = cost
                pool += assembled
                if plan is None or ranking_time(mine) < ranking_time(plan):
                    plan = mine
        except MemoryBudgetError as exc:
            if len(candidates) == 1:
                raise
            failure = exc if failure is None else MemoryBudgetError(
                exc.budget, min(exc.needed, failure.needed), min(exc.found, failure.found))
            tried.append({"mesh": view.label, "predicted_s": None,
                          "plan_s": time.perf_counter() - t, "error": str(exc)})
            continue
        tried.append({"mesh": view.label, "predicted_s": plan.predicted.step_time,
                      "ranked_s": ranking_time(plan), "plan_s": time.perf_counter() - t})
        if best is None or ranking_time(plan) < ranking_time(best):
            best = plan
    if best is None:
        raise failure
    if best.cluster.overlap and opts.rank_compiled and not step.abstract:
        best = compiled_best(step, tr, [best] + pool, opts.rank_compiled)
    solver = {**best.solver, "plan_s": time.perf_counter() - t0}
    forms = attention_forms(tr.traced.graph, best)
    if forms:  # how each attention is split (explain() shows it)
        solver["attention"] = forms
    if best.cluster.overlap:  # the step it was ranked by (explain() shows it)
        solver["overlapped_s"] = ranking_time(best)
    if priced:
        solver["seeds"] = priced  # every view's seeds: the plan costs no more than any
    if opts.mesh_search:
        solver["mesh_search"] = tried
        if pins_layouts(tr):
            solver["mesh_search_note"] = (
                "only the given mesh was planned: the program fixes layouts on its axes")
    return dataclasses.replace(best, solver=solver)


@dataclass(frozen=True)
class Objective:
    """One search of a view: the combiners whose shared latencies its objective prices, and
    the cluster whose collective model prices its objective (the view's own, or NCCL's:
    :func:`objectives`). Its plans are priced on the view's own cluster."""

    combiner: Combiner
    cluster: Cluster


def objectives(mesh, cluster: Cluster) -> tuple[Objective, ...]:
    """The searches of a view, each an :class:`Objective`: first the backend's combiners
    under ``cluster``; under overlap also XLA:CPU's where the backend's differs. The
    objective prices communication serially, and on XLA:GPU, whose all-gathers combine, it
    leads to ZeRO-like plans whose gathers run at the step's start beside nothing: GPT-2 on
    one node compiled to 4.774 ms overlapped, where the search charging each gather its
    latency led to Megatron's seed at 4.190 (the overlap replay ranks them so: 5.549 and
    4.820 ms). The overlap replay (:func:`ranking_time`) picks among both searches' plans.
    Serially under another collective model than NCCL's, also the search under NCCL's,
    its plans priced by ``cluster``'s: the objective charges every collective its own
    latencies, which the prediction shares among those XLA combines, and where each step
    pays one (ring) it drove GPT-2 on two nodes to a ZeRO-1 completion of 49 all-to-alls,
    7.386 ms compiled and priced with ring steps, where the plan made under NCCL's model
    prices 6.882 there."""
    own = combiner_for(platform_of(mesh))
    if cluster.overlap:
        return tuple(Objective(c, cluster) for c in ((own, XLA_CPU) if own != XLA_CPU
                                                     else (own,)))
    if cluster.collective_model != "nccl":
        return Objective(own, cluster), Objective(own, _under_nccl(cluster))
    return (Objective(own, cluster),)


@functools.lru_cache(maxsize=64)
def _under_nccl(cluster: Cluster) -> Cluster:
    """``cluster`` pricing collectives with NCCL's model (one object per cluster: the cost
    graphs built for it are reused, :mod:`shardc.solve.reuse`)."""
    return dataclasses.replace(cluster, collective_model="nccl")


def _view_plan(step, tr: TracedCall, view: View, sopts: SolveOptions, is_physical: bool,
               reuse: Reuse | None, search: Objective | None = None,
               own: CostGraph | None = None
               ) -> tuple[Plan, dict[str, float], list[Plan], CostGraph]:
    """The best plan on one view from one search (the search's, or a seed's that ranks
    better), the seeds' objectives, every plan assembled (the search's first), and the
    cost graph searched. ``search``: its objective (None: the view's own cluster's); where
    it prices by another cluster than the view's, the plans are assembled on ``own``, the
    view's own cost graph (the same choices: the rules' strategies do not depend on the
    cluster)."""
    graph = tr.traced.graph
    objective = view.cluster if search is None else search.cluster
    # another view keeps only the ops' restrictions: the layouts pinned are the mesh's
    fixed = tr.fixed if is_physical else Fixed(whole=tr.fixed.whole)
    cg, sol = plan_graph(graph, view.shape, view.names, objective, sopts,
                         ties=tr.ties, fixed=fixed,
                         resident=tr.resident, reuse=reuse)
    on = cg if objective is view.cluster else own
    if [len(c) for c in on.choices] != [len(c) for c in cg.choices]:
        raise AssertionError("the objective's cost graph and the view's differ in choices")
    sol.stats.pop("seeds", None)  # the objective's figures: priced below as the plan is
    solver = {"status": sol.status.value, "objective": sol.objective, **sol.stats}
    if on is not cg:
        solver["objective_model"] = objective.collective_model
    plan = assemble(graph, on, sol.choice, tr.ties, solver, tr.traced.remat,
                    len(tr.traced.segments), platform_of(step.mesh))
    assembled, costs = [plan], {}
    for name, choice in sol.seed_choices.items():
        # every seed priced as the plan is (assembled: XLA's combined collectives as the one
        # collective each compiles to; under overlap, replayed), so a plan and the seeds it
        # is shown beside have one predicted step each, and the plan is no slower than any
        other = assemble(graph, on, choice, tr.ties, {**solver, "seed": name},
                         tr.traced.remat, len(tr.traced.segments), platform_of(step.mesh))
        assembled.append(other)
        costs[name] = ranking_time(other)
        if costs[name] < ranking_time(plan):
            plan = other
    return plan, costs, assembled, cg
