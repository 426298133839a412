"""Rule families (shape, reduce, indexing, elementwise, dot): expected signatures are present,
wrong ones absent, and EVERY returned signature is checked numerically on a simulated 1-D mesh
(``check_signature_numerically`` in tests/helpers.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    RNG,
    S,
    check_all,
    check_signature_numerically,
    evaluate,
    f32,
    op_inputs,
    sig,
)

from shardc.ir.sbp import WHOLE, B, NdSbp, P, Partial
from shardc.ir.trace import trace
from shardc.rules import signatures, strategies

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


def test_reshape_with_dimensions_splits_through_its_transpose():
    """``lax.reshape(x, sizes, dimensions)`` (``jax.vmap`` of a convolution emits it)
    transposes by ``dimensions`` first: a kept group splits along its major dim there."""
    sigs = check_all(lambda x: jax.lax.reshape(x, (6, 32), dimensions=(1, 0, 2)), f32(4, 6, 8),
                     name="reshape")
    assert sig([S(1)], [S(0)]) in sigs and sig([S(0)], [S(1)]) in sigs
    assert sig([S(0)], [S(0)]) not in sigs


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
