"""End to end: auto_shard of the zoo's train steps equals the unsharded step."""

import functools

import jax
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding

import shardc
from shardc.models import gpt, mlp

MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("node", "gpu")), "4x2": ((4, 2), ("node", "gpu"))}
MODELS = {"mlp": (mlp, mlp.MLPConfig.tiny()), "gpt": (gpt, gpt.GPTConfig.tiny())}


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def run_steps(step, state, batch, n=3):
    losses = []
    for _ in range(n):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


@functools.cache
def _unsharded(model_name):
    """The model's step, its arguments and three unsharded steps' state and losses (one
    reference per model, shared by its meshes)."""
    module, cfg = MODELS[model_name]
    step_fn, (state, batch) = module.make_train_step(cfg)
    return step_fn, state, batch, *run_steps(jax.jit(step_fn), state, batch)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_sharded_equals_unsharded(model_name, mesh_name):
    _, cfg = MODELS[model_name]
    step_fn, state, batch, r_state, r_losses = _unsharded(model_name)
    mesh = make_mesh(*MESHES[mesh_name])
    step = shardc.auto_shard(step_fn, mesh=mesh, time_limit=2.0)
    s_state, s_losses = run_steps(step, state, batch)
    np.testing.assert_allclose(s_losses, r_losses, rtol=1e-4)
    # the parameters after three Adam steps: each element to the plain tolerance plus what
    # Adam's update makes of rounding-sized gradient differences (shardc.bench.numerics;
    # the attention key bias has an identically zero gradient, softmax ignoring a
    # per-query constant, so its summation-order rounding becomes whole updates)
    assert_close(s_state, r_state, lr=3 * cfg.learning_rate)
    # the new state comes back laid out as the plan says, the plan priced on this mesh
    plan = step.plan(state, batch)
    assert plan.axis_names == mesh.axis_names and plan.predicted.step_time > 0
    leaves = jax.tree.leaves(s_state)
    for x, spec in zip(leaves, plan.output_specs()[:len(leaves)], strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (
            x.sharding, spec)


def test_plan_cached_and_abstract_args():
    step_fn, (state, batch) = mlp.make_train_step(mlp.MLPConfig.tiny())
    step = shardc.auto_shard(step_fn, mesh=make_mesh((2, 4), ("node", "gpu")), time_limit=1.0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    p1 = step.plan(*abstract)
    p2 = step.plan(state, batch)
    assert p1 is p2  # same abstract signature: planned once
    # lowered from shapes alone, the compiled step runs the arrays as the plan lays them out
    compiled = step.lower(*abstract).compile()
    specs = [s.spec for s in jax.tree.leaves(compiled.input_shardings)]
    assert len(specs) == len(p1.input_specs())
    for got, want, x in zip(specs, p1.input_specs(), jax.tree.leaves((state, batch)),
                            strict=True):
        assert NamedSharding(step.mesh, got).is_equivalent_to(NamedSharding(step.mesh, want),
                                                              x.ndim), (got, want)
    new_state, loss = compiled(*jax.device_put((state, batch),
                                               compiled.input_shardings[0]))
    ref_state, ref_loss = jax.jit(step_fn)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(new_state, ref_state, lr=mlp.MLPConfig.tiny().learning_rate)


def test_plan_json_round_trip():
    step_fn, (state, batch) = mlp.make_train_step(mlp.MLPConfig.tiny())
    step = shardc.auto_shard(step_fn, mesh=make_mesh((2, 4), ("node", "gpu")), time_limit=1.0)
    plan = step.plan(state, batch)
    again = shardc.Plan.from_json(plan.to_json())
    assert again == plan
    step.use_plan(again, state, batch)
    _, loss = step(state, batch)
    assert np.isfinite(float(loss))


def test_explicit_mesh_is_converted():
    step_fn, (state, batch) = mlp.make_train_step(mlp.MLPConfig.tiny())
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    step = shardc.auto_shard(step_fn, mesh=mesh, time_limit=1.0)
    assert all(t == AxisType.Auto for t in step.mesh.axis_types)
    _, loss = step(state, batch)
    _, ref = jax.jit(step_fn)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


def test_decorator_form_static_and_donate():
    mesh = make_mesh((8,), ("x",))

    @shardc.auto_shard(mesh=mesh, static_argnums=1, donate_argnums=0)
    def scale(x, k):
        return x * k + 1.0

    x = jax.numpy.ones((16, 8))
    np.testing.assert_allclose(np.asarray(scale(x, 3.0)), 4.0)
    np.testing.assert_allclose(np.asarray(scale(jax.numpy.ones((16, 8)), 2.0)), 3.0)
    assert len(scale._plans) == 2  # one plan per static value


def test_bad_mesh_and_cluster_errors():
    with pytest.raises(TypeError, match="needs a jax.sharding.Mesh"):
        shardc.auto_shard(lambda x: x, mesh=(2, 4))
    cluster = shardc.Cluster(axis_bandwidth={"nope": 1e9})
    with pytest.raises(ValueError, match="does not have"):
        shardc.auto_shard(lambda x: x, mesh=make_mesh((8,), ("x",)), cluster=cluster)


def test_memory_budget_is_enforced():
    cfg = mlp.MLPConfig(batch=64, d_in=256, hidden=256, d_out=256, n_layers=3,
                        learning_rate=1e-2)
    step_fn, (state, batch) = mlp.make_train_step(cfg)
    mesh = make_mesh((8,), ("x",))
    free = shardc.auto_shard(step_fn, mesh=mesh, time_limit=2.0).plan(state, batch)
    budget = free.predicted.peak_memory * 0.6
    tight = shardc.auto_shard(step_fn, mesh=mesh, time_limit=5.0, memory_budget=budget)
    plan = tight.plan(state, batch)
    assert plan.predicted.peak_memory <= budget
    with pytest.raises(shardc.MemoryBudgetError, match="no plan fits"):
        shardc.auto_shard(step_fn, mesh=mesh, memory_budget=1024.0, time_limit=1.0).plan(
            state, batch)


def test_unknown_primitive_runs_replicated_with_one_warning():
    mesh = make_mesh((8,), ("x",))

    def f(x):
        y = jax.lax.igamma(x * x + 1.0, x * x + 2.0)  # no rule
        return jax.lax.igamma(y + 1.0, y + 2.0) + 1.0

    step = shardc.auto_shard(f, mesh=mesh)
    x = jax.numpy.arange(64.0).reshape(16, 4)[::-1] / 64
    with pytest.warns(UserWarning, match="no sharding rule for primitive 'igamma'") as rec:
        out = step(x)
    assert sum("igamma" in str(w.message) for w in rec) == 1
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x)), rtol=1e-5)


def test_new_state_is_tied_to_the_state_it_replaces():
    from shardc.ir.trace import trace
    from shardc.step.signature import tie_outputs

    st = {"a": jax.numpy.ones(3), "b": jax.numpy.ones((2, 2))}
    x = jax.numpy.ones(4)
    t = trace(lambda s, x: ({"a": s["a"] + 1, "b": s["b"] * x.sum()}, x.sum()), st, x)
    assert tie_outputs(t.in_tree.children(), t.out_tree, t.graph) == [(0, 0), (1, 1)]
    t = trace(lambda s, x: {"a": s["a"] + 1, "b": s["b"]}, st, x)  # the state alone
    assert tie_outputs(t.in_tree.children(), t.out_tree, t.graph) == [(0, 0), (1, 1)]
    t = trace(lambda s, x: {"a": s["a"][:2], "b": s["b"]}, st, x)  # a leaf changed shape
    assert tie_outputs(t.in_tree.children(), t.out_tree, t.graph) == [(1, 1)]
