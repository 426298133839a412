"""Compiling a plan's executable before the step's first call: a plan made under a memory
budget is compiled to read its peak (:func:`shardc.step.solving.compiled_within`), a
pipeline leaving axes to XLA to check its communication (:mod:`shardc.step.pipelining`),
and the first call of its signature runs that compile instead of making its own (the
step keeps it, :class:`shardc.step.auto_shard.AutoSharded`). Each function takes the
step for its meshes and traced programs."""

from __future__ import annotations

import logging

from jax import ShapeDtypeStruct
from jax.sharding import NamedSharding
from jax.stages import Compiled

from shardc.inspect.hlo import compiled_peak_memory
from shardc.lower.program import jit_plan
from shardc.plan.record import Plan
from shardc.solve.collector import gc_paused
from shardc.step.calling import Call, Dispatch, abstract_leaf, passed_placed
from shardc.step.ranking import compile_lowered, program_key

log = logging.getLogger("shardc")

#: compiles kept per signature for its first call: the pipeline checks compile two
#: choices (tensor parallelism inside the stages, then without) and may keep the first
KEPT_AHEAD = 2

__all__ = ["compile_ahead", "jit_for", "peak_ahead", "typed_leaves"]


def compile_ahead(step, call: Call, plan: Plan) -> Compiled | None:
    """Compile the executable that runs ``plan`` for calls like ``call``, as their first
    call would (the :class:`Dispatch` of the planned program, placed and donated alike),
    and keep it in ``step._ahead`` beside the last one compiled for the signature
    (:data:`KEPT_AHEAD`): its first call runs the one of the plan it runs.

    Returns:
        The compiled program; None where it does not compile
        (the error surfaces where it runs).
    """
    key, tr = step._traced(call, plan.remat)
    shardings = step._in_shardings(tr, plan)
    jitted = jit_for(step, call, tr, plan)
    dispatch = Dispatch.of(jitted, call, shardings, step._out_shardings(tr, plan))
    args, kwargs = call.unflatten(typed_leaves(call, shardings, placed_only=True))
    try:
        with gc_paused():
            compiled = compile_lowered(dispatch.jitted.lower(
                *args, *(kwargs[k] for k in dispatch.kw_names)))
    except Exception as exc:  # noqa: BLE001 - jax's compile errors have no common type
        log.info("shardc: the plan's check could not compile it: %s", exc)
        return None
    kept, program = step._ahead.setdefault(key, {}), program_key(plan)
    kept.pop(program, None)  # the newest last
    kept[program] = dispatch
    while len(kept) > KEPT_AHEAD:  # the oldest compile goes
        del kept[next(iter(kept))]
    return compiled


def peak_ahead(step, call: Call, plan: Plan) -> float | None:
    """:func:`compile_ahead`, and the compiled peak, bytes per device (``memory_analysis()``:
    arguments + outputs + temporaries - aliased); None where the backend reports none, or
    the program does not compile."""
    compiled = compile_ahead(step, call, plan)
    return None if compiled is None else compiled_peak_memory(compiled)


def jit_for(step, call: Call, tr, plan: Plan):
    """The ``jax.jit`` of ``tr``'s traced program that runs ``plan`` for calls like
    ``call`` (their tree, donated arguments), on the step's meshes for the plan."""
    return jit_plan(tr.traced, plan, step.mesh_for(plan), step._out_mesh(tr, plan), call.tree,
                    tr.traced.out_tree, donate_argnums=call.donate_argnums,
                    donate_argnames=call.donate_argnames)


def typed_leaves(call: Call, shardings: list[NamedSharding], placed_only: bool = False
                 ) -> list:
    """The call's leaves as ShapeDtypeStructs placed by ``shardings`` (what a lowering
    takes); leaves that are no arrays as they are. ``placed_only``: only the leaves a call
    passes placed (:func:`~shardc.step.calling.passed_placed`: committed arrays,
    ShapeDtypeStructs with a sharding, state moved to host memory) carry theirs, the
    others none, as a call passes them to the executable (whose ``in_shardings`` place
    them): ``jax.jit`` compiles again for a call whose arguments' placement differs from
    its lowering's."""
    return [ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s if not
                             placed_only or passed_placed(x, s) else None)
            if hasattr(x, "shape") else x
            for x, a, s in zip(call.leaves, map(abstract_leaf, call.leaves), shardings)]
