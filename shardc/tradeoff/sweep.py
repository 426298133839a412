"""The device sweep: the best plan of a step on each device count that divides its mesh,
each planned on an AbstractMesh of the sub-mesh with its axes priced at the links they have in
the whole mesh."""

from __future__ import annotations

import dataclasses
import logging

from jax.sharding import AbstractMesh

from shardc.cost.units import fmt_time
from shardc.report.explain import mesh_label
from shardc.solve.search import MemoryBudgetError
from shardc.tradeoff.frontier import (
    DeviceCount,
    DeviceSweep,
    device_counts,
)

log = logging.getLogger("shardc")

__all__ = ["device_sweep"]


def device_sweep(step, *args, memory_budget: float | None = None, **kwargs
                 ) -> DeviceSweep:
    """:meth:`AutoSharded.device_sweep <shardc.step.auto_shard.AutoSharded.device_sweep>`
    of ``step``: each count planned by a copy of the step on an AbstractMesh of its
    sub-mesh."""
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
