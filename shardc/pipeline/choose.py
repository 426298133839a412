"""The planner's choice of a pipeline: stage axis, stages, micro-batches, schedule.

For a program with layer scans (:mod:`shardc.pipeline.scans`) on a mesh, every mesh axis
``a`` whose size S divides the layer count is a stage axis; with ``views``, so is every axis
of the other logical views of the devices (:mod:`shardc.tradeoff.views`), each view planned
unpipelined too. For each, the program is planned again with ``a`` cut to one device (the
*stage* plans: the layouts inside a stage, chosen by the ordinary search): once with the
layers' weights whole over the other axes (data parallelism inside a stage), and where no
pipeline priced so fits the memory budget, once per other axis with the weights free to
split over it and the batch whole there (tensor parallelism inside a stage;
:func:`_stage_plans`), and every pipeline over ``a`` is priced from each stage plan and the
unpipelined plan (:func:`shardc.pipeline.cost.price`): M among the divisors of the batch
whose micro-batch the stage plan's carry layout still divides, each schedule, and for the
circular one (where M >= S) V among the divisors of L / S up to ``max_virtual``. The
cheapest pipeline within the memory budget wins when its step is below ``1 - min_gain`` of
the unpipelined plan's; else there is none. The margin stands for what the price leaves out
and a pipeline adds: the loop over ticks, the copies that rotate the stage buffers, smaller
kernels per micro-batch; it is a judgement, not a measured figure (5% by default). The
search is deterministic: candidates are priced in a fixed order; of equal steps the leaner
wins, then the first (GPipe before 1F1B, which holds fewer micro-batches' residuals and runs
the loss on the last stage: it is a candidate only for a stack that ends in its loss,
:func:`shardc.pipeline.stack.layers_loss`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner
from shardc.cost.units import fmt_time
from shardc.errors import MeshAxisError, OptionsError, PipelineError, closest
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Split
from shardc.pipeline.cost import PipelinePrice, price
from shardc.pipeline.parts import parts
from shardc.pipeline.runs import pipelined_reshards
from shardc.pipeline.scans import Layers, find_layers
from shardc.pipeline.schedule import SCHEDULES, Pipeline
from shardc.plan.assemble import assemble
from shardc.plan.record import Plan, Predicted
from shardc.solve.fixed import NOTHING_FIXED, Fixed
from shardc.solve.problem import input_choices
from shardc.solve.search import DEFAULT_TIME_LIMIT, MemoryBudgetError, SolveOptions, plan_graph
from shardc.tradeoff.views import View, views

__all__ = ["Choice", "ChoiceOptions", "adopt", "best_pipeline", "candidates", "pinned",
           "updates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceOptions:
    """``memory_budget``: bytes per device a stage may hold (None: the cluster's device
    memory); ``time_limit``: the ILP guard of each stage plan's search (seconds);
    ``schedules``: those considered (``"1f1b"`` only where the program has a
    :func:`~shardc.pipeline.stack.layers_loss` stack); ``max_virtual``: the most virtual
    stages per device a circular schedule may have; ``min_gain``: the share of the
    unpipelined step a pipeline must save to be chosen (module doc); ``views``: the stage
    axis may also be an axis of another logical view of the devices
    (:func:`shardc.tradeoff.views.views`: one more unpipelined plan per view, and one
    stage plan per axis). ``pipeline``: as ``auto_shard``'s
    option: None chooses, False chooses none, a :class:`Pipeline` prices that one.
    ``combiner``: the combiners of the backend the plans compile for. ``tensor``: where no
    pipeline with data parallelism inside its stages fits the budget, price the stage
    plans with tensor parallelism inside (:func:`_stage_plans`; the runtime leaves a
    stage's layouts on those axes to XLA, so the planner checks such a choice against its
    compiled program, :func:`shardc.step.pipelining.pipelined`). ``stack``: the program has a
    layer stack that can run as a pipeline (:func:`shardc.pipeline.stack.has_stack`; a
    scan whose layer cannot is priced as none, as the planner plans it)."""

    memory_budget: float | None = None
    time_limit: float = DEFAULT_TIME_LIMIT
    schedules: tuple[str, ...] = SCHEDULES
    max_virtual: int = 4
    min_gain: float = 0.05
    views: bool = False
    pipeline: Pipeline | bool | None = None
    combiner: Combiner = XLA_CPU
    tensor: bool = True
    stack: bool = True

    def __post_init__(self):
        if not 0 <= self.min_gain < 1:
            raise OptionsError(f"ChoiceOptions(min_gain={self.min_gain}): a share of the "
                               "step in [0, 1)")
        unknown = set(self.schedules) - set(SCHEDULES)
        if unknown:
            raise OptionsError(f"ChoiceOptions(schedules=...): {sorted(unknown)} are not "
                               f"schedules; use some of {SCHEDULES}")
        if self.max_virtual < 1:
            raise OptionsError(f"ChoiceOptions(max_virtual={self.max_virtual}): need >= 1")

    def budget(self, cluster: Cluster) -> float:
        """Bytes per device a stage may hold: ``memory_budget``, else the cluster's."""
        return self.memory_budget if self.memory_budget is not None else cluster.device_memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """The pipeline chosen (None: none beats the unpipelined plan, or none applies, see
    ``reason``), the unpipelined step, the cheapest pipeline priced (chosen or not; its
    ``mesh`` is the view of the devices it runs on, another than the plan's only with
    ``views``) and every price, in the order priced; ``plan_s``: seconds the choice
    took; ``layers``: the layer count of the program's layer scans (0: none found)."""

    pipeline: Pipeline | None
    base_time: float
    best: PipelinePrice | None
    reason: str
    priced: tuple[PipelinePrice, ...] = field(default=(), repr=False)
    plan_s: float = 0.0
    layers: int = 0
    #: the stage plan the chosen pipeline was priced from (its layouts inside a stage)
    stage_plan: Plan | None = field(default=None, repr=False, compare=False)
    #: stage plans with tensor parallelism inside were priced (no pipeline with data
    #: parallelism inside fitted the budget, :attr:`ChoiceOptions.tensor`)
    tensor: bool = False

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """What was chosen and why, against the unpipelined step."""
        base = f"unpipelined {fmt_time(self.base_time)}"
        if self.pipeline is not None:
            return f"pipeline ({self.reason}): {self.best.summary()}; {base}"
        best = f"; the best priced: {self.best.summary()}" if self.best is not None else ""
        return f"no pipeline: {self.reason} ({base}){best}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(axis: str, stages: int, layers: Layers, options: ChoiceOptions
               ) -> list[Pipeline]:
    """Every pipeline over ``axis`` with ``stages`` stages for ``layers``, in the order
    they are priced: by micro-batches, then schedule, then virtual stages."""
    out = []
    for m in _divisors(layers.batch):
        for schedule in options.schedules:
            if schedule != "circular":
                out.append(Pipeline(axis, stages, m, schedule))
                continue
            for v in _divisors(layers.length // stages):
                # a micro-batch must be back at stage 0 before its next pass is due
                # (runtime.check_pipeline): M >= S
                if 2 <= v <= options.max_virtual and m >= stages:
                    out.append(Pipeline(axis, stages, m, schedule, v))
    return out


def _check_request(p: Pipeline, sizes: Sequence[int], names: Sequence[str],
                   layers: Layers, schedules: Sequence[str]) -> None:
    """A requested pipeline fits the mesh, the layers, the batch and the program (1F1B
    needs a stack's loss: ``schedules``), else the error names the fix."""
    if p.schedule not in schedules:
        raise PipelineError(f"{p}: 1F1B runs each micro-batch's backward right after its "
                            "forward, so the loss must be inside the pipeline: write the stack "
                            "and its loss as shardc.pipeline.layers_loss(layer_fn, loss_fn, "
                            "carry, stacked_params, head, targets), or use schedule='gpipe'")
    if p.axis not in names:
        raise MeshAxisError(f"{p}: axis {p.axis!r} is not a mesh axis{closest(p.axis, names)}; "
                            f"use one of {list(names)}")
    size = sizes[list(names).index(p.axis)]
    if p.stages != size:
        raise PipelineError(f"{p}: axis {p.axis!r} has {size} devices; stages={size}")
    if layers.length % (p.stages * p.virtual):
        per = (f" (here virtual dividing {layers.length // p.stages})"
               if layers.length % p.stages == 0 else "")
        raise PipelineError(f"{p}: {layers.length} layers do not split into {p.stages} stages "
                            f"x {p.virtual} virtual stages of equal size; pick stages x virtual "
                            f"dividing {layers.length}{per}")
    if layers.batch % p.microbatches:
        raise PipelineError(f"{p}: the batch of {layers.batch} does not split into "
                            f"{p.microbatches} micro-batches; pick a divisor of {layers.batch}")


def _splits_batch(plan: Plan, layers: Layers, microbatches: int, graph: Graph) -> bool:
    """The stage plan's carry layouts still divide a micro-batch's carry."""
    shapes = {v.id: v.shape for v in graph.values()}
    for c in layers.carry:
        shape = (shapes[c][0] // microbatches, *shapes[c][1:])
        if not plan.values[c].fits(shape, plan.axis_sizes):
            return False
    return True


def _planned(graph: Graph, sizes: Sequence[int], names: Sequence[str], cluster: Cluster,
             ties, resident, options: SolveOptions, fixed: Fixed = NOTHING_FIXED) -> Plan:
    cg, sol = plan_graph(graph, sizes, names, cluster, options, ties=ties, resident=resident,
                         fixed=fixed)
    return assemble(graph, cg, sol.choice, ties, {"status": sol.status.value},
                    platform=options.combiner.backend)


def _held_weights(graph: Graph, layers: Layers, ties: Sequence[tuple[int, int]],
                  sizes: Sequence[int], tensor: Collection[int] = ()) -> Fixed:
    """What a stage plan must keep of the stacked parameters the layer scans read, as the
    pipelined loop holds them (``pipeline_scan``'s ``in_specs`` split them over the stage
    axis, its ``shard_map`` manual there and over the axes splitting each micro-batch,
    Auto over the rest): whole on every axis but the ``tensor`` ones (indices), over which
    the search may split them on any dim but the layer dim (tensor parallelism inside a
    stage, laid out by XLA from the weights' layout). Without ``tensor`` axes, whole
    everywhere (and their tied results too). With, the stack's carry leaves its batch dim
    whole over them (``unsplit``): those axes split no micro-batch. So the stage plan's
    compute, its gradient all-reduce over the batch axes and its memory are the loop's."""
    whole = NdSbp((B,) * len(sizes))
    tied = {i: j for j, i in ties}
    ins = [k for k, v in enumerate(graph.inputs) if v.id in layers.params]
    if not tensor:
        return Fixed({k: whole for k in ins}, {tied[k]: whole for k in ins if k in tied})
    among = {k: tuple(nd for nd in input_choices(graph.inputs[k], sizes)
                      if all(sbp is B or i in tensor and sbp != Split(0)
                             for i, sbp in enumerate(nd.sbps)))
             for k in ins}
    enters = {op.id for op in graph.ops if op.outputs and op.outputs[0].id in layers.carry}
    return Fixed(among=among, unsplit={i: frozenset(tensor) for i in enters})


def _stage_plans(graph: Graph, view: View, k: int, layers: Layers, ties, resident,
                 solve: SolveOptions, rooms: Sequence[float], tensor: bool = False
                 ) -> list[Plan]:
    """The stage plans for a pipeline over ``view``'s axis ``k`` (that axis cut to one
    device): the one with every other axis splitting the micro-batches and the weights
    whole (data parallelism inside a stage); with ``tensor``, instead one per other axis
    of more than one device, with that axis splitting the weights and not the batch
    (tensor parallelism inside a stage, Megatron's pipeline x tensor x data form), solved
    within ``S`` times the first of ``rooms`` (bytes per device) it can keep to: a stage
    holds ``1 / S`` of the stacked state, which is what such a budget binds (the rooms:
    what a stage has besides the rest of the program's memory, then the whole budget)."""
    cut = view.shape[:k] + (1,) + view.shape[k + 1:]
    stages = view.shape[k]

    def planned(axes: tuple[int, ...], options: SolveOptions) -> Plan:
        return _planned(graph, cut, view.names, view.cluster, ties, resident, options,
                        _held_weights(graph, layers, ties, cut, axes))

    if not tensor:
        return [planned((), solve)]
    plans = []
    for t, n in enumerate(cut):
        for room in (r for r in rooms if r > 0):
            if n < 2:
                break
            try:
                plans.append(planned((t,), dataclasses.replace(
                    solve, memory_budget=stages * room)))
                break
            except MemoryBudgetError:
                continue
    return plans


def best_pipeline(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
                  cluster: Cluster, *, ties: Sequence[tuple[int, int]] = (),
                  resident: Collection[int] = (), base: Plan | None = None,
                  options: ChoiceOptions = ChoiceOptions()) -> Choice:
    """The best pipeline for ``graph`` on the mesh (see the module doc); ``base`` is the
    unpipelined plan on that mesh (planned here when not given), ``ties`` and
    ``resident`` as for :func:`shardc.solve.search.plan_graph`."""
    t0 = time.perf_counter()
    sizes, names = tuple(axis_sizes), tuple(axis_names)
    solve = SolveOptions(time_limit=options.time_limit, combiner=options.combiner)
    if base is None:
        base = _planned(graph, sizes, names, cluster, ties, resident, solve)
    layers = find_layers(graph, ties, resident)

    tensor_ran = False

    def none(reason: str, priced=(), best=None) -> Choice:
        return Choice(pipeline=None, base_time=base.predicted.step_time, best=best,
                      reason=reason, priced=tuple(priced), plan_s=time.perf_counter() - t0,
                      layers=layers.length if layers else 0, tensor=tensor_ran)

    request = options.pipeline
    if request is False:
        return none("pipelines are forbidden (pipeline=False)")
    if not options.stack:
        return none("no layer stack that can run as a pipeline (a scan whose layer mixes "
                    "the batch's examples, draws random bits or reads the batch size is "
                    "not one: the log says why)")
    if layers is None:
        return none("no scan over at least two layers whose carry leads with the batch: a "
                    "leading dim its leaves share with an input fed each step (not a train "
                    "step's state, passed in and returned) that the carry is made from")
    meshes = [View(sizes, names, cluster)]
    if isinstance(request, Pipeline):
        _check_request(request, sizes, names, layers, options.schedules)
    elif options.views:
        meshes += views(sizes, names, cluster)[1:]
    budget = options.budget(cluster)
    axes = []  # (view, its whole plan's parts, stage axis index)
    for view in meshes:
        whole_plan = base if view.names == names else \
            _planned(graph, view.shape, view.names, view.cluster, ties, resident, solve)
        whole = parts(whole_plan, graph, layers, ties, resident)
        axes += [(view, whole, k) for k, (axis, s) in enumerate(zip(view.names, view.shape))
                 if s > 1 and not layers.length % s and
                 not (isinstance(request, Pipeline) and request.axis != axis)]
    priced, tensor_ran = _price_all(graph, axes, layers, ties, resident, solve, budget,
                                    options)
    if isinstance(request, Pipeline):
        chosen = _cheapest(priced, budget)
        return Choice(pipeline=request, base_time=base.predicted.step_time, best=chosen,
                      reason="requested", priced=(chosen,), plan_s=time.perf_counter() - t0,
                      layers=layers.length, stage_plan=chosen.stage_plan, tensor=tensor_ran)
    fits = [p for p in priced if p.peak_memory <= budget]
    if not fits:
        return none("no pipeline fits the memory budget" if priced else
                    "no mesh axis's size divides the layer count", priced)
    best = _cheapest(priced, budget)
    if best.step_time >= (1 - options.min_gain) * base.predicted.step_time:
        return none(f"no pipeline saves {options.min_gain:.0%} of the unpipelined step",
                    priced, best)
    return Choice(pipeline=best.pipeline, base_time=base.predicted.step_time, best=best,
                  reason="cheapest pipeline", priced=tuple(priced),
                  plan_s=time.perf_counter() - t0, layers=layers.length,
                  stage_plan=best.stage_plan, tensor=tensor_ran)


def _price_all(graph: Graph, axes: list, layers, ties, resident, solve: SolveOptions,
               budget: float, options: ChoiceOptions) -> tuple[list[PipelinePrice], bool]:
    """Every candidate pipeline on each ``(view, whole plan's parts, stage axis)`` of
    ``axes`` priced from its stage plans (with a request, the requested one per stage
    plan), and whether stage plans with tensor parallelism inside were priced."""
    request = options.pipeline
    priced: list[PipelinePrice] = []
    tensor_ran = False
    # tensor parallelism inside the stages, where data parallelism inside fits no budget
    for tensor in (False, True) if options.tensor else (False,):
        if tensor and any(p.peak_memory <= budget for p in priced):
            break
        tensor_ran = tensor
        for view, whole, k in axes:
            axis, s = view.names[k], view.shape[k]
            rooms = (budget - whole.other_state - whole.working, budget)
            for stage_plan in _stage_plans(graph, view, k, layers, ties, resident, solve,
                                           rooms, tensor):
                stage = parts(stage_plan, graph, layers, ties, resident)
                mine = [price(p, whole, stage, view.cluster, _axes(view), stage_plan,
                              options.combiner.threshold_bytes)
                        for p in ([request] if isinstance(request, Pipeline) else
                                  candidates(axis, s, layers, options))
                        if isinstance(request, Pipeline) or
                        _splits_batch(stage_plan, layers, p.microbatches, graph)]
                priced += mine
    return priced, tensor_ran


def _cheapest(priced: Sequence[PipelinePrice], budget: float) -> PipelinePrice:
    """The fastest of ``priced`` within ``budget`` (of equal steps the leaner, then the
    first), else the leanest."""
    fits = [p for p in priced if p.peak_memory <= budget]
    if not fits:
        return min(priced, key=lambda p: p.peak_memory)
    return min(fits, key=lambda p: (p.step_time, p.peak_memory))


def _axes(view: View) -> tuple[tuple[str, int], ...]:
    return tuple(zip(view.names, view.shape))


def adopt(plan: Plan, choice: Choice, graph: Graph, ties: Sequence[tuple[int, int]] = (),
          resident: Collection[int] = (), combiner: Combiner = XLA_CPU) -> Plan:
    """``plan`` (of ``graph``) running ``choice``'s pipeline: its conversions are those the
    pipelined program runs (:func:`shardc.pipeline.runs.pipelined_reshards`), their
    seconds and wire bytes its communication, its compute the stages' as priced and the
    rest's as ``plan`` has it, its peak the price's, and ``solver["pipeline"]`` keeps the
    price that ``plan.explain()`` shows and, as ``"free"``, the ids of the values
    (:func:`updates`) the lowering leaves unconstrained. ``plan`` itself where the choice
    is none."""
    best = choice.best
    if choice.pipeline is None or best is None:
        return plan
    old = plan.predicted
    layers = find_layers(graph, ties, resident)
    reshards = pipelined_reshards(plan, graph, layers, choice.pipeline, best, combiner)
    comm = sum(r.time for r in reshards)
    stages = best.step_time - best.rest - best.transfers - best.gathers - best.grads - \
        best.loss_reduce - best.sample_comm
    rest = sum(op.compute_time for op in plan.ops if not layers.layer_part(op.id))
    predicted = Predicted(comm, stages + rest, sum(r.wire_bytes for r in reshards),
                          best.peak_memory, old.feed_time, old.host_time)
    record = {"reason": choice.reason, "layers": choice.layers, "step_s": best.step_time,
              "bubble_s": best.bubble, "unpipelined_s": choice.base_time,
              "permutes": best.permutes, "permute_bytes": best.permute_bytes,
              "reduces": best.reduces, "reduce_bytes": best.reduce_bytes,
              "comm_s": best.comm, "grads_s": best.grads, "grad_bytes": best.grad_bytes,
              "batch_axes": [name for name, _ in best.batch_spans],
              "tensor_axes": [name for name, _ in best.tensor_spans],
              "loss_bytes": best.loss_bytes, "loss_axes": [n for n, _ in best.loss_spans],
              "choice_s": choice.plan_s, "free": sorted(updates(graph, ties, resident))}
    return dataclasses.replace(plan, pipeline=choice.pipeline, predicted=predicted,
                               reshards=tuple(reshards),
                               solver={**plan.solver, "pipeline": record})


def pinned(graph: Graph, choice: Choice, ties: Sequence[tuple[int, int]] = (),
           resident: Collection[int] = ()) -> tuple[dict[int, NdSbp], dict[int, NdSbp]]:
    """(graph input index -> layout, graph output index -> layout): the layer state
    (stacked parameters and their optimizer moments, fed back step to step) as a stage holds
    it, for the plan that runs ``choice``'s pipeline to keep: the stage plan's layout with
    the layer dim split over the stage axis (stage ``s`` holds layers ``s L / S`` on, the
    runtime's chunks for ``V = 1``), tied results alike; the stacked parameters the layer
    scans read as the pipelined loop holds them: whole over the axes splitting the
    micro-batches, over its tensor axes as the stage plan splits them. Empty without a
    chosen pipeline."""
    p, stage = choice.pipeline, choice.stage_plan
    layers = find_layers(graph, ties, resident)
    if p is None or stage is None or layers is None:
        return {}, {}
    at = list(stage.axis_names).index(p.axis)
    sizes = tuple(p.stages if i == at else n for i, n in enumerate(stage.axis_sizes))
    tied = {i: j for j, i in ties}
    ins: dict[int, NdSbp] = {}
    for k, v in enumerate(graph.inputs):
        nd = stage.inputs[k]
        if k not in tied or v.id not in layers.stacked:
            continue
        if v.id in layers.params:  # the loop holds a stage's weights whole over the axes
            # splitting the micro-batches (runtime.pipeline_scan: in_specs P(stage)), split
            # as the stage plan has them over its tensor axes: stored so, nothing is gathered
            ins[k] = NdSbp(nd.sbps[:at] + (Split(0),) + nd.sbps[at + 1:])
        else:  # the layer dim over the stage axis too, where the layers divide so (the
            # stage plan may split it over another axis: left to the planner, the final plan
            # split another dim over the stages and converted the moments every step)
            held = NdSbp(nd.sbps[:at] + (Split(0),) + nd.sbps[at + 1:])
            if not held.fits(v.shape, sizes):
                held = NdSbp(tuple(Split(0) if i == at else
                                   B if isinstance(sbp, Split) and sbp.dim == 0 else sbp
                                   for i, sbp in enumerate(nd.sbps)))
            ins[k] = held
    return ins, {tied[k]: nd for k, nd in ins.items()}


def updates(graph: Graph, ties: Sequence[tuple[int, int]] = (),
            resident: Collection[int] = ()) -> set[int]:
    """Ids of the layer state as the step is given it (the stacked inputs: parameters and
    optimizer moments) and of the values its update makes outside the layer scans (the
    optimizer's step of the stacked parameters, :attr:`Layers.outside`). Under a pipeline
    they are left unconstrained: the state is read as it is held, split over the stages
    (the unpipelined plan settled the parameters into its scan's layout first, whole on
    every stage: a gather over the stage axis every step), the update's operands come
    from the pipeline split over the stages and its results are pinned so, where the
    unpipelined plan, whose layer gradients leave the scan whole, laid them out whole on
    every stage."""
    layers = find_layers(graph, ties, resident)
    if layers is None:
        return set()
    return {v.id for op in graph.ops if op.id in layers.outside for v in op.outputs} | \
        {v.id for v in graph.inputs if v.id in layers.stacked}
