"""``shardc demo``: plan a GPT train step on 8 simulated CPU devices (mesh node=2 x gpu=4),
print the plan, run 3 steps and print the losses beside the unsharded run's."""

from __future__ import annotations

import time

from shardc.cli.common import device_mesh, needs_zoo
from shardc.util.devices import force_cpu_devices

__all__ = ["cmd_demo"]


def cmd_demo(args) -> None:
    needs_zoo("demo")
    force_cpu_devices(8)
    import jax
    import numpy as np

    import shardc
    from shardc.models import gpt

    # the smallest GPT whose plan shards on this cluster (a smaller one is cheapest run
    # replicated: its collectives' latency exceeds the compute they would save)
    cfg = gpt.GPTConfig(vocab=2048, seq_len=128, d_model=256, n_heads=8, n_layers=args.layers,
                        batch=32, learning_rate=1e-3)
    print(f"shardc demo: GPT ({cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}, "
          f"seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}) on 8 CPU devices, "
          "mesh node=2 x gpu=4")
    mesh = device_mesh((2, 4), ("node", "gpu"))
    cluster = shardc.Cluster.multi_node("node", "gpu")
    step_fn, (state, batch) = gpt.make_train_step(cfg)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster)
    t0 = time.perf_counter()
    plan = step.plan(state, batch)
    print(f"planned in {time.perf_counter() - t0:.2f} s\n")
    compiled = step.lower(state, batch).compile()
    print(plan.explain(max_rows=args.rows, compiled=compiled, mesh=mesh))
    ref_step = jax.jit(step_fn)
    s_state, r_state = state, state
    print("\nstep   shardc loss   unsharded loss")
    for i in range(3):
        s_state, s_loss = step(s_state, batch)
        r_state, r_loss = ref_step(r_state, batch)
        print(f"{i:>4}   {float(s_loss):11.6f}   {float(r_loss):14.6f}")
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(s_state), jax.tree.leaves(r_state)))
    print(f"max |param difference| after 3 steps: {diff:.3g}")
