"""One process of a training job that checkpoints every step and resumes from the latest
complete checkpoint (tests/test_resume.py launches it, kills it, and launches it again):
the tiny MLP under auto_shard on all the job's CPU devices, a different batch each step.
Prints one JSON line per event: ``{"resumed_from": k}``, ``{"step": i, "loss": x}``,
``{"done": ...}``; the last process-0 run writes the final parameters to ``OUT.npz``.

    python tests/resume_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES CKPT STEPS OUT
        [--kill-at STEP:step|save]

``DEVICES`` CPU devices per process; the mesh is one axis over all of them. ``--kill-at
i:step`` SIGKILLs the process once step i is dispatched (its result neither fetched nor
saved); ``i:save`` once checkpoint i's save has started (its files being written).
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main(argv: list[str]) -> None:
    process_id, num_processes, port, devices = (int(a) for a in argv[:4])
    ckpt_dir, steps, out = argv[4], int(argv[5]), argv[6]
    kill = tuple(argv[argv.index("--kill-at") + 1].split(":")) if "--kill-at" in argv else None
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}")
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=60)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType

    import shardc
    from shardc.models import mlp
    from shardc.runtime.checkpoint import Checkpoints
    from shardc.runtime.multihost import global_batch, process_slice

    def say(**event):
        print(json.dumps({"process": process_id, **event}), flush=True)

    cfg = mlp.MLPConfig.tiny()
    step_fn, (init, _) = mlp.make_train_step(cfg)
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(step_fn, mesh=mesh, memory_budget=budget(init, n))
    abstract = jax.eval_shape(lambda: init)
    abstract_batch = jax.eval_shape(lambda: batch_for(cfg, 1))
    (state_sh, batch_sh), _ = step.input_shardings(abstract, abstract_batch)
    plan = step.plan(abstract, abstract_batch)
    ckpt = Checkpoints(ckpt_dir, max_to_keep=2)
    start = ckpt.latest_step() or 0
    state = ckpt.restore(abstract, state_sh) if start else jax.tree.map(np.asarray, init)
    say(resumed_from=start, devices=n)
    for i in range(start + 1, steps + 1):
        full = batch_for(cfg, i)
        local = {k: np.asarray(v)[process_slice(batch_sh[k], v.shape)]
                 for k, v in full.items()}
        state, loss = step(state, global_batch(local, batch_sh,
                                               {k: v.shape for k, v in full.items()}))
        if kill == (str(i), "step"):
            os.kill(os.getpid(), signal.SIGKILL)
        say(step=i, loss=float(loss))
        ckpt.save(i, state, plan)
        if kill == (str(i), "save"):
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    params = multihost_utils.process_allgather(state["params"], tiled=True)
    if process_id == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(out, **flat)
    say(done=steps)
    if num_processes > 1:
        jax.distributed.shutdown()


def budget(state, n_devices: int) -> float:
    """A memory budget that makes the plan split the state (the tiny MLP runs replicated
    otherwise): half of it per device on 8 devices, three quarters on 4."""
    import jax

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return state_bytes * (0.5 if n_devices >= 8 else 0.75)


def batch_for(cfg, i: int):
    """Step i's batch (each step its own, so a lost or repeated step changes the result)."""
    from shardc.models import mlp

    return mlp.example_batch(cfg, seed=1000 + i)


if __name__ == "__main__":
    main(sys.argv[1:])
