"""Rule families (shape, reduce, indexing, elementwise, dot): expected signatures are present,
wrong ones absent, and EVERY returned signature is checked numerically on a simulated 1-D mesh.

``check_signature_numerically`` shards real inputs per the signature (Split: the device's
chunk, B: whole, P: random summands), runs the primitive per device with its params made
local (shapes of the device's piece), reassembles per the output SBP and compares with the
unsharded result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardc.ir.graph import Graph, Op
from shardc.ir.prims import BINARY, UNARY
from shardc.ir.sbp import WHOLE, B, NdSbp, P, Partial, Sbp, Split
from shardc.ir.trace import trace
from shardc.rules import Signature, signatures, strategies

S = Split
RNG = np.random.default_rng(0)
ELEMENTWISE = set(UNARY) | set(BINARY)


def _bind(op: Op, ins, params: dict) -> list:
    outs = op.prim.bind(*ins, **params)
    return list(outs) if op.prim.multiple_results else [outs]


def evaluate(graph: Graph, args) -> dict[int, np.ndarray]:
    """Concrete value of every Value of ``graph`` (``prim.bind`` op by op, in one jit)."""

    def run(*leaves):
        env = dict(zip((v.id for v in graph.inputs), leaves, strict=True))
        for op in graph.ops:
            ins = [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]
            env.update(zip((v.id for v in op.outputs), _bind(op, ins, op.params), strict=True))
        return env

    return {k: np.asarray(v) for k, v in jax.jit(run)(*jax.tree.leaves(args)).items()}


def op_inputs(fn, *args, name: str, index: int = 0) -> tuple[Op, list[np.ndarray]]:
    """The ``index``-th op called ``name`` in ``fn``'s graph and its concrete inputs."""
    graph = trace(fn, *args).graph
    env = evaluate(graph, args)
    op = [o for o in graph.ops if o.name == name][index]
    return op, [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]


def _local_shape(shape, sbp: Sbp, n: int) -> tuple[int, ...]:
    return tuple(s // n if isinstance(sbp, Split) and sbp.dim == d else s
                 for d, s in enumerate(shape))


def _shard(x: np.ndarray, sbp: Sbp, n: int, rng) -> list[np.ndarray]:
    if isinstance(sbp, Split):
        return np.split(x, n, axis=sbp.dim)
    if not isinstance(sbp, Partial):
        return [x] * n
    if x.dtype == np.bool_:
        raise AssertionError("a bool value cannot be partial")
    if sbp.op in ("max", "min"):  # one device holds x, the others values on its far side
        sign = 1 if sbp.op == "max" else -1
        return [x] + [(x - sign * np.abs(rng.normal(size=x.shape)) * (1 + np.abs(x)))
                      .astype(x.dtype) for _ in range(n - 1)]
    if jnp.issubdtype(x.dtype, jnp.floating):
        finite = np.abs(x) < 1e30  # huge (mask) and non-finite entries are not split
        scale = np.where(finite, np.abs(x), 0.0)  # relative per element: no cancellation
        parts = [(rng.uniform(-1.0, 1.0, x.shape) * scale).astype(x.dtype)
                 for _ in range(n - 1)]
    else:
        parts = [rng.integers(-5, 5, x.shape).astype(x.dtype) for _ in range(n - 1)]
    return [x - sum(parts)] + parts  # entries not split stay whole in part 0


def _local_params(op: Op, sig: Signature, local_ins, n: int) -> dict:
    params = dict(op.params)
    out_shape = _local_shape(op.outputs[0].shape, sig.outs[0], n)
    if op.name in ("broadcast_in_dim", "iota"):
        params["shape"] = out_shape
    if op.name == "reshape":
        params["new_sizes"] = out_shape
    split0 = sig.ins[0] if op.inputs and isinstance(sig.ins[0], Split) else None
    if split0 is not None and op.name == "slice":
        limits = list(params["limit_indices"])
        limits[split0.dim] = local_ins[0].shape[split0.dim]
        params["limit_indices"] = tuple(limits)
    if split0 is not None and "slice_sizes" in params:
        sizes, d = list(params["slice_sizes"]), split0.dim
        if sizes[d] == op.inputs[0].shape[d]:
            sizes[d] = local_ins[0].shape[d]
        params["slice_sizes"] = tuple(sizes)
    return params


def _assert_close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if not jnp.issubdtype(want.dtype, jnp.inexact):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = 1e-4 if jnp.finfo(want.dtype).bits >= 32 else 3e-2
    wide = np.complex128 if np.iscomplexobj(want) else np.float64  # complex: both parts
    finite = np.where(np.isfinite(want), np.abs(want.astype(wide)), 0.0)
    np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=tol,
                               atol=tol * (1.0 + finite.max(initial=0.0)), equal_nan=True,
                               err_msg=what)


def _assemble(pieces: list[np.ndarray], sbp: Sbp, what: str) -> np.ndarray:
    if isinstance(sbp, Split):
        return np.concatenate(pieces, axis=sbp.dim)
    if isinstance(sbp, Partial):
        combine = {"sum": np.add, "whole": np.add, "max": np.maximum, "min": np.minimum}[sbp.op]
        return combine.reduce(pieces)
    for p in pieces[1:]:
        _assert_close(p, pieces[0], what + " (B output differs between devices)")
    return pieces[0]


def _masked_index(op: Op, sig: Signature) -> int | None:
    """The index-vector position of a gather / scatter whose operand is split on a dim the
    indices select (the masked signatures of ``rules/indexing.py``), else None."""
    if op.name not in ("gather",) and not op.name.startswith("scatter"):
        return None
    if not isinstance(sig.ins[0], Split):
        return None
    dn = op.params["dimension_numbers"]
    index_map = dn.start_index_map if op.name == "gather" else dn.scatter_dims_to_operand_dims
    where = [j for j, d in enumerate(index_map) if d == sig.ins[0].dim]
    return where[0] if where else None


def _shift_indices(op: Op, params: dict, indices, j: int, k: int, chunk: int):
    """Device ``k``'s indices into its shard (``chunk`` elements from ``k * chunk``): those
    outside it made out of bounds, dropped (scatter) or read as 0 (gather)."""
    idx = np.array(indices)
    local = idx[..., j] - k * chunk
    idx[..., j] = np.where((local >= 0) & (local < chunk), local, 10 * chunk)
    params = {**params, "mode": jax.lax.GatherScatterMode.FILL_OR_DROP}
    if op.name == "gather":
        params["fill_value"] = 0
    return idx, params


def check_signature_numerically(op: Op, sig: Signature, inputs, n: int = 2,
                                 expected=None) -> bool:
    """Assert ``sig`` is exact for ``op`` with ``inputs`` on ``n`` simulated devices; returns
    False (nothing checked) where ``strategies`` drops it: an uneven split or a partial
    constant. ``expected``: the unsharded outputs, if known (else computed)."""
    values, sbps = [*op.inputs, *op.outputs], [*sig.ins, *sig.outs]
    if not all(NdSbp((s,)).fits(v.shape, (n,)) for s, v in zip(sbps, values, strict=True)):
        return False
    if any(v.is_const and isinstance(s, Partial) for v, s in zip(op.inputs, sig.ins, strict=True)):
        return False
    inputs = [np.asarray(x) for x in inputs]
    rng = np.random.default_rng(1)
    shards = [_shard(x, s, n, rng) for x, s in zip(inputs, sig.ins, strict=True)]
    out0, sbp0 = op.outputs[0], sig.outs[0]
    if op.name in ELEMENTWISE and isinstance(sbp0, Split):
        # jax 0.10 elementwise ops broadcast size-1 dims implicitly: a B operand whose dim
        # matches the split output dim is sliced locally (free, each device holds it whole)
        for k, (v, s) in enumerate(zip(op.inputs, sig.ins, strict=True)):
            if s == B and v.ndim == out0.ndim and v.shape[sbp0.dim] == out0.shape[sbp0.dim] > 1:
                shards[k] = np.split(inputs[k], n, axis=sbp0.dim)
    per_device = []
    for k in range(n):
        local = [sh[k] for sh in shards]
        params = _local_params(op, sig, local, n)
        masked = _masked_index(op, sig)
        if masked is not None:  # a device serves the indices that fall in its shard only
            local[1], params = _shift_indices(op, params, local[1], masked, k,
                                              local[0].shape[sig.ins[0].dim])
        outs = [np.asarray(o) for o in _bind(op, local, params)]
        if op.name == "iota" and sbp0 == S(op.params["dimension"]):
            outs[0] = outs[0] + k * outs[0].shape[sbp0.dim]  # each device offsets its slice
        per_device.append(outs)
    ref = expected if expected is not None else _bind(op, inputs, op.params)
    for j, (want, sbp) in enumerate(zip(ref, sig.outs, strict=True)):
        what = f"{op.name} {sig} output {j}"
        got = _assemble([outs[j] for outs in per_device], sbp, what)
        assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
        _assert_close(got, want, what)
    return True


def check_all(fn, *args, name: str, index: int = 0) -> list[Signature]:
    """Signatures of the op; every one that fits 2 devices is verified numerically."""
    op, ins = op_inputs(fn, *args, name=name, index=index)
    sigs = signatures(op)
    assert sum(check_signature_numerically(op, s, ins) for s in sigs) >= 2
    return sigs


def sig(ins, outs) -> Signature:
    return Signature(tuple(ins), tuple(outs))


def f32(*shape):
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


# ---- shape -------------------------------------------------------------------------------

def test_reshape_head_split_and_merge():
    split = check_all(lambda x: x.reshape(2, 8, 12, 64), f32(2, 8, 768), name="reshape")
    for s in (sig([S(0)], [S(0)]), sig([S(1)], [S(1)]), sig([S(2)], [S(2)]), sig([P], [P])):
        assert s in split
    assert sig([S(2)], [S(3)]) not in split
    merge = check_all(lambda x: x.reshape(2, 8, 768), f32(2, 8, 12, 64), name="reshape")
    assert {sig([S(d)], [S(d)]) for d in range(3)} <= set(merge)
    assert sig([S(3)], [S(2)]) not in merge


@pytest.mark.parametrize("shapes", [((2, 8, 768), (2, 8, 12, 64)), ((2, 8, 12, 64), (2, 8, 768))])
def test_reshape_strategies_respect_divisibility(shapes):
    src, dst = shapes
    op, _ = op_inputs(lambda x: x.reshape(dst), f32(*src), name="reshape")
    head = (NdSbp((S(2),)),), (NdSbp((S(2),)),)
    assert head in [(st.ins, st.outs) for st in strategies(op, (4,))]
    assert head not in [(st.ins, st.outs) for st in strategies(op, (8,))]  # 12 % 8 != 0


def test_reshape_merge_and_unit_dims():
    sigs = check_all(lambda x: x.reshape(24, 4), f32(2, 12, 4), name="reshape")
    assert sig([S(0)], [S(0)]) in sigs and sig([S(2)], [S(1)]) in sigs
    assert sig([S(1)], [S(0)]) not in sigs  # a minor dim of a merged group is not contiguous
    sigs = check_all(lambda x: x.reshape(4, 1, 6), f32(4, 6), name="reshape")
    assert sig([S(1)], [S(2)]) in sigs


def test_broadcast_in_dim():
    sigs = check_all(lambda x: jnp.broadcast_to(x, (4, 8, 6)), f32(4, 1, 6),
                     name="broadcast_in_dim")
    assert {sig([S(0)], [S(0)]), sig([S(2)], [S(2)]), sig([B], [S(1)]), sig([P], [P])} <= set(sigs)
    assert sig([S(1)], [S(1)]) not in sigs
    sigs = check_all(lambda x: x[:, None, :] + jnp.zeros((4, 2, 6)), f32(4, 6),
                     name="broadcast_in_dim")
    assert sig([B], [S(1)]) in sigs and sig([S(1)], [S(2)]) in sigs
    zeros = check_all(lambda x: x + jnp.zeros((4, 6)), f32(4, 6), name="broadcast_in_dim")
    assert sig([B], [S(0)]) in zeros


def test_partial_for_bfloat16_but_not_for_bool():
    bf16 = jnp.asarray(RNG.normal(size=(4, 6)), jnp.bfloat16)
    assert sig([P], [P]) in check_all(lambda x: x[None] + jnp.zeros((2, 4, 6), jnp.bfloat16),
                                      bf16, name="broadcast_in_dim")
    assert sig([S(1)], [P]) in check_all(lambda x: x.sum(1), bf16, name="reduce_sum")
    mask = check_all(lambda x: (x > 0).reshape(24), f32(4, 6), name="reshape")
    assert sig([P], [P]) not in mask


def test_transpose_squeeze_rev_split():
    t = check_all(lambda x: jnp.transpose(x, (2, 0, 1)), f32(2, 4, 6), name="transpose")
    assert {sig([S(2)], [S(0)]), sig([S(0)], [S(1)]), sig([S(1)], [S(2)]), sig([P], [P])} <= set(t)
    sq = check_all(lambda x: jnp.squeeze(x, 1), f32(4, 1, 6), name="squeeze")
    assert sig([S(2)], [S(1)]) in sq and sig([S(0)], [S(0)]) in sq
    rv = check_all(lambda x: jnp.flip(x, 0), f32(4, 6), name="rev")
    assert sig([S(1)], [S(1)]) in rv and sig([S(0)], [S(0)]) not in rv
    sp = check_all(lambda x: jnp.split(x, 2, axis=1), f32(4, 6), name="split")
    assert sig([S(0)], [S(0), S(0)]) in sp and sig([S(1)], [S(1), S(1)]) not in sp


def test_slice_keeps_split_only_on_full_dims():
    sigs = check_all(lambda x: x[1:, :], f32(4, 6), name="slice")
    assert sig([S(1)], [S(1)]) in sigs and sig([S(0)], [S(0)]) not in sigs
    sigs = check_all(lambda x: x[:, ::2], f32(4, 6), name="slice")
    assert sig([S(0)], [S(0)]) in sigs and sig([S(1)], [S(1)]) not in sigs


def test_concatenate():
    sigs = check_all(lambda x, y: jnp.concatenate([x, y], 1), f32(4, 6), f32(4, 2),
                     name="concatenate")
    assert sig([S(0), S(0)], [S(0)]) in sigs and sig([P, P], [P]) in sigs
    assert sig([S(1), S(1)], [S(1)]) not in sigs


def test_pad_partial_needs_zero_padding_value():
    zero = check_all(lambda x: jnp.pad(x, ((1, 0), (0, 0))), f32(4, 6), name="pad")
    assert {sig([S(1), B], [S(1)]), sig([P, P], [P]), sig([P, B], [P])} <= set(zero)
    assert sig([S(0), B], [S(0)]) not in zero
    one = check_all(lambda x: jax.lax.pad(x, 1.0, ((0, 0, 0), (0, 0, 1))), f32(4, 6), name="pad")
    assert sig([S(0), B], [S(0)]) in one and sig([P, B], [P]) not in one
    assert sig([S(1), B], [S(1)]) not in one
    const_zero = check_all(lambda x: jax.lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 0))), f32(4, 6),
                           name="pad")
    assert sig([P, B], [P]) in const_zero


# ---- reduce ------------------------------------------------------------------------------

def test_reduce_sum():
    sigs = check_all(lambda x: x.sum(1), f32(4, 6), name="reduce_sum")
    assert {sig([S(0)], [S(0)]), sig([S(1)], [P]), sig([P], [P])} <= set(sigs)
    sigs = check_all(lambda x: x.sum((0, 2)), f32(4, 6, 8), name="reduce_sum")
    assert {sig([S(1)], [S(0)]), sig([S(0)], [P]), sig([S(2)], [P])} <= set(sigs)


@pytest.mark.parametrize("name,fn,op", [
    ("reduce_max", lambda x: x.max(1), "max"), ("reduce_min", lambda x: x.min(1), "min"),
    ("reduce_and", lambda x: (x > 0).all(1), "min"), ("reduce_or", lambda x: (x > 0).any(1), "max"),
])
def test_extrema_over_a_split_dim_are_partial_extrema(name, fn, op):
    """A max over the split vocabulary: each device's max, then an all-reduce with max
    (checked numerically: the pieces' max / min is the result); an ``and`` / ``or`` of
    booleans is their min / max."""
    sigs = check_all(fn, f32(4, 6), name=name)
    assert {sig([S(0)], [S(0)]), sig([S(1)], [Partial(op)])} <= set(sigs)
    assert sig([S(1)], [P]) not in sigs and sig([P], [P]) not in sigs


@pytest.mark.parametrize("name,fn", [
    ("reduce_prod", lambda x: x.prod(1)), ("argmax", lambda x: jnp.argmax(x, 1)),
    ("argmin", lambda x: jnp.argmin(x, 1)),
])
def test_non_sum_reductions_have_no_partial(name, fn):
    sigs = check_all(fn, f32(4, 6), name=name)
    assert sig([S(0)], [S(0)]) in sigs
    assert not any(isinstance(s, Partial) for g in sigs for s in (*g.ins, *g.outs))
    assert all(g.ins != (S(1),) for g in sigs)


@pytest.mark.parametrize("name,fn", [
    ("cumsum", lambda x: jnp.cumsum(x, 1)), ("cumprod", lambda x: jnp.cumprod(x, 1)),
    ("cummax", lambda x: jax.lax.cummax(x, 1, reverse=True)),
    ("cumlogsumexp", lambda x: jax.lax.cumlogsumexp(x, 1)),
])
def test_scans(name, fn):
    sigs = check_all(fn, f32(4, 6), name=name)
    assert sig([S(0)], [S(0)]) in sigs and sig([S(1)], [S(1)]) not in sigs
    assert (sig([P], [P]) in sigs) == (name == "cumsum")


# ---- indexing ----------------------------------------------------------------------------

IDS = jnp.asarray(RNG.integers(0, 16, (4, 6)), jnp.int32)
LABELS = jnp.asarray(RNG.integers(0, 10, (2, 4)), jnp.int32)


def _take(logits, labels):
    return jnp.take_along_axis(logits, labels[..., None], axis=-1)


def test_gather_embedding_and_take_along_axis():
    emb = check_all(lambda t, i: t[i], f32(16, 8), IDS, name="gather")
    expected = {sig([S(1), B], [S(2)]), sig([B, S(0)], [S(0)]), sig([B, S(1)], [S(1)])}
    assert expected <= set(emb)
    take = check_all(_take, f32(2, 4, 10), LABELS, name="gather")
    assert {sig([S(0), S(0)], [S(0)]), sig([S(1), S(1)], [S(1)])} <= set(take)
    # an indexed dim read one element at a time splits with a partial result (a masked local
    # gather; checked numerically above): vocab-parallel embedding and label logits
    assert sig([S(0), B], [P]) in emb and sig([S(2), B], [P]) in take
    assert all(g.ins[0] != S(2) or g.outs == (P,) for g in take)
    window = check_all(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, 3, 1), f32(4, 10),
                       jnp.int32(2), name="dynamic_slice")
    assert all(g.ins[0] != S(1) for g in window)  # a window of 3 is not pointwise


def test_scatter_add_from_gradients():
    grad_emb = jax.grad(lambda t, i: (t[i] ** 2).sum())
    sigs = check_all(grad_emb, f32(16, 8), IDS, name="scatter-add")
    assert {sig([S(1), B, S(2)], [S(1)]), sig([P, S(0), S(0)], [P]),
            sig([P, B, P], [P])} <= set(sigs)
    # the operand is jax's zero table: a replicated one splits the tokens too (checked
    # numerically above), the data-parallel embedding gradient; its partial is reduced whole
    assert sig([B, S(0), S(0)], [WHOLE]) in sigs and sig([B, B, P], [P]) not in sigs
    added = check_all(lambda t, i, u: t.at[i].add(u), f32(16, 8), IDS, f32(*IDS.shape, 8),
                      name="scatter-add")
    assert sig([P, S(0), S(0)], [P]) in added
    assert sig([B, S(0), S(0)], [WHOLE]) not in added  # a real operand would count n times
    grad_take = jax.grad(lambda x, y: (_take(x, y) ** 2).sum())
    sigs = check_all(grad_take, f32(2, 4, 10), LABELS, name="scatter-add")
    assert {sig([S(0), S(0), S(0)], [S(0)]), sig([S(1), S(1), S(1)], [S(1)])} <= set(sigs)
    # into a table split on the indexed dim: each device applies the updates landing in its
    # shard (masked; checked numerically), the vocabulary-parallel embedding gradient
    assert sig([S(2), B, B], [S(2)]) in sigs
    assert sig([S(0), B, B], [S(0)]) in check_all(grad_emb, f32(16, 8), IDS, name="scatter-add")
    put = check_all(lambda t, i, u: t.at[i].set(u), f32(16, 8), IDS, f32(*IDS.shape, 8),
                    name="scatter")
    assert sig([S(0), B, B], [S(0)]) in put


def test_dynamic_slice_and_update():
    ds = check_all(lambda x, i: jax.lax.dynamic_slice(x, (i, 0), (2, 6)), f32(4, 6), 1,
                   name="dynamic_slice")
    assert sig([S(1), B, B], [S(1)]) in ds and sig([P, B, B], [P]) in ds
    assert all(g.ins[0] != S(0) for g in ds)
    dus = check_all(lambda x, u, i: jax.lax.dynamic_update_slice(x, u, (i, 0)),
                    f32(4, 6), f32(2, 6), 1, name="dynamic_update_slice")
    assert sig([S(1), S(1), B, B], [S(1)]) in dus and sig([P, P, B, B], [P]) in dus
    assert all(g.ins[0] != S(0) for g in dus)


def test_iota():
    sigs = check_all(lambda: jax.lax.broadcasted_iota(jnp.int32, (4, 6), 1), name="iota")
    assert sig([], [S(0)]) in sigs and sig([], [S(1)]) in sigs


# ---- elementwise and dot (the other family files) ---------------------------------------

@pytest.mark.parametrize("name,fn", [
    ("add", lambda x, y: x + y), ("sub", lambda x, y: x - y), ("mul", lambda x, y: x * y),
    ("div", lambda x, y: x / (y * y + 1.0)), ("mul", lambda x, y: x * 3.0),
    ("select_n", lambda x, y: jnp.where(x > y, x, y)),
    ("convert_element_type", lambda x, y: x.astype(jnp.float16)),
    ("convert_element_type", lambda x, y: x.astype(jnp.int32)),
    ("complex", lambda x, y: jax.lax.complex(x, y)),
])
def test_elementwise_signatures_are_exact(name, fn):
    sigs = check_all(fn, f32(4, 6), f32(4, 6), name=name)
    assert any(g.outs == (S(0),) for g in sigs) and any(g.outs == (S(1),) for g in sigs)


@pytest.mark.parametrize("spec,shapes", [
    ("bij,bjk->bik", ((2, 4, 6), (2, 6, 8))), ("ij,jk->ik", ((4, 6), (6, 8))),
    ("bhqd,bhkd->bhqk", ((2, 4, 6, 8), (2, 4, 6, 8))),
])
def test_dot_general_signatures_are_exact(spec, shapes):
    sigs = check_all(lambda a, b: jnp.einsum(spec, a, b), *(f32(*s) for s in shapes),
                     name="dot_general")
    assert sig([P, B], [P]) in sigs


# ---- every rule on a real training step --------------------------------------------------

def test_every_signature_of_the_gpt_train_step_is_exact():
    from shardc.models import gpt
    from shardc.rules import has_rule

    config = dataclasses.replace(gpt.GPTConfig.tiny(), n_layers=1)
    train_step, args = gpt.make_train_step(config)
    graph = trace(train_step, *args).graph
    env = evaluate(graph, args)
    seen: dict[str, set] = {}
    checked = 0
    for op in graph.ops:  # up to 3 distinct variants per primitive keep this at ~20 s
        key = (tuple((v.shape, str(v.dtype)) for v in op.inputs), repr(op.params))
        variants = seen.setdefault(op.name, set())
        if not has_rule(op.name) or key in variants or len(variants) >= 3:
            continue
        variants.add(key)
        ins = [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]
        outs = [env[v.id] for v in op.outputs]
        checked += sum(check_signature_numerically(op, s, ins, expected=outs)
                       for s in signatures(op))
    assert checked > 200
