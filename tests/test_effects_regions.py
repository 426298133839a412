"""Every primitive of a real train step: prints and callbacks run as under jax.jit, shard_map
regions are fixed layouts, dropout and pooling steps plan like data parallelism where that
is cheapest, and the plan reports what ran replicated for lack of a rule."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import SLOW_DEVICES, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc
from shardc.inspect.hlo import collectives

MESH = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def shard(fn, **kw):
    """auto_shard on slow devices (tests/helpers.py): these small steps shard there."""
    kw.setdefault("cluster", SLOW_DEVICES)
    return shardc.auto_shard(fn, mesh=MESH, time_limit=kw.pop("time_limit", 3.0), **kw)


# ---- effects -----------------------------------------------------------------------------

def _count_callbacks(step, n_calls=3):
    fired = []

    def record(x):
        fired.append(float(x))

    def loss(w, x):
        jax.debug.print("loss input {}", jnp.sum(w))  # inside a differentiated loss
        return jnp.sum(jnp.tanh(x @ w))

    def fn(w, x, i):
        jax.debug.callback(record, jnp.sum(x))  # top level
        value, g = jax.value_and_grad(loss)(w, x)

        def body(c, _):
            jax.debug.callback(record, c)  # a scan body
            return c + 1.0, None

        c, _ = jax.lax.scan(body, value, None, length=3)
        jax.lax.cond(i % 2 == 0, lambda: jax.debug.callback(record, c),  # unused result
                     lambda: None)
        return w - 0.1 * g, value

    f = step(fn)
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    for i in range(n_calls):
        jax.block_until_ready(f(w, x, i))
    jax.effects_barrier()
    return fired


def test_callbacks_fire_as_often_as_under_jit(capfd):
    want = _count_callbacks(jax.jit)
    printed_jit = capfd.readouterr().out.count("loss input")
    got = _count_callbacks(shard)
    printed = capfd.readouterr().out.count("loss input")
    assert len(want) == 1 * 3 + 3 * 3 + 2  # top level, scan body, cond taken twice
    assert got == want  # the same values, in the same order
    assert printed == printed_jit == 3


def test_an_effect_with_no_outputs_is_a_graph_op():
    from shardc.ir.trace import trace

    graph = trace(lambda x: (jax.debug.print("{}", x), x * 2)[1], jnp.ones(4)).graph
    op = next(o for o in graph.ops if o.name == "debug_print")
    assert op.outputs == [] and op.effects
    assert "debug_print" in str(graph)


# ---- shard_map regions -------------------------------------------------------------------

def test_shard_map_region_runs_and_matches_jit(recwarn):
    def kernel(h):
        return jax.lax.pmean(h * 2.0, "gpu")

    def step(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            h = jax.shard_map(kernel, mesh=MESH, in_specs=Ps("node", "gpu"),
                              out_specs=Ps("node"))(h)
            return jnp.sum(h ** 2)

        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    w = jnp.arange(64.0).reshape(8, 8) / 64
    x = jnp.ones((16, 8))
    s = shard(step)
    got = s(w, x)
    assert_close(got, jax.jit(step)(w, x), rtol=1e-5, atol=1e-6)
    assert not [m for m in recwarn if "no sharding rule" in str(m.message)]
    region = next(o for o in s.plan(w, x).ops if o.prim == "shard_map")
    assert [str(nd) for nd in region.ins] == ["(S(0), S(1))"]  # its in_specs, fixed


# ---- dropout and pooling plan like data parallelism --------------------------------------

class _DropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1)

    def __call__(self, x, rngs):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


class _PoolCNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(3, 16, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.fc = nnx.Linear(32 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.c1(x)), (2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.c2(x)), (2, 2), strides=(2, 2))
        return self.fc(x.reshape(x.shape[0], -1))


def _dropout_step():
    graphdef, params = nnx.split(_DropoutMLP(nnx.Rngs(0)), nnx.Param)
    opt = optax.adam(1e-3)

    def step(state, batch):
        def loss(p):
            out = nnx.merge(graphdef, p)(batch["x"], nnx.Rngs(dropout=batch["key"]))
            return jnp.mean((out - batch["y"]) ** 2)

        value, g = jax.value_and_grad(loss)(state["params"])
        u, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

    batch = {"x": jnp.ones((2048, 64)), "y": jnp.ones((2048, 64)), "key": jax.random.key(0)}
    return step, {"params": params, "opt": opt.init(params)}, batch


def _pooling_step():
    graphdef, params = nnx.split(_PoolCNN(nnx.Rngs(0)), nnx.Param)
    opt = optax.sgd(1e-2)

    def step(state, batch):
        def loss(p):
            logits = nnx.merge(graphdef, p)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, g = jax.value_and_grad(loss)(state["params"])
        u, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

    batch = {"x": jnp.ones((256, 16, 16, 3)), "y": jnp.zeros((256,), jnp.int32)}
    return step, {"params": params, "opt": opt.init(params)}, batch


def _data_parallel(step, state, batch):
    rep = jax.tree.map(lambda _: NamedSharding(MESH, Ps()), state)
    split = jax.tree.map(lambda x: NamedSharding(MESH, Ps(("node", "gpu")) if x.ndim else Ps()),
                         batch)
    return jax.jit(step, in_shardings=(rep, split)).lower(state, batch).compile()


def _kinds(compiled) -> collections.Counter:
    return collections.Counter(c.kind for c in collectives(compiled.as_text(), MESH))


@pytest.mark.parametrize("make", [_dropout_step, _pooling_step], ids=["dropout", "pooling"])
def test_dropout_and_pooling_steps_compile_like_data_parallelism(make, recwarn):
    step, state, batch = make()
    s = shard(step, time_limit=5.0)
    plan = s.plan(state, batch)
    assert not [m for m in recwarn if "no sharding rule" in str(m.message)]
    got = s.lower(state, batch).compile()
    dp = _data_parallel(step, state, batch)
    assert got.cost_analysis()["flops"] <= dp.cost_analysis()["flops"]
    assert set(_kinds(got)) <= set(_kinds(dp))
    assert plan.predicted.step_time > 0
    got_state, got_loss = s(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    # dropout's step is Adam's (lr 1e-3): its update bounds the parameters' difference
    assert_close(got_state, want_state, rtol=1e-4, atol=1e-6,
                 lr=1e-3 if make is _dropout_step else 0.0)


def test_the_dropout_mask_is_drawn_split():
    step, state, batch = _dropout_step()
    bits = next(o for o in shard(step).plan(state, batch).ops if o.prim == "random_bits")
    assert not bits.outs[0].is_replicated  # each device draws its own slice


# ---- coverage ----------------------------------------------------------------------------

def test_explain_lists_what_ran_replicated_for_lack_of_a_rule():
    def f(x):  # igamma (the regularized incomplete gamma function) has no rule
        return jax.lax.igamma(x.T @ x + 16.0, jnp.ones((8, 8))) @ x.T

    with pytest.warns(UserWarning, match="igamma"):
        plan = shard(f).plan(jnp.ones((16, 8)))
    text = plan.explain()
    assert "no sharding rule" in text and "igamma" in text and "% of compute" in text
