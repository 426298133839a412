"""Solving a traced call: the meshes to plan on (the physical one, or every logical view
with ``mesh_search``), the fastest plan within the memory budget (recomputing forward segments
where the budget binds), the error naming the smallest budget that plans, and the pipeline the
planner chooses. Each function takes the step (:class:`shardc.step.auto_shard.AutoSharded`)
for its mesh, options and traced programs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner, combiner_for
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.inspect.hlo import compiled_peak_memory
from shardc.ir.remat import levels
from shardc.ir.sbp import NdSbp
from shardc.plan.assemble import assemble
from shardc.plan.overlap import ranking_time
from shardc.plan.record import Plan
from shardc.rules.registry import has_rule, warn_missing
from shardc.solve.costgraph import NOTHING_FIXED, CostGraph, Fixed
from shardc.solve.reuse import Reuse
from shardc.solve.search import MemoryBudgetError, SolveOptions, plan_graph
from shardc.step.calling import Call
from shardc.step.options import Options, platform_of
from shardc.step.ranking import compiled_best, compiled_program, compiled_row
from shardc.step.seeds import view_seeds
from shardc.step.signature import TracedCall, pins_layouts
from shardc.tradeoff.views import View, views

log = logging.getLogger("shardc")

__all__ = ["Objective", "SEED_RECHECK", "choice_options", "fastest", "leanest", "mesh_views",
           "objectives", "pipelined", "problem", "solve", "solve_views"]


def pipelined(step, call: Call, tr: TracedCall, candidates: list[View],
               seeds: list[dict[str, dict[int, NdSbp]]]) -> Plan:
    """The solved plan, with the pipeline the planner chooses (``pipeline=None``) or was
    asked for where the program has a layer stack (:func:`shardc.pipeline.layers`) to
    run as one: planned again on the mesh with the layer state pinned as a stage holds
    it (:func:`shardc.pipeline.choose.pinned`), and priced as the pipeline
    (:func:`~shardc.pipeline.choose.adopt`). Unpipelined with ``pipeline=False``,
    without a stack, or where no pipeline pays: against the plan on the mesh, and with
    ``mesh_search``, against the best view's (the stages are over an axis of the
    mesh itself). On a mesh with devices, a choice whose stages leave an axis to XLA is
    kept only where its compiled program communicates as priced and fits the budget
    (:func:`_auto_slack`) and, asked for, predicts a peak within the budget; of a pipeline
    asked for, where no choice passes, the leanest predicted of those that compiled runs
    (priced: where its pinned plan fits no budget, planned with none), with a warning.
    The choices passed over are listed in ``solver["pipeline"]["rejected"]`` (or
    ``solver["pipeline_rejected"]`` where none is kept)."""
    from shardc.pipeline.choose import best_pipeline
    from shardc.pipeline.stack import has_stack

    plan = solve(step, call, tr, candidates, seeds, step.options)
    if step.options.pipeline is False or not has_stack(tr.traced.jaxpr):
        return plan
    # the stage axis is one of the mesh's: priced against the plan on the mesh itself,
    # and where mesh_search ran another view, the pipeline must beat that one too
    own = plan.axis_names == tuple(step.mesh.axis_names)
    base = plan if own else solve(step, call, tr, candidates[:1], seeds[:1], step.options)
    graph, why, asked = tr.traced.graph, [], None
    # a stage's layouts on the axes that split no micro-batch are XLA's (the pipelined
    # loop is Auto there): a choice with such axes is checked against its compiled program,
    # first with tensor parallelism inside the stages priced, then without, then none. On
    # an AbstractMesh nothing compiles: tensor parallelism inside is not chosen there
    for tensor in (True, False) if not step.abstract else (False,):
        opts = dataclasses.replace(choice_options(step, tr, views=False), tensor=tensor)
        choice = best_pipeline(graph, base.axis_sizes, base.axis_names, base.cluster,
                               ties=tr.ties, resident=tr.resident, base=base, options=opts)
        log.info("shardc: %s", choice.summary())
        chosen = _pipelined(step, call, tr, plan, base, own, choice, candidates, seeds, opts)
        if chosen is plan:  # none pays; or under overlap, none compiled faster than the
            # plan: with tensor parallelism inside priced, the pipelines without it may
            if choice.pipeline is None or not choice.tensor:
                break
            continue
        # (under overlap the compiled ranking has compared its compiled program already)
        budget = opts.budget(chosen.cluster)
        slack = None if step.abstract or "compiled_ranking" in chosen.solver["pipeline"] \
            else _auto_slack(step, tr, chosen, budget)
        if slack is None and chosen.predicted.peak_memory > budget:  # only one asked for
            slack = (f"{choice.pipeline} predicts a peak of "
                     f"{fmt_bytes(chosen.predicted.peak_memory)} per device, over the "
                     f"budget of {fmt_bytes(budget)}")
        if slack is None:
            return _noting(chosen, why)
        log.info("shardc: %s", slack)
        why.append(slack)
        if choice.reason == "requested" and (
                asked is None or
                chosen.predicted.peak_memory < asked[0].predicted.peak_memory):
            asked = (chosen, slack)  # of those asked for that compiled, the leanest
        if not choice.tensor:
            break  # without tensor parallelism inside priced, the same choice again
    if asked is not None:  # a pipeline asked for runs, as it compiles, where none passes
        log.warning("shardc: the pipeline asked for runs although %s", asked[1])
        return _noting(asked[0], [w for w in why if w is not asked[1]], kept_asked=asked[1])
    return dataclasses.replace(plan, solver={**plan.solver, "pipeline_rejected": why}) \
        if why else plan


def _noting(chosen: Plan, why: list[str], kept_asked: str | None = None) -> Plan:
    """``chosen`` with the choices passed over before it (``why``) in its record, and
    where it failed the compiled check but was asked for, why (``kept_asked``)."""
    record = {**chosen.solver["pipeline"], **({"rejected": why} if why else {}),
              **({"kept_asked": kept_asked} if kept_asked else {})}
    return dataclasses.replace(chosen, solver={**chosen.solver, "pipeline": record})


#: a pipelined plan whose stages leave axes to XLA (the loop's Auto axes: tensor
#: parallelism inside a stage, or any layout the stage plan gives them) is kept where its
#: compiled communication is at most this share above the predicted: where XLA does not
#: follow the stage plan it gathers weights per layer and tick (a Llama on 8 CPU devices:
#: seven to ten times the communication priced)
AUTO_SLACK = 1.25


def _auto_slack(step, tr: TracedCall, plan: Plan, budget: float) -> str | None:
    """None where ``plan``'s stages split every micro-batch over every axis but the stage
    axis (the loop is manual over all of them), or its compiled communication is within
    :data:`AUTO_SLACK` of the predicted and its compiled peak within ``budget`` (or it
    does not compile: its error surfaces where it runs); else why not."""
    record = plan.solver["pipeline"]
    auto = [n for n, k in plan.mesh_axes
            if k > 1 and n != plan.pipeline.axis and n not in record["batch_axes"]]
    if not auto:
        return None
    try:
        compiled, mesh = compiled_program(step, tr, plan)
    except Exception:  # noqa: BLE001 - the plan's own compile reports it
        return None
    check = plan.verify(compiled, mesh)
    peak = compiled_peak_memory(compiled)
    what = "weights split" if record["tensor_axes"] else "micro-batches whole"
    head = (f"{plan.pipeline}, its stages' {what} over {' x '.join(auto)} (the loop leaves "
            "those axes to XLA), compiled to ")
    if check.compiled_comm_time > AUTO_SLACK * check.predicted_comm_time:
        return (head + f"{fmt_time(check.compiled_comm_time)} of communication against "
                f"{fmt_time(check.predicted_comm_time)} priced: XLA did not lay the stages "
                "out as the stage plan does")
    if peak is not None and peak > budget:
        return (head + f"a peak of {fmt_bytes(peak)} per device (predicted "
                f"{fmt_bytes(plan.predicted.peak_memory)}), over the budget of "
                f"{fmt_bytes(budget)}")
    return None


def _pipelined(step, call: Call, tr: TracedCall, plan: Plan, base: Plan, own: bool, choice,
               candidates: list[View], seeds, opts) -> Plan:
    """``plan`` running ``choice``'s pipeline (``base``: the unpipelined plan on the mesh
    itself), or ``plan`` where it chose none or it does not pay against ``plan``."""
    from shardc.pipeline.choose import adopt, pinned

    graph = tr.traced.graph
    if choice.pipeline is None or not own and choice.reason != "requested" and \
            choice.best.step_time >= (1 - opts.min_gain) * plan.predicted.step_time:
        return plan
    ins, outs = pinned(graph, choice, tr.ties, tr.resident)
    if ins:
        keep = dataclasses.replace(tr, fixed=Fixed({**ins, **tr.fixed.inputs},
                                                   {**outs, **tr.fixed.outputs}))
        try:  # on the mesh itself: the stage axis is one of its axes (no error to word:
            # fastest, not solve, which would plan again for the smallest budget)
            base = fastest(step, call, keep, candidates[:1], seeds[:1], step.options)
        except MemoryBudgetError:
            if choice.reason != "requested":
                return plan
            # a pipeline asked for runs as priced: its state pinned, planned with no budget
            # (the pipeline's own peak, not this unpipelined one's, is checked against it)
            base = fastest(step, call, keep, candidates[:1], seeds[:1],
                           dataclasses.replace(step.options, memory_budget=None))
    if base.cluster.overlap and step.options.rank_compiled and not step.abstract and \
            choice.reason != "requested":
        return _compiled_pipeline(step, tr, plan, base, choice, opts)
    return adopt(base, choice, graph, tr.ties, tr.resident)


def _compiled_pipeline(step, tr: TracedCall, plan: Plan, base: Plan, choice, opts) -> Plan:
    """Under overlap on a mesh with devices (``rank_compiled``): the chosen pipeline and the
    cheapest priced of each other schedule from the same stage plan that fits the budget,
    each adopted on ``base`` (the plan with the layer state pinned as a stage holds it) and
    compiled, against the unpipelined ``plan``'s compiled time: the fastest compiled
    program overlapped wins. The pipeline's price is serial; overlapped, a schedule whose
    sends do not feed the next tick's compute (1F1B's forward send beside its backward)
    hides them where GPipe's cannot. ``solver["pipeline"]["compiled_ranking"]`` lists each
    candidate's price and compiled time (or error)."""
    from shardc.pipeline.choose import adopt

    graph = tr.traced.graph
    budget = opts.budget(base.cluster)
    per = {choice.pipeline.schedule: choice.best}
    for p in sorted(choice.priced, key=lambda p: (p.step_time, p.peak_memory)):
        # priced from the same stage plan (its mesh and stage axis): ``base`` holds the
        # layer state as that plan's stages do
        if p.stage_plan is choice.stage_plan and p.peak_memory <= budget:
            per.setdefault(p.pipeline.schedule, p)
    unpipelined = [r["compiled_s"] for r in plan.solver.get("compiled_ranking", ())
                   if "compiled_s" in r]
    # where the unpipelined plan does not compile, the pipelines are compared among themselves
    none = {"compiled_s": min(unpipelined)} if unpipelined else compiled_row(step, tr, plan)
    none_s = none.get("compiled_s", math.inf)
    rows, best, best_s = [], None, none_s
    for price in per.values():
        candidate = adopt(base, dataclasses.replace(choice, pipeline=price.pipeline,
                                                    best=price), graph, tr.ties, tr.resident)
        row = {"schedule": price.pipeline.schedule, "pipeline": price.summary(),
               "priced_s": price.step_time, **compiled_row(step, tr, candidate)}
        rows.append(row)
        if "compiled_s" in row and row["compiled_s"] < best_s:
            best, best_s = candidate, row["compiled_s"]
    rows.append({"schedule": None, "pipeline": "none", "priced_s": plan.predicted.step_time,
                 **none})
    if best is None and none_s < math.inf:
        return plan  # the unpipelined program compiled fastest
    if best is None:  # nothing compiled: the serial choice
        best = adopt(base, choice, graph, tr.ties, tr.resident)
    record = {**best.solver["pipeline"], "compiled_ranking": rows}
    return dataclasses.replace(best, solver={**best.solver, "pipeline": record})


def choice_options(step, tr: TracedCall, views: bool):
    """The pipeline choice's options for ``step`` on the program ``tr``: 1F1B is a schedule
    only where a stack ends in its loss (:func:`shardc.pipeline.stack.layers_loss`)."""
    from shardc.pipeline.choose import ChoiceOptions
    from shardc.pipeline.schedule import SCHEDULES
    from shardc.pipeline.stack import has_stack

    opts = step.options
    schedules = SCHEDULES if has_stack(tr.traced.jaxpr, loss=True) else \
        tuple(s for s in SCHEDULES if s != "1f1b")
    return ChoiceOptions(opts.memory_budget, opts.time_limit, schedules, views=views,
                         pipeline=opts.pipeline, combiner=combiner_for(platform_of(step.mesh)),
                         stack=has_stack(tr.traced.jaxpr))


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
           seeds: list[dict[str, dict[int, NdSbp]]], opts: Options) -> Plan:
    """The fastest plan within ``opts.memory_budget`` (:func:`fastest`); where none
    fits, the error names the smallest budget that plans (:func:`leanest`)."""
    try:
        return fastest(step, call, tr, candidates, seeds, opts)
    except MemoryBudgetError as exc:
        raise leanest(step, call, tr, candidates, seeds, opts, exc) from None


def fastest(step, call: Call, tr: TracedCall, candidates: list[View],
             seeds: list[dict[str, dict[int, NdSbp]]], opts: Options) -> Plan:
    """The fastest plan within ``opts.memory_budget``. Where the budget binds (no plan
    that keeps every activation for the backward pass fits, or the one that does is
    slower than the plan at no budget), the programs recomputing forward segments are
    planned too (:func:`shardc.ir.remat.levels`: all of them, then the half that saves
    the most bytes per recomputed FLOP), and the fastest plan that fits wins; the error
    names the smallest peak any of them reached."""
    recomputed = levels(tr.traced.segments)
    budget = opts.memory_budget
    try:
        plan = solve_views(step, tr, candidates, seeds, opts)
    except MemoryBudgetError as exc:
        if budget is None or not recomputed:
            raise
        plan, failure = None, exc
    if budget is None or not recomputed:
        return plan
    if plan is not None:
        free = solve_views(step, tr, candidates, seeds,
                                 dataclasses.replace(opts, memory_budget=None))
        if ranking_time(plan) <= ranking_time(free):
            return plan  # the budget does not bind
    fits = [] if plan is None else [plan]
    for remat in recomputed:  # most recomputed first: fewer fit no better
        log.info("shardc: the budget %s binds; planning with %d of %d forward segments "
                 "recomputed", fmt_bytes(budget), len(remat), len(tr.traced.segments))
        try:
            fits.append(solve_views(step, step._traced(call, remat)[1], candidates,
                                          seeds, opts))
        except MemoryBudgetError as again:
            if plan is None:
                failure = MemoryBudgetError(budget, min(failure.needed, again.needed),
                                            min(failure.found, again.found))
            break
    if not fits:
        raise failure
    return min(fits, key=ranking_time)


def leanest(step, call: Call, tr: TracedCall, candidates: list[View],
             seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
             failure: MemoryBudgetError) -> MemoryBudgetError:
    """The error for a budget no plan fits, naming the smallest budget found to plan: the
    smallest peak the search reached, where planning at it succeeds (the leanest plans
    are the search's, not its lean start's: on a residual MLP, 2.6 MiB against 4.9
    MiB), else the lean start's peak, which always does; then the peak of the plan made
    at that budget, where planning at it succeeds too (the search meets a budget it can
    leaner than it gets under one it cannot: an MLP stack on 8 devices plans at 5.2 MiB
    under a 6 MiB budget, and under 5 MiB reached only its lean start's 8.0)."""

    def peak_at(budget: int) -> int | None:
        log.info("shardc: no plan fits %s; checking that one fits %s",
                 fmt_bytes(opts.memory_budget), fmt_bytes(budget))
        try:
            plan = fastest(step, call, tr, candidates, seeds,
                           dataclasses.replace(opts, memory_budget=budget))
        except MemoryBudgetError:
            return None
        return math.ceil(plan.predicted.peak_memory)

    needed, found = failure.needed, math.ceil(failure.found)
    peak = peak_at(found) if found < needed else None
    if peak is None:
        found, peak = needed, peak_at(needed)
    if peak is not None and peak < found and peak_at(peak) is not None:
        found = peak
    return MemoryBudgetError(failure.budget, found)


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
                sopts = SolveOptions(opts.memory_budget, opts.time_limit, seeds=seeds_here,
                                     combiner=search.combiner)
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
    cg, sol = plan_graph(graph, view.shape, view.names, objective, sopts,
                         ties=tr.ties, fixed=tr.fixed if is_physical else NOTHING_FIXED,
                         resident=tr.resident, reuse=reuse)
    on = cg if objective is view.cluster else own
    if [len(c) for c in on.choices] != [len(c) for c in cg.choices]:
        raise AssertionError("the objective's cost graph and the view's differ in choices")
    costs = sol.stats.pop("seeds", {})
    solver = {"status": sol.status.value, "objective": sol.objective, **sol.stats}
    if on is not cg:
        solver["objective_model"] = objective.collective_model
    plan = assemble(graph, on, sol.choice, tr.ties, solver, tr.traced.remat,
                    len(tr.traced.segments), platform_of(step.mesh))
    assembled = [plan]
    for name, choice in sol.seed_choices.items():
        # the objective prices combined collectives by shares; a seed close to the
        # plan is priced as the plan is, so the plan predicts no more than any seed.
        # The objective prices communication serially: under overlap every seed is
        # ranked as the plan is (FSDP's gathers hide behind compute a serial sum
        # charges them for)
        if view.cluster.overlap or costs.get(name, math.inf) <= (
                sol.objective * SEED_RECHECK):
            other = assemble(graph, on, choice, tr.ties, {**solver, "seed": name},
                             tr.traced.remat, len(tr.traced.segments),
                             platform_of(step.mesh))
            assembled.append(other)
            if ranking_time(other) < ranking_time(plan):
                plan = other
    return plan, costs, assembled, cg


#: a seed whose objective is within this factor of the plan's is assembled and compared on
#: the plan's own prediction (the objective and the prediction price XLA's combined
#: collectives differently: by shares, and as the one collective they compile to)
SEED_RECHECK = 1.25
