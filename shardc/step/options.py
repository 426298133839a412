"""What ``auto_shard`` is asked for besides the function.

One frozen :class:`Options` record, checked at construction; the mesh it plans on (every
axis Auto); and the error for running on an AbstractMesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import AbstractMesh, AxisType, Mesh

from shardc.cost.cluster import DEFAULT_CLUSTER, Cluster
from shardc.errors import NeedsDevicesError as NeedsDevicesError
from shardc.errors import OptionsError, OptionsTypeError
from shardc.ir.trace import DEFAULT_WHILE_TRIPS
from shardc.pipeline.schedule import Pipeline
from shardc.solve.ilp import DEFAULT_TIME_LIMIT

__all__ = ["auto_mesh", "check_mesh", "NeedsDevicesError", "Options", "platform_of"]


def check_mesh(mesh) -> None:
    """Refuse what is no mesh.

    Args:
        mesh: what ``auto_shard`` was given as its mesh.

    Raises:
        OptionsTypeError: ``mesh`` is neither a ``jax.sharding.Mesh`` nor an
            ``AbstractMesh``; the message says how to make one.
    """
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise OptionsTypeError(f"auto_shard needs a jax.sharding.Mesh, or an AbstractMesh to "
                               f"plan without the devices, got {type(mesh).__name__}; make one "
                               "with jax.make_mesh((2, 4), ('node', 'gpu')) or "
                               "jax.sharding.AbstractMesh((16, 8), ('node', 'gpu'))")


def auto_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """The same mesh with every axis Auto (what sharding constraints need).

    Args:
        mesh: A mesh, or an AbstractMesh.

    Returns:
        The same devices (for an AbstractMesh, the same shape) and axes, every axis Auto;
        ``mesh`` itself where they already are.
    """
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Everything ``auto_shard`` is asked for besides the function and its mesh.

    Keyword-only; each field is :func:`shardc.auto_shard`'s argument of the same name
    (its ``Args`` say what each means).

    Attributes:
        cluster: The cluster the plan is priced on.
        memory_budget: Bytes per device a plan may hold; None: no budget.
        time_limit: Seconds, the wall-clock guard on each ILP solve.
        seeds: Hand-written plans to start from, by name.
        mesh_search: Also plan the other logical views of the mesh's devices.
        in_shardings: Layouts fixed for the arguments, as for ``jax.jit``.
        keep_input_shardings: Keep the placement of arguments already on the mesh; None:
            True on a mesh with Explicit axes.
        cache_dir: Where plans are kept on disk; None: ``$SHARDC_CACHE_DIR`` if set.
        while_trips: Iterations a while loop without static bounds is planned for.
        pipeline: A Pipeline to run; False: none; None: the planner's choice.
        rank_compiled: Under overlap, how many of the best candidates are compiled and
            ranked by their compiled programs.
        offload: Where a budget binds, state may live in host memory.
        context_parallel: Attention may be split along its sequence.

    Raises:
        TypeError: For a ``pipeline`` that is none of those.
        ValueError: For a value out of its range (named in the message).
    """

    cluster: Cluster = DEFAULT_CLUSTER
    memory_budget: float | None = None
    time_limit: float = DEFAULT_TIME_LIMIT
    seeds: Mapping[str, Any] = field(default_factory=dict)
    mesh_search: bool = False
    in_shardings: Any = None
    keep_input_shardings: bool | None = None  # None: True on a mesh with Explicit axes
    cache_dir: str | None = None  # None: $SHARDC_CACHE_DIR if set, else no disk cache
    while_trips: int = DEFAULT_WHILE_TRIPS
    pipeline: Pipeline | bool | None = None  # None: the planner's choice; False: never
    rank_compiled: int = 0  # under overlap: the best candidates compiled and ranked so
    offload: bool = True  # where a budget binds, state may live in host memory
    context_parallel: bool = True  # attention may be split along its sequence

    def __post_init__(self):
        """Check the fields (see Raises)."""
        if not (self.pipeline is None or self.pipeline is False
                or isinstance(self.pipeline, Pipeline)):
            raise OptionsTypeError(f"pipeline must be a shardc.pipeline.Pipeline, False (never "
                                   f"pipeline) or None (the planner's choice); got "
                                   f"{self.pipeline!r}")
        if (not isinstance(self.while_trips, int) or isinstance(self.while_trips, bool)
                or self.while_trips < 1):
            raise OptionsError(f"while_trips is the iterations a while loop without static "
                               f"bounds is planned for, a whole number >= 1; got "
                               f"{self.while_trips!r}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise OptionsError(f"memory_budget must be a positive number of bytes per device, "
                               f"got {self.memory_budget!r}")
        if (not isinstance(self.rank_compiled, int) or isinstance(self.rank_compiled, bool)
                or self.rank_compiled < 0):
            raise OptionsError(f"rank_compiled is how many of the best candidate plans are "
                               f"compiled and ranked by their compiled programs under "
                               f"Cluster(overlap=True), a whole number >= 0 (0: the estimate "
                               f"alone); got {self.rank_compiled!r}")
        if not self.time_limit >= 0:
            raise OptionsError(f"time_limit must be seconds >= 0, got {self.time_limit!r}")


def platform_of(mesh: Mesh | AbstractMesh) -> str | None:
    """The platform of the mesh's devices (what ``platform_index`` conds resolve for).

    Args:
        mesh: A mesh, or an AbstractMesh.

    Returns:
        The platform's name; None on an abstract mesh (the default backend's).
    """
    return None if isinstance(mesh, AbstractMesh) else mesh.devices.flat[0].platform
