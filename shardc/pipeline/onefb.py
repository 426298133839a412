"""A layer stack and its loss run as a one-forward-one-backward (1F1B) pipeline:
:func:`pipeline_loss` computes what ``loss_fn(jax.lax.scan(layer_fn, carry,
stacked_params)[0], head, targets)`` computes, and its gradient, with the layers split into
stages over one mesh axis and the batch cut into micro-batches.

Why the loss is inside: 1F1B runs the backward of micro-batch ``m`` on a stage as soon as
the cotangent of ``m`` comes back from the next stage, before the forward of later
micro-batches, so a stage holds the residuals of a few micro-batches rather than of all of
them (GPipe's). The cotangent of micro-batch ``m`` is the loss's gradient at its output:
the loss must be computed per micro-batch inside the loop, which a stack returning its
carry (:func:`~shardc.pipeline.runtime.pipeline_scan`, under ``jax.grad`` of the whole
step: every forward first, then every backward) cannot do. ``loss_fn`` must be the mean
over the batch's examples of a per-example term (a token-mean cross-entropy, a mean
squared error): the loss is the mean of the micro-batches' losses.

The loop (one ``shard_map`` manual over the stage axis and ``batch_axes``, as
``pipeline_scan``'s): tick ``t`` of ``T = M + 2 S - 2``, stage ``s`` runs the forward of
micro-batch ``f = t - s`` (where ``0 <= f < M``) and keeps its residuals; the last stage
computes the loss of ``f`` and its gradient at once; stage ``s`` then runs the backward of
micro-batch ``b = t - 2 S + 2 + s`` (where ``0 <= b < M``: the last stage's is ``f``
itself) from the residuals it kept and the cotangent the next stage sent, and adds its
weights' gradient. Each tick one ``ppermute`` sends the forward's output to ``s + 1`` and
one the backward's input cotangent to ``s - 1``. A stage keeps the residuals of at most
``R = min(M, 2 S - 1)`` micro-batches (stage 0's count; the last stage's is one), in a
buffer of ``R`` slots; a residual that is a weight itself is read where it is, not copied
per slot. Every stage runs the forward, the loss and the backward every tick, its results
kept where the tick has them for the stage (``jnp.where``): a part under ``lax.cond``
would skip a stage's idle work, but a stage's tensor parallelism puts collectives inside
the branch, which the stages taking the other branch never join (XLA:CPU's
collective-permute waits for every device: the 1F1B expert with TP inside its stages hung
so). :mod:`shardc.pipeline.cost` prices what runs: ``M + 2S - 2`` ticks of each part, where
GPipe runs ``M + S - 1`` of a forward and as many of a backward.

What one step compiles to (per device; ``a`` the bytes of one example's carry, ``b = B/M``
over the ``batch_axes`` ways): in the loop, two collective-permutes of ``b * a`` bytes per
tick, ``T`` runs, over the stage axis; after it, all-reduces of the loss and the head's
gradient (over the stage axis and ``batch_axes``), of the input's cotangent (``M * b * a``
bytes, the stage axis) and of the stage's weight gradients (over ``batch_axes``, where
there are any). The whole step's gradient is computed in the forward (a
``jax.custom_vjp``): its backward scales the gradients kept by the loss's cotangent.

References:
  Narayanan et al., "Efficient large-scale language model training on GPU clusters using
  Megatron-LM" (SC 2021) §2.2: the 1F1B schedule, at most S micro-batches in flight per
  stage in its asynchronous form (the lock-step loop here holds up to 2 S - 1 on stage 0,
  as the ticks above count).
  Fan et al., "DAPPLE" (PPoPP 2021): the early backward scheduling 1F1B is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardc.errors import PipelineError
from shardc.pipeline.runtime import (
    at,
    carry_of,
    check_batch_axes,
    check_pipeline,
    leading,
    pipeline_scan,
    psum,
    put,
    sums_wide,
    varying,
)
from shardc.pipeline.schedule import Pipeline

__all__ = ["in_flight", "pipeline_loss", "ticks"]


def ticks(pipeline: Pipeline) -> int:
    """The loop's tick count, ``M + 2 S - 2`` (module doc)."""
    return pipeline.microbatches + 2 * pipeline.stages - 2


def in_flight(pipeline: Pipeline) -> int:
    """The most micro-batches whose residuals a stage keeps, ``min(M, 2 S - 1)``."""
    return min(pipeline.microbatches, 2 * pipeline.stages - 1)


def _passes(stage: Callable, params, x0):
    """A stage's forward and backward passes for the 1F1B loop, split so the forward's
    residuals that are not weights are kept per slot: the first micro-batch's output and
    residuals (their shapes), ``forward(w, x) -> (y, kept)`` and ``backward(w, kept, ct)
    -> (dw, dx)``."""

    def residuals(w, x):
        """The forward of ``x`` and its residuals that are not weights, with the map
        from the residual tree's leaves to the weights' (None: kept per slot)."""
        y, back = jax.vjp(stage, w, x)
        leaves, tree = jax.tree.flatten(back)
        ws = jax.tree.leaves(w)
        where = tuple(next((k for k, wl in enumerate(ws) if wl is leaf), None)
                      for leaf in leaves)
        return y, [leaf for leaf, k in zip(leaves, where) if k is None], tree, where

    y0, kept0, tree, where = residuals(params, x0)  # the shapes (XLA drops the compute)

    def forward(w, x):
        y, kept, _, w_at = residuals(w, x)
        if w_at != where:
            raise AssertionError("pipeline_loss: the stage's residuals differ between "
                                 "two traces of the same forward")
        return y, kept

    def backward(w, kept, ct):
        ws, it = jax.tree.leaves(w), iter(kept)
        return jax.tree.unflatten(tree, [next(it) if k is None else ws[k]
                                         for k in where])(ct)

    return y0, kept0, forward, backward


def _loop(layer_fn: Callable, loss_fn: Callable, pipeline: Pipeline,
          batch_axes: tuple[str, ...], wide: bool = False):
    """The per-device loop (the body of the ``shard_map``): ``params`` leaves ``[K, ...]``
    (this stage's layers), ``head`` whole, ``mbs`` / ``tgs`` leaves ``[M, b, ...]`` (this
    device's part of every micro-batch over ``batch_axes``). Returns the loss, the
    stage's weight gradients, the head's gradient and the input's cotangent."""
    p = pipeline
    s_n, m_n, axis = p.stages, p.microbatches, p.axis
    every = (axis, *batch_axes)
    slots, n_ticks = in_flight(p), ticks(p)
    up = [(i, i + 1) for i in range(s_n - 1)]
    down = [(i + 1, i) for i in range(s_n - 1)]
    one = carry_of(layer_fn, "pipeline_loss")

    def stage(w, x):
        return jax.lax.scan(lambda c, wl: (one(c, wl), None), x, w)[0]

    def run(params, head, mbs, tgs):
        ways = math.prod(jax.lax.axis_size(a) for a in batch_axes) if batch_axes else 1
        scale = 1.0 / (m_n * ways)  # the loss is the mean over micro-batches and devices
        # made varying once, before the loop: the sums of the cotangents over the axes
        # run once after it, as pipeline_scan's
        mbs, tgs, head, params = jax.tree.map(lambda x: varying(x, every),
                                              (mbs, tgs, head, params))
        s = jax.lax.axis_index(axis)
        last = s == s_n - 1

        x0 = at(mbs, 0)
        y0, kept0, forward, backward = _passes(stage, params, x0)

        def loss_of(y, h, tg):
            return jax.value_and_grad(lambda yy, hh: loss_fn(yy, hh, tg) * scale,
                                      argnums=(0, 1))(y, h)

        def tick(state, t):
            cur, dcur, buf, gw, gh, dmbs, loss = state
            f, b = t - s, t - 2 * s_n + 2 + s
            live_f, live_b = (f >= 0) & (f < m_n), (b >= 0) & (b < m_n)
            fm, bm = jnp.clip(f, 0, m_n - 1), jnp.clip(b, 0, m_n - 1)
            x = jax.tree.map(lambda a, c: jnp.where(s == 0, a, c), at(mbs, fm), cur)
            # every part runs on every stage each tick, its results kept where the tick
            # has it for the stage (module doc: no collective may sit in a branch)
            y, kept = forward(params, x)
            lm, (dy, dh) = loss_of(y, head, at(tgs, fm))
            mine_loss = live_f & last
            lm = jnp.where(mine_loss, lm, 0.0)
            dh = jax.tree.map(lambda g: jnp.where(mine_loss, g, jnp.zeros_like(g)), dh)
            # stored before the backward's slot is read: a live backward's slot is never the
            # one written (at most ``slots`` micro-batches are in flight; on the last stage
            # they are the same micro-batch), and the buffer is updated in place (read
            # first, XLA copied the whole buffer every tick)
            buf = put(buf, fm % slots, kept, ~live_f)
            # the last stage runs the backward of the micro-batch it has just finished
            mine = [jnp.where(last, k, old) for k, old in zip(kept, at(buf, bm % slots))]
            ct = jax.tree.map(lambda a, c: jnp.where(last, a, c), dy, dcur)
            dw, dx = backward(params, mine, ct)
            dw = jax.tree.map(lambda g: jnp.where(live_b, g, jnp.zeros_like(g)), dw)
            gw = jax.tree.map(jnp.add, gw, dw)
            gh = jax.tree.map(jnp.add, gh, dh)
            dmbs = put(dmbs, bm, dx, ~(live_b & (s == 0)))
            nxt = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, up), y)
            back = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, down), dx)
            return (nxt, back, buf, gw, gh, dmbs, loss + lm), None

        start = (x0, jax.tree.map(jnp.zeros_like, y0),
                 [jnp.zeros((slots,) + k.shape, k.dtype) for k in kept0],
                 jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, head),
                 jax.tree.map(jnp.zeros_like, mbs), jnp.zeros((), jnp.float32))
        start = jax.tree.map(lambda a: varying(a, every), start)
        (_, _, _, gw, gh, dmbs, loss), _ = jax.lax.scan(tick, start, jnp.arange(n_ticks))
        loss, gh = psum((loss, gh), every, wide)
        dmbs = psum(dmbs, axis, wide)
        if batch_axes:
            gw = psum(gw, batch_axes, wide)
        return loss, gw, gh, dmbs

    return run


def pipeline_loss(layer_fn: Callable, loss_fn: Callable, carry: Any, stacked_params: Any,
                  head: Any, targets: Any, *, pipeline: Pipeline, mesh: Mesh,
                  batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """``loss_fn(jax.lax.scan(layer_fn, carry, stacked_params)[0], head, targets)`` run as
    the 1F1B pipeline ``pipeline`` on ``mesh`` (module doc); differentiable in ``carry``,
    ``stacked_params`` and ``head`` (the targets' cotangent is zero). ``carry``'s and
    ``targets``' leaves share a leading batch dim (cut into micro-batches: micro-batch
    ``m`` is examples ``m, m + M, ...``), ``stacked_params``' leaves a leading layer dim
    (cut into ``stages`` chunks, chunk ``s`` on stage ``s``); ``layer_fn(carry,
    layer_params)`` returns ``(carry, None)``; ``loss_fn(final_carry, head, targets)`` is a
    scalar, the mean of a per-example term. ``batch_axes`` as for
    :func:`~shardc.pipeline.runtime.pipeline_scan`."""
    p = pipeline
    if p.schedule != "1f1b":
        raise PipelineError(f"pipeline_loss({p}): runs schedule='1f1b'; use pipeline_scan "
                            "for the others")
    batch, layers = leading(carry, "carry"), leading(stacked_params, "stacked params")
    if leading(targets, "targets") != batch:
        raise PipelineError(f"pipeline_loss: the targets' leading dim "
                            f"{leading(targets, 'targets')} is not the carry's batch {batch}")
    check_pipeline(p, mesh, batch, layers)
    check_batch_axes(p, mesh, batch_axes, batch)
    m_n = p.microbatches
    split = PartitionSpec(None, batch_axes or None)
    run = jax.shard_map(_loop(layer_fn, loss_fn, p, tuple(batch_axes), sums_wide(mesh)),
                        mesh=mesh,
                        in_specs=(PartitionSpec(p.axis), PartitionSpec(), split, split),
                        out_specs=(PartitionSpec(), PartitionSpec(p.axis), PartitionSpec(),
                                   split),
                        axis_names={p.axis, *batch_axes})

    def micro(tree):
        return jax.tree.map(
            lambda x: x.reshape((batch // m_n, m_n) + x.shape[1:]).swapaxes(0, 1), tree)

    def whole(tree):
        return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape((batch,) + o.shape[2:]), tree)

    # the loop sums the loss in float32; the result has the loss function's own dtype
    dtype = jax.eval_shape(loss_fn, carry, head, targets).dtype

    def value_and_grads(c, w, h, tg):
        loss, gw, gh, dmbs = run(w, h, micro(c), micro(tg))
        return loss.astype(dtype), (whole(dmbs), gw, gh)

    @jax.custom_vjp
    def value(c, w, h, tg):  # not differentiated: the forward alone, in GPipe's order
        out = pipeline_scan(layer_fn, c, w, pipeline=dataclasses.replace(p, schedule="gpipe"),
                            mesh=mesh, batch_axes=batch_axes)[0]
        return loss_fn(out, h, tg)

    def fwd(c, w, h, tg):
        loss, grads = value_and_grads(c, w, h, tg)
        return loss, (grads, tg)

    def bwd(res, g):
        (dc, dw, dh), tg = res
        scaled = jax.tree.map(lambda x: (g * x).astype(x.dtype), (dc, dw, dh))
        return (*scaled, jax.tree.map(_zero_cotangent, tg))

    value.defvjp(fwd, bwd)
    return value(carry, stacked_params, head, targets)


def _zero_cotangent(x):
    """The zero cotangent of a primal ``x`` (``float0`` for integers, as autodiff has it)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)
