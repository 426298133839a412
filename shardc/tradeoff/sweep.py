"""The device sweep: the best plan of a step on each device count that divides its mesh.

Each count is planned on an AbstractMesh of the sub-mesh, its axes priced at the links they
have in the whole mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jax.sharding import AbstractMesh

from shardc.cost.units import fmt_bytes, fmt_time
from shardc.plan.record import Plan
from shardc.report.explain import mesh_label
from shardc.solve.search import MemoryBudgetError

log = logging.getLogger("shardc")

__all__ = ["DeviceCount", "DeviceSweep", "device_counts", "device_sweep"]


def device_sweep(step, *args, memory_budget: float | None = None, **kwargs
                 ) -> DeviceSweep:
    """Plan ``step`` on each device count that divides its mesh.

    What :meth:`AutoSharded.device_sweep <shardc.step.auto_shard.AutoSharded.device_sweep>`
    runs: each count planned by a copy of the step on an AbstractMesh of its sub-mesh.

    Args:
        step: An ``auto_shard`` step.
        *args: Its arguments (arrays or ShapeDtypeStructs).
        memory_budget: Bytes per device; None: the step's budget, else its cluster's
            device memory.
        **kwargs: Its keyword arguments.

    Returns:
        The sweep, fewest devices first.
    """
    budget = memory_budget if memory_budget is not None else (
        step.options.memory_budget or step.options.cluster.device_memory)
    cluster = step.options.cluster
    counts = []
    for k, shape, names in device_counts(tuple(step.mesh.axis_sizes),
                                         tuple(step.mesh.axis_names)):
        sub = dataclasses.replace(
            cluster, axis_bandwidth={a: cluster.bandwidth(a) for a in names},
            axis_latency={a: cluster.latency(a) for a in names},
            axis_link={a: cluster.link(a) for a in names},
            axis_nodes={a: n for a, n in cluster.axis_nodes.items() if a in names})
        opts = dataclasses.replace(step.options, cluster=sub, memory_budget=budget,
                                   seeds={}, in_shardings=None,
                                   keep_input_shardings=False, cache_dir=None)
        sub_step = type(step)(step.fn, AbstractMesh(shape, names), opts, step.convention)
        mesh = tuple(zip(names, shape))
        try:
            counts.append(DeviceCount(k, mesh, sub_step.plan(*args, **kwargs)))
        except MemoryBudgetError as exc:
            counts.append(DeviceCount(k, mesh, None, exc.needed))
        log.info("shardc: %d devices (%s): %s", k, mesh_label(mesh),
                 "no plan fits" if counts[-1].plan is None else
                 fmt_time(counts[-1].plan.predicted.step_time) + " step")
    return DeviceSweep(tuple(counts), budget)


def device_counts(shape: Sequence[int], names: Sequence[str]
                  ) -> list[tuple[int, tuple[int, ...], tuple[str, ...]]]:
    """The sub-meshes of each device count that divides the mesh.

    A count takes the first devices in row-major order, so it fills the inner (fastest)
    axes before the outer ones (4 of ``(node=2, gpu=4)`` is ``(node=1, gpu=4)``). Every
    axis keeps its name, at size 1 where the count leaves it: the program's own
    ``with_sharding_constraint`` may name any of the mesh's axes. A count whose devices are
    not a whole block of inner axes is skipped (6 of ``(2, 4)``).

    Args:
        shape: The mesh's axis sizes.
        names: The mesh's axis names.

    Returns:
        ``(devices, sub-mesh shape, its axis names)`` per count, fewest first.
    """
    n = math.prod(shape)
    out = []
    for k in range(1, n + 1):
        if n % k:
            continue
        sub, rem = [], k
        for size in reversed(shape):
            take = math.gcd(size, rem)
            if rem > 1 and take < min(size, rem):
                break
            sub.append(take)
            rem //= take
        else:
            if rem != 1:
                continue
            sub.reverse()
            out.append((k, tuple(sub), tuple(names)))
    return out


@dataclass(frozen=True)
class DeviceCount:
    """The best plan on ``devices`` devices, within the sweep's budget.

    Attributes:
        devices: The device count.
        mesh: The sub-mesh, ``(name, size)`` per axis.
        plan: The best plan; None when none fits.
        needed: Where none fits, the leanest plan's peak (bytes per device).
    """

    devices: int
    mesh: tuple[tuple[str, int], ...]
    plan: Plan | None
    needed: int | None = None

    @property
    def fits(self) -> bool:
        """Whether a plan fits the budget on this count."""
        return self.plan is not None


@dataclass(frozen=True)
class DeviceSweep:
    """The best plan on each device count that divides the mesh, fewest first.

    Attributes:
        counts: One :class:`DeviceCount` per count, fewest first.
        memory_budget: The budget each was planned within, bytes per device.
    """

    counts: tuple[DeviceCount, ...]
    memory_budget: float

    def fewest(self) -> DeviceCount:
        """The fewest devices on which a plan fits the budget.

        Returns:
            That count's :class:`DeviceCount`.

        Raises:
            MemoryBudgetError: Naming the leanest plan on all the devices, if none fits.
        """
        for c in self.counts:
            if c.fits:
                return c
        raise MemoryBudgetError(self.memory_budget, self.counts[-1].needed)

    def table(self) -> str:
        """The counts as a table: mesh, predicted step, peak and whether it fits."""
        rows = ["devices   mesh                  predicted step   peak per device   fits "
                f"{fmt_bytes(self.memory_budget)}"]
        for c in self.counts:
            if c.plan is None:
                step, peak, fits = "-", f">= {fmt_bytes(c.needed, up=True)}", "no"
            else:
                step = fmt_time(c.plan.predicted.step_time)
                peak, fits = fmt_bytes(c.plan.predicted.peak_memory), "yes"
            rows.append(f"{c.devices:>7}   {mesh_label(c.mesh):<20}  {step:>14}   "
                        f"{peak:>15}   {fits}")
        return "\n".join(rows)

    def __str__(self) -> str:
        """:meth:`table`."""
        return self.table()
