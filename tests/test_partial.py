"""Partial sums held stacked in a loop body (``shardc/lower/partial.py``): the pieces on
plain arrays, then a loop whose accumulator the plan keeps partial."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import shardc
from shardc.ir.sbp import B, NdSbp, P, Partial, S
from shardc.lower.partial import (
    Stacked,
    lift,
    stack,
    stackable,
    stacked_sharding,
    unstack,
    vmapped,
    widen,
)

SIZES = (2, 4)  # mesh (node, gpu)
RNG = np.random.default_rng(0)


def test_lift_cuts_a_split_dim_into_the_axis_pieces():
    x = jnp.asarray(RNG.normal(size=(16, 3)), jnp.float32)
    arr, batched = lift(x, (), NdSbp((B, S(0))), (1,), SIZES)
    assert batched == (1,) and arr.shape == (4, 4, 3)
    for j in range(4):  # the gpu axis's j-th device holds rows 4j..4j+3
        np.testing.assert_array_equal(arr[j], x[4 * j:4 * j + 4])


def test_lift_keeps_other_axes_splitting_the_same_dim():
    """Dim 0 split on (node, gpu), lifted along gpu only: piece j holds node i's chunk
    (i, j) for each i, in node order, so the node split of what is left is unchanged."""
    x = jnp.arange(16.0)
    arr, batched = lift(x, (), NdSbp((S(0), S(0))), (1,), SIZES)
    assert batched == (1,) and arr.shape == (4, 4)
    for j in range(4):
        np.testing.assert_array_equal(arr[j], jnp.concatenate([x[8 * i + 2 * j:8 * i + 2 * j + 2]
                                                                for i in range(2)]))


def test_stack_keeps_the_value_on_the_first_device_only():
    x = jnp.asarray(RNG.normal(size=(5,)), jnp.float32)
    held = stack(x, (0, 1), SIZES)
    assert held.shape == (2, 4, 5)
    np.testing.assert_array_equal(held[0, 0], x)
    assert float(jnp.abs(held).sum() - jnp.abs(x).sum()) == 0.0
    np.testing.assert_array_equal(unstack(Stacked(held, (0, 1))), x)


def test_widening_a_stacked_sum_keeps_its_summands_and_adds_zeros():
    """A sum held stacked over the gpu axis, read partial over both axes (replicated along
    node): each node's summands are the gpu summands on node 0 and zeros on node 1; the
    value is the same, and nothing was summed."""
    held = Stacked(jnp.asarray(RNG.normal(size=(4, 5)), jnp.float32), (1,))
    wide = widen(held, (0, 1), SIZES)
    assert wide.axes == (0, 1) and wide.x.shape == (2, 4, 5)
    np.testing.assert_array_equal(wide.x[0], held.x)
    np.testing.assert_array_equal(wide.x[1], jnp.zeros((4, 5)))
    np.testing.assert_allclose(unstack(wide), unstack(held), rtol=1e-6)
    node = widen(Stacked(held.x[:2], (0,)), (0, 1), SIZES)  # the new axis after the held one
    assert node.x.shape == (2, 4, 5)
    np.testing.assert_array_equal(node.x[:, 0], held.x[:2])
    assert float(jnp.abs(node.x[:, 1:]).sum()) == 0.0


def test_summands_of_a_dot_over_the_split_dim_add_up_to_the_dot():
    x = jnp.asarray(RNG.normal(size=(16, 3)), jnp.float32)
    y = jnp.asarray(RNG.normal(size=(16, 5)), jnp.float32)
    split = NdSbp((S(0), S(0)))
    lifted = [lift(v, (), split, (0, 1), SIZES) for v in (x, y)]
    out = vmapped(lambda a, b: a.T @ b, [b for _, b in lifted], (0, 1))(*[a for a, _ in lifted])
    assert out.shape == (2, 4, 3, 5)
    np.testing.assert_allclose(unstack(Stacked(out, (0, 1))), x.T @ y, rtol=1e-5, atol=1e-5)


def test_a_stacked_value_names_its_partial_axes_first():
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    spec = stacked_sharding(mesh, (0,), NdSbp((P, S(1))), 2).spec
    assert tuple(spec) == ("node", None, "gpu")
    assert stacked_sharding(mesh, (0,), NdSbp((Partial("max"), B)), 2) is None


def test_stackable_needs_every_partial_axis_fed():
    ins = (NdSbp((S(0), S(0))), NdSbp((S(0), S(0))))
    assert stackable("dot_general", ins, NdSbp((P, P)))
    assert stackable("add", (NdSbp((P, B)), NdSbp((P, B))), NdSbp((P, B)))
    # an elementwise op reading a split operand does not contract the split dim
    assert not stackable("add", (NdSbp((S(0), B)), NdSbp((P, B))), NdSbp((P, B)))
    # nothing makes the gpu axis partial: a vmap would count the value four times
    assert not stackable("add", (NdSbp((P, B)), NdSbp((P, B))), NdSbp((P, P)))
    assert not stackable("reduce_max", (NdSbp((S(0), B)),), NdSbp((Partial("max"), B)))


def test_a_partial_accumulator_matches_the_unsharded_loop():
    """An accumulator of per-micro-batch partial sums (a column sum of a batch-split input):
    the plan keeps the carry partial and the run equals ``jax.jit``'s."""
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    xs = jnp.asarray(RNG.normal(size=(3, 64, 128)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(128, 128)), jnp.float32)

    def accumulate(w, xs):
        def body(acc, x):
            return acc + jnp.tanh(x @ w).T @ x, None

        return jax.lax.scan(body, jnp.zeros((128, 128), jnp.float32), xs)[0]

    spec = jax.sharding.PartitionSpec
    step = shardc.auto_shard(accumulate, mesh=mesh,
                             in_shardings=(spec(), spec(None, ("node", "gpu"))),
                             cluster=shardc.Cluster(device_flops=1e12))  # compute decides
    plan = step.plan(w, xs)
    carry = [o for o in plan.ops if o.prim == "scan_enter" and o.outs[0].has_partial]
    assert len(carry) == 1 and str(carry[0].outs[0]) == "(P, P)"
    # the loop carries each device's summand: one leading dim per mesh axis
    assert "tensor<2x4x128x128xf32>" in step.lower(w, xs).as_text()
    np.testing.assert_allclose(np.asarray(step(w, xs)), np.asarray(jax.jit(accumulate)(w, xs)),
                               rtol=1e-4, atol=1e-3)
