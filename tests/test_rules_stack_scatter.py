"""stack / unstack / tile and the non-add scatters: expected signatures present, wrong ones
absent, EVERY signature checked numerically with the family checker on 2 simulated devices;
and, end to end, a program built with ``jnp.stack`` compiles to the collectives of the same
program built with expand-dims + ``jnp.concatenate``.

``tile``'s ``B -> S(d)`` on a repeated dim has each device materialise its share of the
copies, which the stand-in :class:`LocalTile` runs (``reps[d] / n`` copies).
"""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_all, check_signature_numerically, f32, op_inputs, sig
from jax.sharding import AxisType

import shardc
from shardc.inspect.hlo import collectives
from shardc.ir.sbp import B, P, Partial, Split
from shardc.ir.trace import trace
from shardc.rules import signatures

S = Split


def prims(fn, *args) -> list[str]:
    return [op.name for op in trace(fn, *args).graph.ops]


def no_partial(sigs) -> bool:
    return not any(isinstance(x, Partial) for s in sigs for x in (*s.ins, *s.outs))


# ---- what jnp.stack / jnp.tile are made of -----------------------------------------------

def test_stack_tile_and_the_stack_gradient_are_primitives_of_their_own():
    a = f32(4, 6)
    assert prims(lambda a, b: jnp.stack([a, b], axis=1), a, a) == ["stack"]
    assert prims(lambda a: jnp.tile(a, (2, 3)), a) == ["tile"]
    grad = jax.grad(lambda a, b: (jnp.stack([a, b], axis=1) ** 2).sum(), argnums=(0, 1))
    assert "unstack" in prims(grad, a, a)
    # jnp.repeat is broadcast + reshape, which the shape rules already split
    assert prims(lambda a: jnp.repeat(a, 3, axis=1), a) == ["broadcast_in_dim", "reshape"]
    rep = check_all(lambda a: jnp.repeat(a, 3, axis=1), a, name="reshape")
    assert {sig([S(0)], [S(0)]), sig([S(1)], [S(1)])} <= set(rep)


# ---- stack / unstack ---------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack_splits_every_existing_dim(axis):
    sigs = check_all(lambda a, b, c: jnp.stack([a, b, c], axis=axis),
                     f32(4, 6), f32(4, 6), f32(4, 6), name="stack")
    moved = {0: 0 if axis > 0 else 1, 1: 1 if axis > 1 else 2}
    assert {sig([S(d)] * 3, [S(moved[d])]) for d in (0, 1)} <= set(sigs)
    assert sig([P] * 3, [P]) in sigs
    assert all(S(axis) not in s.outs for s in sigs)  # the stacked axis is never split


def test_stack_with_a_constant_and_a_broadcast_operand():
    const = np.linspace(0.0, 1.0, 24, dtype=np.float32).reshape(4, 6)
    fn = lambda a: jnp.stack([a, jnp.zeros_like(a), const], axis=1)  # noqa: E731
    op, _ = op_inputs(fn, f32(4, 6), name="stack")
    assert [v.is_const for v in op.inputs] == [False, False, True]
    sigs = check_all(fn, f32(4, 6), name="stack")
    assert {sig([S(0)] * 3, [S(0)]), sig([S(1)] * 3, [S(2)])} <= set(sigs)
    # the zeros come from a broadcast, which makes its split for free
    zeros = check_all(fn, f32(4, 6), name="broadcast_in_dim")
    assert {sig([B], [S(0)]), sig([B], [S(1)])} <= set(zeros)


def test_stack_of_bools_has_no_partial():
    sigs = check_all(lambda a, b: jnp.stack([a > 0, b > 0]), f32(4, 6), f32(4, 6),
                     name="stack")
    assert sig([S(1), S(1)], [S(2)]) in sigs and no_partial(sigs)


def test_unstack_from_the_stack_gradient():
    grad = jax.grad(lambda a, b: (jnp.tanh(jnp.stack([a, b], axis=1)) ** 2).sum(),
                    argnums=(0, 1))
    sigs = check_all(grad, f32(4, 6), f32(4, 6), name="unstack")
    assert {sig([S(0)], [S(0), S(0)]), sig([S(2)], [S(1), S(1)]),
            sig([P], [P, P])} <= set(sigs)
    assert all(s.ins != (S(1),) for s in sigs)  # the unstacked axis


# ---- tile --------------------------------------------------------------------------------

class LocalTile:
    """tile on one device for ``sig``: where the output is split on a dim the input is not,
    each device makes ``reps[d] / n`` of the copies."""

    name = "tile"
    multiple_results = False

    def __init__(self, op, sig, n: int = 2):
        self.op, self.sig, self.n = op, sig, n

    def bind(self, x, *, reps):
        reps, out = list(reps), self.sig.outs[0]
        if isinstance(out, Split) and self.sig.ins[0] != out:
            assert reps[out.dim] % self.n == 0, "test reps must be a multiple of the devices"
            reps[out.dim] //= self.n
        return self.op.prim.bind(x, reps=tuple(reps))


def check_tile(fn, *args) -> list:
    op, ins = op_inputs(fn, *args, name="tile")
    want = [np.asarray(op.prim.bind(*ins, **op.params))]
    sigs = signatures(op)
    for s in sigs:
        local = op.replace(prim=LocalTile(op, s))
        assert check_signature_numerically(local, s, ins, expected=want), f"{s}: uneven"
    return sigs


def test_tile_splits_dims_it_does_not_repeat_and_makes_splits_of_repeated_ones():
    sigs = check_tile(lambda x: jnp.tile(x, (2, 1)), f32(4, 6))
    assert {sig([S(1)], [S(1)]), sig([B], [S(0)]), sig([P], [P])} <= set(sigs)
    assert sig([S(0)], [S(0)]) not in sigs  # [x0 x1 x0 x1] is no split of [x0 x0 x1 x1]
    sigs = check_tile(lambda x: jnp.tile(x[:, None, :], (1, 4, 1)), f32(4, 6))
    assert {sig([S(0)], [S(0)]), sig([S(2)], [S(2)]), sig([B], [S(1)])} <= set(sigs)


def test_tile_of_a_repeated_dim_keeps_its_split_off():
    sigs = check_tile(lambda x: jnp.tile(x, (2, 2)), f32(4, 6))
    assert {sig([B], [S(0)]), sig([B], [S(1)]), sig([P], [P])} <= set(sigs)
    assert all(s.ins[0] == B or s.ins[0] == P for s in sigs)


# ---- end to end: stack vs concatenate ----------------------------------------------------

def _stacked(x, w1, w2, w3):
    return jnp.tanh(jnp.stack([x @ w1, x @ w2, x @ w3], axis=1)).sum(1)


def _concatenated(x, w1, w2, w3):
    hs = [(x @ w)[:, None, :] for w in (w1, w2, w3)]
    return jnp.tanh(jnp.concatenate(hs, axis=1)).sum(1)


def _train(fn):
    def step(x, w1, w2, w3):
        return jax.value_and_grad(lambda ws: (fn(x, *ws) ** 2).mean())((w1, w2, w3))
    return step


def _compiled_collectives(fn, args):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(fn, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = step.plan(*args)
        compiled = step.lower(*args).compile()
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    found = collections.Counter((c.kind, c.result_bytes) for c in collectives(compiled, mesh))
    return plan, found, missing


@pytest.mark.parametrize("train", [False, True])
def test_stack_compiles_to_the_collectives_of_expand_dims_and_concatenate(train):
    args = (f32(512, 256), f32(256, 256), f32(256, 256), f32(256, 256))
    wrap = _train if train else (lambda f: f)
    plan, stacked, missing = _compiled_collectives(wrap(_stacked), args)
    _, concatenated, _ = _compiled_collectives(wrap(_concatenated), args)
    assert stacked == concatenated
    assert missing == []
    split = [op for op in plan.ops if op.prim in ("stack", "unstack")]
    assert len(split) == 1 + train
    assert all(not nd.is_replicated for op in split for nd in (*op.ins, *op.outs))


# ---- scatter -----------------------------------------------------------------------------

ROWS = jnp.asarray([1, 5, 2], jnp.int32)


@pytest.mark.parametrize("mode", [None, "clip"])
def test_scatter_set_splits_the_window_only(mode):
    rows = jnp.asarray([1, 9, 2], jnp.int32)  # 9 is out of bounds: dropped, or clipped to 7
    sigs = check_all(lambda x, v: x.at[rows].set(v, mode=mode), f32(8, 6), f32(3, 6),
                     name="scatter")
    # rows split with the updates replicated: each device writes the rows in its shard
    # (masked); not under CLIP, which moves row 9 to the last row, in another shard
    masked = set() if mode == "clip" else {sig([S(0), B, B], [S(0)])}
    assert set(sigs) == {sig([B, B, B], [B]), sig([S(1), B, S(1)], [S(1)]), *masked}
    sigs = check_all(lambda x, v: x.at[ROWS].set(v), f32(8, 4, 6), f32(3, 4, 6),
                     name="scatter")
    assert {sig([S(1), B, S(1)], [S(1)]), sig([S(2), B, S(2)], [S(2)])} <= set(sigs)
    assert no_partial(sigs) and all(s.ins[1] == B for s in sigs)
    assert all(s.ins[0] != S(0) or s.ins[2] == B for s in sigs)


def test_scatter_set_batching_pairs_split_together():
    fn = jax.vmap(lambda x, i, v: x.at[i].set(v))
    rows = jnp.asarray([[1, 5, 2], [0, 3, 7]], jnp.int32)
    op, _ = op_inputs(fn, f32(2, 8, 6), rows, f32(2, 3, 6), name="scatter")
    assert tuple(op.params["dimension_numbers"].operand_batching_dims) == (0,)
    sigs = check_all(fn, f32(2, 8, 6), rows, f32(2, 3, 6), name="scatter")
    assert {sig([S(0), S(0), S(0)], [S(0)]), sig([S(2), B, S(2)], [S(2)]),
            sig([S(1), B, B], [S(1)])} <= set(sigs)  # the last masked (see above)
    assert no_partial(sigs) and all(s.ins[0] != S(1) or s.ins[2] == B for s in sigs)


def test_scatter_of_the_set_gradient():
    grad = jax.grad(lambda x, v: (jnp.sin(x.at[ROWS].set(v)) ** 2).sum(), argnums=(0, 1))
    op, _ = op_inputs(grad, f32(8, 6), f32(3, 6), name="scatter")
    assert op.outputs[0].dtype == np.uint32  # jax scatters ids to find the surviving writes
    sigs = check_all(grad, f32(8, 6), f32(3, 6), name="scatter")
    assert sig([S(1), B, S(1)], [S(1)]) in sigs and no_partial(sigs)


@pytest.mark.parametrize("method,name", [("multiply", "scatter-mul"), ("min", "scatter-min"),
                                         ("max", "scatter-max")])
def test_scatter_mul_min_max_split_like_set(method, name):
    rows = jnp.asarray([1, 5, 1], jnp.int32)  # a repeated row combines both updates
    fn = lambda x, v: getattr(x.at[rows], method)(v)  # noqa: E731
    sigs = check_all(fn, f32(8, 6), f32(3, 6), name=name)
    assert set(sigs) == {sig([B, B, B], [B]), sig([S(1), B, S(1)], [S(1)]),
                         sig([S(0), B, B], [S(0)])}


def test_scatter_sub_has_the_scatter_add_signatures():
    rows = jnp.asarray([1, 5, 1], jnp.int32)
    sub = check_all(lambda x, v: x.at[rows].subtract(v), f32(8, 6), f32(3, 6),
                    name="scatter-sub")
    add = check_all(lambda x, v: x.at[rows].add(v), f32(8, 6), f32(3, 6), name="scatter-add")
    assert sub == add
    assert {sig([S(1), B, S(1)], [S(1)]), sig([P, S(0), S(0)], [P]),
            sig([P, B, P], [P])} <= set(sub)
