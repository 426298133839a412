"""``cond`` and ``while`` planned inside: a platform-dependent ``cond`` (``jnp.diagonal``) is
resolved at trace time to its platform's branch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import shardc
from shardc.ir.graph import check_graph
from shardc.ir.trace import trace

RNG = np.random.default_rng(0)


def mesh8():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _close(got, want, rtol=1e-4, atol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# ---- platform_index ------------------------------------------------------------------------

BATCH, DIM = 4096, 512


def _contrastive_step(diagonal: bool):
    """A contrastive (CLIP-style) loss's SGD step; the matched pairs' logits read with
    ``jnp.diagonal`` or, equivalently, masked with an identity matrix."""
    def loss(p, x, y):
        logits = (x @ p["a"]) @ (y @ p["b"]).T
        d = jnp.diagonal(logits) if diagonal else jnp.sum(logits * jnp.eye(BATCH), 1)
        return jnp.mean(jax.nn.logsumexp(logits, 1) - d)

    def step(p, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, p, g), value

    return step


def _contrastive_args():
    f32 = jnp.float32
    p = {k: jnp.asarray(RNG.normal(size=(DIM, DIM)) / DIM ** 0.5, f32) for k in "ab"}
    return (p, jnp.asarray(RNG.normal(size=(BATCH, DIM)), f32),
            jnp.asarray(RNG.normal(size=(BATCH, DIM)), f32))


def test_a_platform_dependent_cond_is_traced_as_its_platform_branch():
    x = jnp.ones((8, 8))
    graph = trace(jnp.diagonal, x).graph
    check_graph(graph)
    names = [op.name for op in graph.ops]
    assert "cond" not in names and "platform_index" not in names
    assert "gather" in names  # the default branch, inlined


def test_diagonal_keeps_the_matmul_split():
    """``jnp.diagonal`` lowers to a ``platform_index`` and a ``cond``: planned as one opaque
    op it made the logits' matmul run replicated (3x the FLOPs per device of the same loss
    without it); resolved, the two losses compile alike."""
    args = _contrastive_args()
    flops = {}
    for diagonal in (False, True):
        s = shardc.auto_shard(_contrastive_step(diagonal), mesh=mesh8(), time_limit=3.0)
        flops[diagonal] = s.lower(*args).compile().cost_analysis()["flops"]
        if diagonal:
            _close(s(*args), jax.jit(_contrastive_step(True))(*args))
    assert flops[True] <= 1.2 * flops[False], flops
