"""The step's time-memory frontier: its plans at no budget, at the leanest budget and between,
recomputing forward segments as budgets need, beside the generic layouts' plans, and below
them the leanest plans keeping state in host memory (:func:`shardc.tradeoff.frontier.sweep`
makes the staircase)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from shardc.ir.sbp import NdSbp
from shardc.plan.record import Plan
from shardc.solve.collector import gc_paused
from shardc.solve.reuse import Reuse
from shardc.step.margins import state_inputs
from shardc.step.offload import offloadable
from shardc.step.solving import problem, solve_views
from shardc.tradeoff.frontier import (
    BUDGETS,
    Frontier,
    Sources,
    sweep,
)

__all__ = ["frontier"]


@gc_paused()
def frontier(step, *args, budgets: int = BUDGETS, **kwargs) -> Frontier:
    """:meth:`AutoSharded.pareto <shardc.step.auto_shard.AutoSharded.pareto>` of ``step``:
    its searches and the generic layouts' plans, swept by
    :func:`shardc.tradeoff.frontier.sweep`."""
    from shardc.tradeoff.baselines import generic_layouts, layout_plan, optimizer_state

    call = step.convention.split(args, kwargs)
    _, tr = step._traced(call)
    candidates, seeds = problem(step, call, tr)
    sizes, names = tuple(step.mesh.axis_sizes), tuple(step.mesh.axis_names)
    graph, state = tr.traced.graph, state_inputs(step, call, tr)
    optimizer = optimizer_state(graph, state)
    generic = {f"generic {name}": layouts for name, layouts in generic_layouts(
        [v.shape for v in graph.inputs], state, sizes, optimizer).items()
               if not isinstance(layouts, str)}
    physical = next((i for i, v in enumerate(candidates) if v.names == names), None)
    if physical is not None:
        seeds = [{**s, **generic} if i == physical else s for i, s in enumerate(seeds)]

    reuse = Reuse()  # each program's cost graphs, built once for all its budgets

    def solve(budget: float | None, remat: tuple[int, ...] = ()) -> Plan:
        # the frontier's points are ranked by the estimate: no compiles (rank_compiled)
        opts = dataclasses.replace(step.options, memory_budget=budget, rank_compiled=0)
        rtr = step._traced(call, remat)[1]
        return step._named(call, rtr, solve_views(step, rtr, candidates, seeds, opts,
                                                        reuse))

    moved = offloadable(tr) if step.options.offload else frozenset()

    def offloaded(budget: float | None, remat: tuple[int, ...] = ()) -> Plan:
        opts = dataclasses.replace(step.options, memory_budget=budget, rank_compiled=0)
        rtr = dataclasses.replace(step._traced(call, remat)[1], offloaded=moved)
        return step._named(call, rtr, solve_views(step, rtr, candidates, seeds, opts, reuse))

    def place(remat: tuple[int, ...], layouts: Mapping[str, Mapping[int, NdSbp]]
              ) -> list[Plan]:
        """The program recomputing ``remat`` placed around each of ``layouts``."""
        rtr = step._traced(call, remat)[1]
        t = rtr.traced
        return [step._named(call, rtr, layout_plan(
            t.graph, rtr.ties, sizes, names, step.options.cluster, inputs, rtr.fixed,
            tuple(rtr.resident), t.remat, len(t.segments), name, reuse))
            for name, inputs in layouts.items()]

    inputs = tuple(math.prod(v.shape) * v.dtype.itemsize for v in graph.inputs)
    return sweep(Sources(solve, place, {} if physical is None else seeds[physical],
                         tr.traced.segments, inputs,
                         tuple(tuple(v.shape) for v in graph.inputs), frozenset(optimizer),
                         tuple(zip(names, sizes)), offloaded if moved else None), budgets)
