"""Mesh-shape search: the logical views of a physical mesh, and running on the one chosen."""

import jax
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType

import shardc
from shardc.cost.cluster import IB_BW, IB_LAT, NVLINK_BW, Cluster
from shardc.models import mlp
from shardc.plan.record import Plan
from shardc.tradeoff.views import views


def test_views_of_two_nodes_price_each_axis_at_the_links_it_crosses():
    got = {v.shape: v for v in views((2, 8), ("node", "gpu"), Cluster.multi_node())}
    assert list(got) == [(2, 8), (16,), (4, 4), (8, 2)]
    assert got[(2, 8)].names == ("node", "gpu")
    flat = got[(16,)]
    assert flat.cluster.bandwidth(flat.names[0]) == IB_BW  # 16 devices cross InfiniBand
    a, b = got[(4, 4)].names
    assert (a, b) == ("node_gpu2", "gpu4")  # 2 nodes x 2 GPUs, then 4 GPUs of a node
    assert got[(4, 4)].cluster.bandwidth(a) == IB_BW
    assert got[(4, 4)].cluster.latency(a) == IB_LAT
    assert got[(4, 4)].cluster.bandwidth(b) == NVLINK_BW


def test_views_skip_cuts_that_split_an_axis_unevenly():
    # (3, 2) devices cannot be cut into (2, 3) along row-major order without splitting the
    # 3-axis across a logical boundary
    shapes = [v.shape for v in views((3, 2), ("a", "b"), Cluster())]
    assert shapes == [(3, 2), (6,)]


def test_axes_of_size_one_are_not_cut():
    # a device-sweep sub-mesh: dropping node=1 is the same mesh, and one device has no cut
    two = Cluster.multi_node()
    assert [v.label for v in views((1, 4), ("node", "gpu"), two)] == ["node=1 x gpu=4"]
    assert [v.label for v in views((1, 1), ("node", "gpu"), two)] == ["node=1 x gpu=1"]
    assert [v.shape for v in views((1, 8), ("node", "gpu"), two)] == [(1, 8), (2, 4), (4, 2)]


def test_view_mesh_keeps_the_device_order():
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    v = next(v for v in views((2, 4), ("node", "gpu"), Cluster()) if v.shape == (4, 2))
    m = v.mesh(mesh)
    assert m.axis_names == v.names
    assert [d.id for d in m.devices.flat] == [d.id for d in mesh.devices.flat]


TINY = mlp.MLPConfig(batch=64, d_in=32, hidden=32, d_out=32, n_layers=2)


def _tiny():
    return mlp.make_train_step(TINY)


def test_mesh_search_reports_every_view_and_keeps_the_cheapest():
    step_fn, (state, data) = _tiny()
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=Cluster.multi_node(),
                             time_limit=1.0, mesh_search=True)
    plan = step.plan(state, data)
    tried = plan.solver["mesh_search"]
    assert [t["mesh"] for t in tried] == [v.label for v in views(
        (2, 4), ("node", "gpu"), Cluster.multi_node())]
    assert plan.predicted.step_time == pytest.approx(min(t["predicted_s"] for t in tried))
    assert "mesh search (predicted step per view of the devices)" in plan.explain()
    loss = step(state, data)[1]
    np.testing.assert_allclose(float(loss), float(jax.jit(step_fn)(state, data)[1]),
                               rtol=1e-5)


def test_a_plan_for_another_view_runs_on_that_view_of_the_devices():
    """A plan made on a (2, 2) mesh, adopted by a function with mesh search over the same 4
    devices as (4,), runs on the (2, 2) view and matches the unsharded step."""
    step_fn, (state, data) = _tiny()
    devices = jax.devices()[:4]
    square = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                           devices=devices)
    made = shardc.auto_shard(step_fn, mesh=square, time_limit=1.0).plan(state, data)
    line = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=devices)
    step = shardc.auto_shard(step_fn, mesh=line, time_limit=1.0, mesh_search=True)
    step.use_plan(Plan.from_json(made.to_json()), state, data)
    assert step.mesh_for(step.plan(state, data)).axis_names == ("a", "b")
    new_state, loss = step(state, data)
    ref_state, ref = jax.jit(step_fn)(state, data)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    assert_close(new_state, ref_state, lr=TINY.learning_rate)


def test_seeds_written_on_another_view_seed_that_view():
    """Under mesh search a seed seeds every view whose axes it names: data parallelism over
    the flat view of a (2, 4) mesh (axis ``node_gpu``) bounds that view's plan; a seed that
    names no view's axes is refused."""
    step_fn, (state, data) = _tiny()
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    flat_dp = (jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec("node_gpu"))
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=Cluster.multi_node(), time_limit=1.0,
                             mesh_search=True, seeds={"dp": flat_dp})
    plan = step.plan(state, data)
    flat = next(t for t in plan.solver["mesh_search"] if t["mesh"] == "node_gpu=8")
    seeded = plan.solver["seeds"]["dp on node_gpu=8"]
    assert flat["predicted_s"] <= seeded * (1 + 1e-6)
    assert plan.predicted.step_time <= seeded * (1 + 1e-6)
    stray = shardc.auto_shard(step_fn, mesh=mesh, time_limit=1.0, mesh_search=True,
                              seeds={"dp": (jax.sharding.PartitionSpec(),
                                            jax.sharding.PartitionSpec("z"))})
    with pytest.raises(ValueError, match="seed 'dp' fits none of the meshes planned"):
        stray.plan(state, data)
