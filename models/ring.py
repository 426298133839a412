"""Ring attention written by hand, as a practitioner runs context parallelism's ring form.

Within :func:`ring_over` (the ``ringN-x-fsdp`` experts of :mod:`shardc.bench.experts`),
:func:`attend` runs causal attention as a ``shard_map`` over the mesh: each device holds a
block of the queries, keys and values along the sequence (split over ``seq`` axes, the
batch over ``batch`` axes) and passes its key/value block round the ring with ``ppermute``
(the grouped key/value heads, before they are repeated for the query heads: 1 / groups
of the bytes), combining each block's scores into its queries' output with the online
softmax (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"). The backward pass is JAX's
derivative of the same program (each ``ppermute`` transposed to the reverse one). Every
device computes every block, the causally masked ones included: the work stays balanced
without the zigzag reordering, at twice the causal FLOPs (as shardc's own ring).
Outside :func:`ring_over`, :func:`attend` is the model's plain softmax attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from shardc.models import logical

__all__ = ["attend", "ring_over", "Ring"]


@dataclass(frozen=True)
class Ring:
    """Where :func:`attend` runs its ring: the mesh, the axes the sequence is split over
    (the ring's), and those the batch is split over where they divide it (empty: none)."""

    mesh: Mesh
    seq: tuple[str, ...]
    batch: tuple[str, ...] = ()


_RING: contextvars.ContextVar[Ring | None] = contextvars.ContextVar("models_ring", default=None)


@contextlib.contextmanager
def ring_over(ring: Ring | None) -> Iterator[None]:
    """Within the block, :func:`attend` runs as ``ring`` says (None: plain attention)."""
    token = _RING.set(ring)
    try:
        yield
    finally:
        _RING.reset(token)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, plain) -> jax.Array:
    """Causal attention of ``q`` ``[b, t, h, dh]`` over ``k``, ``v`` ``[b, t, kv, dh]``
    (``h / kv`` query heads per key/value head): ``plain(q, k, v)`` outside
    :func:`ring_over`, the ring inside it."""
    ring = _RING.get()
    if ring is None:
        return plain(q, k, v)
    # the batch split only over axes that divide it (as the activations' rules split it)
    spec = logical.spec(("batch", "seq", None, None), {"batch": ring.batch, "seq": ring.seq},
                        q.shape, ring.mesh)
    if spec[1] != (ring.seq[0] if len(ring.seq) == 1 else ring.seq):
        raise ValueError(f"ring attention over {ring.seq}: the sequence of {q.shape[1]} "
                         "tokens does not divide over the ring's devices")
    n = math.prod(ring.mesh.shape[a] for a in ring.seq)
    body = _local(n, ring.seq, q.shape[2] // k.shape[2])
    return jax.shard_map(body, mesh=ring.mesh, in_specs=(spec, spec, spec),
                         out_specs=spec, check_vma=False)(q, k, v)


def _local(n: int, axes: tuple[str, ...], groups: int):
    """One device's ring: its query block against the ``n`` key/value blocks in turn,
    each sent on to the next device once used."""
    perm = [(j, (j + 1) % n) for j in range(n)]

    def run(q, k, v):
        b, t, h, dh = q.shape
        me = jax.lax.axis_index(axes)
        rows = me * t + jnp.arange(t)
        scale = jnp.asarray(1 / math.sqrt(dh), jnp.float32)
        top = jnp.full((b, h, t), -jnp.inf, jnp.float32)
        total = jnp.zeros((b, h, t), jnp.float32)
        out = jnp.zeros((b, t, h, dh), jnp.float32)
        for i in range(n):
            cols = ((me - i) % n) * t + jnp.arange(t)  # the block held came from me - i
            kk, vv = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=jnp.float32)
            s = jnp.where(rows[:, None] >= cols[None, :], s * scale,
                          jnp.finfo(jnp.float32).min)
            new = jnp.maximum(top, s.max(-1))  # the diagonal block comes first: finite
            p = jnp.exp(s - new[..., None])
            fade = jnp.exp(top - new)
            total = total * fade + p.sum(-1)
            out = out * jnp.moveaxis(fade, 1, 2)[..., None] + jnp.einsum(
                "bhqk,bkhd->bqhd", p.astype(v.dtype), vv, preferred_element_type=jnp.float32)
            top = new
            if i < n - 1:
                k, v = jax.lax.ppermute(k, axes, perm), jax.lax.ppermute(v, axes, perm)
        return (out / jnp.moveaxis(total, 1, 2)[..., None]).astype(q.dtype)

    return run
