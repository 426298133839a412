"""``step.explain(*args)``: the plan's explanation straight from the step."""

import jax
import jax.numpy as jnp
import pytest

import shardc


def _step():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    return shardc.auto_shard(lambda x, w: jnp.tanh(x @ w).sum(), mesh=mesh)


def test_explain_plans_for_the_arguments_as_plan_explain_does():
    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    step = _step()
    text = step.explain(x, w)
    assert text == step.plan(x, w).explain()
    assert "  x  f32[64,32]" in text and "  w  f32[32,16]" in text  # the user's names


def test_explain_with_no_arguments_reads_the_plan_the_step_made():
    step = _step()
    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    step(x, w)
    assert step.explain() == step.plan(x, w).explain()


def test_explain_before_any_plan_says_to_pass_the_arguments():
    with pytest.raises(shardc.PlanError, match=r"step\.explain\(\*args\)"):
        _step().explain()


def test_explain_with_several_plans_asks_which():
    step = _step()
    step.plan(jnp.ones((64, 32)), jnp.ones((32, 16)))
    step.plan(jnp.ones((32, 32)), jnp.ones((32, 16)))
    with pytest.raises(shardc.PlanError, match="plans for 2 argument signatures"):
        step.explain()
    sds = jax.ShapeDtypeStruct
    assert step.explain(sds((32, 32), jnp.float32), sds((32, 16), jnp.float32)) == \
        step.plan(jnp.ones((32, 32)), jnp.ones((32, 16))).explain()


def test_explain_of_a_function_without_arguments_plans_it():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    step = shardc.auto_shard(lambda: jnp.arange(64.0).reshape(8, 8) * 2, mesh=mesh)
    assert step.explain() == step.plan().explain()
