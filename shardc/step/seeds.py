"""Hand-written plans as graph-input layouts: the ``seeds`` option and ``in_shardings``
(PartitionSpecs per dynamic argument, as for ``jax.jit``), checked as ``jax.jit`` checks them
and read per logical view of the mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from shardc.errors import MeshAxisError, OptionsError, OptionsTypeError, closest
from shardc.ir.sbp import NdSbp, from_partition_spec
from shardc.step.calling import (
    Call,
    abstract_leaf,
)
from shardc.tradeoff.views import View
from shardc.util.axes import axis_tuple

__all__ = ["check_specs", "is_spec_leaf", "named_seeds", "seed_layouts", "view_seeds"]


def view_seeds(step, call: Call, candidates: list[View]) -> list[dict[str, dict[int, NdSbp]]]:
    """The ``seeds`` option as graph-input layouts by seed name, per candidate view: a
    seed seeds each view whose axes its specs name (the mesh's own, or another view's
    such as ``gpu2`` / ``gpu4`` of a flat 8-device mesh); one that names no view's
    axes is an error."""
    dyn_args, _ = call.unflatten(call.leaves)
    abstract = jax.tree.map(abstract_leaf, dyn_args)
    out: list[dict[str, dict[int, NdSbp]]] = [{} for _ in candidates]
    for name, spec in step.options.seeds.items():
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


def check_specs(specs, mesh: Mesh | AbstractMesh) -> None:
    """Refuse the PartitionSpecs of ``in_shardings`` that ``jax.jit`` refuses (an axis named
    twice: DuplicateSpecError; an axis the mesh lacks), as it does, when they are given."""
    names = tuple(mesh.axis_names)
    for spec in jax.tree.leaves(specs, is_leaf=is_spec_leaf):
        if isinstance(spec, PartitionSpec):
            axes = [a for e in spec for a in axis_tuple(e)]
            bad = [a for a in axes if a not in names]
            if bad:
                raise MeshAxisError(f"in_shardings: {spec} names axis {bad[0]!r}, not in the "
                                    f"mesh {list(names)}{closest(bad[0], names)}")
            NamedSharding(mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh, spec)


def is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def named_seeds(seeds) -> dict[str, Any]:
    """``seeds`` as ``{name: in_shardings}`` (a mapping only: one seed is itself a tuple of
    per-argument specs, so a bare sequence would be ambiguous)."""
    if seeds is None:
        return {}
    if isinstance(seeds, Mapping):
        return dict(seeds)
    raise OptionsTypeError("seeds takes {name: in_shardings}, where in_shardings holds a "
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
        raise OptionsError(f"{what}: give one entry per dynamic positional argument "
                           f"({len(abstract)}), as a tuple, like jax.jit's in_shardings")
    try:
        per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs,
                                abstract, is_leaf=is_spec_leaf)
    except ValueError as exc:
        raise OptionsError(f"{what} does not match the arguments' pytree: {exc}") from exc
    leaves = jax.tree.leaves(per_leaf, is_leaf=is_spec_leaf)
    out: dict[int, NdSbp] = {}
    for k, (spec, x) in enumerate(zip(leaves, jax.tree.leaves(abstract), strict=True)):
        if spec is None:
            continue
        spec = spec.spec if isinstance(spec, NamedSharding) else spec
        try:
            out[k] = from_partition_spec(spec, len(x.shape), tuple(axis_names))
        except ValueError as exc:
            raise OptionsError(f"{what}, argument leaf {k} {x.shape}: {exc}") from exc
    return out
