"""PRNG rules: the primitives a dropout step traces to with jax's default threefry keys.

``jax.random.bernoulli(jax.random.fold_in(key, 3), p, shape)`` traces to ``random_wrap`` /
``random_unwrap`` (raw ``uint32[2]`` keys only), ``random_fold_in`` and ``random_bits``, then
``shift_right_logical``/``or``/``bitcast_convert_type`` (uniform floats from the bits: the
first two are elementwise rules, ``bitcast_convert_type`` is in ``misc.py``);
``jax.random.split`` traces to ``random_split``, ``jax.random.key`` to ``random_seed``.
``threefry2x32`` (the hash itself) is what ``jax.extend.random.threefry_2x32`` binds.

A key array ``key<fry>[b...]`` holds one key per batch position; every op here maps each key
on its own (jax batches them with ``vmap``), so a split of a key batch dim carries through,
each device working on its own keys: S(i) on the keys (and on a per-key operand that has the
dim: the messages of ``random_fold_in``) gives S(i) on the output. That is exact on each
device's piece. Keys and bits are never partial: a sum of keys or of random words means
nothing, so there is no P anywhere in this family.

``random_bits`` and ``random_split`` also draw new dims (the ``shape`` param, after the key
batch dims). With ``jax_threefry_partitionable`` (the default since jax 0.5.0, read when a rule
runs) the words are ``threefry2x32(key, counter)`` with the counter the element's row-major
index in the drawn shape (``prng.iota_2x32_shape``), so element ``i`` depends on ``(key, i)``
only, and XLA's SPMD partitioner gives each device the slice of the counter iota that matches
its output slice: B keys -> S(d) on a drawn dim d, no communication (the ``iota_2x32_shape``
docstring: "it lowers in a way such that the compiler's automatic SPMD partitioner recognizes
its partitionability"). Such a split is exact through XLA, not per device: a device binding
``random_bits`` with its local shape would number its elements from 0 and draw device 0's
bits.
Without the flag (the original flattened-counter scheme) or for another PRNG (``rbg``: XLA's
RngBitGenerator) only key batch splits are offered.

``random_seed``, ``random_wrap``, ``random_unwrap`` and ``random_clone`` are per-key: S(i) on
a key batch dim (never on the trailing key-data dim of the raw ``uint32[..., 2]`` array).
``threefry2x32`` is elementwise with broadcasting (rank-0 key words with shaped counters), as
in ``elementwise.py``.

FLOPs (32-bit integer ops, counted as XLA's HloCostAnalysis counts elementwise ops):

* one threefry2x32 hash of a counter pair = :data:`THREEFRY2X32_OPS` = 117: 20 rounds of
  (add, rotate = shift-left + shift-right + or, xor) = 100, and 17 adds of key injection
  (the key added before round 1, then after every 4th round: 2 + 5 x 3, the second word also
  adding the injection number); plus :data:`KEY_SCHEDULE_OPS` = 2 xors per key for the third
  schedule word ``k0 ^ k1 ^ 0x1BD11BDA``. Threefry-2x32 with 20 rounds, rotations
  (13, 15, 26, 6, 17, 29, 16, 24) and key injection every 4 rounds is Random123's
  Threefry-2x32-20 (Salmon et al., SC'11, the Threefry section); jax ``_threefry2x32_lowering``
  (the unrolled form lowered for GPU/TPU; the CPU lowering rolls the 5 groups into a
  ``fori_loop`` whose body HloCostAnalysis counts once);
* counters of a drawn shape of rank r >= 1: ``2r + 1`` per element (``iota_2x32_shape``: r-1
  stride multiplies, r-1 adds, a shift and two converts), computed once for all keys;
* ``random_bits``: a hash per element, then 1 op to make a 32-bit word (``bits1 ^ bits2``), 2
  for 8/16 bits (and a convert), 4 for 64 bits (two converts, a shift and an or);
* ``random_split``: a hash per new key (the two words are the new key), no combining op;
* ``random_fold_in``: one hash per key (the message, split into two words, hashed under it);
* ``random_seed``: :data:`SEED_OPS` = 3 per key (``threefry_seed``: a shift gives the high word,
  two converts; the mask ``& 0xFFFFFFFF`` of a 32-bit seed is the identity);
* ``random_wrap`` / ``random_unwrap`` / ``random_clone``: 0 (a change of type, no data).

The tests check these against ``cost_analysis()["flops"]`` of the GPU lowering: equal within
2 FLOPs per op for ``random_bits``, ``random_split`` and ``threefry2x32``, within 1% for
``random_fold_in`` and ``random_seed`` (XLA folds a key-schedule xor, the all-ones mask of the
message split, a constant or two).

References:
  J. K. Salmon, M. A. Moraes, R. O. Dror, D. E. Shaw, "Parallel random numbers: as easy as
  1, 2, 3", SC'11 (Threefry). jax ``_src/random/threefry2x32.py``
  (``_threefry2x32_lowering``, ``_threefry_random_bits_partitionable``,
  ``_threefry_split_foldlike``) and ``_src/random/prng.py`` (``iota_2x32_shape``); the
  ``jax_threefry_partitionable`` upgrade note (jax discussion #18480; on by default since
  jax 0.5.0, changelog).
"""

from __future__ import annotations

import functools
import math

import jax

from shardc.ir.graph import Op, Value
from shardc.ir.sbp import B, Split
from shardc.rules.elementwise import split_signatures
from shardc.rules.misc import no_flops
from shardc.rules.registry import Signature, register

__all__ = ["COMBINE_OPS", "counter_ops", "draws_partitionably", "KEY_SCHEDULE_OPS",
           "random_bits_flops", "random_bits_rule", "random_fold_in_flops",
           "random_fold_in_rule", "random_seed_flops", "random_seed_rule", "random_split_flops",
           "random_split_rule", "random_unwrap_rule", "random_wrap_rule", "SEED_OPS",
           "threefry2x32_flops", "THREEFRY2X32_OPS", "threefry2x32_rule"]

#: 32-bit ops of one threefry2x32 hash of a counter pair: 20 rounds x 5 + 17 injection adds
THREEFRY2X32_OPS = 20 * 5 + 2 + 5 * 3
#: xors per key for the key schedule's third word ``k0 ^ k1 ^ 0x1BD11BDA``
KEY_SCHEDULE_OPS = 2
#: ops per key of ``threefry_seed`` (a shift for the high word, two converts)
SEED_OPS = 3
#: ops turning the two hash words into one word of ``bit_width`` bits
COMBINE_OPS = {8: 2, 16: 2, 32: 1, 64: 4}


@functools.cache
def _threefry_key_dtype():
    return jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32")).dtype


def draws_partitionably(key: Value) -> bool:
    """True when a split of a drawn dim costs no communication: threefry keys with
    ``jax_threefry_partitionable`` on."""
    return bool(jax.config.jax_threefry_partitionable) and key.dtype == _threefry_key_dtype()


def _per_key(v: Value, key: Value, d: int) -> bool:
    """``v`` has key batch dim ``d`` at full size: a per-key operand (the messages of
    ``random_fold_in``, not a scalar one) or raw key data ``uint32[b..., 2]``."""
    return v.ndim >= key.ndim and v.shape[d] == key.shape[d]


def _batch_signatures(op: Op, key: Value) -> list[Signature]:
    """S(d) on a key batch dim ``d``: every operand that has it splits, the outputs too."""
    sigs = []
    for d in range(key.ndim):
        if key.shape[d] == 1:
            continue
        ins = tuple(Split(d) if _per_key(v, key, d) else B for v in op.inputs)
        sigs.append(Signature(ins, (Split(d),) * len(op.outputs)))
    return sigs


def _draw_signatures(op: Op) -> list[Signature]:
    """Key batch splits, plus B keys -> S(d) on a drawn dim when the draw partitions."""
    key, out = op.inputs[0], op.outputs[0]
    sigs = _batch_signatures(op, key)
    if draws_partitionably(key):
        sigs += [Signature((B,), (Split(d),)) for d in range(key.ndim, out.ndim)
                 if out.shape[d] > 1]
    return sigs


def counter_ops(shape) -> int:
    """Ops per element of ``iota_2x32_shape(shape)``; a scalar draw uses the constant 0."""
    return 2 * len(shape) + 1 if len(shape) else 0


def random_bits_flops(op: Op) -> float:
    keys, shape = op.inputs[0].size, tuple(op.params["shape"])
    m = math.prod(shape)
    per_word = THREEFRY2X32_OPS + COMBINE_OPS[op.params["bit_width"]]
    return float(keys * m * per_word + m * counter_ops(shape) + KEY_SCHEDULE_OPS * keys)


def random_split_flops(op: Op) -> float:
    keys, shape = op.inputs[0].size, tuple(op.params["shape"])
    m = math.prod(shape)
    return float(keys * m * THREEFRY2X32_OPS + m * counter_ops(shape) + KEY_SCHEDULE_OPS * keys)


def random_fold_in_flops(op: Op) -> float:
    return float(op.outputs[0].size * (THREEFRY2X32_OPS + KEY_SCHEDULE_OPS))


def random_seed_flops(op: Op) -> float:
    return float(SEED_OPS * op.outputs[0].size)


def threefry2x32_flops(op: Op) -> float:
    k0, k1 = op.inputs[:2]
    return float(THREEFRY2X32_OPS * op.outputs[0].size + KEY_SCHEDULE_OPS * max(k0.size, k1.size))


@register("random_bits", flops=random_bits_flops)
def random_bits_rule(op: Op) -> list[Signature]:
    return _draw_signatures(op)


@register("random_split", flops=random_split_flops)
def random_split_rule(op: Op) -> list[Signature]:
    return _draw_signatures(op)


@register("random_fold_in", flops=random_fold_in_flops)
def random_fold_in_rule(op: Op) -> list[Signature]:
    return _batch_signatures(op, op.inputs[0])


@register("random_seed", flops=random_seed_flops)
def random_seed_rule(op: Op) -> list[Signature]:
    return _batch_signatures(op, op.outputs[0])


@register("random_wrap", flops=no_flops)
def random_wrap_rule(op: Op) -> list[Signature]:
    return _batch_signatures(op, op.outputs[0])  # the trailing key-data dims stay whole


@register("random_unwrap", "random_clone", flops=no_flops)
def random_unwrap_rule(op: Op) -> list[Signature]:
    return _batch_signatures(op, op.inputs[0])


@register("threefry2x32", flops=threefry2x32_flops)
def threefry2x32_rule(op: Op) -> list[Signature]:
    return split_signatures(op)
