"""Host memory as a placement: where a memory budget binds, an optimizer's moments live in
``pinned_host`` memory between steps, moved to the devices for the update and back."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import first_call_compiles

import shardc
from shardc.plan.record import Plan

LAYERS, WIDTH, BATCH = 4, 256, 64
OPT = optax.adam(1e-3)


def _loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def _step(ws, st, x):
    loss, g = jax.value_and_grad(_loss)(ws, x)
    updates, st = OPT.update(g, st, ws)
    return optax.apply_updates(ws, updates), st, loss


@pytest.fixture(scope="module")
def args():
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) * 0.05
          for k in jax.random.split(jax.random.key(0), LAYERS)]
    return ws, OPT.init(ws), jax.random.normal(jax.random.key(1), (BATCH, WIDTH))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:8])


#: below the leanest plan keeping everything on the devices (about 1 MiB: the weights, the
#: moments and the update's temporaries), above one keeping the moments in host memory
BUDGET = 900_000


@pytest.fixture(scope="module")
def offloaded(mesh, args):
    step = shardc.auto_shard(_step, mesh=mesh, memory_budget=BUDGET)
    return step, step.plan(*args)


def test_a_binding_budget_keeps_the_moments_in_host_memory(offloaded, args):
    step, plan = offloaded
    ws, st, _ = args
    names = [plan.input_names[k] for k in plan.offloaded]
    moments = [k for k, leaf in enumerate(jax.tree.leaves((ws, st, args[2])))
               if leaf.ndim == 2 and k >= LAYERS and k < LAYERS + 1 + 2 * LAYERS]
    assert sorted(plan.offloaded) == moments, names
    assert all(".mu" in n or ".nu" in n for n in names), names
    # both ways over the host link, each device its shard
    shard = sum(plan.inputs[k].shard_fraction(plan.axis_sizes) for k in plan.offloaded)
    expect = 2 * shard * WIDTH * WIDTH * 4 / plan.cluster.host_bandwidth
    assert plan.predicted.host_time == pytest.approx(expect)
    assert plan.predicted.step_time >= plan.predicted.host_time
    assert plan.predicted.peak_memory <= BUDGET
    assert plan.solver["compiled_peak"] <= BUDGET
    assert "offload: 8 state leaves live in host memory" in plan.explain()


def test_the_offloaded_step_equals_jax_jit_and_keeps_its_state_on_the_host(offloaded, args):
    step, _ = offloaded
    want = jax.jit(_step)(*args)
    got = step(*args)
    # the moments carry the gradients (mu = 0.1 g, nu = 0.001 g^2): compared to f32 sums'
    # rounding at their own scale; Adam's first update moves each weight by at most its
    # learning rate whatever the gradient's size, so the weights within that of each other
    for a, b in zip(jax.tree.leaves(want[1]), jax.tree.leaves(got[1])):
        scale = float(np.max(np.abs(np.asarray(a)))) or 1.0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale)
    for a, b in zip(want[0], got[0]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-3)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
    kinds = [leaf.sharding.memory_kind for leaf in jax.tree.leaves(got[1]) if leaf.ndim]
    assert kinds == ["pinned_host"] * (2 * LAYERS)
    again = step(got[0], got[1], args[2])  # the state fed back as it came
    np.testing.assert_allclose(np.asarray(again[2]), np.asarray(jax.jit(_step)(
        want[0], want[1], args[2])[2]), rtol=1e-5)


def test_the_compiled_program_reads_and_writes_host_memory(offloaded, args):
    step, _ = offloaded
    text = step.lower(*args).compile().as_text()
    layout = text.splitlines()[0]
    assert layout.count(":S(5)}") == 2 * 2 * LAYERS  # the moments in, their new values out


def test_offload_false_keeps_everything_on_the_devices(mesh, args):
    step = shardc.auto_shard(_step, mesh=mesh, memory_budget=BUDGET, offload=False)
    with pytest.raises(shardc.MemoryBudgetError):
        step.plan(*args)


def test_without_a_budget_nothing_is_offloaded(mesh, args):
    plan = shardc.auto_shard(_step, mesh=mesh).plan(*args)
    assert plan.offloaded == () and plan.predicted.host_time == 0


def test_a_saved_plan_keeps_what_it_offloads(offloaded):
    _, plan = offloaded
    back = Plan.from_json(plan.to_json())
    assert back.offloaded == plan.offloaded
    assert back.offloaded_outputs == plan.offloaded_outputs
    assert back.predicted.host_time == plan.predicted.host_time


def test_the_first_call_runs_the_budget_checks_compile(mesh, args):
    """The budget's check compiled the offloading plan as its first call passes the
    arguments (the moments moved to host memory first), so that call compiles nothing
    (a step planned without a budget compiles its program, by this name, at its first
    call)."""
    compiled, _ = first_call_compiles(shardc.auto_shard(_step, mesh=mesh), *args)
    assert "jit(positional)" in compiled, compiled
    step = shardc.auto_shard(_step, mesh=mesh, memory_budget=BUDGET)
    assert step.plan(*args).offloaded
    compiled, got = first_call_compiles(step, *args)
    assert "jit(positional)" not in compiled, compiled
    np.testing.assert_allclose(got[2], jax.jit(_step)(*args)[2], rtol=1e-5)


def test_a_plan_adopted_after_planning_runs_its_own_program(mesh, args):
    """The budget's check compiled the offloading plan ahead for the first call; a plan
    adopted before that call (``use_plan``: here the same layouts with the state kept on
    the devices) runs its own program instead, its state on the devices."""
    step = shardc.auto_shard(_step, mesh=mesh, memory_budget=BUDGET)
    plan = step.plan(*args)
    assert plan.offloaded
    step.use_plan(dataclasses.replace(plan, offloaded=(), offloaded_outputs=()), *args)
    got = step(*args)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got)} == {"device"}
    np.testing.assert_allclose(got[2], jax.jit(_step)(*args)[2], rtol=1e-5)


def test_the_frontier_extends_below_the_leanest_plan_on_the_devices(mesh, args):
    step = shardc.auto_shard(_step, mesh=mesh)
    frontier = step.pareto(*args, budgets=2)
    on_device = [p for p in frontier if not p.offloaded]
    in_host = [p for p in frontier if p.offloaded]
    assert in_host and on_device
    assert min(p.predicted.peak_memory for p in in_host) < \
        min(p.predicted.peak_memory for p in on_device)
    assert "in host memory" in frontier.table()


def test_moving_the_state_in_hides_behind_the_compute_before_its_first_read(offloaded):
    import dataclasses

    from shardc.plan.overlap import host_exposed

    _, plan = offloaded
    host = plan.predicted.host_time
    assert host / 2 <= host_exposed(plan) <= host
    # with the forward and backward passes slower than the way in, only the way out shows
    slow = dataclasses.replace(plan, ops=tuple(
        dataclasses.replace(op, compute_time=op.compute_time + host) for op in plan.ops))
    assert host_exposed(slow) == pytest.approx(host / 2)


def test_a_budget_nothing_meets_names_one_that_plans_with_state_in_host_memory(mesh, args):
    with pytest.raises(shardc.MemoryBudgetError) as err:
        shardc.auto_shard(_step, mesh=mesh, memory_budget=100_000).plan(*args)
    named = err.value.needed
    assert named < 1_000_000  # below the leanest plan kept on the devices (about 1 MiB)
    plan = shardc.auto_shard(_step, mesh=mesh, memory_budget=named).plan(*args)
    assert plan.offloaded and plan.predicted.peak_memory <= named
