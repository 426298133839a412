"""``@shardc.auto_shard``: trace, plan, lower and run a JAX function on a mesh.

Plans are cached per abstract signature (tree structure, shapes and dtypes of the dynamic
arguments, values of the static ones), so a second call with the same shapes re-uses the
plan and the compiled executable.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from shardc.cost.cluster import DEFAULT_CLUSTER, Cluster
from shardc.ir.sbp import NdSbp, from_partition_spec
from shardc.ir.trace import Traced, trace
from shardc.lower.emit import jit_plan
from shardc.plan import Plan, assemble, fingerprint
from shardc.solve.search import MemoryBudgetError, plan_graph
from shardc.views import View, views


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axes with every axis Auto (what sharding constraints need)."""
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct((), jax.numpy.result_type(x))


def tie_outputs(in_tree, out_tree, graph=None) -> list[tuple[int, int]]:
    """(flat output, flat input) pairs of a step whose output is, or holds, a pytree shaped
    like one of its arguments (``(state, batch) -> (new_state, loss)``): the new state should
    be laid out as the state it replaces. With ``graph``, only leaves of equal shape and dtype
    are tied."""
    ins = in_tree.children()
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


@dataclass
class _Entry:
    traced: Traced
    plan: Plan
    ties: list
    jitted: Callable | None = None


class AutoSharded:
    """The callable ``auto_shard`` returns. ``plan``/``lower`` accept ShapeDtypeStructs."""

    def __init__(self, fn: Callable, mesh: Mesh, cluster: Cluster | None, memory_budget,
                 donate_argnums, static_argnums, time_limit: float, seeds=None,
                 mesh_search: bool = False):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"auto_shard needs a jax.sharding.Mesh, got {type(mesh).__name__}; "
                            "make one with jax.make_mesh((2, 4), ('node', 'gpu'), "
                            "axis_types=(AxisType.Auto,) * 2)")
        self.fn = fn
        self.mesh = auto_mesh(mesh)
        self.cluster = cluster if cluster is not None else DEFAULT_CLUSTER
        self.cluster.check_axes(self.mesh.axis_names)
        self.memory_budget = memory_budget
        self.static_argnums = tuple(sorted(_norm(static_argnums)))
        self.donate_argnums = tuple(_norm(donate_argnums))
        self.time_limit = time_limit
        self.seeds = _named_seeds(seeds)
        self.mesh_search = mesh_search
        self._cache: dict[Any, _Entry] = {}
        functools.update_wrapper(self, fn)

    # ---- the plan cache ------------------------------------------------------------------------
    def _split(self, args: Sequence) -> tuple[tuple, tuple]:
        for i in self.static_argnums:
            if i >= len(args):
                raise TypeError(f"static_argnums names argument {i} but only {len(args)} given")
        static = tuple(args[i] for i in self.static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return static, dynamic

    def _entry(self, args: Sequence) -> _Entry:
        static, dynamic = self._split(args)
        abstract = jax.tree.map(_abstract, dynamic)
        leaves, tree = jax.tree.flatten(abstract)
        key = (tree, tuple((x.shape, str(x.dtype)) for x in leaves), static)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._plan(static, abstract)
            self._cache[key] = entry
        return entry

    def _bound(self, static: tuple) -> Callable:
        def bound(*dynamic):
            full, d, s = [], iter(dynamic), iter(static)
            for i in range(len(dynamic) + len(static)):
                full.append(next(s) if i in self.static_argnums else next(d))
            return self.fn(*full)
        return bound

    def _plan(self, static: tuple, abstract: tuple) -> _Entry:
        t0 = time.perf_counter()
        traced = trace(self._bound(static), *abstract)
        t1 = time.perf_counter()
        ties = tie_outputs(traced.in_tree, traced.out_tree, traced.graph)
        shape, names = self.mesh.devices.shape, tuple(self.mesh.axis_names)
        seeds = {name: seed_layouts(name, spec, abstract, names)
                 for name, spec in self.seeds.items()}
        candidates = views(shape, names, self.cluster) if self.mesh_search else \
            [View(shape, names, self.cluster)]
        best, tried, failure = None, [], None
        for view in candidates:
            t = time.perf_counter()
            try:
                cg, sol = plan_graph(traced.graph, view.shape, view.names, view.cluster,
                                     ties=ties, memory_budget=self.memory_budget,
                                     time_limit=self.time_limit,
                                     seeds=seeds if view.names == names else None)
            except MemoryBudgetError as exc:
                if len(candidates) == 1:
                    raise
                failure = failure or exc
                tried.append({"mesh": view.label, "predicted_s": None, "plan_s":
                              time.perf_counter() - t, "error": str(exc)})
                continue
            solver = {"status": sol.status, "objective": sol.objective, "trace_s": t1 - t0,
                      **sol.stats}
            plan = assemble(traced.graph, cg, sol.choice, ties, solver)
            tried.append({"mesh": view.label, "predicted_s": plan.predicted.step_time,
                          "plan_s": time.perf_counter() - t})
            if best is None or plan.predicted.step_time < best.predicted.step_time:
                best = plan
        if best is None:
            raise failure
        best.solver["plan_s"] = time.perf_counter() - t0
        if self.mesh_search:
            best.solver["mesh_search"] = tried
        return _Entry(traced, best, ties)

    # ---- public surface ------------------------------------------------------------------------
    def plan(self, *args) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStructs); nothing is executed."""
        return self._entry(args).plan

    def use_plan(self, plan: Plan, *args) -> None:
        """Adopt a saved plan (``Plan.from_json``) for these argument shapes."""
        entry = self._entry(args)
        if plan.fingerprint != fingerprint(entry.traced.graph):
            raise ValueError("the plan was made for a different program (fingerprint "
                             f"{plan.fingerprint} != {fingerprint(entry.traced.graph)}); re-plan")
        if math.prod(plan.axis_sizes) != self.mesh.devices.size or (
                not self.mesh_search and plan.mesh_axes != tuple(
                    zip(self.mesh.axis_names, self.mesh.devices.shape))):
            raise ValueError(f"the plan is for mesh {plan.mesh_axes}, this function runs on "
                             f"{tuple(zip(self.mesh.axis_names, self.mesh.devices.shape))}")
        entry.plan, entry.jitted = plan, None

    def _jitted(self, args: Sequence) -> Callable:
        entry = self._entry(args)
        if entry.jitted is None:
            donate = tuple(sum(1 for j in range(i) if j not in self.static_argnums)
                           for i in self.donate_argnums if i not in self.static_argnums)
            entry.jitted = jit_plan(entry.traced.graph, entry.plan, self.mesh_for(entry.plan),
                                    entry.traced.in_tree, entry.traced.out_tree,
                                    donate_argnums=donate)
        return entry.jitted

    def mesh_for(self, plan: Plan) -> Mesh:
        """The mesh ``plan`` runs on: this function's mesh, or the view of its devices the
        mesh search chose (``plan.mesh_axes``)."""
        names, sizes = plan.axis_names, plan.axis_sizes
        return View(sizes, names, plan.cluster).mesh(self.mesh)

    def lower(self, *args):
        """``jax.stages.Lowered`` of the planned program (ShapeDtypeStructs are fine)."""
        _, dynamic = self._split(args)
        return self._jitted(args).lower(*dynamic)

    def __call__(self, *args):
        _, dynamic = self._split(args)
        return self._jitted(args)(*dynamic)


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


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


def seed_layouts(name: str, specs, abstract: tuple, axis_names) -> dict[int, NdSbp]:
    """Graph-input layouts of a hand-written plan: ``specs`` holds a PartitionSpec (or
    NamedSharding, or None: shardc's choice) for every dynamic argument, or for a prefix of
    their pytree (one spec for a whole subtree), like ``jax.jit``'s ``in_shardings``."""
    specs = tuple(specs) if isinstance(specs, list) else specs
    if not isinstance(specs, tuple) or len(specs) != len(abstract):
        raise ValueError(f"seed {name!r}: give one entry per dynamic argument "
                         f"({len(abstract)}), as a tuple, like jax.jit's in_shardings")
    try:
        per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs,
                                abstract, is_leaf=_is_spec_leaf)
    except ValueError as exc:
        raise ValueError(f"seed {name!r} does not match the arguments' pytree: {exc}") from exc
    leaves = jax.tree.leaves(per_leaf, is_leaf=_is_spec_leaf)
    out: dict[int, NdSbp] = {}
    for k, (spec, x) in enumerate(zip(leaves, jax.tree.leaves(abstract), strict=True)):
        if spec is None:
            continue
        spec = spec.spec if isinstance(spec, NamedSharding) else spec
        try:
            out[k] = from_partition_spec(spec, len(x.shape), tuple(axis_names))
        except ValueError as exc:
            raise ValueError(f"seed {name!r}, argument leaf {k} {x.shape}: {exc}") from exc
    return out


def _norm(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, int) else tuple(x)


def auto_shard(fn: Callable | None = None, *, mesh: Mesh, cluster: Cluster | None = None,
               memory_budget: float | None = None, donate_argnums=(), static_argnums=(),
               time_limit: float = 10.0, seeds=None, mesh_search: bool = False):
    """Plan and run ``fn`` sharded over ``mesh``. Usable as ``@auto_shard(mesh=...)``.

    ``cluster`` prices the plan (default: every mesh axis an H100 NVLink link, see
    :class:`shardc.Cluster`); ``memory_budget`` caps per-device bytes; ``time_limit`` bounds
    the ILP in seconds (its best incumbent is used, and the plan says so). ``seeds`` are
    hand-written plans to start from, ``{name: in_shardings}`` (PartitionSpecs per dynamic
    argument, as for ``jax.jit``): the plan's predicted cost is never above theirs, and
    ``plan.explain()`` lists what each costs. ``mesh_search`` also plans the other logical
    views of the mesh's devices (:func:`shardc.views.views`: for ``(node=2, gpu=8)`` also
    ``(16,)``, ``(4, 4)`` and ``(8, 2)``, each axis priced at the links it crosses), runs
    the cheapest, and records each view's predicted step in ``plan.solver["mesh_search"]``;
    it multiplies planning time by the number of views (4 for 16 devices).
    """
    def wrap(f):
        return AutoSharded(f, mesh, cluster, memory_budget, donate_argnums, static_argnums,
                           time_limit, seeds, mesh_search)
    return wrap if fn is None else wrap(fn)
