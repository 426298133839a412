"""One process of a multi-process job (tests/test_multihost.py launches it): 4 CPU devices
per process, gloo collectives, the tiny GPT's train step under auto_shard on a (2, 4) mesh
over every process's devices. Prints one JSON line: the losses and the plan's digests.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT STEPS [--skew] [--other]

``--skew`` (on one process) prices the plan on another cluster, so the processes plan
differently: every process must run process 0's plan. ``--other`` (on one process) plans
another program (one more layer): the job must stop with PlanMismatchError on every
process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

LOCAL_DEVICES = 4


def main(argv: list[str]) -> None:
    process_id, num_processes, port, steps = (int(a) for a in argv[:4])
    skew, other = "--skew" in argv[4:], "--other" in argv[4:]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={LOCAL_DEVICES}")
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import AxisType

    import shardc
    from shardc.models import gpt
    from shardc.runtime.multihost import PlanMismatchError, global_batch, plan_digest, process_slice

    assert len(jax.devices()) == LOCAL_DEVICES * num_processes
    cfg = gpt.GPTConfig.tiny()
    if other:
        cfg = dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)
    step_fn, (state, batch) = gpt.make_train_step(cfg)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster(skew))
    state = jax.tree.map(np.asarray, state)  # the same values in every process
    try:
        (_, batch_sh), _ = step.input_shardings(state, batch)
    except PlanMismatchError as exc:
        print(json.dumps({"process": process_id, "error": str(exc)}), flush=True)
        sys.exit(3)
    # this process's rows of the global batch, assembled in the plan's batch sharding
    local = {k: np.asarray(v)[process_slice(batch_sh[k], v.shape)] for k, v in batch.items()}
    global_b = global_batch(local, batch_sh, {k: v.shape for k, v in batch.items()})
    plan = step.plan(state, global_b)
    losses = []
    for _ in range(steps):
        state, loss = step(state, global_b)
        losses.append(float(loss))
    print(json.dumps({"process": process_id, "losses": losses, "digest": plan_digest(plan),
                      "fingerprint": plan.fingerprint,
                      "batch_specs": {k: str(s.spec) for k, s in batch_sh.items()},
                      "local_shapes": {k: list(v.shape) for k, v in local.items()}}), flush=True)
    jax.distributed.shutdown()


def cluster(skew: bool):
    """Compute priced slow (10 GFLOP/s) so the plan shards the tiny GPT, batch included;
    ``skew``: priced fast, which plans it otherwise."""
    import shardc

    return shardc.Cluster(device_flops=1e12 if skew else 1e10)


if __name__ == "__main__":
    main(sys.argv[1:])
