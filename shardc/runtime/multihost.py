"""Running a planned step under ``jax.distributed``.

One process per host, every process executing the same plan on the global mesh. Every
process plans for itself; plans are deterministic when their search runs to its end, so
they agree when the processes plan the same program with the same cluster and options.
:func:`agree` makes sure they run the same one (``auto_shard`` calls it for each plan it
adopts when ``jax.process_count() > 1``): where the processes' plans differ but the program
is the same, every process adopts process 0's, with one warning; different programs raise
:class:`PlanMismatchError` on every process at once, before a step runs.

:func:`global_batch` assembles global arrays from each process's part of the batch in the
shardings the plan gives them (:meth:`shardc.AutoSharded.input_shardings`);
:func:`process_slice` says which part of a global array a process's data loader reads.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence

import jax
import numpy as np

from shardc.errors import OptionsError
from shardc.errors import PlanMismatchError as PlanMismatchError
from shardc.plan.record import Plan

__all__ = ["PlanMismatchError", "agree", "global_batch", "plan_digest", "process_slice"]


def plan_digest(plan: Plan) -> str:
    """A digest of what a plan runs.

    It covers the program fingerprint, mesh, cluster, every value's layout and every op's
    strategy, not the solver's statistics (such as its run time).

    Args:
        plan: The plan.

    Returns:
        16 hex digits.
    """
    d = json.loads(plan.to_json())
    d.pop("solver")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _gathered(digest: str) -> list[str]:
    """Every process's hex ``digest`` (one collective)."""
    from jax.experimental import multihost_utils

    rows = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(digest), np.uint8))
    return [bytes(row).hex() for row in np.asarray(rows).reshape(jax.process_count(), -1)]


def _from_process_0(text: str) -> str:
    """Process 0's ``text`` on every process (two collectives: its length, its bytes)."""
    from jax.experimental import multihost_utils

    data = text.encode()
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def agree(plan: Plan) -> Plan:
    """The plan every process runs.

    Every process must call it (a collective); in a single process it returns ``plan``.

    Args:
        plan: This process's plan.

    Returns:
        ``plan`` where all processes hold the same one, else process 0's (one warning).

    Raises:
        PlanMismatchError: On every process, where they planned different programs.
    """
    if jax.process_count() == 1:
        return plan
    digests = _gathered(plan_digest(plan))
    if len(set(digests)) == 1:
        return plan
    program = hashlib.sha256(plan.fingerprint.encode()).hexdigest()[:16]
    if len(set(_gathered(program))) > 1:
        listing = ", ".join(f"process {i}: {d}" for i, d in enumerate(digests))
        raise PlanMismatchError(
            f"the processes planned different programs (plan digests {listing}; "
            f"this process's program is {plan.fingerprint}). Every process must call the "
            "step with the same program and argument shapes")
    adopted = Plan.from_json(_from_process_0(plan.to_json()))
    warnings.warn(
        f"the processes made different plans for program {plan.fingerprint} (digests "
        f"{', '.join(digests)}); every process runs process 0's. Plans differ when the "
        "processes' clusters or auto_shard options differ (calibrate one Cluster and load it "
        "from one file) or when the solver stops at time_limit (a memory budget's search on a "
        "loaded host): raise time_limit, or plan once and load it with step.use_plan(...)",
        stacklevel=3)
    return adopted


def global_batch(local, shardings, global_shapes=None):
    """Global arrays from this process's part of each input.

    Every process calls it with its own part.

    Args:
        local: A pytree of host arrays: this process's rows.
        shardings: The matching pytree of shardings (the plan's, from
            ``step.input_shardings(...)``).
        global_shapes: The matching pytree of global shapes; None: inferred from the
            shardings (each process's part concatenated along the dimensions split across
            processes).

    Returns:
        The pytree of global arrays.
    """
    if global_shapes is None:
        return jax.tree.map(jax.make_array_from_process_local_data, shardings, local)
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, local,
                        global_shapes)


def process_slice(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of a global array this process's devices hold.

    Args:
        sharding: The array's sharding.
        shape: The array's global shape.

    Returns:
        One slice per dimension: the rows this process's data loader reads for
        :func:`global_batch`.

    Raises:
        ValueError: Where the process's devices hold non-adjacent parts of a dimension.
    """
    index = sharding.addressable_devices_indices_map(tuple(shape))
    block = []
    for d, n in enumerate(shape):
        parts = sorted({ix[d].indices(n)[:2] for ix in index.values()})
        if any(a[1] != b[0] for a, b in zip(parts, parts[1:])):
            raise OptionsError(f"this process's devices hold non-adjacent parts of dimension "
                               f"{d} ({parts}) under {sharding}; order the mesh's devices by "
                               "process (jax.make_mesh does) so each process holds one block")
        block.append(slice(parts[0][0], parts[-1][1]))
    return tuple(block)
