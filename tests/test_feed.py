"""What passing a step's arguments costs: host arrays pay the feed of their shards, arrays
already placed on the mesh pay their conversion to the plan's layout (nothing where the
plan keeps them where they are)."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc

MESH = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))


def _layer(w, x):
    return jnp.tanh(x @ w)


def _args():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(256, 256)).astype(np.float32),
            rng.normal(size=(4096, 256)).astype(np.float32))


def test_arguments_already_placed_pay_no_feed():
    """The same layer planned three ways: its arguments from the host pay their feed;
    placed on the mesh as the plan takes them they pay nothing; the batch placed whole
    (replicated) pays nothing either, as a split of a replicated array is a slice. Each
    run equals jax.jit's."""
    w, x = _args()
    host = shardc.auto_shard(_layer, mesh=MESH).plan(w, x)
    assert host.predicted.feed_time > 0
    for spec in (Ps("gpu"), Ps()):
        placed = (jax.device_put(w, NamedSharding(MESH, Ps())),
                  jax.device_put(x, NamedSharding(MESH, spec)))
        step = shardc.auto_shard(_layer, mesh=MESH)
        plan = step.plan(*placed)
        assert plan.predicted.feed_time == 0.0, (spec, plan.predicted)
        assert plan.predicted.step_time < host.predicted.step_time
        assert_close(step(*placed), jax.jit(_layer)(w, x), rtol=1e-5, atol=1e-5)


def test_an_argument_placed_otherwise_pays_its_conversion():
    """In the cost graph a placed input costs, per layout, its conversion from where it is
    (nothing to stay, a slice to split further, an all-gather to be whole), where a host
    input costs its shard's feed; a plan that keeps a split weight split feeds nothing and
    gathers it in the program."""
    from shardc.ir.sbp import B, NdSbp, Split
    from shardc.ir.trace import trace
    from shardc.solve.fixed import Fixed
    from shardc.solve.problem import build

    w, x = _args()
    graph = trace(_layer, w, x).graph
    cluster = shardc.Cluster()
    split, whole = NdSbp((Split(0),)), NdSbp((B,))
    host = build(graph, (8,), ("gpu",), cluster)
    placed = build(graph, (8,), ("gpu",), cluster, fixed=Fixed(placed={0: split}))
    layouts = host.choices[0]
    assert placed.choices[0] == layouts and {split, whole} <= set(layouts)
    cost = dict(zip(layouts, placed.cost[0], strict=True))
    feed = dict(zip(layouts, host.cost[0], strict=True))
    assert cost[split] == 0.0 < feed[split] < feed[whole]
    assert cost[whole] == placed.reshard_matrix([split], [whole], w.nbytes)[0, 0] > 0
    placed_args = (jax.device_put(w, NamedSharding(MESH, Ps("gpu"))),
                   jax.device_put(x, NamedSharding(MESH, Ps("gpu"))))
    step = shardc.auto_shard(_layer, mesh=MESH)
    plan = step.plan(*placed_args)
    assert plan.inputs[0] == split and plan.predicted.feed_time == 0.0
    assert plan.predicted.comm_time > 0  # the weight gathered inside the program
    assert_close(step(*placed_args), jax.jit(_layer)(w, x), rtol=1e-5, atol=1e-5)
