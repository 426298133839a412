"""sort / top_k / approx_top_k (``shardc/rules/sort.py``) and the no-arithmetic ops of
``shardc/rules/misc.py`` (``name``, ``optimization_barrier``, ``bitcast_convert_type``): expected
signatures present, wrong ones absent, EVERY signature checked numerically with the family
checker on 2 simulated devices (approx_top_k's on 8 too, and planned and run on the 8 CPU
devices of ``conftest.py``), and the FLOP counts against XLA's."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_signature_numerically, f32, op_inputs, sig
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType

import shardc
from shardc.inspect.hlo import compiled_flops
from shardc.ir.sbp import B, NdSbp, P, Partial, Split
from shardc.rules import op_flops, signatures, strategies
from shardc.rules.misc import MAX_FREE_PAIRINGS

S = Split
RNG = np.random.default_rng(3)


def check_every(fn, *args, name: str, n: int = 2):
    """(op, signatures); every signature is verified numerically on ``n`` simulated devices
    (none may be uneven)."""
    op, ins = op_inputs(fn, *args, name=name)
    sigs = signatures(op)
    for s in sigs:
        assert check_signature_numerically(op, s, ins, n=n), f"{name} {s}: uneven test shapes"
    return op, sigs


def has_partial(sigs) -> bool:
    return any(isinstance(x, Partial) for s in sigs for x in (*s.ins, *s.outs))


def xla_flops(fn, *args) -> float:
    return compiled_flops(jax.jit(fn).lower(*args).compile())


# ---- sort --------------------------------------------------------------------------------

def test_sort_splits_every_dim_but_the_sorted_one():
    op, sigs = check_every(lambda x: jnp.sort(x, axis=1), f32(4, 6, 2), name="sort")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)]), sig([S(2)], [S(2)])}
    assert not has_partial(sigs)


def test_multi_operand_sort_and_argsort_move_all_operands_together():
    x, y = f32(4, 6), jnp.asarray(RNG.integers(0, 3, (4, 6)), jnp.float32)  # ties: key 2 used
    _, sigs = check_every(lambda x, y: lax.sort((y, x), dimension=0, num_keys=2), x, y,
                          name="sort")
    assert set(sigs) == {sig([B, B], [B, B]), sig([S(1), S(1)], [S(1), S(1)])}
    _, sigs = check_every(lambda x: jnp.argsort(x, axis=1), f32(4, 6), name="sort")  # (x, iota)
    assert set(sigs) == {sig([B, B], [B, B]), sig([S(0), S(0)], [S(0), S(0)])}


@pytest.mark.parametrize("axis", [-1, 0])
def test_top_k_splits_every_dim_but_its_axis(axis):
    op, sigs = check_every(lambda x: lax.top_k(x, 2, axis=axis), f32(4, 6), name="top_k")
    other = 1 - axis % 2
    assert set(sigs) == {sig([B], [B, B]), sig([S(other)], [S(other), S(other)])}


def test_sort_strategies_never_cut_the_sorted_dim():
    op, _ = op_inputs(lambda x: jnp.sort(x, axis=1), f32(4, 8, 6), name="sort")
    strats = strategies(op, (2, 2))
    assert {"S(0)->S(0) | S(2)->S(2)", "S(2)->S(2) | S(0)->S(0)"} <= {st.name for st in strats}
    assert all(sb.dim != 1 for st in strats for nd in (*st.ins, *st.outs) for sb in nd
               if isinstance(sb, Split))
    assert all(st.flops == op_flops(op) / 4 for st in strats if "B" not in st.name)


def test_sort_flops_count_comparisons_per_row():
    """n ceil(log2 n) per row. For one row XLA's HloCostAnalysis says the same; for a batch of
    rows it charges N ceil(log2 N) for all N elements at once, so we check a batch against
    rows x XLA's count of one row."""
    for n in (64, 100):
        op, _ = op_inputs(jnp.sort, f32(n), name="sort")
        assert op_flops(op) == xla_flops(jnp.sort, f32(n)) == n * np.ceil(np.log2(n))
    op, _ = op_inputs(lambda x: jnp.sort(x, axis=1), f32(16, 64), name="sort")
    assert op_flops(op) == 16 * xla_flops(jnp.sort, f32(64)) == 16 * 64 * 6
    assert xla_flops(lambda x: jnp.sort(x, axis=1), f32(16, 64)) == 16 * 64 * 10  # overcount
    op, _ = op_inputs(lambda x: jnp.argsort(x, axis=0), f32(64, 4), name="sort")
    assert op_flops(op) == 4 * 64 * 6  # a second operand adds no comparisons


def test_top_k_flops_are_the_sort_xla_decomposes_it_into():
    """XLA's TopkDecomposer sorts each row with an iota and slices k off; HandleTopK itself
    charges nothing, so the number to match is XLA's count of that sort."""
    op, _ = op_inputs(lambda x: lax.top_k(x, 4), f32(8, 128), name="top_k")
    row = lambda x: lax.sort((x, lax.iota(jnp.int32, 128)), num_keys=1)  # noqa: E731
    assert op_flops(op) == 8 * xla_flops(row, f32(128)) == 8 * 128 * 7


# ---- approx_top_k (top_k's rule along reduction_dimension) -------------------------------

@pytest.mark.parametrize("approx", [lax.approx_max_k, lax.approx_min_k])
@pytest.mark.parametrize("dim,aggregate", [(-1, True), (1, True), (0, True), (1, False)])
def test_approx_top_k_splits_every_dim_but_its_reduction_dimension(approx, dim, aggregate):
    """S(d) -> S(d), S(d) for every d but the reduced one, exact on 2 and on 8 devices (CPU's
    fallback is an exact top-k: the indices are compared exactly); ``aggregate_to_topk=False``
    keeps more than k along the reduced dim and splits the same dims."""
    fn = lambda x: approx(x, 4, reduction_dimension=dim, aggregate_to_topk=aggregate)  # noqa: E731
    x = f32(8, 24, 16)
    for n in (2, 8):
        op, sigs = check_every(fn, x, name="approx_top_k", n=n)
    reduced = dim % 3
    assert op.params["reduction_dimension"] == dim
    assert set(sigs) == {sig([B], [B, B])} | {sig([S(d)], [S(d), S(d)])
                                              for d in range(3) if d != reduced}
    assert not has_partial(sigs)
    strats = strategies(op, (2, 4))
    assert all(sb.dim != reduced for st in strats for nd in (*st.ins, *st.outs) for sb in nd
               if isinstance(sb, Split))
    assert all(st.flops == op_flops(op) / 8 for st in strats if "B" not in st.name)


def test_approx_top_k_flops_are_top_k_s():
    """Priced as top_k: each row sorted with an iota, k sliced off (XLA's fallback). A min's
    fallback stays a sort on CPU (a max's becomes the TopK custom call, which XLA's analysis
    does not count), so one row of it is XLA's n ceil(log2 n)."""
    x = f32(8, 128)
    approx, _ = op_inputs(lambda x: lax.approx_min_k(x, 4), x, name="approx_top_k")
    exact, _ = op_inputs(lambda x: lax.top_k(x, 4), x, name="top_k")
    assert op_flops(approx) == op_flops(exact) == 8 * 128 * 7
    assert op_flops(approx) == 8 * xla_flops(lambda x: lax.approx_min_k(x, 4), f32(128))
    along0, _ = op_inputs(lambda x: lax.approx_max_k(x, 4, reduction_dimension=0), x.T,
                          name="approx_top_k")
    assert op_flops(along0) == op_flops(approx)  # the rows are along the other dim


def test_approx_max_k_is_planned_on_8_devices_without_a_warning_and_matches_jit():
    """Under ``shardc.auto_shard`` on the 8 CPU devices: no NoRuleWarning, the op split
    (not replicated), no all-gather, and exactly ``jax.jit``'s values and indices."""
    x = f32(16, 64)

    def fn(x):
        values, indices = lax.approx_max_k(jnp.tanh(x), 4)
        return values * 2.0, indices

    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    sharded = shardc.auto_shard(fn, mesh=mesh, time_limit=1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = sharded.plan(x)
        got = sharded(x)
    assert not [w for w in record if issubclass(w.category, shardc.NoRuleWarning)], record
    op = [o for o in plan.ops if o.prim == "approx_top_k"][0]
    assert any(isinstance(sb, Split) for sb in op.ins[0].sbps), op
    assert "all-gather" not in sharded.lower(x).compile().as_text()
    for a, b in zip(got, jax.jit(fn)(x), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- name and optimization_barrier -------------------------------------------------------

def test_checkpoint_name_passes_every_layout_through():
    op, sigs = check_every(lambda x: checkpoint_name(x, "h") * 2.0, f32(4, 6), name="name")
    assert op.params["name"] == "h"
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)]), sig([S(1)], [S(1)]), sig([P], [P])}
    _, sigs = check_every(lambda x: checkpoint_name(x > 0, "m"), f32(4, 6), name="name")
    assert not has_partial(sigs)  # a bool is never partial


def test_barrier_pairs_operands_independently():
    # 3 x 3 layouts: every pairing is listed, e.g. activation S(0) next to weight S(1)
    op, sigs = check_every(lambda x, w: lax.optimization_barrier((x, w)), f32(4, 6), f32(6, 2),
                           name="optimization_barrier")
    assert len(sigs) == 9 + 1
    assert {sig([S(0), S(1)], [S(0), S(1)]), sig([B, S(0)], [B, S(0)]),
            sig([S(1), B], [S(1), B]), sig([P, P], [P, P])} <= set(sigs)
    assert all(s.ins == s.outs for s in sigs)  # result k is operand k
    names = {st.name for st in strategies(op, (2, 2), consume_partial=True)}
    assert "S(0),B->S(0),B | B,S(0)->B,S(0)" in names  # independent across mesh axes too


def test_barrier_partial_leaves_bool_operands_broadcast():
    _, sigs = check_every(lambda x: lax.optimization_barrier((x, x > 0)), f32(4, 6),
                          name="optimization_barrier")
    assert sig([P, B], [P, B]) in sigs
    assert not any(isinstance(s.ins[1], Partial) for s in sigs)


def test_barrier_over_many_operands_lists_a_linear_number_of_layouts():
    args = [f32(4, 6), f32(4, 6), f32(4, 2)]  # 27 pairings > MAX_FREE_PAIRINGS
    assert 3 ** 3 > MAX_FREE_PAIRINGS
    _, sigs = check_every(lambda *xs: lax.optimization_barrier(xs), *args,
                          name="optimization_barrier")
    together = {sig([S(d)] * 3, [S(d)] * 3) for d in (0, 1)}
    alone = {sig([S(d) if j == k else B for j in range(3)], [S(d) if j == k else B
                                                             for j in range(3)])
             for k in range(3) for d in (0, 1)}
    assert set(sigs) == together | alone | {sig([B] * 3, [B] * 3), sig([P] * 3, [P] * 3)}


def test_identities_cost_nothing():
    op, _ = op_inputs(lambda x: checkpoint_name(x, "h") * 2.0, f32(4, 6), name="name")
    assert op_flops(op) == 0.0
    barrier = lambda x, y: lax.optimization_barrier((x, y))  # noqa: E731
    op, _ = op_inputs(barrier, f32(4, 6), f32(6), name="optimization_barrier")
    assert op_flops(op) == 0.0 == xla_flops(barrier, f32(4, 6), f32(6))


# ---- bitcast_convert_type ----------------------------------------------------------------

@pytest.mark.parametrize("shape,src,dst,kept", [
    ((4, 6), jnp.float32, jnp.uint32, 2),  # same width: elementwise
    ((4, 6), jnp.float32, jnp.uint8, 2),  # narrower: a trailing dim of 4 bytes is added
    ((4, 6, 2), jnp.uint16, jnp.float32, 2),  # wider: the trailing dim of 2 halves goes
])
def test_bitcast_keeps_every_split_but_the_bytes_dim(shape, src, dst, kept):
    x = jnp.asarray(RNG.integers(0, 2**15, shape), src)
    fn = lambda x: lax.bitcast_convert_type(x, dst)  # noqa: E731
    op, sigs = check_every(fn, x, name="bitcast_convert_type")
    assert set(sigs) == {sig([B], [B])} | {sig([S(d)], [S(d)]) for d in range(kept)}
    assert not has_partial(sigs)  # bits of a sum are not a sum of bits
    lowered = jax.jit(fn).lower(x).cost_analysis()["flops"]  # XLA: one per output element
    assert op_flops(op) == op.outputs[0].size == lowered


def test_bitcast_strategies_fit_the_mesh():
    op, _ = op_inputs(lambda x: lax.bitcast_convert_type(x, jnp.uint8), f32(4, 6),
                      name="bitcast_convert_type")
    outs = {st.outs[0] for st in strategies(op, (2, 2))}
    assert NdSbp((S(0), S(1))) in outs and NdSbp((S(1), S(1))) not in outs  # 6 % 4 != 0
