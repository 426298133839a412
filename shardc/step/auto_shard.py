"""``@shardc.auto_shard``: trace, plan, lower and run a JAX function on a mesh.

A drop-in for ``jax.jit``, called like it (static, donated and keyword arguments, weak
types). Tracing, planning and compiling are cached per abstract signature (the dynamic
arguments' tree, shapes, dtypes and weak types, the static values, the input layouts the
plan keeps); a steady-state call goes straight to its executable through ``jax.jit``'s
dispatch. A saved plan (``use_plan``) skips the solver. Arguments placed elsewhere than the
plan wants are moved (reported once), or kept with ``keep_input_shardings=True`` (or
``in_shardings=``): the plan is made around them. A ``with_sharding_constraint`` the user
wrote is a fixed layout of the plan; on a mesh with Explicit axes, results come back typed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from shardc.cost.cluster import DEFAULT_CLUSTER, Cluster
from shardc.ir.sbp import to_partition_spec
from shardc.ir.trace import DEFAULT_WHILE_TRIPS
from shardc.lower.control import explicit_axes
from shardc.lower.emit import HOST
from shardc.pipeline.runtime import check_axis
from shardc.pipeline.schedule import Pipeline
from shardc.plan.record import Plan
from shardc.solve.collector import gc_paused
from shardc.solve.ilp import DEFAULT_TIME_LIMIT
from shardc.step.adopt import use_plan
from shardc.step.ahead import jit_for, typed_leaves
from shardc.step.calling import (
    Call,
    Convention,
    Dispatch,
    Miss,
    dispatch_key,
    misplaced,
    place,
    placement,
)
from shardc.step.explaining import explain as explain_step
from shardc.step.margins import compare
from shardc.step.options import NeedsDevicesError, Options, auto_mesh, check_mesh
from shardc.step.pareto import frontier
from shardc.step.pipelining import choice_options
from shardc.step.planned import Planned
from shardc.step.ranking import program_key
from shardc.step.seeds import check_specs, named_seeds
from shardc.step.signature import (
    TracedCall,
)
from shardc.tradeoff.frontier import BUDGETS, Frontier
from shardc.tradeoff.sweep import DeviceSweep
from shardc.tradeoff.sweep import device_sweep as sweep_devices
from shardc.tradeoff.views import View

__all__ = ["AutoSharded", "auto_shard", "device_sweep", "pareto"]

log = logging.getLogger("shardc")


class AutoSharded(Planned):
    """The callable ``auto_shard`` returns: call it like ``jax.jit(fn)``.

    ``plan``, ``lower``, ``use_plan`` and the other methods take the same arguments as a
    call (arrays or ``ShapeDtypeStruct``s).
    """

    def __init__(self, fn: Callable, mesh: Mesh | AbstractMesh, options: Options,
                 convention: Convention):
        """Made by :func:`auto_shard`, which checks and records the options."""
        check_mesh(mesh)
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
        self._traces: dict[Any, TracedCall] = {}
        self._plans: dict[Any, Plan] = {}
        self._execs: dict[Any, Callable] = {}
        self._dispatch: dict[Any, Dispatch] = {}
        #: signature key -> {program key: Dispatch}: the executables planning compiled to
        #: check its plans (:func:`shardc.step.ahead.compile_ahead`); the signature's first
        #: call runs the one of its plan and drops the others
        self._ahead: dict[Any, dict[tuple, Dispatch]] = {}
        #: calls' :func:`~shardc.step.calling.dispatch_key` -> the Dispatch the last such call ran
        self._fast: dict[Any, Dispatch] = {}
        self._moved: set = set()
        check_specs(options.in_shardings, self.mesh)
        functools.update_wrapper(self, fn)

    # ---- execution -------------------------------------------------------------------------
    def mesh_for(self, plan: Plan) -> Mesh | AbstractMesh:
        """The mesh ``plan`` runs on.

        Args:
            plan: A plan of this step.

        Returns:
            This function's mesh (its Auto version), or the view of its devices the mesh
            search chose (``plan.mesh_axes``); abstract when this function's mesh is.
        """
        return View(plan.axis_sizes, plan.axis_names, plan.cluster).mesh(self.mesh)

    def _out_mesh(self, tr: TracedCall, plan: Plan) -> Mesh:
        """Where results are placed.

        Where the plan runs on this function's mesh: the user's mesh (with its axis types)
        where its results are typed (``tr.typed``), else its Auto version (the same mesh
        where it has no Explicit axes), which types no result. Else the view of its devices
        the plan runs on.
        """
        if plan.mesh_axes != self.mesh.shape_tuple:
            return self.mesh_for(plan)
        return self.user_mesh if tr.typed else self.mesh

    def _in_shardings(self, tr: TracedCall, plan: Plan) -> list[NamedSharding]:
        mesh = self._out_mesh(tr, plan)
        return [NamedSharding(mesh, to_partition_spec(nd, v.ndim, mesh.axis_names),
                              memory_kind=HOST if k in plan.offloaded else None)
                for k, (nd, v) in enumerate(zip(plan.inputs, tr.traced.graph.inputs))]

    def _out_shardings(self, tr: TracedCall, plan: Plan) -> Any:
        """The result pytree's shardings under ``plan`` (of ``tr``'s program).

        On the mesh :meth:`_out_mesh` names: the user's, with its axis types, where
        ``jax.jit`` types the results on it.
        """
        mesh = self._out_mesh(tr, plan)
        return jax.tree.unflatten(tr.traced.out_tree, [
            NamedSharding(mesh, to_partition_spec(nd, v.ndim, mesh.axis_names),
                          memory_kind=HOST if j in plan.offloaded_outputs else None)
            for j, (nd, v) in enumerate(zip(plan.outputs, tr.traced.graph.outputs))])

    def _exec(self, call: Call) -> tuple[Callable, list[NamedSharding], Any]:
        if self.abstract:
            raise NeedsDevicesError(self.mesh)
        key, tr, plan = self._plan(call)
        jitted = self._execs.get(key)
        if jitted is None:
            jitted = self._execs[key] = jit_for(self, call, tr, plan)
        return jitted, self._in_shardings(tr, plan), key

    def _call(self, args: tuple, kwargs: dict):
        """The full path of a call.

        Its signature's plan and executable (traced, planned and compiled on its first
        call), placed arguments moved where the plan wants them; the executable's
        :class:`Dispatch` becomes the fast path of calls like it.
        """
        call = self.convention.split(args, kwargs)
        jitted, shardings, key = self._exec(call)
        self._report_moves(call, shardings, key)
        placed = call.unflatten(place(call.leaves, shardings))
        with gc_paused():  # the first call of a signature traces and compiles
            dispatch = self._dispatch.get(key)
            if dispatch is not None:
                try:
                    out = dispatch(*placed)
                except Miss:  # arguments typed otherwise than its first call's (tracers)
                    dispatch = None
            if dispatch is None:
                _, tr, plan = self._plan(call)
                dispatch = self._ahead.pop(key, {}).get(program_key(plan)) or \
                    Dispatch.of(jitted, call, shardings, self._out_shardings(tr, plan))
                self._dispatch[key] = dispatch
                out = dispatch(*placed)
        self._fast[dispatch_key(*self.convention.dynamic(args, kwargs))] = dispatch
        return out

    def _report_moves(self, call: Call, shardings: list[NamedSharding], key) -> None:
        """Log, once per argument and signature, a placed argument the plan moves.

        Not one only given the plan's type (an earlier call's untyped result).
        """
        fresh = [k for k in misplaced(call.leaves, shardings) if (key, k) not in self._moved
                 and not placement(call.leaves[k]).is_equivalent_to(
                     shardings[k], call.leaves[k].ndim)]
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
        """The plan for these arguments (arrays or ShapeDtypeStructs); nothing runs.

        Args:
            *args: As for a call.
            **kwargs: As for a call.

        Returns:
            The :class:`Plan`, made on the first request per signature and kept.
        """
        call = self.convention.split(args, kwargs)
        key, tr, plan = self._plan(call)
        if not self.abstract:  # on an AbstractMesh nothing runs, so nothing is moved
            self._report_moves(call, self._in_shardings(tr, plan), key)
        return plan

    explain = explain_step  # step.explain(*args): plan.explain() for these arguments

    def pareto(self, *args, budgets: int = BUDGETS, **kwargs) -> Frontier:
        """The time-memory frontier for these arguments (:mod:`shardc.tradeoff.frontier`).

        Plans at no memory budget, at the smallest one a plan was found for, at ``budgets``
        budgets between and in the gaps they leave, recomputing forward segments'
        activations or keeping state in host memory as the budget needs, and the generic
        layouts' plans (:mod:`shardc.tradeoff.baselines`); the non-dominated ones, each a
        plan ``use_plan`` runs. Nothing is cached:
        ``step.use_plan(frontier.pick(budget), *args)`` adopts one.

        Args:
            *args: As for a call.
            budgets: Fixed budgets searched besides the gaps.
            **kwargs: As for a call.

        Returns:
            The :class:`Frontier`.
        """
        return frontier(self, *args, budgets=budgets, **kwargs)

    def margins(self, *args, **kwargs):
        """The plan for these arguments beside generic layouts.

        Data-parallel, FSDP, Megatron and DP x TP (:mod:`shardc.tradeoff.baselines`): on a
        mesh with devices each compiled and priced from its HLO, the plan's program too; on
        an abstract mesh estimated on the plan's cost model.
        ``plan.explain(margins=step.margins(*args))`` prints them.

        Args:
            *args: As for a call.
            **kwargs: As for a call.

        Returns:
            The margins, one per layout (:func:`shardc.step.margins.compare`).
        """
        return compare(self, *args, **kwargs)

    def device_sweep(self, *args, memory_budget: float | None = None, **kwargs
                     ) -> DeviceSweep:
        """The best plan for these arguments on each device count that divides the mesh.

        Counts from :func:`shardc.tradeoff.sweep.device_counts` (the first devices, inner
        axes filled first): how many devices the program needs, and what each more buys.
        Each count is planned on an AbstractMesh of its sub-mesh, its axes priced at the
        links they have in the whole mesh, with this function's options but its seeds and
        kept layouts (written for the whole mesh); a count where no plan fits records the
        leanest plan's peak. Nothing is cached or run:
        ``step.use_plan(count.plan, *args)`` adopts the whole mesh's.

        Args:
            *args: As for a call.
            memory_budget: Bytes per device; None: this function's budget, else the
                cluster's ``device_memory``.
            **kwargs: As for a call.

        Returns:
            The :class:`DeviceSweep`.
        """
        return sweep_devices(self, *args, memory_budget=memory_budget, **kwargs)

    def pipeline_choice(self, *args, tensor: bool | None = None, **kwargs):
        """The pipeline the planner chooses for these arguments, priced against this plan.

        With ``mesh_search``, over the stage axes of every view of the devices.

        Args:
            *args: As for a call.
            tensor: Price the stage plans with tensor parallelism inside a stage; None:
                where the planner does, on a mesh with devices, which checks such a choice
                against its compiled program; True on an AbstractMesh prices what its plan
                leaves out.
            **kwargs: As for a call.

        Returns:
            A :class:`shardc.pipeline.choose.Choice` (none with ``pipeline=False``).
        """
        from shardc.pipeline.choose import best_pipeline

        _, tr, plan = self._plan(self.convention.split(args, kwargs))
        base = plan if plan.pipeline is None else None  # a pipelined plan's step is not one
        options = dataclasses.replace(
            choice_options(self, tr, self.options.mesh_search),
            tensor=not self.abstract if tensor is None else tensor)
        return best_pipeline(tr.traced.graph, plan.axis_sizes, plan.axis_names, plan.cluster,
                             ties=tr.ties, resident=tr.resident, base=base, options=options)

    def input_shardings(self, *args, **kwargs) -> tuple[tuple, dict]:
        """The shardings the plan gives the dynamic arguments (static ones left out).

        Restore a checkpoint into them (:class:`shardc.runtime.checkpoint.Checkpoints`) or
        assemble a batch in them (:func:`shardc.runtime.multihost.global_batch`) and the
        step moves nothing.

        Args:
            *args: As for a call; ShapeDtypeStructs are fine.
            **kwargs: As for a call.

        Returns:
            ``(args, kwargs)`` pytrees of ``NamedSharding``, like ``jax.jit``'s
            ``Compiled.input_shardings`` (on an AbstractMesh, shardings of it).
        """
        call = self.convention.split(args, kwargs)
        _, tr, plan = self._plan(call)
        return call.unflatten(self._in_shardings(tr, plan))

    def use_plan(self, plan: Plan, *args, **kwargs) -> None:
        """Adopt a saved plan (``Plan.from_json``) for these arguments.

        Later calls trace and compile, but do not solve. One made on an AbstractMesh runs
        on a concrete mesh of the same shape and names.

        Args:
            plan: The plan.
            *args: As for a call.
            **kwargs: As for a call.

        Raises:
            PlanMismatchError: The plan was made for another program or mesh.
        """
        return use_plan(self, plan, *args, **kwargs)

    def lower(self, *args, **kwargs):
        """The planned program, lowered.

        Args:
            *args: As for a call; ShapeDtypeStructs are fine.
            **kwargs: As for a call.

        Returns:
            ``jax.stages.Lowered``; its compiled form is called with the dynamic
            arguments, as ``jax.jit``'s is.

        Raises:
            NeedsDevicesError: On an AbstractMesh.
        """
        call = self.convention.split(args, kwargs)
        jitted, shardings, key = self._exec(call)
        self._report_moves(call, shardings, key)
        dyn_args, dyn_kwargs = call.unflatten(typed_leaves(call, shardings))
        with gc_paused():
            return jitted.lower(*dyn_args, **dyn_kwargs)

    def __call__(self, *args, **kwargs):
        """Run the step, as ``jax.jit(fn)(*args, **kwargs)`` would.

        A call goes straight to the executable of the last call with its statics and
        argument names through ``jax.jit``'s dispatch, which checks the arguments' pytree,
        types and placements in C++; a call that executable was not made for takes the full
        path (:meth:`_call`).
        """
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


def auto_shard(fn: Callable | None = None, *, mesh: Mesh | AbstractMesh,
               cluster: Cluster | None = None, memory_budget: float | None = None,
               time_limit: float = DEFAULT_TIME_LIMIT, seeds=None, mesh_search: bool = False,
               in_shardings=None, keep_input_shardings: bool | None = None,
               static_argnums=None, static_argnames=None, donate_argnums=None,
               donate_argnames=None, cache_dir: str | None = None,
               while_trips: int = DEFAULT_WHILE_TRIPS, pipeline: Pipeline | bool | None = None,
               rank_compiled: int = 0, offload: bool = True, context_parallel: bool = True):
    """Plan and run ``fn`` sharded over ``mesh``, called like ``jax.jit(fn)``.

    Usable as ``@auto_shard(mesh=...)``. The search runs to its end, so the plan is the same
    on every machine and under any load.

    Args:
        fn: The function; None returns a decorator.
        mesh: The mesh. An ``AbstractMesh`` plans only (lowering or calling raises
            :class:`NeedsDevicesError`); a concrete mesh of its shape runs it (``use_plan``).
        cluster: Prices the plan; None: every axis an H100 NVLink link.
        memory_budget: Bytes per device a plan may hold; None: no budget.
        time_limit: Seconds, a wall-clock guard on each ILP stage (a stage it cuts keeps
            its best plan, status ``time-limit``); 0 runs coordinate descent alone.
        seeds: Hand-written plans to start from, ``{name: in_shardings}``: the plan is
            never predicted slower, and ``plan.explain()`` lists each one's cost.
        mesh_search: Also plan the other logical views of the devices
            (:func:`shardc.tradeoff.views.views`) and run the cheapest.
        in_shardings: As for ``jax.jit``: fixes those inputs' layouts.
        keep_input_shardings: Fix every argument placed on this mesh to its placement;
            None: True on a mesh with Explicit axes (else such arguments are moved).
        static_argnums: As for ``jax.jit``.
        static_argnames: As for ``jax.jit``.
        donate_argnums: As for ``jax.jit``.
        donate_argnames: As for ``jax.jit``.
        cache_dir: Keep plans on disk, keyed by the program, argument types, mesh, cluster,
            options and shardc version; None: ``$SHARDC_CACHE_DIR`` if set.
        while_trips: Iterations a ``lax.while_loop`` without static bounds is planned for.
        pipeline: A :class:`shardc.pipeline.Pipeline` runs the :func:`shardc.pipeline.layers`
            stacks as that pipeline; False: never; None: the planner's choice
            (:mod:`shardc.pipeline.choose`).
        rank_compiled: With ``Cluster(overlap=True)``, compile this many of the best
            candidates and keep the fastest compiled one; 0: the estimate alone.
        offload: Where the budget binds, state may live in host memory between steps.
        context_parallel: Attention may be split along its sequence (its keys and values
            all-gathered, or converted to a split over the heads); False keeps every
            attention's sequence whole (:func:`shardc.plan.attention.sequence_dims`).

    Returns:
        An :class:`AutoSharded` step, or a decorator making one when ``fn`` is None.

    Raises:
        TypeError: For a ``pipeline`` that is not a Pipeline, False or None.
        ValueError: For an option out of its range (named in the message).
    """
    options = Options(cluster=cluster if cluster is not None else DEFAULT_CLUSTER,
                      memory_budget=memory_budget, time_limit=time_limit,
                      seeds=named_seeds(seeds), mesh_search=mesh_search,
                      in_shardings=in_shardings, keep_input_shardings=keep_input_shardings,
                      cache_dir=cache_dir, while_trips=while_trips, pipeline=pipeline,
                      rank_compiled=rank_compiled, offload=offload,
                      context_parallel=context_parallel)

    def wrap(f):
        return AutoSharded(f, mesh, options, Convention.of(
            f, static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames))

    return wrap if fn is None else wrap(fn)


def pareto(fn: Callable, *args, mesh: Mesh, budgets: int = BUDGETS, **options) -> Frontier:
    """The time-memory frontier of ``fn`` on these arguments.

    Args:
        fn: The function; keyword arguments go through ``auto_shard(...).pareto``.
        *args: Its positional arguments (arrays or ShapeDtypeStructs).
        mesh: The mesh to plan on.
        budgets: Fixed budgets searched besides the gaps.
        **options: :func:`auto_shard`'s options.

    Returns:
        ``auto_shard(fn, mesh=mesh, **options).pareto(*args)``: the :class:`Frontier`.
    """
    return auto_shard(fn, mesh=mesh, **options).pareto(*args, budgets=budgets)


def device_sweep(fn: Callable, *args, mesh: Mesh | AbstractMesh,
                 memory_budget: float | None = None, **options) -> DeviceSweep:
    """The best plan of ``fn`` on these arguments for each device count that divides ``mesh``.

    Args:
        fn: The function.
        *args: Its positional arguments (arrays or ShapeDtypeStructs).
        mesh: The mesh (or AbstractMesh) whose device counts are swept.
        memory_budget: Bytes per device; None: the options' budget, else device memory.
        **options: :func:`auto_shard`'s options.

    Returns:
        ``auto_shard(fn, mesh=mesh, **options).device_sweep(*args)``: the DeviceSweep.
    """
    return auto_shard(fn, mesh=mesh, **options).device_sweep(*args, memory_budget=memory_budget)
