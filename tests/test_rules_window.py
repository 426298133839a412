"""Windowed reductions (pooling) and their gradients: expected signatures present, no split of
a windowed (spatial) dim, no partial of a max or min, EVERY signature checked numerically
with the family checker on 2 simulated devices, and FLOPs equal to XLA's count.

The window params (sizes, strides, padding, dilations) only name the windowed dims, so a
split of a pass-through dim needs no local params: the checker runs the primitive as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import check_signature_numerically, evaluate, f32, op_inputs, sig
from jax import lax

from shardc.inspect.hlo import compiled_flops
from shardc.ir.sbp import B, P, Partial, Split
from shardc.ir.trace import trace
from shardc.rules import has_rule, op_flops, signatures, strategies
from shardc.rules.window import passthrough_dims

S = Split
WINDOW_OPS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
              "select_and_scatter_add", "select_and_gather_add")
LINEAR = ("reduce_window_sum", "select_and_scatter_add", "select_and_gather_add")


def checked_ops(fn, *args, names=(*WINDOW_OPS, "pad")) -> list[tuple]:
    """(op, signatures) of every ``names`` op of ``fn``; each signature is checked
    numerically (all must fit the test shapes, a partial constant aside)."""
    graph = trace(fn, *args).graph
    env = evaluate(graph, args)
    found = []
    for op in graph.ops:
        if op.name not in names:
            continue
        ins = [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]
        sigs = signatures(op)
        for s in sigs:
            const_partial = any(v.is_const and isinstance(x, Partial)
                                for v, x in zip(op.inputs, s.ins, strict=True))
            assert check_signature_numerically(op, s, ins) or const_partial, \
                f"{op.name} {s} does not fit the test shapes"
        found.append((op, sigs))
    return found


def windowed_dims(op) -> set[int]:
    return set(range(len(op.params["window_dimensions"]))) - set(passthrough_dims(op))


def assert_window_signatures(op, sigs, kept=(0, 3)) -> None:
    """Pass-through dims ``kept`` split, nothing else split, partial only where linear."""
    n_in, n_out = len(op.inputs), len(op.outputs)
    assert set(passthrough_dims(op)) == set(kept)
    for d in kept:
        ins = (S(d),) * n_in if op.name.startswith("select") else \
            (S(d),) * n_out + (B,) * (n_in - n_out)
        assert sig(ins, [S(d)] * n_out) in sigs
    for s in sigs:
        splits = {x.dim for x in (*s.ins, *s.outs) if isinstance(x, Split)}
        assert not splits & windowed_dims(op), f"{op.name} {s} splits a windowed dim"
    has_partial = any(isinstance(x, Partial) for s in sigs for x in (*s.ins, *s.outs))
    assert has_partial == (op.name in LINEAR)
    if op.name == "reduce_window_sum":
        assert sig([P], [P]) in sigs
    elif op.name in LINEAR:
        assert sig([P, B], [P]) in sigs  # linear in the values, not in the selecting operand


def _loss(pool, window, strides, padding):
    return lambda x: (pool(jnp.tanh(x), window, strides=strides, padding=padding) ** 2).sum()


POOLS = {"max": (nnx.max_pool, {"reduce_window_max", "select_and_scatter_add"}),
         "avg": (nnx.avg_pool, {"reduce_window_sum", "pad"})}


@pytest.mark.parametrize("pool,window,strides,padding", [
    ("max", (2, 2), (2, 2), "VALID"), ("max", (2, 3), (1, 2), ((1, 0), (0, 1))),
    ("avg", (3, 3), (2, 2), "SAME"),
    ("avg", (2, 3), (1, 2), ((1, 0), (0, 1)))])
def test_pooling_and_its_gradient_split_batch_and_channels_only(pool, window, strides, padding):
    fn, prims = POOLS[pool]
    loss = _loss(fn, window, strides, padding)
    x = f32(4, 8, 8, 6)  # NHWC: batch 4, channels 6
    (fwd, fwd_sigs), = checked_ops(loss, x)
    assert fwd.name == f"reduce_window_{'sum' if pool == 'avg' else pool}"
    assert_window_signatures(fwd, fwd_sigs)
    grads = checked_ops(jax.grad(loss), x)
    assert {op.name for op, _ in grads} == prims | {fwd.name}
    for op, sigs in grads:
        if op.name == "pad":  # avg-pool's gradient dilates the cotangent by the stride
            assert {sig([S(0), B], [S(0)]), sig([S(3), B], [S(3)]), sig([P, B], [P])} <= set(sigs)
            assert all(s.ins[0] not in (S(1), S(2)) for s in sigs)
        else:
            assert_window_signatures(op, sigs)


def test_nchw_min_pool_and_its_gradient_split_batch_and_channels():
    def loss(x):
        return (lax.reduce_window(x, jnp.inf, lax.min, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")
                ** 2).sum()

    found = checked_ops(jax.grad(loss), f32(4, 6, 8, 8))
    assert {op.name for op, _ in found} == {"reduce_window_min", "select_and_scatter_add"}
    for op, sigs in found:
        assert_window_signatures(op, sigs, kept=(0, 1))


@pytest.mark.parametrize("kw", [
    {"window_strides": (1, 1, 2, 1)},  # a size-1 window that subsamples
    {"padding": ((0, 0), (0, 0), (1, 0), (0, 0))},  # a size-1 window over padding
    {"base_dilation": (1, 1, 2, 1)},  # holes between the elements of dim 2
])
def test_a_size_one_window_is_no_pass_through_when_it_moves_elements(kw):
    params = {"window_dimensions": (1, 2, 1, 1), "window_strides": (1, 1, 1, 1),
              "padding": ((0, 0),) * 4, "base_dilation": (1,) * 4} | kw

    def fn(x):
        return lax.reduce_window(x, 0.0, lax.add, params["window_dimensions"],
                                 params["window_strides"], params["padding"],
                                 base_dilation=params["base_dilation"])

    (op, sigs), = checked_ops(fn, f32(4, 8, 8, 6))
    assert op.name == "reduce_window_sum"
    assert_window_signatures(op, sigs)
    assert all(S(2) not in s.ins for s in sigs)


def _sum_and_max(x):
    return lax.reduce_window((x, x), (0.0, -jnp.inf),
                             lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
                             (1, 2, 2, 1), (1, 1, 1, 1), "VALID")


def _product(x):
    return lax.reduce_window(x, 1.0, lax.mul, (1, 2, 2, 1), (1, 2, 1, 1), "VALID")


@pytest.mark.parametrize("fn", [_sum_and_max, _product])
def test_generic_reduce_window_splits_pass_through_dims_with_broadcast_inits(fn):
    (op, sigs), = checked_ops(fn, f32(4, 8, 8, 6))
    assert op.name == "reduce_window"
    assert_window_signatures(op, sigs)


def test_select_and_gather_add_from_the_max_pool_jvp():
    def jvp(x, t):
        pool = lambda x: nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")  # noqa: E731
        return jax.jvp(pool, (x,), (t,))

    found = checked_ops(jvp, f32(4, 8, 8, 6), f32(4, 8, 8, 6))
    assert {op.name for op, _ in found} == {"reduce_window_max", "select_and_gather_add"}
    for op, sigs in found:
        assert_window_signatures(op, sigs)


# ---- FLOPs -------------------------------------------------------------------------------

def _xla_flops(op, compiled: bool = True) -> float:
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in op.inputs]
    lowered = jax.jit(lambda *xs: op.prim.bind(*xs, **op.params)).lower(*avals)
    if compiled:
        return compiled_flops(lowered.compile())
    return float(lowered.cost_analysis()["flops"])


def test_window_flops_are_xla_counts():
    """reduce_window*: (window - 1) reducer applications per output element, padded taps
    included; select_and_scatter_add: (window - 1) selects + 1 add per source element, as
    XLA counts the HLO op (the CPU backend then expands it into index tuples, so its
    compiled count is not the op's: compared before optimisation)."""
    x = f32(2, 9, 9, 4)
    loss = lambda x: ((nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME") ** 2).sum()  # noqa: E731
                      + (nnx.avg_pool(x, (3, 2), strides=(2, 1), padding="SAME") ** 2).sum())
    graph = trace(jax.grad(loss), x).graph
    ops = [op for op in graph.ops if op.name in WINDOW_OPS]
    assert sorted(op.name for op in ops) == ["reduce_window_max", "reduce_window_sum",
                                             "reduce_window_sum", "select_and_scatter_add"]
    for op in ops:
        compiled = op.name != "select_and_scatter_add"
        assert op_flops(op) == pytest.approx(_xla_flops(op, compiled), rel=1e-9), op.params
    (rw_max,) = [op for op in ops if op.name == "reduce_window_max"]
    assert op_flops(rw_max) == 8 * rw_max.outputs[0].size  # 3x3 window: 8 comparisons each
    (sas,) = [op for op in ops if op.name == "select_and_scatter_add"]
    assert op_flops(sas) == 9 * sas.inputs[0].size


@pytest.mark.parametrize("fn,per_output", [(_sum_and_max, 3 * 2), (_product, 3 * 1)])
def test_generic_reduce_window_flops_count_the_reducer_body(fn, per_output):
    op, _ = op_inputs(fn, f32(2, 8, 8, 4), name="reduce_window")
    # 2x2 windows: 3 reductions per output, of 2 scalar ops (sum, max) or 1 (product)
    assert op_flops(op) == per_output * op.outputs[0].size
    assert op_flops(op) == pytest.approx(_xla_flops(op), rel=1e-9)


def test_select_and_gather_add_flops():
    x = f32(2, 8, 8, 4)
    jvp = lambda x, t: jax.jvp(lambda x: nnx.max_pool(x, (2, 2), strides=(2, 2)), (x,), (t,))  # noqa: E731
    op, _ = op_inputs(jvp, x, x, name="select_and_gather_add")
    assert op_flops(op) == 3 * 3 * op.outputs[0].size  # compare + 2 selects, 3 reductions
    assert op_flops(op) == pytest.approx(_xla_flops(op), rel=1e-9)


def test_pooling_strategies_on_a_2d_mesh():
    op, _ = op_inputs(lambda x: nnx.max_pool(x, (2, 2), strides=(2, 2)), f32(4, 8, 8, 6),
                      name="reduce_window_max")
    strats = strategies(op, (2, 2))
    names = {st.name for st in strats}
    assert {"S(0)->S(0) | S(3)->S(3)", "S(3)->S(3) | S(0)->S(0)", "B->B | B->B"} <= names
    assert not any("S(1)" in n or "S(2)" in n or "P" in n for n in names)
    for st in strats:
        split = sum(part != "B->B" for part in st.name.split(" | "))
        assert st.flops == op_flops(op) / 2 ** split


# ---- a pooling CNN's train step ----------------------------------------------------------

def _cnn_step(params, x, y):
    def loss(params):
        w1, w2, wd = params
        conv = lambda h, w: lax.conv_general_dilated(  # noqa: E731
            h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = nnx.max_pool(jax.nn.relu(conv(x, w1)), (2, 2), strides=(2, 2))
        h = nnx.avg_pool(jax.nn.relu(conv(h, w2)), (3, 3), strides=(2, 2), padding="SAME")
        return optax.softmax_cross_entropy_with_integer_labels(h.mean((1, 2)) @ wd, y).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def test_every_op_of_a_pooling_cnn_train_step_has_a_rule():
    params = (f32(3, 3, 3, 4), f32(3, 3, 4, 6), f32(6, 10))
    x, y = f32(4, 8, 8, 3), jnp.arange(4, dtype=jnp.int32)
    graph = trace(_cnn_step, params, x, y).graph
    assert [op.name for op in graph.ops if not has_rule(op.name)] == []
    found = [op for op in graph.ops if op.name in WINDOW_OPS]
    assert {op.name for op in found} == {"reduce_window_max", "reduce_window_sum",
                                         "select_and_scatter_add"}
    for op in found:  # the same kinds of op are checked numerically above
        assert_window_signatures(op, signatures(op))
