"""``step.explain(*args)``: the plan's explanation (:meth:`shardc.Plan.explain`) straight
from the step, planned for the arguments if need be."""

from __future__ import annotations

import inspect

from shardc.errors import PlanError

__all__ = ["explain"]


def explain(step, *args, **kwargs) -> str:
    """What ``step.plan(*args, **kwargs).explain()`` returns: ``AutoSharded.explain``.

    Args:
        step: the :class:`~shardc.step.auto_shard.AutoSharded` step.
        *args: its positional arguments (arrays or ``ShapeDtypeStruct``s), as for a call;
            none (and no keyword ones): the plan the step already made, for one signature.
        **kwargs: its keyword arguments.

    Returns:
        The plan's explanation: every argument and result leaf's PartitionSpec, the per-op
        table and the costliest reshards (:meth:`shardc.Plan.explain`).

    Raises:
        PlanError: called with no arguments on a step that has no plan yet (and a function
            that needs arguments), or has plans for several signatures.
    """
    if args or kwargs or not step._plans and _takes_no_arguments(step.fn):
        return step.plan(*args, **kwargs).explain()
    plans = list(step._plans.values())
    name = getattr(step.fn, "__name__", "fn")
    if not plans:
        raise PlanError(f"step.explain() has no plan to explain: {name} has not been planned "
                        "or called yet. Pass its arguments, step.explain(*args) (arrays or "
                        "jax.ShapeDtypeStructs), or call the step first")
    if len(plans) > 1:
        raise PlanError(f"step.explain(): {name} has plans for {len(plans)} argument "
                        "signatures (shapes, dtypes or statics); pass the arguments of the "
                        "one to explain, step.explain(*args)")
    return plans[0].explain()


def _takes_no_arguments(fn) -> bool:
    """Whether ``fn`` can be called with no arguments (then ``explain()`` plans that call)."""
    try:
        inspect.signature(fn).bind()
    except (TypeError, ValueError):
        return False
    return True
