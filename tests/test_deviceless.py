"""Compiling for H100s on a machine without one (shardc.bench.deviceless): XLA:GPU's
program for an FSDP step and for a saved plan. The compiles need JAX's CUDA plugin and are
skipped without it; the error that names the install is checked everywhere."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardc import auto_shard
from shardc.bench import deviceless
from shardc.inspect.hlo import collectives

needs_plugin = pytest.mark.skipif(
    deviceless.plugin() is None,
    reason="JAX's CUDA plugin is not installed (" + deviceless.install_hint() + ")")


def _step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    value, grads = jax.value_and_grad(loss)(ws)
    return value, [w - 0.1 * g for w, g in zip(ws, grads)]


def _mesh(devices) -> Mesh:
    return Mesh(np.array(devices[:8]), ("gpu",), axis_types=(AxisType.Auto,))


def test_missing_plugin_names_the_install(monkeypatch):
    monkeypatch.setattr(deviceless, "PLUGINS", ("jax_plugins.no_such_plugin",))
    assert deviceless.plugin() is None
    with pytest.raises(RuntimeError, match=r"pip install jax-cuda12-plugin==" +
                       jax.__version__.replace(".", r"\.")):
        deviceless.gpu_devices()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must be >= 1"):
        deviceless.gpu_devices(hosts=0)


@needs_plugin
def test_devices_are_h100s_over_hosts():
    devices = deviceless.gpu_devices(hosts=2, per_host=4)
    assert len(devices) == 8
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert {d.process_index for d in devices} == {0, 1}
    assert jax.devices()[0].platform == "cpu"  # JAX's own backend is unchanged


@needs_plugin
def test_devices_after_jax_started_without_the_plugin():
    # a fresh process whose JAX starts first: the plugin, finding no CUDA libraries, does
    # not register then, and gpu_devices registers it afterwards
    code = ("import jax; cpu = jax.devices(); from shardc.bench.deviceless import gpu_devices; "
            "print(cpu[0].platform, len(gpu_devices()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu", "8"]


@needs_plugin
def test_fsdp_step_gpu_combines_what_cpu_does_not():
    gpu, cpu = _mesh(deviceless.gpu_devices()), _mesh(jax.devices())

    def args(mesh):
        sharded = NamedSharding(mesh, P("gpu"))
        return ([jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=sharded)] * 4,
                jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=sharded))

    texts = {name: jax.jit(_step).lower(*args(mesh)).compile().as_text()
             for name, mesh in (("gpu", gpu), ("cpu", cpu))}
    gathers = {name: [c.result_bytes for c in collectives(text, cpu) if c.kind == "all-gather"]
               for name, text in texts.items()}
    # the same parameters gathered, in fewer collectives: XLA:GPU's combiner merges them
    assert sum(gathers["gpu"]) == sum(gathers["cpu"]) > 0
    assert len(gathers["gpu"]) < len(gathers["cpu"])
    assert "all-gather-start" in texts["gpu"] and "all-gather-start" not in texts["cpu"]


@needs_plugin
def test_saved_plan_compiles_for_gpus():
    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 4
    x = jax.ShapeDtypeStruct((8192, 256), jnp.float32)
    plan = auto_shard(_step, mesh=_mesh(jax.devices())).plan(ws, x)
    gpu = _mesh(deviceless.gpu_devices())
    step = auto_shard(_step, mesh=gpu)
    step.use_plan(plan, ws, x)
    compiled = step.lower(ws, x).compile()
    assert "all-reduce-start" in compiled.as_text()
    rows = plan.verify(compiled, gpu).rows
    assert rows and all(r.compiled_count == r.planned_count for r in rows)


@needs_plugin
def test_xla_gpu_reduces_an_add_of_two_reduced_summands_once():
    """What :attr:`shardc.cost.combine.Combiner.reassociates` says of XLA:GPU: two partial
    dots, each reduce-scattered into an add that alone reads them, compile to one
    reduce-scatter of the sum there (on XLA:CPU, the two reductions combined)."""
    from shardc.cost.combine import XLA_CPU, XLA_GPU

    def f(x, w1, w2):
        split = NamedSharding(mesh, P("gpu", None))
        a = jax.lax.with_sharding_constraint(x @ w1, split)
        b = jax.lax.with_sharding_constraint(x @ w2, split)
        return a + b

    counts = {}
    for name, devices in (("gpu", deviceless.gpu_devices()), ("cpu", jax.devices())):
        mesh = _mesh(devices)
        shard = [NamedSharding(mesh, s) for s in (P(None, "gpu"), P("gpu", None),
                                                  P("gpu", None))]
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh) for s, sh in
                zip(((64, 256), (256, 128), (256, 128)), shard, strict=True)]
        text = jax.jit(f).lower(*args).compile().as_text()
        counts[name] = [(c.kind, c.result_bytes) for c in collectives(text, mesh)
                        if c.kind in ("reduce-scatter", "all-reduce")]
    # one reduce-scatter of the sum on XLA:GPU; on XLA:CPU the two summands' reductions
    # combined into one collective of both (twice the bytes)
    (gpu_kind, gpu_bytes), = counts["gpu"]
    (cpu_kind, cpu_bytes), = counts["cpu"]
    assert gpu_kind == cpu_kind == "reduce-scatter" and 2 * gpu_bytes == cpu_bytes, counts
    assert XLA_GPU.reassociates and not XLA_CPU.reassociates
