"""Batched linear algebra, FFT, ``complex`` and collectives over a vmapped axis name: the
expected signatures are present (batch dims only for the matrix ops, untransformed dims only
for the FFT), EVERY signature is checked numerically with the family checker on 2 simulated
devices, FLOPs follow the cited counts, and programs using each op, planned on 8 devices,
split the batch and give jax.jit's values.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    RNG,
    assert_close,
    check_all,
    check_signature_numerically,
    evaluate,
    f32,
    op_inputs,
    sig,
)
from jax import lax
from jax._src.lax import linalg as linalg_internal  # geqrf, geqp3: no public wrapper
from jax.sharding import AxisType

import shardc
from shardc.ir.sbp import B, P, Partial, Split
from shardc.ir.trace import trace
from shardc.rules import op_flops, signatures

S = Split



class Retraced:
    """Stand-in primitive running ``local_fn`` (a Python function of the op's inputs, in op
    order, that traces the same jaxpr again) on the pieces it gets."""

    multiple_results = True

    def __init__(self, name: str, local_fn):
        self.name = name
        self.local_fn = local_fn

    def bind(self, *ins, **params):
        return jax.tree.leaves(self.local_fn(*ins))


def spd(*batch: int, n: int = 6) -> jax.Array:
    a = RNG.normal(size=(*batch, n, n))
    return jnp.asarray(a @ np.swapaxes(a, -1, -2) + n * np.eye(n), jnp.float32)


def c64(*shape):
    return jnp.asarray(RNG.normal(size=shape) + 1j * RNG.normal(size=shape), jnp.complex64)


def batch_only(sigs, batch_dims) -> None:
    """Every batch dim is offered split on every operand and result, nothing else is split,
    and nothing is partial."""
    for s in sigs:
        assert not any(isinstance(x, Partial) for x in (*s.ins, *s.outs)), s
        dims = {x.dim for x in (*s.ins, *s.outs) if isinstance(x, Split)}
        assert dims <= set(batch_dims), s
    for d in batch_dims:
        assert any(all(x == S(d) for x in (*s.ins, *s.outs)) for s in sigs), d


# ---- lax.linalg --------------------------------------------------------------------------

TRI = dict(lower=True, transpose_a=False, conjugate_a=False, unit_diagonal=False)
LINALG = {
    "cholesky": (lambda a: lax.linalg.cholesky(a, symmetrize_input=False), (spd(4),), (0,)),
    "cholesky 2 batch dims": (lambda a: lax.linalg.cholesky(a, symmetrize_input=False),
                              (spd(2, 4),), (0, 1)),
    "triangular_solve left": (
        lambda a, b: lax.linalg.triangular_solve(jnp.tril(a), b, left_side=True, **TRI),
        (spd(4), f32(4, 6, 3)), (0,)),
    "triangular_solve right": (
        lambda a, b: lax.linalg.triangular_solve(jnp.tril(a), b, left_side=False, **TRI),
        (spd(4), f32(4, 3, 6)), (0,)),
    "lu": (lax.linalg.lu, (f32(4, 6, 5),), (0,)),
    "qr": (lambda a: lax.linalg.qr(a, full_matrices=False), (f32(4, 6, 5),), (0,)),
    "qr full": (lambda a: lax.linalg.qr(a, full_matrices=True), (f32(4, 6, 5),), (0,)),
    "eigh": (lambda a: lax.linalg.eigh(a, symmetrize_input=False), (spd(4),), (0,)),
    "svd": (lambda a: lax.linalg.svd(a, full_matrices=False), (f32(4, 6, 5),), (0,)),
    "householder_product": (lax.linalg.householder_product, (f32(4, 6, 5), f32(4, 5)), (0,)),
    "lu_pivots_to_permutation": (
        lambda p: lax.linalg.lu_pivots_to_permutation(p, 6),
        (jnp.asarray(RNG.integers(0, 6, (4, 5)), jnp.int32),), (0,)),
    "tridiagonal_solve": (
        lambda dl, d, du, b: lax.linalg.tridiagonal_solve(dl.at[:, 0].set(0), d + 4.0,
                                                          du.at[:, -1].set(0), b),
        (f32(4, 6), f32(4, 6), f32(4, 6), f32(4, 6, 3)), (0,)),
    "eig": (lax.linalg.eig, (f32(4, 6, 6),), (0,)),
    "schur": (lax.linalg.schur, (f32(4, 6, 6),), (0,)),
    "hessenberg": (lax.linalg.hessenberg, (f32(4, 6, 6),), (0,)),
    "tridiagonal": (lax.linalg.tridiagonal, (spd(4),), (0,)),
    "symmetric_product": (lax.linalg.symmetric_product, (f32(4, 6, 5), spd(4)), (0,)),
    "ormqr": (lax.linalg.ormqr, (f32(4, 6, 5), f32(4, 5), f32(4, 6, 3)), (0,)),
    "geqrf": (linalg_internal.geqrf, (f32(4, 6, 5),), (0,)),
    "geqp3": (lambda a: linalg_internal.geqp3(a, jnp.zeros((4, 5), jnp.int32)),
              (f32(4, 6, 5),), (0,)),
}


@pytest.mark.parametrize("case", list(LINALG))
def test_linalg_splits_batch_dims_only(case):
    fn, args, batch = LINALG[case]
    name = case.split(" ")[0]
    batch_only(check_all(fn, *args, name=name), batch)


def test_a_batch_dim_of_size_one_is_not_split():
    """A batch dim of size 1 is not split (nothing to divide)."""
    op, _ = op_inputs(lambda a: lax.linalg.cholesky(a, symmetrize_input=False), spd(1, 4),
                      name="cholesky")
    assert sig([S(1)], [S(1)]) in signatures(op) and sig([S(0)], [S(0)]) not in signatures(op)


def test_linalg_flops_follow_the_standard_counts():
    n = 6

    def flops(fn, *args, name):
        return op_flops(op_inputs(fn, *args, name=name)[0])

    chol = flops(lambda a: lax.linalg.cholesky(a, symmetrize_input=False), spd(4), name="cholesky")
    assert chol == pytest.approx(4 * n ** 3 / 3)
    assert flops(lax.linalg.lu, spd(4), name="lu") == pytest.approx(4 * 2 * n ** 3 / 3)
    assert flops(lambda a: lax.linalg.qr(a, full_matrices=False), spd(4),
                 name="qr") == pytest.approx(4 * 8 * n ** 3 / 3)
    assert flops(lambda a: lax.linalg.eigh(a), spd(4), name="eigh") == pytest.approx(4 * 9 * n ** 3)
    assert flops(lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False), spd(4),
                 name="eig") == pytest.approx(4 * 25 * n ** 3)
    assert flops(lax.linalg.svd, f32(4, 6, 5), name="svd") == pytest.approx(
        4 * (4 * 36 * 5 + 8 * 6 * 25 + 9 * 125))  # full U: 4 m^2 n + 8 m n^2 + 9 n^3
    tri = flops(lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
                spd(4), f32(4, 6, 3), name="triangular_solve")
    assert tri == pytest.approx(4 * n * n * 3)


# ---- custom_linear_solve -----------------------------------------------------------------

def _cho_solve(a, x):
    return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(a), True), x[..., None])[..., 0]


def _batched_solve(a, b):
    """A batched SPD solve with explicit matvec and solve (a captured by both)."""
    return lax.custom_linear_solve(lambda x: jnp.einsum("bij,bj->bi", a, x), b,
                                   lambda _, x: _cho_solve(a, x))


def test_custom_linear_solve_splits_the_batch_through_its_jaxprs():
    a, b = spd(4), f32(4, 6)
    graph = trace(_batched_solve, a, b).graph
    (op,) = [o for o in graph.ops if o.name == "custom_linear_solve"]
    env = evaluate(graph, (a, b))
    ins = [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]
    assert [v.shape for v in op.inputs] == [a.shape, a.shape, b.shape]  # matvec, solve, b

    def local(a_matvec, a_solve, b):
        return _batched_solve(a_solve, b)

    sigs = signatures(op)
    assert sig([S(0), S(0), S(0)], [S(0)]) in sigs
    assert all(s.outs == (S(0),) or s.outs == (B,) for s in sigs)
    retraced = op.replace(prim=Retraced("custom_linear_solve", local))
    assert all(check_signature_numerically(retraced, s, ins) for s in sigs)
    solve_body = sum(op_flops(o) for o in trace(_cho_solve, a, b).graph.ops)
    assert op_flops(op) == pytest.approx(solve_body)


def test_custom_linear_solve_mixing_the_batch_is_not_split():
    """A solve that sums over the batch (not batch-parallel) gets no split."""
    a, b = spd(4), f32(4, 6)

    def fn(a, b):
        return lax.custom_linear_solve(lambda x: (a[0] @ x.T).T, b,
                                       lambda _, x: x / x.sum(0, keepdims=True))

    op, _ = op_inputs(fn, a, b, name="custom_linear_solve")
    assert not any(isinstance(s, Split) and s.dim == 0 for g in signatures(op) for s in g.ins)


# ---- fft and complex ---------------------------------------------------------------------

@pytest.mark.parametrize("fn,arg,untouched", [
    (lambda x: jnp.fft.fft(x), c64(4, 2, 8), (0, 1)),
    (lambda x: jnp.fft.ifft2(x), c64(4, 2, 8), (0,)),
    (lambda x: jnp.fft.rfft(x), f32(4, 2, 8), (0, 1)),
    (lambda x: jnp.fft.irfft(x, 8), c64(4, 2, 5), (0, 1)),
])
def test_fft_splits_untransformed_dims_and_passes_partial(fn, arg, untouched):
    sigs = check_all(fn, arg, name="fft")
    assert sig([P], [P]) in sigs
    for d in untouched:
        assert sig([S(d)], [S(d)]) in sigs
    assert all(g.ins[0] in (B, P) or g.ins[0].dim in untouched for g in sigs)


def test_fft_flops_are_5_n_log2_n_per_signal():
    op, _ = op_inputs(lambda x: jnp.fft.fft(x), c64(4, 2, 8), name="fft")
    assert op_flops(op) == pytest.approx(4 * 2 * 5 * 8 * 3)
    op, _ = op_inputs(lambda x: jnp.fft.rfft2(x), f32(4, 2, 8), name="fft")
    assert op_flops(op) == pytest.approx(4 * 2.5 * 16 * 4)


def test_complex_is_elementwise_and_linear():
    sigs = check_all(lambda x, y: lax.complex(x, y), f32(4, 6), f32(4, 6), name="complex")
    assert {sig([S(0), S(0)], [S(0)]), sig([S(1), S(1)], [S(1)]), sig([P, P], [P])} <= set(sigs)
    op, _ = op_inputs(lambda x, y: lax.complex(x, y), f32(4, 6), f32(4, 6), name="complex")
    assert op.outputs[0].nbytes == 4 * 6 * 8  # complex64: 8 bytes an element


# ---- collectives over a vmapped axis name ------------------------------------------------

@pytest.mark.parametrize("name,coll,partial", [
    ("psum", lax.psum, P), ("pmax", lax.pmax, Partial("max")), ("pmin", lax.pmin, Partial("min")),
])
def test_vmapped_collectives_are_reductions_over_the_vmapped_dim(name, coll, partial):
    fn = jax.vmap(lambda v: coll(v, "i") * v, axis_name="i")
    sigs = check_all(fn, f32(4, 6), name=name)
    assert {sig([S(1)], [S(0)]), sig([S(0)], [partial])} <= set(sigs)
    assert (sig([P], [P]) in sigs) == (name == "psum")


def test_pmean_all_gather_axis_index_reach_the_jaxpr_as_rules_cover():
    def pm(v):
        return (lax.pmean(v, "i"), lax.all_gather(v, "i"), lax.axis_index("i"),
                lax.ppermute(v, "i", [(k, (k + 1) % 4) for k in range(4)]))

    graph = trace(jax.vmap(pm, axis_name="i"), f32(4, 6)).graph
    names = {op.name for op in graph.ops}
    assert "psum" in names and not names & {"all_gather", "axis_index", "ppermute", "pmean"}
    assert all(shardc.rules.has_rule(n) for n in names)


# ---- planned on 8 devices ----------------------------------------------------------------

def _chol_solve(m, b):
    low = jnp.linalg.cholesky(m)
    return lax.linalg.triangular_solve(low, b, left_side=True, lower=True)


def _vmapped(x):
    def pm(v):
        return jnp.tanh(v) * lax.pmean(v, "i") + lax.psum(v, "i"), lax.all_gather(v, "i").sum(0)
    return jax.vmap(pm, axis_name="i")(x)


PROGRAMS = {
    "cholesky+triangular_solve": (_chol_solve, (spd(8, n=16), f32(8, 16, 4))),
    "complex multiply": (lambda x, y: lax.complex(x, y) * lax.complex(y, x),
                         (f32(8, 16, 16), f32(8, 16, 16))),
    "lu": (lax.linalg.lu, (f32(8, 16, 16),)),
    "qr": (jnp.linalg.qr, (f32(8, 16, 16),)),
    "eigh": (jnp.linalg.eigh, (spd(8, n=16),)),
    "solve (custom_linear_solve)": (jnp.linalg.solve, (spd(8, n=16), f32(8, 16, 4))),
    # a psum over the vmapped dim split needs an all-reduce: the kept dim 2 splits instead
    "vmapped psum / pmean / all_gather": (_vmapped, (f32(8, 24, 16),)),
}
SPLIT_DIM = {"vmapped psum / pmean / all_gather": 2}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def _flops(compiled) -> float:
    """XLA's per-device FLOPs, loop bodies once (``lu``'s pivots-to-permutation loop does
    scalar work per row, the same on 1 matrix as on 8)."""
    return float(compiled.cost_analysis()["flops"])


def _close(got, want):
    assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_batched_programs_split_the_batch_on_8_devices(name, mesh):
    """Planned with the batch split: no rule missing, every input split on dim 0 (a
    vmapped collective's operand on a dim it keeps) with no
    all-gather, each LAPACK call on one matrix of the 8, at most a quarter of jax.jit's FLOPs
    per device (XLA's analysis counts no FLOPs in a custom call: only the elementwise work
    around them, some of it on unbatched masks), jax.jit's values."""
    fn, args = PROGRAMS[name]
    sharded = shardc.auto_shard(fn, mesh=mesh, time_limit=1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = sharded.plan(*args)
    assert not [w for w in record if "no sharding rule" in str(w.message)]
    split = S(SPLIT_DIM.get(name, 0))
    assert all(nd.sbps == (split,) for nd in plan.inputs), plan.inputs
    _close(sharded(*args), jax.jit(fn)(*args))
    compiled = sharded.lower(*args).compile()
    text = compiled.as_text()
    assert "all-gather" not in text
    lapack = [line for line in text.splitlines() if 'custom_call_target="lapack' in line]
    assert all("[8," not in line and "[1," in line for line in lapack), lapack
    assert _flops(compiled) <= 0.25 * _flops(jax.jit(fn).lower(*args).compile())


def test_batched_fft_plans_the_batch_split(mesh):
    """The plan splits the signals (its FLOPs are 1/8); XLA's partitioner (``HandleFft``)
    partitions only the transformed last dim and would gather the operand, so the lowering
    runs the fft per device (``Prim.per_device``): no gather, 1/8 of the FLOPs."""
    x = f32(8, 16, 16)
    fn = jnp.fft.fft
    sharded = shardc.auto_shard(fn, mesh=mesh, time_limit=1.0)
    plan = sharded.plan(x)
    assert plan.inputs[0].sbps == (S(0),) and plan.outputs[0].sbps == (S(0),)
    fft_op = [o for o in plan.ops if o.prim == "fft"][0]
    assert fft_op.ins[0].sbps == (S(0),)
    _close(sharded(x), jax.jit(fn)(x))
    compiled = sharded.lower(x).compile()
    assert "all-gather" not in compiled.as_text()
    assert _flops(compiled) <= 0.2 * _flops(jax.jit(fn).lower(x).compile())
    # and it differentiates as jax.jit's does
    loss = lambda x: jnp.sum(jnp.abs(jnp.fft.fft(x)) ** 2)  # noqa: E731
    _close(shardc.auto_shard(jax.grad(loss), mesh=mesh, time_limit=1.0)(x),
           jax.jit(jax.grad(loss))(x))
