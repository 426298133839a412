"""``@shardc.auto_shard``: trace, plan, lower and run a JAX function on a mesh, as a drop-in
for ``jax.jit``.

The function is called like ``jax.jit(fn)``: positional and keyword arguments, static ones
by position (negative too) or name, donated ones, weak-typed Python scalars. Tracing,
planning and compiling are cached per abstract signature (the tree of the dynamic
arguments, each leaf's shape, dtype and weak type, the static values, and the input layouts
the plan must keep), so a second call with the same shapes re-uses the plan and the
executable. A steady-state call skips even that lookup: it goes straight to the last
executable of its statics and argument names through ``jax.jit``'s own C++ dispatch, which
checks the arguments' pytree, types and placements (``shardc bench --calls``: within a few
microseconds of ``jax.jit``); a call that executable was not made for takes the full path.
The function is traced as ``jax.jit`` traces it: under the caller's mesh context, its errors
naming its own source line and argument paths. A saved plan (``use_plan``) skips the
solver: tracing and compiling only.

Arguments already placed elsewhere than the plan wants are moved (one transfer each,
reported once), or, with ``keep_input_shardings=True`` (or ``in_shardings=``), kept: the
plan is made around them. A ``with_sharding_constraint`` the user wrote is a fixed layout
of the plan. On a mesh with Explicit axes, results come back typed on that mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from shardc.cost.cluster import DEFAULT_CLUSTER, Cluster
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.remat import levels
from shardc.ir.sbp import Broadcast, NdSbp, from_partition_spec, to_partition_spec
from shardc.ir.trace import DEFAULT_WHILE_TRIPS, Traced, rematerialized, trace
from shardc.lower.emit import explicit_axes, jit_plan
from shardc.pipeline.runtime import check_axis
from shardc.pipeline.schedule import Pipeline
from shardc.plan.overlap import ranking_time
from shardc.plan.record import Plan, Predicted, assemble, fingerprint
from shardc.report.explain import mesh_label
from shardc.rules.fixed import on_mesh
from shardc.rules.registry import has_rule, is_pinned, warn_missing
from shardc.runtime.multihost import agree
from shardc.solve.costgraph import NOTHING_FIXED, Fixed
from shardc.solve.problem import feed_time
from shardc.solve.reuse import Reuse
from shardc.solve.search import MemoryBudgetError, SolveOptions, plan_graph
from shardc.step.cache import PlanCache
from shardc.step.calling import (
    Call,
    Convention,
    Dispatch,
    Miss,
    abstract_leaf,
    dispatch_key,
    misplaced,
    place,
    placement,
)
from shardc.step.names import input_names, output_names
from shardc.tradeoff.frontier import (
    BUDGETS,
    DeviceCount,
    DeviceSweep,
    Frontier,
    Sources,
    device_counts,
    sweep,
)
from shardc.tradeoff.views import View, views

__all__ = ["AutoSharded", "NeedsDevicesError", "Options", "auto_shard", "device_sweep",
           "pareto"]

log = logging.getLogger("shardc")


def auto_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """The same devices (or, for an AbstractMesh, the same shape) and axes with every axis
    Auto (what sharding constraints need)."""
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


class NeedsDevicesError(ValueError):
    """Lowering or running a function whose ``auto_shard`` was given an AbstractMesh: it
    plans, but running needs devices."""

    def __init__(self, mesh: AbstractMesh):
        shape, names = tuple(mesh.axis_sizes), tuple(mesh.axis_names)
        super().__init__(
            f"auto_shard was given an AbstractMesh ({mesh_label(zip(names, shape))}): it "
            "plans (step.plan, plan.explain, plan.to_json), but lowering and running need a "
            "concrete jax.sharding.Mesh of the same shape: jax.make_mesh("
            f"{shape!r}, {names!r}); make the step on that mesh and adopt this plan with "
            "step.use_plan(plan, *args)")


@dataclass(frozen=True)
class Options:
    """Everything ``auto_shard`` is asked for besides the function and its mesh (see
    :func:`auto_shard` for each field)."""

    cluster: Cluster = DEFAULT_CLUSTER
    memory_budget: float | None = None
    time_limit: float = 10.0
    seeds: Mapping[str, Any] = field(default_factory=dict)
    mesh_search: bool = False
    in_shardings: Any = None
    keep_input_shardings: bool | None = None  # None: True on a mesh with Explicit axes
    cache_dir: str | None = None  # None: $SHARDC_CACHE_DIR if set, else no disk cache
    while_trips: int = DEFAULT_WHILE_TRIPS
    pipeline: Pipeline | bool | None = None  # None: the planner's choice; False: never

    def __post_init__(self):
        if not (self.pipeline is None or self.pipeline is False
                or isinstance(self.pipeline, Pipeline)):
            raise TypeError(f"pipeline must be a shardc.pipeline.Pipeline, False (never "
                            f"pipeline) or None (the planner's choice); got {self.pipeline!r}")
        if (not isinstance(self.while_trips, int) or isinstance(self.while_trips, bool)
                or self.while_trips < 1):
            raise ValueError(f"while_trips is the iterations a while loop without static "
                             f"bounds is planned for, a whole number >= 1; got "
                             f"{self.while_trips!r}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(f"memory_budget must be a positive number of bytes per device, "
                             f"got {self.memory_budget!r}")
        if not self.time_limit >= 0:
            raise ValueError(f"time_limit must be seconds >= 0, got {self.time_limit!r}")


#: a seed whose objective is within this factor of the plan's is assembled and compared on
#: the plan's own prediction (the objective and the prediction price XLA's combined
#: collectives differently: by shares, and as the one collective they compile to)
SEED_RECHECK = 1.25


def _platform(mesh: Mesh | AbstractMesh) -> str | None:
    """The platform of the mesh's devices (what ``platform_index`` conds resolve for);
    None on an abstract mesh: the default backend's."""
    return None if isinstance(mesh, AbstractMesh) else mesh.devices.flat[0].platform


def resident_inputs(arg_trees, ties) -> frozenset[int]:
    """Flat inputs that stay on the devices from call to call besides the tied state: with
    no ties (a function that returns no new state, such as a decode loop
    ``decode(params, tokens)``), a first argument that is a pytree of several arrays (the
    model's parameters) when more arguments follow; a train step's state is its ties. The
    other inputs (a batch; plain arrays, ``f(x, y)``) are fed from the host every call,
    which the plan pays for."""
    trees = list(arg_trees)
    if ties or len(trees) < 2 or trees[0].num_leaves < 2:
        return frozenset()
    return frozenset(range(trees[0].num_leaves))


def tie_outputs(arg_trees, out_tree, graph=None) -> list[tuple[int, int]]:
    """(flat output, flat input) pairs of a step whose output is, or holds, a pytree shaped
    like one of its arguments (``(state, batch) -> (new_state, loss)``): the new state should
    be laid out as the state it replaces. ``arg_trees`` has one treedef per dynamic
    argument, in flattening order. With ``graph``, only leaves of equal shape and dtype are
    tied."""
    ins = list(arg_trees)
    outs = [out_tree] if out_tree in ins or not out_tree.children() else out_tree.children()
    in_off = [0]
    for t in ins:
        in_off.append(in_off[-1] + t.num_leaves)
    ties, out_start = [], 0
    for o in outs:
        for a, t in enumerate(ins):
            if t == o and t.num_leaves:
                ties += [(out_start + k, in_off[a] + k) for k in range(t.num_leaves)]
                break
        out_start += o.num_leaves
    if graph is not None:
        ties = [(j, i) for j, i in ties
                if (graph.outputs[j].shape, graph.outputs[j].dtype)
                == (graph.inputs[i].shape, graph.inputs[i].dtype)]
    return ties


@dataclass(frozen=True)
class _Traced:
    """A traced signature: the program, its ties, and the layouts it must keep."""

    traced: Traced
    ties: tuple[tuple[int, int], ...]
    fixed: Fixed
    #: inputs that stay on the devices from call to call besides the tied state
    #: (:func:`resident_inputs`): no host feed is charged for them
    resident: frozenset[int] = frozenset()


class AutoSharded:
    """The callable ``auto_shard`` returns: call it like ``jax.jit(fn)``; ``plan`` /
    ``lower`` / ``use_plan`` take the same arguments (arrays or ``ShapeDtypeStruct``s)."""

    def __init__(self, fn: Callable, mesh: Mesh | AbstractMesh, options: Options,
                 convention: Convention):
        if not isinstance(mesh, Mesh | AbstractMesh):
            raise TypeError(f"auto_shard needs a jax.sharding.Mesh, or an AbstractMesh to plan "
                            f"without the devices, got {type(mesh).__name__}; make one with "
                            "jax.make_mesh((2, 4), ('node', 'gpu')) or "
                            "jax.sharding.AbstractMesh((16, 8), ('node', 'gpu'))")
        #: planning needs the mesh's shape and axis names only; an AbstractMesh plans for
        #: devices that are not here, and lowering or running raises NeedsDevicesError
        self.abstract = isinstance(mesh, AbstractMesh)
        self.fn = fn
        self.user_mesh = mesh
        self.mesh = auto_mesh(mesh)
        self.options = options
        self.convention = convention
        #: keep placed arguments where they are: asked for, or implied by Explicit axes
        #: (an argument's sharding is then part of its type, the user's own choice)
        self.keep = options.keep_input_shardings if options.keep_input_shardings is not None \
            else bool(explicit_axes(mesh))
        options.cluster.check_axes(self.mesh.axis_names)
        if isinstance(options.pipeline, Pipeline):
            check_axis(options.pipeline, self.mesh)
        self._traces: dict[Any, _Traced] = {}
        self._plans: dict[Any, Plan] = {}
        self._execs: dict[Any, Callable] = {}
        self._dispatch: dict[Any, Dispatch] = {}
        #: calls' :func:`~shardc.step.calling.dispatch_key` -> the Dispatch the last such call ran
        self._fast: dict[Any, Dispatch] = {}
        self._moved: set = set()
        _check_specs(options.in_shardings, self.mesh)
        functools.update_wrapper(self, fn)

    # ---- tracing and planning, cached per abstract signature ---------------------------------
    def _key(self, call: Call) -> tuple:
        avals = tuple((a.shape, str(a.dtype), a.weak_type) for a in call.avals(self.fn))
        kept = tuple(sorted(self._kept_layouts(call).items())) if self.keep else ()
        return call.tree, avals, call.statics, kept

    def _kept_layouts(self, call: Call) -> dict[int, NdSbp]:
        """The layouts of placed arguments the plan must keep (``keep_input_shardings``)."""
        names = tuple(self.mesh.axis_names)
        out = {}
        for k, x in enumerate(call.leaves):
            sh = placement(x)
            if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names \
                    and sh.mesh.shape_tuple == self.mesh.shape_tuple:
                out[k] = from_partition_spec(sh.spec, len(x.shape), names)
        return out

    def _fixed(self, call: Call) -> Fixed:
        """The inputs the plan keeps (``in_shardings``, kept placements) and, on a mesh with
        Explicit axes, the outputs' layouts their types get under ``jax.jit``."""
        inputs = {}
        if self.options.in_shardings is not None:
            dyn_args, _ = call.unflatten(call.leaves)
            inputs.update(seed_layouts("in_shardings", self.options.in_shardings,
                                       jax.tree.map(abstract_leaf, dyn_args),
                                       self.mesh.axis_names))
        if self.keep:
            inputs.update(self._kept_layouts(call))
        return Fixed(inputs, self._typed_outputs(call))

    def _typed_outputs(self, call: Call) -> dict[int, NdSbp]:
        """On a mesh with Explicit axes the results get types as ``jax.jit`` infers them
        (``jax.eval_shape``), from arguments typed with shardings of the mesh and from the
        program's own ``reshard`` / ``out_sharding``: results are placed so, and combine
        with the user's arrays as ``jax.jit``'s would. With no argument typed, a result
        the program leaves untyped (replicated) keeps the plan's layout."""
        names = tuple(self.mesh.axis_names)
        typed = [isinstance(sh := placement(x), NamedSharding) and
                 tuple(sh.mesh.axis_names) == names for x in call.leaves]
        if not explicit_axes(self.user_mesh):
            return {}
        try:  # under the caller's mesh context, as jax.jit traces
            outs = jax.eval_shape(call.function(self.fn), *call.leaves)
        except Exception as exc:
            # arguments typed by an earlier plan's results (not by the user) may not type-check
            # under jax.jit's rules, which shardc's lowering (under auto_axes) does not need:
            # the results then keep the plan's layouts as their types
            if type(exc).__name__ != "ShardingTypeError":
                raise
            log.info("shardc: %s does not type-check with these argument shardings (%s); "
                     "its results are typed with the plan's layouts",
                     getattr(self.fn, "__name__", "fn"), str(exc).splitlines()[0])
            return {}
        fixed = {}
        for j, o in enumerate(jax.tree.leaves(outs)):
            sh = getattr(o, "sharding", None)
            if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == names:
                nd = from_partition_spec(sh.spec, len(o.shape), names)
                if any(typed) or any(not isinstance(p, Broadcast) for p in nd.sbps):
                    fixed[j] = nd
        return fixed

    def _traced(self, call: Call, remat: tuple[int, ...] = ()) -> tuple[Any, _Traced]:
        """The call's signature key and its traced program; with ``remat``, the program
        that recomputes those forward segments (:mod:`shardc.ir.remat`)."""
        key = self._key(call)
        if remat:
            rkey = (key, tuple(sorted(set(remat))))
            hit = self._traces.get(rkey)
            if hit is None:
                base = self._traced(call)[1]
                hit = dataclasses.replace(base, traced=self._own(
                    rematerialized(base.traced, remat)))
                self._traces[rkey] = hit
            return key, hit
        hit = self._traces.get(key)
        if hit is None:
            t0 = time.perf_counter()
            with _gc_paused():
                traced = self._own(trace(call.function(self.fn),
                                         *map(abstract_leaf, call.leaves),
                                         platform=_platform(self.mesh),
                                         while_trips=self.options.while_trips))
            ties = tie_outputs(call.arg_trees(), traced.out_tree, traced.graph)
            hit = _Traced(traced, tuple(ties), self._fixed(call),
                          resident_inputs(call.arg_trees(), ties))
            self._traces[key] = hit
            log.debug("shardc: traced %s in %.2f s", getattr(self.fn, "__name__", "fn"),
                      time.perf_counter() - t0)
        return key, hit

    def _own(self, traced: Traced) -> Traced:
        """``traced`` with the user's constraints on another mesh of these devices read on
        this one (:func:`shardc.rules.fixed.on_mesh`)."""
        if not self.abstract:
            on_mesh(traced.graph.ops, self.mesh)
        return traced

    def _plan(self, call: Call) -> tuple[Any, _Traced, Plan]:
        """The call's key, its plan, and the program the plan runs (the traced one, or the
        one recomputing the segments the plan chose)."""
        key, tr = self._traced(call)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._compatible(key, tr.fixed) or self._cached_or_solved(tr, call)
            pipe = self.options.pipeline  # asked for: the plan runs it
            if isinstance(pipe, Pipeline) and plan.pipeline != pipe:
                plan = dataclasses.replace(plan, pipeline=pipe)
            # under jax.distributed: every process runs the same plan (process 0's)
            plan = agree(self._named(call, tr, plan))
            self._plans[key] = plan
        if plan.remat:
            _, tr = self._traced(call, plan.remat)
        return key, tr, plan

    def _named(self, call: Call, tr: _Traced, plan: Plan) -> Plan:
        """``plan`` naming this call's argument and result leaves (``plan.explain()``)."""
        return plan.named(input_names(self.fn, call), output_names(tr.traced.out_tree))

    def _cached_or_solved(self, tr: _Traced, call: Call) -> Plan:
        """The plan from the disk cache (``cache_dir``), else solved and stored there."""
        candidates, seeds = self._problem(call, tr)
        store = PlanCache.at(self.options.cache_dir)
        if store is None:
            return self._pipelined(call, tr, candidates, seeds)
        program = fingerprint(tr.traced.graph)
        flat = {f"{view.label}: {name}": layouts
                for view, named in zip(candidates, seeds) for name, layouts in named.items()}
        key = store.key(program, tr.traced.graph.inputs, self.mesh, self.options, flat,
                        tr.ties, tr.fixed, tr.resident)
        plan = store.load(key, lambda p: fingerprint(self._traced(call, p.remat)[1].traced.graph))
        if plan is None:
            plan = self._pipelined(call, tr, candidates, seeds)
            store.save(key, plan)
        return plan

    def _pipelined(self, call: Call, tr: _Traced, candidates: list[View],
                   seeds: list[dict[str, dict[int, NdSbp]]]) -> Plan:
        """The solved plan, with the pipeline the planner chooses (``pipeline=None``) or was
        asked for where the program has a layer stack (:func:`shardc.pipeline.layers`) to
        run as one: planned again on the mesh with the layer state pinned as a stage holds
        it (:func:`shardc.pipeline.choose.pinned`), and priced as the pipeline
        (:func:`~shardc.pipeline.choose.adopt`). Unpipelined with ``pipeline=False``,
        without a stack, or where no pipeline pays: against the plan on the mesh, and with
        ``mesh_search``, against the best view's (the stages are over an axis of the
        mesh itself)."""
        from shardc.pipeline.choose import adopt, best_pipeline, pinned
        from shardc.pipeline.stack import has_stack

        plan = self._solve(call, tr, candidates, seeds, self.options)
        if self.options.pipeline is False or not has_stack(tr.traced.jaxpr):
            return plan
        # the stage axis is one of the mesh's: priced against the plan on the mesh itself,
        # and where mesh_search ran another view, the pipeline must beat that one too
        own = plan.axis_names == tuple(self.mesh.axis_names)
        base = plan if own else self._solve(call, tr, candidates[:1], seeds[:1], self.options)
        graph, opts = tr.traced.graph, self._choice_options(views=False)
        choice = best_pipeline(graph, base.axis_sizes, base.axis_names, base.cluster,
                               ties=tr.ties, resident=tr.resident, base=base, options=opts)
        log.info("shardc: %s", choice.summary())
        if choice.pipeline is None or not own and choice.reason != "requested" and \
                choice.best.step_time >= (1 - opts.min_gain) * plan.predicted.step_time:
            return plan
        ins, outs = pinned(graph, choice, tr.ties, tr.resident)
        if ins:
            keep = dataclasses.replace(tr, fixed=Fixed({**ins, **tr.fixed.inputs},
                                                       {**outs, **tr.fixed.outputs}))
            try:  # on the mesh itself: the stage axis is one of its axes
                base = self._solve(call, keep, candidates[:1], seeds[:1], self.options)
            except MemoryBudgetError:
                return plan
        return adopt(base, choice, graph, tr.ties, tr.resident)

    def _choice_options(self, views: bool):
        from shardc.pipeline.choose import ChoiceOptions

        opts = self.options
        return ChoiceOptions(opts.memory_budget, opts.time_limit, views=views,
                             pipeline=opts.pipeline)

    def _problem(self, call: Call, tr: _Traced
                 ) -> tuple[list[View], list[dict[str, dict[int, NdSbp]]]]:
        """What a solve of this call needs besides its options: the meshes to plan on and
        the seeds of each; warns once per primitive without a rule (it runs replicated)."""
        warn_missing([op for op in tr.traced.graph.ops if not has_rule(op.name)])
        candidates = self._views(tr)
        return candidates, self._seed_layouts(call, candidates)

    def _views(self, tr: _Traced) -> list[View]:
        """The meshes to plan on: the physical one, and with ``mesh_search`` (unless the
        program fixes layouts on the physical axes) every other logical view of it."""
        opts = self.options
        shape, names = tuple(self.mesh.axis_sizes), tuple(self.mesh.axis_names)
        if opts.mesh_search and not _pinned(tr):
            return views(shape, names, opts.cluster)
        return [View(shape, names, opts.cluster)]

    def _seed_layouts(self, call: Call, candidates: list[View]
                      ) -> list[dict[str, dict[int, NdSbp]]]:
        """The ``seeds`` option as graph-input layouts by seed name, per candidate view: a
        seed seeds each view whose axes its specs name (the mesh's own, or another view's
        such as ``gpu2`` / ``gpu4`` of a flat 8-device mesh); one that names no view's
        axes is an error."""
        dyn_args, _ = call.unflatten(call.leaves)
        abstract = jax.tree.map(abstract_leaf, dyn_args)
        out: list[dict[str, dict[int, NdSbp]]] = [{} for _ in candidates]
        for name, spec in self.options.seeds.items():
            errors = []
            for i, view in enumerate(candidates):
                try:
                    out[i][name] = seed_layouts(f"seed {name!r}", spec, abstract, view.names)
                except ValueError as exc:
                    errors.append(exc)
            if len(errors) == len(candidates):
                raise errors[0] if len(candidates) == 1 else ValueError(
                    f"seed {name!r} fits none of the meshes planned "
                    f"({', '.join(v.label for v in candidates)}): {errors[0]}")
        return out

    def _compatible(self, key, fixed: Fixed) -> Plan | None:
        """A plan made for the same shapes that already has the layouts ``fixed`` asks for:
        the results of a step fed back in as its next arguments (kept, on a mesh with
        Explicit axes) need no second solve."""
        if not fixed:
            return None
        for k, plan in self._plans.items():
            if k[:3] == key[:3] and \
                    all(plan.inputs[i] == nd for i, nd in fixed.inputs.items()) and \
                    all(plan.outputs[j] == nd for j, nd in fixed.outputs.items()):
                return plan
        return None

    def _solve(self, call: Call, tr: _Traced, candidates: list[View],
               seeds: list[dict[str, dict[int, NdSbp]]], opts: Options) -> Plan:
        """The fastest plan within ``opts.memory_budget`` (:meth:`_fastest`); where none
        fits, the error names the smallest budget that plans (:meth:`_leanest`)."""
        try:
            return self._fastest(call, tr, candidates, seeds, opts)
        except MemoryBudgetError as exc:
            raise self._leanest(call, tr, candidates, seeds, opts, exc) from None

    def _fastest(self, call: Call, tr: _Traced, candidates: list[View],
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
            plan = self._solve_views(tr, candidates, seeds, opts)
        except MemoryBudgetError as exc:
            if budget is None or not recomputed:
                raise
            plan, failure = None, exc
        if budget is None or not recomputed:
            return plan
        if plan is not None:
            free = self._solve_views(tr, candidates, seeds,
                                     dataclasses.replace(opts, memory_budget=None))
            if ranking_time(plan) <= ranking_time(free):
                return plan  # the budget does not bind
        fits = [] if plan is None else [plan]
        for remat in recomputed:  # most recomputed first: fewer fit no better
            log.info("shardc: the budget %s binds; planning with %d of %d forward segments "
                     "recomputed", fmt_bytes(budget), len(remat), len(tr.traced.segments))
            try:
                fits.append(self._solve_views(self._traced(call, remat)[1], candidates,
                                              seeds, opts))
            except MemoryBudgetError as again:
                if plan is None:
                    failure = MemoryBudgetError(budget, min(failure.needed, again.needed),
                                                min(failure.found, again.found))
                break
        if not fits:
            raise failure
        return min(fits, key=ranking_time)

    def _leanest(self, call: Call, tr: _Traced, candidates: list[View],
                 seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
                 failure: MemoryBudgetError) -> MemoryBudgetError:
        """The error for a budget no plan fits, naming the smallest budget that plans: the
        smallest peak the search reached when planning at it succeeds (the leanest plans
        are the search's, not its lean start's: on a residual MLP, 2.6 MiB against 4.9
        MiB), else the lean start's peak, which always does."""
        found = math.ceil(failure.found)
        if found >= failure.needed:
            return MemoryBudgetError(failure.budget, failure.needed)
        log.info("shardc: no plan fits %s; checking that one fits %s",
                 fmt_bytes(opts.memory_budget), fmt_bytes(found))
        try:
            self._fastest(call, tr, candidates, seeds,
                        dataclasses.replace(opts, memory_budget=found))
        except MemoryBudgetError:
            return MemoryBudgetError(failure.budget, failure.needed)
        return MemoryBudgetError(failure.budget, found)

    def _solve_views(self, tr: _Traced, candidates: list[View],
                     seeds: list[dict[str, dict[int, NdSbp]]], opts: Options,
                     reuse: Reuse | None = None) -> Plan:
        """The fastest plan of ``tr``'s program over the meshes ``candidates`` (``reuse``:
        where cost graphs built for other budgets are kept, :mod:`shardc.solve.reuse`)."""
        graph = tr.traced.graph
        names = tuple(self.mesh.axis_names)
        t0 = time.perf_counter()
        best, tried, failure, priced = None, [], None, {}
        for view, view_seeds in zip(candidates, seeds, strict=True):
            t = time.perf_counter()
            is_physical = view.names == names
            sopts = SolveOptions(opts.memory_budget, opts.time_limit, seeds=view_seeds)
            try:
                cg, sol = plan_graph(graph, view.shape, view.names, view.cluster, sopts,
                                     ties=tr.ties, fixed=tr.fixed if is_physical else NOTHING_FIXED,
                                     resident=tr.resident, reuse=reuse)
            except MemoryBudgetError as exc:
                if len(candidates) == 1:
                    raise
                failure = exc if failure is None else MemoryBudgetError(
                    exc.budget, min(exc.needed, failure.needed), min(exc.found, failure.found))
                tried.append({"mesh": view.label, "predicted_s": None,
                              "plan_s": time.perf_counter() - t, "error": str(exc)})
                continue
            costs = sol.stats.pop("seeds", {})
            for name, cost in costs.items():
                priced[name if is_physical else f"{name} on {view.label}"] = cost
            solver = {"status": sol.status.value, "objective": sol.objective, **sol.stats}
            plan = assemble(graph, cg, sol.choice, tr.ties, solver, tr.traced.remat,
                            len(tr.traced.segments), _platform(self.mesh))
            for name, choice in sol.seed_choices.items():
                # the objective prices combined collectives by shares; a seed close to the
                # plan is priced as the plan is, so the plan predicts no more than any seed.
                # The objective prices communication serially: under overlap every seed is
                # ranked as the plan is (FSDP's gathers hide behind compute a serial sum
                # charges them for)
                if view.cluster.overlap or costs.get(name, math.inf) <= (
                        sol.objective * SEED_RECHECK):
                    other = assemble(graph, cg, choice, tr.ties, {**solver, "seed": name},
                                     tr.traced.remat, len(tr.traced.segments),
                                     _platform(self.mesh))
                    if ranking_time(other) < ranking_time(plan):
                        plan = other
            tried.append({"mesh": view.label, "predicted_s": plan.predicted.step_time,
                          "ranked_s": ranking_time(plan), "plan_s": time.perf_counter() - t})
            if best is None or ranking_time(plan) < ranking_time(best):
                best = plan
        if best is None:
            raise failure
        solver = {**best.solver, "plan_s": time.perf_counter() - t0}
        if priced:
            solver["seeds"] = priced  # every view's seeds: the plan costs no more than any
        if opts.mesh_search:
            solver["mesh_search"] = tried
            if _pinned(tr):
                solver["mesh_search_note"] = (
                    "only the given mesh was planned: the program fixes layouts on its axes")
        return dataclasses.replace(best, solver=solver)

    # ---- execution -------------------------------------------------------------------------
    def mesh_for(self, plan: Plan) -> Mesh | AbstractMesh:
        """The mesh ``plan`` runs on: this function's mesh (its Auto version), or the view of
        its devices the mesh search chose (``plan.mesh_axes``); abstract when this function's
        mesh is."""
        return View(plan.axis_sizes, plan.axis_names, plan.cluster).mesh(self.mesh)

    def _out_mesh(self, plan: Plan) -> Mesh:
        """Where results are placed: the user's mesh (with its axis types) unless the plan
        runs on another view of its devices."""
        same = plan.mesh_axes == self.mesh.shape_tuple
        return self.user_mesh if same else self.mesh_for(plan)

    def _in_shardings(self, tr: _Traced, plan: Plan) -> list[NamedSharding]:
        mesh = self._out_mesh(plan)
        return [NamedSharding(mesh, to_partition_spec(nd, v.ndim, mesh.axis_names))
                for nd, v in zip(plan.inputs, tr.traced.graph.inputs)]

    def _out_shardings(self, tr: _Traced, plan: Plan) -> Any:
        """The result pytree's shardings under ``plan`` (of ``tr``'s program): on the user's
        mesh, with its axis types (the types ``jax.jit`` gives the results)."""
        mesh = self._out_mesh(plan)
        return jax.tree.unflatten(tr.traced.out_tree, [
            NamedSharding(mesh, to_partition_spec(nd, v.ndim, mesh.axis_names))
            for nd, v in zip(plan.outputs, tr.traced.graph.outputs)])

    def _exec(self, call: Call) -> tuple[Callable, list[NamedSharding], Any]:
        if self.abstract:
            raise NeedsDevicesError(self.mesh)
        key, tr, plan = self._plan(call)
        jitted = self._execs.get(key)
        if jitted is None:
            jitted = jit_plan(tr.traced, plan, self.mesh_for(plan), self._out_mesh(plan),
                              call.tree, tr.traced.out_tree,
                              donate_argnums=call.donate_argnums,
                              donate_argnames=call.donate_argnames)
            self._execs[key] = jitted
        return jitted, self._in_shardings(tr, plan), key

    def _call(self, args: tuple, kwargs: dict):
        """The full path of a call: its signature's plan and executable (traced, planned
        and compiled on its first call), placed arguments moved where the plan wants them;
        the executable's :class:`Dispatch` becomes the fast path of calls like it."""
        call = self.convention.split(args, kwargs)
        jitted, shardings, key = self._exec(call)
        self._report_moves(call, shardings, key)
        placed = call.unflatten(place(call.leaves, shardings))
        with _gc_paused():  # the first call of a signature traces and compiles
            dispatch = self._dispatch.get(key)
            if dispatch is not None:
                try:
                    out = dispatch(*placed)
                except Miss:  # arguments typed otherwise than its first call's (tracers)
                    dispatch = None
            if dispatch is None:
                _, tr, plan = self._plan(call)
                dispatch = self._dispatch[key] = Dispatch.of(jitted, call, shardings,
                                                             self._out_shardings(tr, plan))
                out = dispatch(*placed)
        self._fast[dispatch_key(*self.convention.dynamic(args, kwargs))] = dispatch
        return out

    def _report_moves(self, call: Call, shardings: list[NamedSharding], key) -> None:
        """Log, once per argument and signature, a placed argument the plan moves."""
        fresh = [k for k in misplaced(call.leaves, shardings) if (key, k) not in self._moved]
        if not fresh:
            return
        paths = call.leaf_names()
        for k in fresh:
            self._moved.add((key, k))
            have = placement(call.leaves[k])
            log.warning("shardc: argument %s is placed as %s; the plan wants %s, so it is "
                        "moved there (keep_input_shardings=True plans around the placement "
                        "instead)", paths[k], getattr(have, "spec", have), shardings[k].spec)

    # ---- public surface ---------------------------------------------------------------------
    def plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStructs); nothing is executed."""
        call = self.convention.split(args, kwargs)
        key, tr, plan = self._plan(call)
        if not self.abstract:  # on an AbstractMesh nothing runs, so nothing is moved
            self._report_moves(call, self._in_shardings(tr, plan), key)
        return plan

    def pareto(self, *args, budgets: int = BUDGETS, **kwargs) -> Frontier:
        """The time-memory frontier for these arguments (:mod:`shardc.tradeoff.frontier`):
        plans at no memory budget, at the smallest one a plan was found for, at ``budgets`` budgets
        between and in the gaps they leave, recomputing forward segments' activations as
        the budget needs, and the generic layouts' plans (:mod:`shardc.tradeoff.baselines`, which
        also seed every search, with the ``seeds`` option's); the non-dominated ones, each
        a plan ``use_plan`` runs. Nothing is cached:
        ``step.use_plan(frontier.pick(budget), *args)`` adopts one."""
        from shardc.tradeoff.baselines import generic_layouts, layout_plan, optimizer_state

        call = self.convention.split(args, kwargs)
        _, tr = self._traced(call)
        candidates, seeds = self._problem(call, tr)
        sizes, names = tuple(self.mesh.axis_sizes), tuple(self.mesh.axis_names)
        graph, state = tr.traced.graph, self._state(call, tr)
        optimizer = optimizer_state(graph, state)
        generic = {f"generic {name}": layouts for name, layouts in generic_layouts(
            [v.shape for v in graph.inputs], state, sizes, optimizer).items()
                   if not isinstance(layouts, str)}
        physical = next((i for i, v in enumerate(candidates) if v.names == names), None)
        if physical is not None:
            seeds = [{**s, **generic} if i == physical else s for i, s in enumerate(seeds)]

        reuse = Reuse()  # each program's cost graphs, built once for all its budgets

        def solve(budget: float | None, remat: tuple[int, ...] = ()) -> Plan:
            opts = dataclasses.replace(self.options, memory_budget=budget)
            rtr = self._traced(call, remat)[1]
            return self._named(call, rtr, self._solve_views(rtr, candidates, seeds, opts,
                                                            reuse))

        def place(remat: tuple[int, ...], layouts: Mapping[str, Mapping[int, NdSbp]]
                  ) -> list[Plan]:
            """The program recomputing ``remat`` placed around each of ``layouts``."""
            rtr = self._traced(call, remat)[1]
            t = rtr.traced
            return [self._named(call, rtr, layout_plan(
                t.graph, rtr.ties, sizes, names, self.options.cluster, inputs, rtr.fixed,
                tuple(rtr.resident), t.remat, len(t.segments), name))
                for name, inputs in layouts.items()]

        inputs = tuple(math.prod(v.shape) * v.dtype.itemsize for v in graph.inputs)
        return sweep(Sources(solve, place, {} if physical is None else seeds[physical],
                             tr.traced.segments, inputs,
                             tuple(tuple(v.shape) for v in graph.inputs), frozenset(optimizer),
                             tuple(zip(names, sizes))), budgets)

    def _state(self, call: Call, tr: _Traced) -> set[int]:
        """The graph inputs that are the program's state (:mod:`shardc.tradeoff.baselines`): those
        its results replace, else the first argument's leaves."""
        trees = call.arg_trees()
        return {i for _, i in tr.ties} or set(range(trees[0].num_leaves if trees else 0))

    def margins(self, *args, **kwargs):
        """The plan for these arguments beside generic data-parallel, FSDP, Megatron and
        DP x TP layouts (:mod:`shardc.tradeoff.baselines`): on a mesh with devices each compiled and
        priced from its HLO, the plan's program too; on an abstract mesh estimated on the
        plan's cost model. ``plan.explain(margins=step.margins(*args))`` prints them."""
        from shardc.tradeoff.baselines import margins

        call = self.convention.split(args, kwargs)
        _, tr, plan = self._plan(call)
        compile = None
        if not isinstance(self.mesh, AbstractMesh):
            compile = functools.partial(self._compiled_margin, call, tr, plan, args, kwargs)
        return margins(tr.traced.graph, tr.ties, plan, self._state(call, tr), compile,
                       tuple(tr.resident))

    def _compiled_margin(self, call: Call, tr: _Traced, plan: Plan, args, kwargs,
                         layouts: dict[int, NdSbp] | None) -> Predicted:
        """The program compiled with ``layouts`` as its input shardings (``jax.jit``, XLA
        placing the rest; None: the plan's own program), priced from its HLO on the plan's
        cluster, with the host feed of the inputs not carried from step to step."""
        from shardc.inspect import price

        graph, cluster = tr.traced.graph, plan.cluster
        if layouts is None:
            compiled, mesh = self.lower(*args, **kwargs).compile(), self.mesh_for(plan)
            inputs = plan.inputs
        else:
            mesh, names = self.mesh, tuple(self.mesh.axis_names)
            whole = NdSbp((Broadcast(),) * len(names))
            inputs = tuple(layouts.get(k, whole) for k in range(len(graph.inputs)))
            shardings = [NamedSharding(mesh, to_partition_spec(nd, v.ndim, names))
                         for nd, v in zip(inputs, graph.inputs, strict=True)]
            leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in call.avals(self.fn)]
            with _gc_paused():
                compiled = jax.jit(call.function(self.fn), in_shardings=shardings).lower(
                    *leaves).compile()
        cost = price(compiled, mesh, cluster)
        carried = {i for _, i in tr.ties} | tr.resident
        sizes = tuple(mesh.shape.values())
        feed = sum(feed_time(v, nd, sizes, cluster, k in carried)
                   for k, (v, nd) in enumerate(zip(graph.inputs, inputs, strict=True)))
        return Predicted(cost.comm_time, cost.compute_time, cost.wire_bytes,
                         cost.peak_memory or 0.0, feed)

    def device_sweep(self, *args, memory_budget: float | None = None, **kwargs
                     ) -> DeviceSweep:
        """The best plan for these arguments on each device count that divides the mesh
        (:func:`shardc.tradeoff.frontier.device_counts`: the first devices, inner axes filled
        first), within ``memory_budget`` bytes per device (default: this function's budget,
        else the cluster's ``device_memory``): how many devices the program needs, and what
        each more buys. Each count is planned on an AbstractMesh of its sub-mesh, its axes
        priced at the links they have in the whole mesh, with this function's options but
        its seeds and kept layouts (written for the whole mesh); a count where no plan fits
        records the leanest plan's peak. Nothing is cached or run:
        ``step.use_plan(count.plan, *args)`` adopts the whole mesh's."""
        budget = memory_budget if memory_budget is not None else (
            self.options.memory_budget or self.options.cluster.device_memory)
        cluster = self.options.cluster
        counts = []
        for k, shape, names in device_counts(tuple(self.mesh.axis_sizes),
                                             tuple(self.mesh.axis_names)):
            sub = dataclasses.replace(
                cluster, axis_bandwidth={a: cluster.bandwidth(a) for a in names},
                axis_latency={a: cluster.latency(a) for a in names},
                axis_link={a: cluster.link(a) for a in names},
                axis_nodes={a: n for a, n in cluster.axis_nodes.items() if a in names})
            opts = dataclasses.replace(self.options, cluster=sub, memory_budget=budget,
                                       seeds={}, in_shardings=None,
                                       keep_input_shardings=False, cache_dir=None)
            step = AutoSharded(self.fn, AbstractMesh(shape, names), opts, self.convention)
            mesh = tuple(zip(names, shape))
            try:
                counts.append(DeviceCount(k, mesh, step.plan(*args, **kwargs)))
            except MemoryBudgetError as exc:
                counts.append(DeviceCount(k, mesh, None, exc.needed))
            log.info("shardc: %d devices (%s): %s", k, mesh_label(mesh),
                     "no plan fits" if counts[-1].plan is None else
                     fmt_time(counts[-1].plan.predicted.step_time) + " step")
        return DeviceSweep(tuple(counts), budget)

    def pipeline_choice(self, *args, **kwargs):
        """The pipeline the planner chooses for these arguments, priced against this
        plan (a :class:`shardc.pipeline.choose.Choice`; none with ``pipeline=False``); with
        ``mesh_search``, over the stage axes of every view of the devices."""
        from shardc.pipeline.choose import best_pipeline

        _, tr, plan = self._plan(self.convention.split(args, kwargs))
        base = plan if plan.pipeline is None else None  # a pipelined plan's step is not one
        return best_pipeline(tr.traced.graph, plan.axis_sizes, plan.axis_names, plan.cluster,
                             ties=tr.ties, resident=tr.resident, base=base,
                             options=self._choice_options(self.options.mesh_search))

    def input_shardings(self, *args, **kwargs) -> tuple[tuple, dict]:
        """The shardings the plan gives the dynamic arguments (static ones left out), as
        ``(args, kwargs)`` pytrees of ``NamedSharding``, like ``jax.jit``'s
        ``Compiled.input_shardings``; the arguments may be ShapeDtypeStructs (on an
        AbstractMesh, the shardings are of it). Restore a
        checkpoint into them (:class:`shardc.runtime.checkpoint.Checkpoints`) or assemble a batch
        in them (:func:`shardc.runtime.multihost.global_batch`) and the step moves nothing."""
        call = self.convention.split(args, kwargs)
        _, tr, plan = self._plan(call)
        return call.unflatten(self._in_shardings(tr, plan))

    def use_plan(self, plan: Plan, *args, **kwargs) -> None:
        """Adopt a saved plan (``Plan.from_json``) for these arguments: later calls trace
        and compile, but do not solve. A plan made for another program or mesh is refused;
        one made on an AbstractMesh runs on a concrete mesh of the same shape and names."""
        call = self.convention.split(args, kwargs)
        key, tr = self._traced(call, plan.remat)
        want = fingerprint(tr.traced.graph)
        if plan.fingerprint != want:
            raise ValueError(f"the plan was made for a different program (fingerprint "
                             f"{plan.fingerprint}, this one is {want}): "
                             f"{self._difference(call, tr, plan)}; plan it again with "
                             "step.plan(...)")
        here = self.mesh.shape_tuple
        # with mesh search, a plan for any view of the same devices runs on that view
        ok = plan.mesh_axes == here or (self.options.mesh_search and
                                        math.prod(plan.axis_sizes) == self.mesh.size)
        if not ok:
            raise ValueError(f"the plan is for mesh {mesh_label(plan.mesh_axes)}, this "
                             f"function runs on {mesh_label(here)}")
        planned = {o.id for o in plan.ops}
        missing = [op for op in tr.traced.graph.ops if op.id not in planned]
        if missing:
            raise ValueError(f"the plan has no strategy for {missing[0]} (and "
                             f"{len(missing) - 1} more): it was edited or is damaged; plan "
                             "again")
        plan = agree(self._named(call, tr, plan))
        self._plans[key] = plan
        self._execs.pop(key, None)
        self._dispatch.pop(key, None)
        self._fast.clear()

    def _difference(self, call: Call, tr: _Traced, plan: Plan) -> str:
        """What differs between ``plan``'s program and this call's: the first argument of
        another type (its path and both types), else the program itself."""
        here = [v.type_str() for v in tr.traced.graph.inputs]
        if plan.input_types and len(plan.input_types) != len(here):
            return (f"the plan takes {len(plan.input_types)} argument leaves, this call "
                    f"{len(here)}")
        diff = [k for k, (a, b) in enumerate(zip(plan.input_types, here)) if a != b]
        if not diff:
            return "the primitives, their params or the dataflow differ"
        k = diff[0]
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        return (f"argument {input_names(self.fn, call)[k]} is {here[k]} here, "
                f"{plan.input_types[k]} in the plan{more}")

    def lower(self, *args, **kwargs):
        """``jax.stages.Lowered`` of the planned program (ShapeDtypeStructs are fine); its
        compiled form is called with the dynamic arguments, as ``jax.jit``'s is."""
        call = self.convention.split(args, kwargs)
        jitted, shardings, key = self._exec(call)
        self._report_moves(call, shardings, key)
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
                  if hasattr(x, "shape") else x
                  for x, a, s in zip(call.leaves, map(abstract_leaf, call.leaves), shardings)]
        dyn_args, dyn_kwargs = call.unflatten(leaves)
        with _gc_paused():
            return jitted.lower(*dyn_args, **dyn_kwargs)

    def __call__(self, *args, **kwargs):
        """A call goes straight to the executable of the last call with its statics and
        argument names through ``jax.jit``'s dispatch, which checks the arguments' pytree,
        types and placements in C++; a call that executable was not made for takes the full
        path (:meth:`_call`)."""
        statics, dyn_args, dyn_kwargs = self.convention.dynamic(args, kwargs)
        try:
            dispatch = self._fast.get(dispatch_key(statics, dyn_args, dyn_kwargs))
        except TypeError:  # unhashable statics: the full path says what to do
            dispatch = None
        if dispatch is not None:
            try:
                return dispatch(dyn_args, dyn_kwargs)
            except Exception as exc:
                if not dispatch.missed(exc, dyn_args, dyn_kwargs):
                    raise
        return self._call(args, kwargs)


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector while tracing or lowering: both allocate
    hundreds of thousands of short-lived objects, and in a process that already holds many
    (a training script, the bench) every full collection they trigger walks all of them.
    Reference counting still frees what dies; the collector resumes afterwards. Measured in
    the bench process (350k objects) on the ViT's saved plan: tracing 1.2 s -> 0.8 s."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _check_specs(specs, mesh: Mesh | AbstractMesh) -> None:
    """Refuse the PartitionSpecs of ``in_shardings`` that ``jax.jit`` refuses (an axis named
    twice: DuplicateSpecError; an axis the mesh lacks), as it does, when they are given."""
    for spec in jax.tree.leaves(specs, is_leaf=_is_spec_leaf):
        if isinstance(spec, PartitionSpec):
            NamedSharding(mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh, spec)


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def _pinned(tr: _Traced) -> bool:
    """Whether the program fixes layouts on the mesh's own axes (kept inputs, typed results,
    the user's constraints): then only that mesh is planned."""
    return bool(tr.fixed) or any(is_pinned(op) for op in tr.traced.graph.ops)


def _named_seeds(seeds) -> dict[str, Any]:
    """``seeds`` as ``{name: in_shardings}`` (a mapping only: one seed is itself a tuple of
    per-argument specs, so a bare sequence would be ambiguous)."""
    if seeds is None:
        return {}
    if isinstance(seeds, Mapping):
        return dict(seeds)
    raise TypeError("seeds takes {name: in_shardings}, where in_shardings holds a "
                    "PartitionSpec (or NamedSharding) per dynamic argument, as for jax.jit; "
                    f"got {type(seeds).__name__}. Example: seeds={{'fsdp': (state_specs, "
                    "P('data'))}}")


def seed_layouts(what: str, specs, abstract: tuple, axis_names) -> dict[int, NdSbp]:
    """Graph-input layouts of a hand-written plan: ``specs`` holds a PartitionSpec (or
    NamedSharding, or None: shardc's choice) for every dynamic positional argument, or for
    a prefix of their pytree (one spec for a whole subtree), like ``jax.jit``'s
    ``in_shardings``. Keyword arguments' leaves (after the positional ones) are left free."""
    specs = tuple(specs) if isinstance(specs, list) else specs
    if not isinstance(specs, tuple) or len(specs) != len(abstract):
        raise ValueError(f"{what}: give one entry per dynamic positional argument "
                         f"({len(abstract)}), as a tuple, like jax.jit's in_shardings")
    try:
        per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs,
                                abstract, is_leaf=_is_spec_leaf)
    except ValueError as exc:
        raise ValueError(f"{what} does not match the arguments' pytree: {exc}") from exc
    leaves = jax.tree.leaves(per_leaf, is_leaf=_is_spec_leaf)
    out: dict[int, NdSbp] = {}
    for k, (spec, x) in enumerate(zip(leaves, jax.tree.leaves(abstract), strict=True)):
        if spec is None:
            continue
        spec = spec.spec if isinstance(spec, NamedSharding) else spec
        try:
            out[k] = from_partition_spec(spec, len(x.shape), tuple(axis_names))
        except ValueError as exc:
            raise ValueError(f"{what}, argument leaf {k} {x.shape}: {exc}") from exc
    return out


def auto_shard(fn: Callable | None = None, *, mesh: Mesh | AbstractMesh,
               cluster: Cluster | None = None, memory_budget: float | None = None,
               time_limit: float = 10.0, seeds=None, mesh_search: bool = False,
               in_shardings=None,
               keep_input_shardings: bool | None = None,
               static_argnums=None, static_argnames=None, donate_argnums=None,
               donate_argnames=None, cache_dir: str | None = None,
               while_trips: int = DEFAULT_WHILE_TRIPS, pipeline: Pipeline | bool | None = None):
    """Plan and run ``fn`` sharded over ``mesh``, called like ``jax.jit(fn)``. Usable as
    ``@auto_shard(mesh=...)``. On a ``jax.sharding.AbstractMesh`` (a shape and axis names,
    no devices: a cluster larger than this machine) the function plans only: ``plan``,
    ``input_shardings`` and ``use_plan`` work, and lowering or calling raises
    :class:`NeedsDevicesError`; the plan runs where a concrete mesh of the same shape
    adopts it (``use_plan``).

    ``cluster`` prices the plan (default: every mesh axis an H100 NVLink link, see
    :class:`shardc.Cluster`); ``memory_budget`` caps per-device bytes; ``time_limit`` is a
    wall-clock guard on the ILP stages of the search, in seconds (every stage normally runs
    to its end, so the plan is the same on every machine and under any load; a stage the
    guard cuts keeps its best plan and the plan's status says ``time-limit``; 0 runs
    coordinate descent alone). ``seeds`` are
    hand-written plans to start from, ``{name: in_shardings}`` (PartitionSpecs per dynamic
    argument, as for ``jax.jit``): the plan's predicted cost is never above theirs, and
    ``plan.explain()`` lists what each costs. ``mesh_search`` also plans the other logical
    views of the mesh's devices (:func:`shardc.tradeoff.views.views`: for ``(node=2, gpu=8)`` also
    ``(16,)``, ``(4, 4)`` and ``(8, 2)``, each axis priced at the links it crosses), runs
    the cheapest, and records each view's predicted step in ``plan.solver["mesh_search"]``;
    it multiplies planning time by the number of views (4 for 16 devices).

    ``in_shardings`` (as for ``jax.jit``: a PartitionSpec or None per dynamic positional
    argument, or per subtree) fixes those inputs' layouts; ``keep_input_shardings=True``
    fixes every argument that arrives placed on this mesh (a committed array, or a
    ``ShapeDtypeStruct`` with a sharding) to its placement; it is the default on a mesh
    with Explicit axes, where a placement is part of the argument's type (and results get
    the types ``jax.jit`` would give them). Otherwise a placed argument is moved to the
    plan's layout (logged once). ``static_argnums`` / ``static_argnames`` /
    ``donate_argnums`` / ``donate_argnames`` mean what they mean for ``jax.jit``.

    ``cache_dir`` (else ``$SHARDC_CACHE_DIR``) keeps plans on disk keyed by the program,
    its argument types, the mesh, the cluster, these options and the shardc version
    (:mod:`shardc.step.cache`): another process planning the same program loads the plan
    instead of solving. Plans are deterministic (see ``time_limit``), so the loaded plan is
    the one it would make.

    ``while_trips`` is how many iterations a ``lax.while_loop`` whose bounds are not
    static (a decode loop that stops at an end token) is planned for; loops with static
    bounds (``fori_loop``) are planned for their own count.

    ``pipeline``: a :class:`shardc.pipeline.Pipeline` runs the function's layer stacks,
    written with :func:`shardc.pipeline.layers` (a drop-in for ``jax.lax.scan``), as that
    pipeline over its mesh axis (:mod:`shardc.pipeline.lowering`), and the plan records it;
    ``False`` forbids pipelining; None (the default) leaves it to the planner: where the
    function has such a stack, the cheapest pipeline that saves 5% of the unpipelined step
    and fits ``memory_budget`` runs (:mod:`shardc.pipeline.choose`; ``plan.explain()``
    shows it, ``step.pipeline_choice(*args)`` says what was priced and why).
    """
    options = Options(cluster if cluster is not None else DEFAULT_CLUSTER, memory_budget,
                      time_limit, _named_seeds(seeds), mesh_search, in_shardings,
                      keep_input_shardings, cache_dir, while_trips, pipeline)

    def wrap(f):
        return AutoSharded(f, mesh, options, Convention.of(
            f, static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames))

    return wrap if fn is None else wrap(fn)


def pareto(fn: Callable, *args, mesh: Mesh, budgets: int = BUDGETS, **options) -> Frontier:
    """The time-memory frontier of ``fn`` on these arguments (arrays or ShapeDtypeStructs):
    ``auto_shard(fn, mesh=mesh, **options).pareto(*args)``. Keyword arguments of ``fn``
    go through ``auto_shard(...).pareto`` instead."""
    return auto_shard(fn, mesh=mesh, **options).pareto(*args, budgets=budgets)


def device_sweep(fn: Callable, *args, mesh: Mesh | AbstractMesh,
                 memory_budget: float | None = None, **options) -> DeviceSweep:
    """The best plan of ``fn`` on these arguments for each device count that divides
    ``mesh`` (:meth:`AutoSharded.device_sweep`): ``auto_shard(fn, mesh=mesh,
    **options).device_sweep(*args, memory_budget=memory_budget)``."""
    return auto_shard(fn, mesh=mesh, **options).device_sweep(*args, memory_budget=memory_budget)
