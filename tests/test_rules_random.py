"""PRNG rules (``shardc/rules/random.py``): expected signatures present, wrong ones absent, and
EVERY signature verified.

Key batch splits are exact on each device's piece and go through the family checker
(``check_signature_numerically``) with the keys as their ``uint32[..., 2]`` data
(:class:`KeyData`: numpy has no key dtype). A split of a drawn dim (``random_bits`` /
``random_split`` with B keys) is not: a device binding ``random_bits`` with its local shape
numbers its elements from 0 and draws device 0's bits. Those go through XLA instead
(:func:`check_through_xla`): ``jax.jit`` with the signature's shardings on a 1-D mesh of 8
CPU devices gives exactly the unsharded values, each device holds the slice the signature
says, and the compiled HLO holds no collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_signature_numerically, f32, sig
from jax.extend.random import threefry2x32_p
from jax.sharding import Mesh, NamedSharding

from shardc.inspect.hlo import compiled_flops
from shardc.ir.graph import Op, Value
from shardc.ir.sbp import B, NdSbp, Partial, Split, to_partition_spec
from shardc.ir.trace import trace
from shardc.rules import has_rule, op_flops, signatures, strategies

S = Split
KEY = jax.random.key(0)
KEYS = jax.random.split(jax.random.key(1), 8)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def is_key(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def _bind(prim, ins, params) -> list:
    outs = prim.bind(*ins, **params)
    return list(outs) if prim.multiple_results else [outs]


def key_op(fn, *args, name: str) -> tuple[Op, list]:
    """The op called ``name`` in ``fn``'s graph and its concrete inputs (typed keys kept)."""
    graph = trace(fn, *args).graph
    (op,) = [o for o in graph.ops if o.name == name]

    def run(*leaves):
        env = dict(zip((v.id for v in graph.inputs), leaves, strict=True))
        for o in graph.ops:
            ins = [v.const if v.is_const else env[v.id] for v in o.inputs]
            env.update(zip((v.id for v in o.outputs), _bind(o.prim, ins, o.params)))
        return [env[v.id] for v in op.inputs if not v.is_const]

    found = iter(jax.jit(run)(*jax.tree.leaves(args)))
    return op, [np.asarray(v.const) if v.is_const else next(found) for v in op.inputs]


def _data(x, v: Value):
    return np.asarray(jax.random.key_data(x) if is_key(v.dtype) else x)


class KeyData:
    """Stand-in primitive taking and giving threefry keys as their ``uint32[..., 2]`` data; it
    runs jitted (eager PRNG ops dispatch their implementation op by op, seconds per shape)."""

    def __init__(self, op: Op):
        self.op, self.name, self.multiple_results = op, op.prim.name, True
        self._run = jax.jit(self._on_data, static_argnames=tuple(op.params))

    def _on_data(self, *ins, **params):
        ins = [jax.random.wrap_key_data(x, impl="threefry2x32") if is_key(v.dtype) else x
               for x, v in zip(ins, self.op.inputs, strict=True)]
        outs = _bind(self.op.prim, ins, params)
        return [jax.random.key_data(x) if is_key(v.dtype) else x
                for x, v in zip(outs, self.op.outputs, strict=True)]

    def bind(self, *ins, **params):
        return [np.asarray(x) for x in self._run(*ins, **params)]


def draws_split(op: Op, s) -> bool:
    """The signature splits a drawn dim (one after the key batch dims)."""
    key = op.inputs[0]
    return op.name in ("random_bits", "random_split") and any(
        isinstance(o, Split) and o.dim >= key.ndim for o in s.outs)


def compiled(op: Op, ins):
    """The op alone, jitted and compiled unsharded for ``ins``."""
    return jax.jit(lambda *xs: _bind(op.prim, xs, op.params)).lower(*ins).compile()


def check_through_xla(op: Op, s, ins, reference, n: int = 8) -> None:
    """``jax.jit`` of the op with ``s``'s shardings on ``n`` devices: the values of the
    unsharded ``reference`` executable, each device holding the slice ``s`` says and doing
    1/n of the reference's work (XLA could also draw everything on every device and slice),
    and no collective in the compiled HLO."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

    def sharding(sbp, v: Value) -> NamedSharding:
        assert not isinstance(sbp, Partial), f"{op.name} {s}: keys and bits are never partial"
        return NamedSharding(mesh, to_partition_spec(NdSbp((sbp,)), v.ndim, ("x",)))

    f = jax.jit(lambda *xs: _bind(op.prim, xs, op.params),
                in_shardings=[sharding(x, v) for x, v in zip(s.ins, op.inputs, strict=True)],
                out_shardings=[sharding(x, v) for x, v in zip(s.outs, op.outputs, strict=True)])
    sharded = f.lower(*ins).compile()
    hlo = sharded.as_text()
    assert not [c for c in COLLECTIVES if c in hlo], f"{op.name} {s} communicates:\n{hlo}"
    # per device vs whole (XLA:CPU counts the hash loop's body once in both)
    assert compiled_flops(sharded) <= 1.25 * compiled_flops(reference) / n, f"{op.name} {s}"
    want = reference(*ins)
    for k, (got, ref, sbp, v) in enumerate(zip(sharded(*ins), want, s.outs, op.outputs,
                                               strict=True)):
        np.testing.assert_array_equal(_data(got, v), _data(ref, v),
                                      err_msg=f"{op.name} {s} output {k}")
        local = [d // n if sbp == S(i) else d for i, d in enumerate(v.shape)]
        assert got.addressable_shards[0].data.shape == tuple(local), f"{op.name} {s}"


def check_keyed(fn, *args, name: str) -> tuple[Op, list]:
    """Signatures of the op; each the rule gives is verified: drawn splits through XLA, the
    rest per device. (The all-broadcast one the registry adds is the unsharded op itself.)"""
    op, ins = key_op(fn, *args, name=name)
    sigs = signatures(op)
    assert sigs[0] == sig([B] * len(op.inputs), [B] * len(op.outputs))
    reference = compiled(op, ins)
    local, data = op.replace(prim=KeyData(op)), [_data(x, v) for x, v in zip(ins, op.inputs)]
    expected = [_data(x, v) for x, v in zip(reference(*ins), op.outputs, strict=True)]
    for s in sigs[1:]:
        assert not any(isinstance(x, Partial) for x in (*s.ins, *s.outs)), f"{name} {s}"
        if draws_split(op, s):
            check_through_xla(op, s, ins, reference)
        else:
            assert check_signature_numerically(local, s, data, expected=expected), f"{s} uneven"
    return op, sigs


def dropout(key, x):
    return jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 3), 0.9, x.shape), x / 0.9, 0)


# ---- which primitives dropout is made of --------------------------------------------------

@pytest.mark.parametrize("key", [jax.random.PRNGKey(0), KEY], ids=["raw", "typed"])
def test_every_primitive_of_a_dropout_step_has_a_rule(key):
    names = {op.name for op in trace(dropout, key, f32(16, 8)).graph.ops}
    names |= {op.name for op in trace(lambda k: jax.random.split(k, 4), key).graph.ops}
    assert {"random_fold_in", "random_bits", "shift_right_logical", "bitcast_convert_type",
            "random_split"} <= names
    assert ({"random_wrap", "random_unwrap"} <= names) == (key.dtype == jnp.uint32)
    assert all(has_rule(n) for n in names), sorted(n for n in names if not has_rule(n))
    assert jax.config.jax_threefry_partitionable  # the default the drawn splits rely on


# ---- random_bits and random_split --------------------------------------------------------

def test_random_bits_splits_drawn_dims_without_communication():
    bits = lambda shape: jax.jit(lambda k: jax.random.bits(k, shape, jnp.uint8))(KEY)  # noqa: E731
    _, sigs = check_keyed(lambda k: jax.random.bits(k, (16, 8), jnp.uint8), KEY,
                          name="random_bits")
    assert set(sigs) == {sig([B], [B]), sig([B], [S(0)]), sig([B], [S(1)])}
    # why not per device: a device's own draw of its (8, 8) piece numbers it from 0, so
    # every device would draw device 0's rows
    full, piece = bits((16, 8)), bits((8, 8))
    assert np.array_equal(piece, full[:8]) and not np.array_equal(piece, full[8:])


def test_random_bits_on_a_key_batch():
    # vmap over 8 keys: bits (8, 16); the key dim splits per device, the drawn dim via XLA
    # (rank 2: XLA:CPU takes seconds to compile a rank-3 draw)
    fn = lambda k: jax.vmap(lambda k: jax.random.bits(k, (16,)))(k)  # noqa: E731
    _, sigs = check_keyed(fn, KEYS, name="random_bits")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)]), sig([B], [S(1)])}


def test_random_split_splits_new_keys_and_key_batches():
    _, sigs = check_keyed(lambda k: jax.random.split(k, 16), KEY, name="random_split")
    assert set(sigs) == {sig([B], [B]), sig([B], [S(0)])}
    _, sigs = check_keyed(lambda k: jax.vmap(lambda k: jax.random.split(k, 8))(k), KEYS,
                          name="random_split")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)]), sig([B], [S(1)])}


def test_drawn_splits_need_partitionable_threefry():
    fn = lambda k: jax.vmap(lambda k: jax.random.bits(k, (8, 16)))(k)  # noqa: E731
    with jax.threefry_partitionable(False):  # the rule reads the flag when it runs
        op, _ = key_op(fn, KEYS, name="random_bits")
        assert signatures(op) == [sig([B], [B]), sig([S(0)], [S(0)])]
        # and rightly: XLA then draws everything on every device and slices
        op, _ = key_op(lambda k: jax.random.bits(k, (16, 8)), KEY, name="random_bits")
        with pytest.raises(AssertionError, match=r"random_bits B->S\(1\)"):
            check_through_xla(op, sig([B], [S(1)]), [KEY], compiled(op, [KEY]))
    rbg = jax.vmap(lambda s: jax.random.key(s, impl="rbg"))(jnp.arange(8))
    graph = trace(lambda k: jax.vmap(lambda k: jax.random.bits(k, (8, 16)))(k), rbg).graph
    (op,) = [o for o in graph.ops if o.name == "random_bits"]
    assert signatures(op) == [sig([B], [B]), sig([S(0)], [S(0)])]


# ---- per-key ops -------------------------------------------------------------------------

def test_fold_in_splits_keys_with_their_messages():
    _, sigs = check_keyed(lambda k, m: jax.vmap(jax.random.fold_in)(k, m), KEYS,
                          jnp.arange(8, dtype=jnp.uint32), name="random_fold_in")
    assert set(sigs) == {sig([B, B], [B]), sig([S(0), S(0)], [S(0)])}
    _, sigs = check_keyed(lambda k: jax.vmap(jax.random.fold_in, (0, None))(k, 3), KEYS,
                          name="random_fold_in")
    assert set(sigs) == {sig([B, B], [B]), sig([S(0), B], [S(0)])}  # one message for all
    _, sigs = check_keyed(lambda k: jax.random.fold_in(k, 3), KEY, name="random_fold_in")
    assert sigs == [sig([B, B], [B])]  # one key: nothing to split


def test_seed_wrap_unwrap_clone_split_key_batches_only():
    _, sigs = check_keyed(lambda s: jax.vmap(jax.random.key)(s), jnp.arange(8),
                          name="random_seed")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)])}
    data = jax.random.key_data(jax.random.split(KEY, (4, 2)))  # uint32 (4, 2, 2)
    _, sigs = check_keyed(jax.random.wrap_key_data, data, name="random_wrap")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)]), sig([S(1)], [S(1)])}
    assert sig([S(2)], [S(2)]) not in sigs  # the key words are never cut
    _, sigs = check_keyed(jax.random.key_data, KEYS, name="random_unwrap")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)])}
    _, sigs = check_keyed(jax.random.clone, KEYS, name="random_clone")
    assert set(sigs) == {sig([B], [B]), sig([S(0)], [S(0)])}


def test_threefry2x32_is_elementwise_with_broadcast_key_words():
    # rank-1 counts: XLA:CPU compiles the hash's loop over a rank-2 array for seconds
    hash_ = lambda a, b, x, y: threefry2x32_p.bind(a, b, x, y)  # noqa: E731
    counts = jnp.arange(16, dtype=jnp.uint32)
    ins = [jnp.uint32(7), jnp.uint32(11), counts, counts + 16]  # one key for every counter
    op, sigs = check_keyed(hash_, *ins, name="threefry2x32")
    assert set(sigs) == {sig([B] * 4, [B, B]), sig([B, B, S(0), S(0)], [S(0), S(0)])}
    check_through_xla(op, sigs[1], ins, compiled(op, ins))
    _, sigs = check_keyed(hash_, counts * 3, counts * 5, counts, counts, name="threefry2x32")
    assert set(sigs) == {sig([B] * 4, [B, B]), sig([S(0)] * 4, [S(0), S(0)])}


def test_dropout_strategies_on_a_2d_mesh():
    graph = trace(dropout, KEY, f32(16, 8)).graph
    (bits,) = [o for o in graph.ops if o.name == "random_bits"]
    names = {st.name for st in strategies(bits, (2, 4))}
    assert "B->S(0) | B->S(1)" in names and "B->S(1) | B->S(1)" in names
    assert all(st.flops == op_flops(bits) / 8 for st in strategies(bits, (2, 4))
               if st.name.count("S(") == 2)


# ---- FLOPs -------------------------------------------------------------------------------

def xla_flops(fn, *args) -> float:
    """XLA's count for ``fn`` lowered for GPU: the threefry hash unrolled (the CPU lowering
    rolls its 5 groups of rounds into a loop whose body HloCostAnalysis counts once)."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return float(lowered.cost_analysis()["flops"])


def the_op(fn, *args, name: str) -> Op:
    (op,) = [o for o in trace(fn, *args).graph.ops if o.name == name]
    return op


@pytest.mark.parametrize("fn,args,name", [
    (lambda k: jax.random.bits(k, (1024,)), (KEY,), "random_bits"),
    (lambda k: jax.random.bits(k, (4, 16, 16), jnp.uint8), (KEY,), "random_bits"),
    (lambda k: jax.random.bits(k, (64, 16), jnp.uint16), (KEY,), "random_bits"),
    (lambda k: jax.vmap(lambda k: jax.random.bits(k, (4, 16)))(k), (KEYS,), "random_bits"),
    (lambda k: jax.random.split(k, (64, 16)), (KEY,), "random_split"),
    (lambda k: jax.vmap(lambda k: jax.random.split(k, 16))(k), (KEYS,), "random_split"),
    (lambda a, b, x, y: threefry2x32_p.bind(a, b, x, y),
     (jnp.uint32(1), jnp.uint32(2), *[jnp.zeros((32, 32), jnp.uint32)] * 2), "threefry2x32"),
])
def test_threefry_flops_match_xla(fn, args, name):
    """117 ops per hash (20 rounds x 5 + 17 key-injection adds), counters and combining ops
    as the module says: XLA counts the same, but for one key-schedule xor it folds."""
    op = the_op(fn, *args, name=name)
    assert op_flops(op) > 117 * op.outputs[0].size  # a hash per word or key, and more
    assert op_flops(op) == pytest.approx(xla_flops(fn, *args), abs=2)


def test_small_key_op_flops():
    # fold_in: one hash per key (XLA folds the all-ones mask of the message split)
    fold = lambda k, m: jax.vmap(jax.random.fold_in)(k, m)  # noqa: E731
    msgs = jnp.arange(8, dtype=jnp.uint32)
    assert op_flops(the_op(fold, KEYS, msgs, name="random_fold_in")) == 8 * 119
    assert 8 * 119 == pytest.approx(xla_flops(fold, KEYS, msgs), rel=0.01)
    seed = lambda s: jax.vmap(jax.random.key)(s)  # noqa: E731
    assert op_flops(the_op(seed, jnp.arange(8), name="random_seed")) == 8 * 3
    assert 8 * 3 == pytest.approx(xla_flops(seed, jnp.arange(8)), abs=1)
    for fn, arg, name in [(jax.random.key_data, KEYS, "random_unwrap"),
                          (jax.random.wrap_key_data, jax.random.key_data(KEYS), "random_wrap"),
                          (jax.random.clone, KEYS, "random_clone")]:
        assert op_flops(the_op(fn, arg, name=name)) == 0.0
