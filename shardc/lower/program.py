"""The planned program under ``jax.jit``: :func:`jit_plan` wraps the plan's evaluator
(:func:`shardc.lower.emit.evaluator`) so that it is called like the user's function, with
its output shardings and donations, on the user's mesh (inside ``auto_axes`` where that
mesh has Explicit axes, since constraints need Auto axes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from shardc.errors import ArgumentsError
from shardc.ir.sbp import to_partition_spec
from shardc.ir.trace import Traced
from shardc.lower.control import explicit_axes
from shardc.lower.emit import HOST, evaluator

__all__ = ["jit_plan"]


def _under(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with ``mesh`` (Auto axes) as the context mesh, whatever mesh the caller
    set (``jax.set_mesh`` of an Explicit mesh, say)."""

    def wrapped(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return wrapped


def jit_plan(traced: Traced, plan, run_mesh: Mesh, out_mesh: Mesh, in_tree, out_tree, *,
             donate_argnums: tuple[int, ...] = (), donate_argnames: tuple[str, ...] = ()
             ) -> Callable:
    """``jax.jit`` of the planned program, called like ``fn`` with its dynamic arguments
    (positional and keyword) and returning ``fn``'s output pytree. ``run_mesh`` is the Auto
    mesh the constraints name; ``out_mesh`` the mesh the outputs are placed on (the user's,
    which may have Explicit axes: then the program runs inside ``auto_axes``)."""
    run = evaluator(traced, plan, run_mesh)
    ranks = [v.ndim for v in traced.graph.outputs]
    out_specs = [to_partition_spec(nd, r, out_mesh.axis_names)
                 for nd, r in zip(plan.outputs, ranks)]
    explicit = explicit_axes(out_mesh)
    if explicit:
        run = jax.sharding.auto_axes(run, axes=explicit, out_sharding=out_specs)
    else:
        run = _under(run, run_mesh)

    def tree_fn(*args: Any, **kwargs: Any):
        leaves, tree = jax.tree.flatten((args, kwargs))
        if tree != in_tree:
            raise ArgumentsError(f"auto_shard: arguments {tree} do not match the planned {in_tree}")
        return jax.tree.unflatten(out_tree, run(*leaves))

    out_sh = jax.tree.unflatten(out_tree, [
        NamedSharding(out_mesh, s, memory_kind=HOST if j in plan.offloaded_outputs else None)
        for j, s in enumerate(out_specs)])
    return jax.jit(tree_fn, out_shardings=out_sh, donate_argnums=donate_argnums,
                   donate_argnames=donate_argnames)
