"""The pipeline the planner chooses for a solved call, or the one asked for: priced against
the unpipelined plan (:func:`shardc.pipeline.choose.best_pipeline`), adopted on the plan made
with the layer state pinned as a stage holds it, and, where its stages leave axes to XLA,
checked against its compiled program. Each function takes the step
(:class:`shardc.step.auto_shard.AutoSharded`) for its mesh, options and traced programs."""

from __future__ import annotations

import dataclasses
import logging
import math

from shardc.cost.combine import combiner_for
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.inspect.hlo import compiled_peak_memory
from shardc.ir.sbp import NdSbp
from shardc.plan.record import Plan
from shardc.solve.fixed import Fixed
from shardc.solve.search import MemoryBudgetError
from shardc.step.ahead import compile_ahead
from shardc.step.calling import Call
from shardc.step.options import platform_of
from shardc.step.ranking import compiled_row
from shardc.step.signature import TracedCall
from shardc.step.solving import checked, solve, solve_views
from shardc.tradeoff.views import View

log = logging.getLogger("shardc")

__all__ = ["AUTO_SLACK", "choice_options", "pipelined"]


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

    options = step.options
    if options.pipeline is False or not has_stack(tr.traced.jaxpr):
        return solve(step, call, tr, candidates, seeds, options)
    plan = solve(step, call, tr, candidates, seeds, options, compiled=False)
    # the stage axis is one of the mesh's: priced against the plan on the mesh itself,
    # and where mesh_search ran another view, the pipeline must beat that one too
    own = plan.axis_names == tuple(step.mesh.axis_names)
    base = plan if own else solve(step, call, tr, candidates[:1], seeds[:1], options,
                                  compiled=False)
    if base.remat:  # a budget the whole program meets with forward segments recomputed:
        # the stages are priced on that program (the plan's values are its values)
        tr = step._traced(call, base.remat)[1]
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
            else _auto_slack(step, call, chosen, budget)
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
    plan = checked(step, call, tr, candidates, seeds, options, plan)  # it runs unpipelined
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


def _auto_slack(step, call: Call, plan: Plan, budget: float) -> str | None:
    """None where ``plan``'s stages split every micro-batch over every axis but the stage
    axis (the loop is manual over all of them), or its compiled communication is within
    :data:`AUTO_SLACK` of the predicted and its compiled peak within ``budget`` (or it
    does not compile: its error surfaces where it runs); else why not. The program is
    compiled as the first call of ``call``'s signature would compile it, which then runs
    this compile (:func:`shardc.step.ahead.compile_ahead`)."""
    record = plan.solver["pipeline"]
    auto = [n for n, k in plan.mesh_axes
            if k > 1 and n != plan.pipeline.axis and n not in record["batch_axes"]]
    if not auto:
        return None
    compiled = compile_ahead(step, call, plan)
    if compiled is None:
        return None
    check = plan.verify(compiled, step.mesh_for(plan))
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
                                                   {**outs, **tr.fixed.outputs},
                                                   whole=tr.fixed.whole))
        # on the mesh itself (the stage axis is one of its axes), and recomputing no forward
        # segment: a stack in a recomputed segment would run its pipelined forward again in
        # the backward, which the pipeline's price counts once (solve_views, not fastest,
        # which plans the recomputing programs too where a budget binds; nor solve, which
        # would plan again for the smallest budget: no error to word)
        try:
            base = solve_views(step, keep, candidates[:1], seeds[:1], step.options)
        except MemoryBudgetError:
            if choice.reason != "requested":
                return plan
            # a pipeline asked for runs as priced: its state pinned, planned with no budget
            # (the pipeline's own peak, not this unpipelined one's, is checked against it)
            base = solve_views(step, keep, candidates[:1], seeds[:1],
                               dataclasses.replace(step.options, memory_budget=None))
    if base.cluster.overlap and step.options.rank_compiled and not step.abstract and \
            choice.reason != "requested":
        return _compiled_pipeline(step, tr, plan, base, choice, opts)
    return adopt(base, choice, graph, tr.ties, tr.resident, opts.combiner)


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
                                                    best=price), graph, tr.ties, tr.resident,
                          opts.combiner)
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
        best = adopt(base, choice, graph, tr.ties, tr.resident, opts.combiner)
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
    return ChoiceOptions(memory_budget=opts.memory_budget, time_limit=opts.time_limit,
                         schedules=schedules, views=views,
                         pipeline=opts.pipeline, combiner=combiner_for(platform_of(step.mesh)),
                         stack=has_stack(tr.traced.jaxpr))
