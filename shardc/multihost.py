"""Running a planned step under ``jax.distributed``: one process per host, every process
executing the same plan on the global mesh.

Every process plans for itself; plans are deterministic (:func:`shardc.auto_shard`'s
``time_limit``), so they agree when the processes plan the same program with the same
cluster and options. :func:`agree` checks that they did: every process's
:func:`plan_digest` is gathered to all (``multihost_utils.process_allgather``), and any
difference raises :class:`PlanMismatchError` on every process at once, before a step runs
(processes running different programs would otherwise wait on each other's collectives
forever). ``auto_shard`` calls it for each plan it adopts when ``jax.process_count() > 1``.

:func:`global_batch` assembles global arrays from each process's part of the batch
(``jax.make_array_from_process_local_data``) in the shardings the plan gives them
(:meth:`shardc.AutoSharded.input_shardings`); :func:`process_slice` says which part of a
global array a process's data loader should read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import jax
import numpy as np

from shardc.plan import Plan

__all__ = ["PlanMismatchError", "agree", "global_batch", "plan_digest", "process_slice"]


class PlanMismatchError(RuntimeError):
    """The processes of a job made different plans for the same step."""


def plan_digest(plan: Plan) -> str:
    """A digest of what a plan runs: its program fingerprint, mesh, cluster, every value's
    layout and every op's strategy (not the solver's statistics, such as its run time)."""
    d = json.loads(plan.to_json())
    d.pop("solver")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def agree(plan: Plan) -> None:
    """Raise :class:`PlanMismatchError` on every process unless all processes hold the same
    plan; a no-op in a single process. Every process must call it (a collective)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = plan_digest(plan)
    gathered = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(mine), np.uint8))
    digests = [bytes(row).hex() for row in np.asarray(gathered).reshape(jax.process_count(), -1)]
    if len(set(digests)) > 1:
        listing = ", ".join(f"process {i}: {d}" for i, d in enumerate(digests))
        raise PlanMismatchError(
            f"the processes made different plans for program {plan.fingerprint} ({listing}). "
            "A plan depends on the program, its argument shapes, the mesh, the cluster and "
            "the auto_shard options: give every process the same ones (a calibrated Cluster "
            "from one file, not measured per process), or plan once, save plan.to_json() "
            "and load it on every process with step.use_plan(Plan.from_json(text), ...)")


def global_batch(local, shardings, global_shapes=None):
    """Global arrays from this process's part of each input: ``local`` a pytree of host
    arrays (this process's rows), ``shardings`` the matching pytree of shardings (the
    plan's, from ``step.input_shardings(...)``), ``global_shapes`` optionally the matching
    pytree of global shapes (else inferred from the sharding: each process's part
    concatenated along the dimensions split across processes). Every process calls it
    with its own part."""
    if global_shapes is None:
        return jax.tree.map(jax.make_array_from_process_local_data, shardings, local)
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, local,
                        global_shapes)


def process_slice(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of a global array of ``shape`` that this process's devices hold under
    ``sharding``: the rows its data loader reads for :func:`global_batch`."""
    index = sharding.addressable_devices_indices_map(tuple(shape))
    block = []
    for d, n in enumerate(shape):
        parts = sorted({ix[d].indices(n)[:2] for ix in index.values()})
        if any(a[1] != b[0] for a, b in zip(parts, parts[1:])):
            raise ValueError(f"this process's devices hold non-adjacent parts of dimension "
                             f"{d} ({parts}) under {sharding}; order the mesh's devices by "
                             "process (jax.make_mesh does) so each process holds one block")
        block.append(slice(parts[0][0], parts[-1][1]))
    return tuple(block)
