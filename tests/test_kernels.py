"""The kernel compute term (shardc.cost.kernels) and its held-out fit (shardc.bench.
compute_fit): curves read as measured, elementwise chains fused into one kernel that moves
its operands and results once, a split op's share of a launch floor."""

import jax
import jax.numpy as jnp
import pytest

from shardc.bench.compute_fit import fit_per_argument, kernel_holdout, step_holdout
from shardc.cost.cluster import Cluster
from shardc.cost.kernels import H100, compute_seconds, fusion, interpolate, monotone, op_seconds
from shardc.ir.flops import op_flops
from shardc.ir.trace import trace

CURVE = monotone([(1e3, 2e-6), (1e6, 4e-6), (1e9, 1e-3), (1e6, 6e-6)])


def test_a_curve_is_its_points_the_floor_below_and_the_last_rate_beyond():
    assert [x for x, _ in CURVE] == [1e3, 1e6, 1e9]
    assert [t for _, t in CURVE] == pytest.approx([2e-6, 5e-6, 1e-3])  # repeats averaged
    assert interpolate(CURVE, 10.0) == 2e-6
    assert interpolate(CURVE, 1e6) == pytest.approx(5e-6)
    assert interpolate(CURVE, 2e9) == pytest.approx(2e-3)
    mid = interpolate(CURVE, 1e3 ** 1.5)  # half way in log size: half way in log time
    assert mid == pytest.approx((2e-6 * 5e-6) ** 0.5)


def test_a_smaller_kernel_never_costs_more_than_a_larger():
    assert monotone([(1.0, 9.0), (2.0, 3.0), (4.0, 5.0)]) == ((1.0, 3.0), (2.0, 3.0),
                                                              (4.0, 5.0))


def _graph(fn, *shapes):
    return trace(fn, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).graph


def test_an_elementwise_chain_between_dots_is_one_kernel_moving_its_ends_once():
    def f(x, w):
        h = x @ w
        h = jnp.tanh(h * 2.0 + 1.0)
        return h @ w

    g = _graph(f, (256, 256), (256, 256))
    places = fusion(g)
    fused = [op for op in g.ops if places[op.id].kind == "fused"]
    assert {op.name for op in fused} >= {"mul", "add", "tanh"}
    moved = sum(places[op.id].nbytes for op in fused)
    assert moved == 2 * 256 * 256 * 4  # the first dot's result in, tanh's out
    assert {places[op.id].kernel_bytes for op in fused} == {moved}
    assert [places[op.id].kind for op in g.ops if op.name == "dot_general"] == ["dot", "dot"]


def test_a_reductions_readers_start_a_kernel_that_reads_the_input_again():
    def norm(x):
        return x - jnp.mean(x, axis=-1, keepdims=True)

    g = _graph(norm, (1024, 1024))
    places = fusion(g)
    sub = next(op for op in g.ops if op.name == "sub")
    total = next(op for op in g.ops if op.name == "reduce_sum")
    assert places[sub.id].kind == places[total.id].kind == "fused"
    assert places[sub.id].kernel_bytes != places[total.id].kernel_bytes  # two kernels
    assert places[sub.id].nbytes >= 2 * 1024 * 1024 * 4  # x read again, result written


def test_a_split_op_takes_its_share_of_the_kernel_and_never_less_than_the_floor():
    big = _graph(lambda x: jnp.exp(x), (8192, 8192))
    small = _graph(lambda x: jnp.exp(x), (64, 64))
    for g, eighth in ((big, 1 / 8 * 1.25), (small, 1.0)):
        op = next(op for op in g.ops if op.name == "exp")
        place = fusion(g)[op.id]
        whole = op_seconds(H100, op, place, op_flops(op))
        split = op_seconds(H100, op, place, op_flops(op) / 8)
        assert split <= whole * eighth
        assert split >= H100.memory[0][1] * place.nbytes / place.kernel_bytes - 1e-12


def test_a_dot_is_the_slower_of_its_arithmetic_and_its_traffic():
    g = _graph(lambda a, b: a @ b, (4096, 4096), (4096, 4096))
    op = g.ops[0]
    t = op_seconds(H100, op, fusion(g)[op.id], op_flops(op))
    assert t == pytest.approx(H100.dot_seconds(op_flops(op), 4))
    assert t == pytest.approx(3.63e-4, rel=0.01)  # the measured 4096^3 f32 dot
    assert H100.dot_seconds(op_flops(op), 2) < t  # bf16 runs faster


def test_without_a_kernel_model_compute_is_flops_over_the_rate():
    g = _graph(lambda a, b: a @ b, (512, 512), (512, 512))
    op = g.ops[0]
    flat = Cluster(kernels=None, device_flops=1e12, utilization=0.5)
    assert compute_seconds(flat, g, op, 1e9) == pytest.approx(1e9 / 5e11)
    assert compute_seconds(Cluster(kernels="h100"), g, op, 1e9) != \
        compute_seconds(flat, g, op, 1e9)


def test_a_cluster_names_its_kernel_model_and_keeps_it_when_saved():
    saved = Cluster(kernels="h100").to_json()
    assert Cluster.from_json(saved).kernels == "h100"
    del saved["kernels"]  # saved before kernel models: FLOPs, the default
    assert Cluster.from_json(saved).kernels is None
    with pytest.raises(ValueError, match="kernels names a measured kernel model"):
        Cluster(kernels="a100")


def test_the_per_argument_cost_is_fitted_without_the_model_it_predicts():
    rows = [("a", 1.0 + 10 * 2e-3, 1.0, 10), ("b", 2.0 + 100 * 2e-3, 2.0, 100),
            ("c", 5.0, 1.0, 50)]
    assert fit_per_argument([(m, k, a) for _, m, k, a in rows[:2]]) == pytest.approx(2e-3)
    fits = step_holdout(rows)
    assert fits[2].per_argument_s == pytest.approx(2e-3)  # c's outlier not in its own fit
    assert fits[2].ratio == pytest.approx(5.0 / 1.1)
    assert fits[0].per_argument_s > 2e-3  # a's fit sees c's residual


def test_each_kernel_is_priced_by_the_curve_without_it():
    rows = [{"kind": "add", "bytes": b, "s": s} for b, s in ((1e3, 1e-6), (1e6, 2e-6),
                                                             (1e9, 1e-3))]
    held = kernel_holdout(rows)
    assert [p for _, p in held] == pytest.approx([2e-6, interpolate(((1e3, 1e-6),
                                                                     (1e9, 1e-3)), 1e6),
                                                  2e-3])
