"""Tracing and planning of an ``auto_shard`` step, cached per abstract signature.

:class:`Planned` is the part of :class:`shardc.step.auto_shard.AutoSharded` that turns a
call into its traced program and plan: traced once per signature (the dynamic arguments'
tree, shapes, dtypes and weak types, the static values, the layouts kept), planned once
(from the disk cache where one is set), every process of a multi-host job running process
0's plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from shardc.ir.trace import Traced, rematerialized, trace
from shardc.lower.control import needs_devices
from shardc.pipeline.lowering import NoStackError
from shardc.pipeline.routing import scans_as_layers
from shardc.pipeline.schedule import Pipeline
from shardc.pipeline.stack import has_stack
from shardc.plan.attention import sequence_dims
from shardc.plan.record import Plan, fingerprint
from shardc.rules.fixed import on_mesh
from shardc.runtime.multihost import agree
from shardc.solve.collector import gc_paused
from shardc.solve.fixed import Fixed
from shardc.step.cache import PlanCache
from shardc.step.calling import Call, abstract_leaf
from shardc.step.names import input_names, output_names
from shardc.step.options import platform_of
from shardc.step.pipelining import pipelined
from shardc.step.signature import (
    TracedCall,
    fixed_layouts,
    kept_layouts,
    resident_inputs,
    tie_outputs,
)
from shardc.step.solving import problem

__all__ = ["Planned"]

log = logging.getLogger("shardc")


class Planned:
    """Traces and plans of a step, per abstract signature.

    The subclass sets ``fn``, ``mesh``, ``abstract``, ``keep``, ``options`` and the
    ``_traces`` / ``_plans`` caches (:class:`shardc.step.auto_shard.AutoSharded`).
    """

    def _key(self, call: Call) -> tuple:
        avals = tuple((a.shape, str(a.dtype), a.weak_type) for a in call.avals(self.fn))
        kept = tuple(sorted(kept_layouts(self, call).items())) if self.keep else ()
        return call.tree, avals, call.statics, kept

    def _traced(self, call: Call, remat: tuple[int, ...] = ()) -> tuple[Any, TracedCall]:
        """The call's signature key and its traced program; with ``remat``, the program
        that recomputes those forward segments (:mod:`shardc.ir.remat`)."""
        key = self._key(call)
        if remat:
            rkey = (key, tuple(sorted(set(remat))))
            hit = self._traces.get(rkey)
            if hit is None:
                base = self._traced(call)[1]
                traced = self._own(rematerialized(base.traced, remat))
                hit = dataclasses.replace(base, traced=traced,
                                          fixed=self._restricted(base.fixed, traced.graph))
                self._traces[rkey] = hit
            return key, hit
        hit = self._traces.get(key)
        if hit is None:
            t0 = time.perf_counter()
            # unless pipelines are forbidden, the function's plain scans over layers are
            # stacks too (a pipeline asked for runs them; else the planner may)
            pipe = self.options.pipeline
            routing = contextlib.nullcontext() if pipe is False else \
                scans_as_layers(asked=isinstance(pipe, Pipeline))
            with gc_paused(), routing:
                traced = self._own(trace(call.function(self.fn),
                                         *map(abstract_leaf, call.leaves),
                                         platform=platform_of(self.mesh),
                                         while_trips=self.options.while_trips))
            ties = tie_outputs(call.arg_trees(), traced.out_tree, traced.graph)
            fixed, typed = fixed_layouts(self, call)
            hit = TracedCall(traced, tuple(ties), self._restricted(fixed, traced.graph),
                             resident_inputs(call.arg_trees(), ties),
                             typed=typed and not needs_devices(traced.jaxpr.jaxpr))
            self._traces[key] = hit
            log.debug("shardc: traced %s in %.2f s", getattr(self.fn, "__name__", "fn"),
                      time.perf_counter() - t0)
        return key, hit

    def _restricted(self, fixed: Fixed, graph) -> Fixed:
        """``fixed`` with the dims the options forbid splitting in ``graph``: every
        attention's sequence under ``context_parallel=False``."""
        whole = {} if self.options.context_parallel else sequence_dims(graph)
        return dataclasses.replace(fixed, whole=whole)

    def _own(self, traced: Traced) -> Traced:
        """``traced`` with the user's constraints on another mesh of these devices read on
        this one (:func:`shardc.rules.fixed.on_mesh`)."""
        if not self.abstract:
            on_mesh(traced.graph.ops, self.mesh)
        return traced

    @gc_paused()
    def _plan(self, call: Call) -> tuple[Any, TracedCall, Plan]:
        """The call's key, its plan, and the program the plan runs (the traced one, or the
        one recomputing the segments the plan chose)."""
        key, tr = self._traced(call)
        plan = self._plans.get(key)
        if plan is None:
            pipe = self.options.pipeline  # asked for: the plan runs it
            if isinstance(pipe, Pipeline) and not has_stack(tr.traced.jaxpr):
                raise NoStackError(pipe)  # when planned, not when first run
            plan = self._compatible(key, tr.fixed) or self._cached_or_solved(tr, call)
            if isinstance(pipe, Pipeline) and plan.pipeline != pipe:
                plan = dataclasses.replace(plan, pipeline=pipe)
            # under jax.distributed: every process runs the same plan (process 0's)
            plan = agree(self._named(call, tr, plan))
            self._plans[key] = plan
        if plan.remat:
            _, tr = self._traced(call, plan.remat)
        return key, tr, plan

    def _named(self, call: Call, tr: TracedCall, plan: Plan) -> Plan:
        """``plan`` naming this call's argument and result leaves (``plan.explain()``)."""
        return plan.named(input_names(self.fn, call), output_names(tr.traced.out_tree))

    def _cached_or_solved(self, tr: TracedCall, call: Call) -> Plan:
        """The plan from the disk cache (``cache_dir``), else solved and stored there."""
        candidates, seeds = problem(self, call, tr)
        store = PlanCache.at(self.options.cache_dir)
        if store is None:
            return pipelined(self, call, tr, candidates, seeds)
        program = fingerprint(tr.traced.graph)
        flat = {f"{view.label}: {name}": layouts
                for view, named in zip(candidates, seeds) for name, layouts in named.items()}
        key = store.key(program, tr.traced.graph.inputs, self.mesh, self.options, flat,
                        tr.ties, tr.fixed, tr.resident)
        plan = store.load(key, lambda p: fingerprint(self._traced(call, p.remat)[1].traced.graph))
        if plan is None:
            plan = pipelined(self, call, tr, candidates, seeds)
            store.save(key, plan)
        return plan

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
