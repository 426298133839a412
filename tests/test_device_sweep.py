"""The device-count sweep: the best plan on each device count that divides the mesh."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardc
from shardc.models import mlp
from shardc.tradeoff.sweep import device_counts

# weights dominate (4 layers of 2048 x 8192 with Adam): one device cannot hold the state in
# a GiB, so the sweep has counts that do not fit and counts that do
CFG = mlp.MLPConfig(batch=256, d_in=2048, hidden=8192, d_out=2048, n_layers=4)
MESH = AbstractMesh((2, 4), ("node", "gpu"))
GIB = float(2**30)


def test_device_counts_fill_the_inner_axes_first():
    # every axis keeps its name, at size 1 where the count leaves it
    names = ("node", "gpu")
    assert device_counts((2, 4), names) == [
        (1, (1, 1), names), (2, (1, 2), names), (4, (1, 4), names), (8, (2, 4), names)]
    # 2 of (2, 3) is no block of the inner axis: skipped
    assert [k for k, _, _ in device_counts((2, 3), names)] == [1, 3, 6]


def test_the_sweep_keeps_the_axes_the_programs_constraints_name():
    # regression: the sub-meshes dropped "node" (size 1 below 8 devices), and planning the
    # user's constraint naming it failed with a LayoutError
    def fn(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(MESH, P("node", "gpu")))
        return jnp.sum(jnp.tanh(h))

    args = (jax.ShapeDtypeStruct((64, 64), jnp.float32),
            jax.ShapeDtypeStruct((32, 64), jnp.float32))
    step = shardc.auto_shard(fn, mesh=MESH, cluster=shardc.Cluster.multi_node(),
                             mesh_search=True)
    sweep = step.device_sweep(*args, memory_budget=GIB)
    assert [c.mesh for c in sweep.counts] == [
        (("node", 1), ("gpu", 1)), (("node", 1), ("gpu", 2)), (("node", 1), ("gpu", 4)),
        (("node", 2), ("gpu", 4))]
    for c in sweep.counts:
        pinned = [str(o.outs[0]) for o in c.plan.ops if o.prim == "sharding_constraint"]
        assert pinned == ["(S(0), S(1))"]
    step_times = [c.plan.predicted.step_time for c in sweep.counts]
    assert step_times[0] < step_times[1]  # one device moves nothing


@pytest.mark.slow
def test_the_sweep_says_how_many_devices_the_model_needs(capsys):
    step = shardc.auto_shard(mlp.build_step(CFG), mesh=MESH, cluster=shardc.Cluster.multi_node())
    sweep = step.device_sweep(*mlp.abstract_args(CFG), memory_budget=GIB)
    assert [c.devices for c in sweep.counts] == [1, 2, 4, 8]
    assert [c.mesh for c in sweep.counts][-1] == (("node", 2), ("gpu", 4))
    fits = [c.fits for c in sweep.counts]
    assert fits == sorted(fits) and not fits[0] and fits[-1]  # more devices, less per device
    fewest = sweep.fewest()
    assert fewest.devices > 1 and fewest.plan.predicted.peak_memory <= GIB
    for c in sweep.counts:
        if not c.fits:
            assert c.needed > GIB  # the leanest plan found on those devices
    fitting = [c.plan.predicted.step_time for c in sweep.counts if c.fits]
    assert fitting == sorted(fitting, reverse=True)  # and each more is no slower
    assert "fits 1.00 GiB" in str(sweep) and "node=2 x gpu=4" in str(sweep)
    with pytest.raises(shardc.MemoryBudgetError, match="no plan fits"):
        step.device_sweep(*mlp.abstract_args(CFG), memory_budget=1e6).fewest()


def test_the_cli_prints_the_sweep(capsys):
    from shardc.cli import main

    main(["pareto", "mlp", "--mesh", "2x4", "--layers", "2", "--devices",
          "--memory-budget", "0.25"])
    captured = capsys.readouterr()
    printed = captured.out
    assert "each device count" in printed and "node=2 x gpu=4" in printed
    assert "fits 256.00 MiB" in printed
    assert "shardc: 8 devices (node=2 x gpu=4): " in captured.err  # progress, as it goes
