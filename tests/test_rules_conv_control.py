"""conv_general_dilated and control-flow rules: expected signatures present, wrong ones absent,
and EVERY returned signature checked numerically with the family checker on 2 simulated
devices.

The checker keeps an op's params global except for a few shape params it knows. Grouped
convs need more to run on a device's piece: a device holding ``1/n`` of the groups runs
``G/n`` of them, so the group counts follow the local lhs (:class:`LocalGroupsConv`, a
stand-in primitive). Loops and branches are planned inside (their bodies inlined between
edge ops), so they are checked by planning and running them against ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    check_signature_numerically,
    evaluate,
    f32,
    op_inputs,
    sig,
)
from jax import lax
from jax.sharding import AxisType

import shardc
from shardc.ir.sbp import B, P, Split
from shardc.ir.trace import trace
from shardc.ir.trips import DEFAULT_WHILE_TRIPS
from shardc.rules import op_flops, signatures, strategies
from shardc.rules.conv import conv_specs

S = Split


# ---- conv --------------------------------------------------------------------------------

class LocalGroupsConv:
    """conv_general_dilated whose group counts scale with the local lhs (what XLA's SPMD
    partitioner does for a channel- or batch-group split)."""

    name = "conv_general_dilated"
    multiple_results = False

    def __init__(self, op):
        self.op = op
        self.prim = op.prim

    def bind(self, lhs, rhs, **params):
        (lb, lf, *_), _, _ = conv_specs(self.op)
        full = self.op.inputs[0].shape
        for key, d in (("feature_group_count", lf), ("batch_group_count", lb)):
            if params[key] == 1:
                continue  # ungrouped: a split of the dim is no split of groups
            g = params[key] * lhs.shape[d]
            assert g % full[d] == 0, f"{key} {params[key]} does not divide the local lhs"
            params[key] = g // full[d]
        return self.prim.bind(lhs, rhs, **params)


def conv_ops(fn, *args):
    """Every conv_general_dilated op of ``fn`` with its concrete inputs."""
    graph = trace(fn, *args).graph
    env = evaluate(graph, args)
    return [(op, [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs])
            for op in graph.ops if op.name == "conv_general_dilated"]


def check_convs(fn, *args) -> list[tuple]:
    """(op, signatures) of every conv in ``fn``; every signature is checked numerically."""
    found = []
    for op, ins in conv_ops(fn, *args):
        grouped = op.params["feature_group_count"] > 1 or op.params["batch_group_count"] > 1
        local = op.replace(prim=LocalGroupsConv(op)) if grouped else op
        sigs = signatures(op)
        checked = sum(check_signature_numerically(local, s, ins) for s in sigs)
        assert checked == len(sigs), f"{op.params} {[str(s) for s in sigs]}: uneven test shapes"
        found.append((op, sigs))
    return found


def _conv(x, w, layout, stride, padding, groups=1):
    lhs, rhs = ("NHWC", "HWIO") if layout == "NHWC" else ("NCHW", "OIHW")
    return lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=(lhs, rhs, lhs),
                                    feature_group_count=groups)


def _cnn(layout, stride, padding, groups=1):
    def loss(x, w1, w2):
        h = jnp.tanh(_conv(x, w1, layout, stride, padding))
        return (_conv(h, w2, layout, (1, 1), padding, groups) ** 2).sum()
    return loss


def _cnn_args(layout, groups=1):
    # batch 4, 4 -> 8 -> 8 channels, 8x8 images
    if layout == "NHWC":
        return f32(4, 8, 8, 4), f32(3, 3, 4, 8), f32(3, 3, 8 // groups, 8)
    return f32(4, 4, 8, 8), f32(8, 4, 3, 3), f32(8, 8 // groups, 3, 3)


def _role_sigs(op):
    """The signatures the rule is expected to give an ungrouped conv, from its specs."""
    (lb, lf, *_), (ro, ri, *_), (ob, of, *_) = conv_specs(op)
    return {sig([S(lb), B], [S(ob)]), sig([B, S(ro)], [S(of)]), sig([S(lf), S(ri)], [P]),
            sig([P, B], [P]), sig([B, P], [P])}


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("stride,padding", [((1, 1), "SAME"), ((2, 2), "SAME"),
                                            ((2, 1), ((1, 2), (0, 1))), ((1, 1), "VALID")])
def test_cnn_forward_and_gradient_convs_are_exact(layout, stride, padding):
    args = _cnn_args(layout)
    loss = _cnn(layout, stride, padding)
    fwd = check_convs(loss, *args)
    assert len(fwd) == 2
    grads = check_convs(jax.grad(loss, argnums=(0, 1, 2)), *args)
    assert len(grads) == 6  # 2 forward, 2 input gradients (transposed), 2 kernel gradients
    for op, sigs in fwd + grads:
        assert set(sigs) == _role_sigs(op) | {sig([B, B], [B])}
        assert all(s.outs != (S(d),) for s in sigs for d in conv_specs(op)[2][2:])  # spatial


def test_kernel_gradient_splits_the_data_batch_into_partial():
    x, w1, w2 = _cnn_args("NHWC")
    ops = conv_ops(jax.grad(_cnn("NHWC", (2, 2), "SAME"), argnums=2), x, w1, w2)
    kernel_grad = [op for op, _ in ops if op.outputs[0].shape == w2.shape]
    assert kernel_grad
    for op in kernel_grad:
        # lhs = activations (batch is dim 0), rhs = cotangent (batch is dim 0): contraction
        assert sig([S(0), S(0)], [P]) in signatures(op)
        assert sig([S(3), B], [S(2)]) in signatures(op)  # lhs "batch" = input channels


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_depthwise_conv_and_its_batch_grouped_kernel_gradient(layout):
    x, w1, w2 = _cnn_args(layout, groups=8)
    loss = _cnn(layout, (1, 1), "SAME", groups=8)
    found = check_convs(jax.grad(loss, argnums=(0, 2)), x, w1, w2)
    grouped = [(op, sigs) for op, sigs in found
               if op.params["feature_group_count"] > 1 or op.params["batch_group_count"] > 1]
    assert {op.params["batch_group_count"] for op, _ in grouped} == {1, 8}
    for op, sigs in grouped:
        (lb, lf, *_), (ro, ri, *_), (ob, of, *_) = conv_specs(op)
        if op.params["batch_group_count"] > 1:  # kernel gradient
            assert sig([S(lb), S(ro)], [S(of)]) in sigs and sig([S(lf), S(ri)], [P]) in sigs
            assert sig([S(lb), B], [S(ob)]) not in sigs and sig([B, S(ro)], [S(of)]) not in sigs
        else:
            assert sig([S(lf), S(ro)], [S(of)]) in sigs and sig([S(lb), B], [S(ob)]) in sigs
            assert sig([B, S(ro)], [S(of)]) not in sigs and sig([S(lf), S(ri)], [P]) not in sigs


def test_grouped_conv_channel_split_only_when_groups_divide():
    # 2 groups of 4 channels: a mesh axis of 4 would cut groups, so no channel split at all
    x, w = f32(4, 8, 8, 8), f32(3, 3, 4, 8)
    found = check_convs(lambda x, w: _conv(x, w, "NHWC", (1, 1), "SAME", groups=2), x, w)
    (op, sigs), = found
    assert sig([S(0), B], [S(0)]) in sigs
    assert not any(isinstance(s.ins[1], Split) for s in sigs)


def test_per_example_kernel_gradients_split_by_group_compile_as_planned():
    """``jax.vmap(jax.grad)`` makes each example's kernel gradient one group of a grouped
    conv; a plan splitting the groups runs them per device: no all-to-all, which XLA's
    partitioner adds for that split (7.88 MiB here before), and jax.jit's values."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    ks = jax.random.split(jax.random.key(0), 4)
    params = {"c1": jax.random.normal(ks[0], (3, 3, 3, 16)) * 0.1,
              "c2": jax.random.normal(ks[1], (3, 3, 16, 16)) * 0.1,
              "w": jax.random.normal(ks[2], (16 * 16 * 16, 10)) * 0.01}
    x, y = jax.random.normal(ks[3], (1024, 16, 16, 3)), jnp.arange(1024) % 10
    dims = ("NHWC", "HWIO", "NHWC")

    def loss(p, xi, yi):
        h = jax.nn.relu(lax.conv_general_dilated(xi[None], p["c1"], (1, 1), "SAME",
                                                 dimension_numbers=dims))
        h = jax.nn.relu(lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME",
                                                 dimension_numbers=dims))
        return -jax.nn.log_softmax(h.reshape(1, -1) @ p["w"])[0, yi]

    def step(p, x, y):  # per-example gradients, clipped and averaged (DP-SGD's shape)
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, y)
        grads = jax.tree.map(lambda g: jnp.clip(g, -1, 1).mean(0), grads)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    sharded = shardc.auto_shard(step, mesh=mesh)
    plan = sharded.plan(params, x, y)
    convs = [o for o in plan.ops if o.prim == "conv_general_dilated"]
    # every conv split (the examples' activations reach the kernel gradients through
    # reshapes with ``dimensions``, which split too), the kernel gradients by group
    assert convs and all(any(isinstance(s, Split) for nd in o.ins for s in nd.sbps)
                         for o in convs), [(o.types, o.ins) for o in convs]
    check = plan.verify(sharded.lower(params, x, y).compile(), sharded.mesh_for(plan))
    assert not check.unplanned and check.counts_match, check.report()
    assert check.compiled_comm_time == pytest.approx(check.predicted_comm_time, rel=1e-3)
    assert_close(sharded(params, x, y), jax.jit(step)(params, x, y))


def test_conv_flops_and_strategies():
    x, w = f32(4, 8, 8, 6), f32(3, 3, 6, 10)
    op, _ = op_inputs(lambda x, w: _conv(x, w, "NHWC", (2, 2), "SAME"), x, w,
                      name="conv_general_dilated")
    # 4x4 outputs per image, 11 of the 12 (position, tap) pairs per dim read real input
    # (SAME at stride 2 pads one column on the high side)
    assert op_flops(op) == 2 * (4 * 10) * (11 * 11) * 6
    names = {st.name for st in strategies(op, (2, 2))}
    assert "S(0),B->S(0) | B,S(3)->S(3)" in names
    assert not any("P" in part.split("->")[0] for n in names for part in n.split(" | "))
    assert all(st.flops == op_flops(op) / 4 for st in strategies(op, (2, 2))
               if "B,B->B" not in st.name)


@pytest.mark.parametrize("stride, padding", [((1, 1), "SAME"), ((2, 2), "SAME"),
                                             ((2, 2), "VALID"), ((1, 1), ((2, 0), (0, 1)))])
def test_conv_flops_count_real_taps_as_xla_does(stride, padding):
    """Every conv of a strided / padded conv and its two gradients (the input gradient has
    lhs_dilation, the kernel gradient rhs_dilation) costs what XLA's cost_analysis says:
    taps that read padding or dilation holes are not work."""
    from shardc.inspect.hlo import compiled_flops

    x, w = f32(2, 9, 9, 4), f32(3, 3, 4, 6)
    loss = lambda x, w: jnp.sum(_conv(x, w, "NHWC", stride, padding) ** 2)  # noqa: E731
    graph = trace(jax.grad(loss, argnums=(0, 1)), x, w).graph
    convs = [op for op in graph.ops if op.name == "conv_general_dilated"]
    assert len(convs) == 3
    for op in convs:
        avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in op.inputs]
        compiled = jax.jit(lambda *xs, op=op: op.prim.bind(*xs, **op.params)).lower(
            *avals).compile()
        assert op_flops(op) == pytest.approx(compiled_flops(compiled), rel=1e-9), op.params


# ---- control flow ------------------------------------------------------------------------

def rnn(h0, xs, w, u):
    def body(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, (h.sum(-1), h * 2.0)
    return lax.scan(body, h0, xs)


def cumulative(h0, xs):
    def body(h, x):
        h = jnp.cumsum(h * x, axis=0)  # mixes the batch (dim 0)
        return h, h[0]
    return lax.scan(body, h0, xs)


def scalar_carry_reversed(h0, xs, bias):
    def body(carry, x):
        t, h = carry
        h = h * 0.5 + x + bias + t  # bias (6,) is broadcast into (8, 6) in the body
        return (t + 1.0, h), h.max(-1)
    return lax.scan(body, (jnp.float32(0.0), h0), xs, reverse=True)


def nested(h0, xs):
    def step(h, x):  # x: (2, batch, 6): an inner scan over its leading axis
        h, _ = lax.scan(lambda c, y: (jnp.tanh(c + y), None), h, x)
        return h, h * 2.0
    return lax.scan(step, h0, xs)


def masked(h0, xs, mask, bias):
    return lax.scan(lambda h, x: (h * mask + x * bias.sum(), None), h0, xs)


SCANS = {
    "rnn": (rnn, (f32(8, 6), f32(5, 8, 3), f32(6, 6), f32(3, 6))),
    "cumulative": (cumulative, (f32(8, 6), f32(5, 8, 6))),
    "scalar carry, reversed": (scalar_carry_reversed, (f32(8, 6), f32(3, 8, 6), f32(6))),
    "nested": (nested, (f32(8, 6), f32(3, 2, 8, 6))),
    "masked": (masked, (f32(8, 6), f32(3, 8, 6), f32(8, 6), f32(6))),
}


def test_scan_enter_and_exit_shift_the_scanned_axis():
    """xs enter the body one slice per iteration (outer dim d + 1 is the body's d; the
    scanned axis is never split), ys leave stacked; consts and carries pass as they are."""
    graph = trace(rnn, *SCANS["rnn"][1]).graph
    kinds = {}
    for op in graph.ops:
        if op.name in ("scan_enter", "scan_exit"):
            kinds.setdefault((op.name, op.params["kind"]), signatures(op))
    xs = kinds["scan_enter", "xs"]
    assert sig([S(1)], [S(0)]) in xs and not any(s.ins[0] == S(0) for s in xs)
    assert sig([S(0)], [S(1)]) in kinds["scan_exit", "ys"]
    assert sig([S(0)], [S(0)]) in kinds["scan_enter", "carry"]
    assert sig([S(0)], [S(0)]) in kinds["scan_exit", "carry"]


def test_nested_scan_bodies_weigh_the_product_of_trip_counts():
    graph = trace(nested, *SCANS["nested"][1]).graph
    assert {op.weight for op in graph.ops if op.name == "tanh"} == {3 * 2}
    assert {op.weight for op in graph.ops if op.name == "mul"} == {3}


@pytest.mark.parametrize("name", list(SCANS))
def test_scans_planned_on_a_mesh_match_jit(name):
    """Each scan, and its gradient (the transposed scan), planned op by op on (2, 4) and
    run: the values jax.jit gives."""
    fn, args = SCANS[name]

    def loss(*args):
        return sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(fn(*args)))

    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    for f in (fn, jax.grad(loss, argnums=tuple(range(len(args))))):
        got = shardc.auto_shard(f, mesh=mesh, time_limit=1.0)(*args)
        want = jax.jit(f)(*args)
        assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_while_loops_are_planned_inside():
    """A while loop's predicate and body are inlined like a scan's body, weighted by the
    trip count its bounds give (else the estimate); planned on a mesh and run, a counted
    loop and one whose predicate reads every row (a reduction over the split batch, read
    replicated) give the values jax.jit gives."""
    def counted(h, w):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)
        return lax.while_loop(lambda c: c[0] < 3, body, (jnp.int32(0), h))

    def until_small(h):  # the trip count depends on every row
        return lax.while_loop(lambda h: jnp.abs(h).max() > 0.1, lambda h: h * 0.5, h)

    graph = trace(counted, f32(8, 6), f32(6, 6)).graph
    assert {op.weight for op in graph.ops if op.name == "tanh"} == {3}
    graph = trace(until_small, f32(8, 6)).graph
    assert {op.weight for op in graph.ops if op.name == "mul"} == {DEFAULT_WHILE_TRIPS}
    rng = np.random.default_rng(0)
    h, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((8, 6), (6, 6)))
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    for fn, args in ((counted, (h, w)), (until_small, (h,))):
        got = shardc.auto_shard(fn, mesh=mesh, time_limit=1.0)(*args)
        assert_close(got, jax.jit(fn)(*args), rtol=1e-5, atol=1e-6)


def test_cond_branches_are_planned_inside_with_the_index_broadcast():
    """A cond's branches are planned op by op between ``cond_enter`` / ``cond_exit`` ops,
    the exits reading the index broadcast; planned on a mesh and run, the cond (either
    branch) and its gradient give the values jax.jit gives."""
    branches = [lambda x, y: (jnp.sin(x), jnp.zeros_like(y[0])),  # index 0: false
                lambda x, y: (x * 2.0, y.sum(0))]

    def fn(p, x, y):
        return lax.cond(p, branches[1], branches[0], x, y)

    graph = trace(fn, True, f32(8, 6), f32(8, 6)).graph
    exits = [op for op in graph.ops if op.name == "cond_exit"]
    assert len(exits) == 2 and all(s.ins[0] == B for op in exits for s in signatures(op))
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(8, 6)), jnp.float32) for _ in range(2))

    def loss(p, x, y):
        return sum(jnp.sum(jnp.sin(v)) for v in fn(p, x, y))

    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    for f in (fn, jax.grad(loss, argnums=(1, 2))):
        planned = shardc.auto_shard(f, mesh=mesh, time_limit=1.0)
        for p in (True, False):
            assert_close(planned(p, x, y), jax.jit(f)(p, x, y), rtol=1e-5, atol=1e-6)
