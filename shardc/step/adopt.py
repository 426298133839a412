"""Adopting a saved plan (``step.use_plan``): refused, with the difference named, when it was
made for another program or mesh; else the step's plan for those arguments."""

from __future__ import annotations

import math

from shardc.errors import PlanError
from shardc.plan.record import Plan, fingerprint
from shardc.report.explain import mesh_label
from shardc.runtime.multihost import agree
from shardc.step.calling import Call
from shardc.step.names import input_names
from shardc.step.signature import TracedCall

__all__ = ["difference", "use_plan"]


def use_plan(step, plan: Plan, *args, **kwargs) -> None:
    """:meth:`AutoSharded.use_plan <shardc.step.auto_shard.AutoSharded.use_plan>` of
    ``step``: refused with :func:`difference` named, else the step's plan."""
    call = step.convention.split(args, kwargs)
    key, tr = step._traced(call, plan.remat)
    want = fingerprint(tr.traced.graph)
    if plan.fingerprint != want:
        raise PlanError(f"the plan was made for a different program (fingerprint "
                        f"{plan.fingerprint}, this one is {want}): "
                        f"{difference(step, call, tr, plan)}; plan it again with "
                        "step.plan(...)")
    here = step.mesh.shape_tuple
    # with mesh search, a plan for any view of the same devices runs on that view
    ok = plan.mesh_axes == here or (step.options.mesh_search and
                                    math.prod(plan.axis_sizes) == step.mesh.size)
    if not ok:
        raise PlanError(f"the plan is for mesh {mesh_label(plan.mesh_axes)}, this "
                        f"function runs on {mesh_label(here)}")
    planned = {o.id for o in plan.ops}
    missing = [op for op in tr.traced.graph.ops if op.id not in planned]
    if missing:
        raise PlanError(f"the plan has no strategy for {missing[0]} (and "
                        f"{len(missing) - 1} more): it was edited or is damaged; plan "
                        "again")
    plan = agree(step._named(call, tr, plan))
    step._plans[key] = plan
    step._execs.pop(key, None)
    step._dispatch.pop(key, None)
    step._ahead.pop(key, None)  # compiled for the plans made before this one
    step._fast.clear()


def difference(step, call: Call, tr: TracedCall, plan: Plan) -> str:
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
    return (f"argument {input_names(step.fn, call)[k]} is {here[k]} here, "
            f"{plan.input_types[k]} in the plan{more}")
