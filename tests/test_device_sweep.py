"""The device-count sweep: the best plan on each device count that divides the mesh."""

import pytest
from jax.sharding import AbstractMesh

import shardc
from shardc.frontier import device_counts
from shardc.models import mlp

# weights dominate (4 layers of 2048 x 8192 with Adam): one device cannot hold the state in
# a GiB, so the sweep has counts that do not fit and counts that do
CFG = mlp.MLPConfig(batch=256, d_in=2048, hidden=8192, d_out=2048, n_layers=4)
MESH = AbstractMesh((2, 4), ("node", "gpu"))
GIB = float(2**30)


def test_device_counts_fill_the_inner_axes_first():
    assert device_counts((2, 4), ("node", "gpu")) == [
        (1, (1,), ("gpu",)), (2, (2,), ("gpu",)), (4, (4,), ("gpu",)),
        (8, (2, 4), ("node", "gpu"))]
    # 2 of (2, 3) is no block of the inner axis: skipped
    assert [k for k, _, _ in device_counts((2, 3), ("node", "gpu"))] == [1, 3, 6]


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
    printed = capsys.readouterr().out
    assert "each device count" in printed and "node=2 x gpu=4" in printed
    assert "fits 256.00 MiB" in printed
