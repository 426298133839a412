"""The device sweep: the best plan on each device count.

The device sweep: the best plan of a step on each device count that divides its mesh,
each planned on an AbstractMesh of the sub-mesh with its axes priced at the links they have in
the whole mesh.
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

    :meth:`AutoSharded.device_sweep <shardc.step.auto_shard.AutoSharded.device_sweep>`
    of ``step``: each count planned by a copy of the step on an AbstractMesh of its
    sub-mesh.
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

    ``(devices, sub-mesh shape, its axis names)`` for each device count that divides the
    mesh, fewest first: the first devices in row-major order, so a count fills the inner
    (fastest) axes before the outer ones (4 of ``(node=2, gpu=4)`` is ``(node=1, gpu=4)``).
    Every axis keeps its name, at size 1 where the count leaves it: the program's own
    ``with_sharding_constraint`` may name any of the mesh's axes, and a spec naming an axis
    of size 1 places the value as if it named none. A count whose devices are not a whole
    block of inner axes is skipped (6 of ``(2, 4)``: it divides nothing, as does no count
    that is not a divisor).
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
    """The best plan on ``devices`` devices.

    The best plan on ``devices`` devices (the sub-mesh ``mesh``), within the sweep's
    budget; ``plan`` is None when none fits, and ``needed`` the leanest plan's peak.
    """

    devices: int
    mesh: tuple[tuple[str, int], ...]
    plan: Plan | None
    needed: int | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class DeviceSweep:
    """The best plan on each device count, fewest first.

    One :class:`DeviceCount` per device count that divides the mesh, fewest first, each
    planned within ``memory_budget`` bytes per device.
    """

    counts: tuple[DeviceCount, ...]
    memory_budget: float

    def fewest(self) -> DeviceCount:
        """The fewest devices on which a plan fits the budget.

        The fewest devices on which a plan fits the budget; :class:`MemoryBudgetError`
        naming the leanest plan on all of them if none does.
        """
        for c in self.counts:
            if c.fits:
                return c
        raise MemoryBudgetError(self.memory_budget, self.counts[-1].needed)

    def table(self) -> str:
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
        return self.table()
