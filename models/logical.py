"""Logical-axis annotations: how an expert would shard each model, by name.

Models call :func:`constrain` on activations with logical axis names (``"batch"``,
``"embed"``, ``"heads"``, ``"mlp"``, ``"vocab"``, ``"expert"``, ...) and declare their
parameters' logical axes with a ``param_axes(path, shape)`` function. Outside an
:func:`axis_rules` context both are inert, so the models stay plain Flax code; inside one
(the expert baselines of ``shardc.bench``) logical names map to mesh axes, MaxText-style.
These rules and :mod:`models.ring`'s ring are the zoo's contextual state, each scoped with
``contextvars``, never a global.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardc.util.axes import axis_tuple

__all__ = ["axis_rules", "constrain", "no_axis_rules", "Rules", "spec"]

Rules = Mapping[str, str | tuple[str, ...] | None]

_RULES: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "models_logical_axis_rules", default=None
)


@contextlib.contextmanager
def axis_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within the block, :func:`constrain` maps logical names to ``mesh`` axes by ``rules``."""
    token = _RULES.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _RULES.reset(token)


@contextlib.contextmanager
def no_axis_rules() -> Iterator[None]:
    """Within the block, :func:`constrain` is inert again (inside a ``shard_map`` manual over
    the axes the rules name, where a stage of a hand-written pipeline runs its layers)."""
    token = _RULES.set(None)
    try:
        yield
    finally:
        _RULES.reset(token)


def spec(names: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None,
         mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for logical ``names``; a mesh axis is used once, first come first
    served, and (with ``shape`` and ``mesh``) only where it divides the dim evenly."""
    used: set[str] = set()
    out = []
    for d, name in enumerate(names):
        axes = rules.get(name) if name is not None else None
        axes = axis_tuple(axes)
        keep = []
        for a in axes:
            if a in used:
                continue
            if shape is not None and mesh is not None:
                size = mesh.shape[a]
                for k in keep:
                    size *= mesh.shape[k]
                if shape[d] % size:
                    continue
            keep.append(a)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate activation ``x`` with logical axis names (inert outside :func:`axis_rules`)."""
    ctx = _RULES.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for a rank-{x.ndim} value")
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, spec(names, rules, x.shape, mesh)))
