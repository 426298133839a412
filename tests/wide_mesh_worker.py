"""One process with 64 simulated CPU devices: a 4-layer Llama-style decoder planned on the
abstract (8, 8) mesh, adopted by the concrete one, compiled, and its predicted collectives
compared with the compiled program's. Prints one JSON line."""

import json
import os

# the flags the tests run with (helpers.launch drops only the device count), and 64 devices
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=64")

import jax  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402

import shardc  # noqa: E402
from shardc.models import llama  # noqa: E402

NAMES = ("node", "gpu")
CLUSTER = shardc.Cluster.multi_node(*NAMES)
CFG = llama.LlamaConfig(vocab=4096, seq_len=256, d_model=512, n_heads=8, n_kv_heads=2,
                        d_ff=1408, n_layers=4, batch=64, learning_rate=3e-4)

args = llama.abstract_args(CFG)
plan = shardc.auto_shard(llama.build_step(CFG), mesh=AbstractMesh((8, 8), NAMES),
                         cluster=CLUSTER).plan(*args)
mesh = jax.make_mesh((8, 8), NAMES, axis_types=(AxisType.Auto,) * 2)
run = shardc.auto_shard(llama.build_step(CFG), mesh=mesh, cluster=CLUSTER)
run.use_plan(plan, *args)
check = plan.verify(run.lower(*args).compile(), mesh)
print(json.dumps({"devices": len(jax.devices()), "predicted": check.predicted_comm_time,
                  "compiled": check.compiled_comm_time, "predicted_bytes": check.predicted_bytes,
                  "compiled_bytes": check.compiled_bytes,
                  "unplanned": [r.kind for r in check.unplanned]}))
