"""A layer stack run as a pipeline: :func:`pipeline_scan` computes what
``jax.lax.scan(layer_fn, carry, stacked_params)`` computes, with the layers split into
stages over one mesh axis and the batch cut into micro-batches.

The whole loop is one ``shard_map`` manual over the stage axis and ``batch_axes`` (the
other mesh axes stay Auto, laid out by whoever calls it). Device ``s`` of the stage axis
holds its layers (``stacked_params`` cut ``[V, S, K, ...]``: chunk ``v * S + s`` of ``K``
layers is stage ``s``'s ``v``-th), every device the micro-batched input ``[M, b, ...]``
(micro-batch ``m`` is examples ``m, m + M, ...``, split over ``batch_axes``). Step ``t`` of
``T = M * V + S - 1`` (MaxText's iteration count): device ``s`` runs its chunk
``v = (t - s) // M`` on micro-batch ``m = (t - s) % M`` when ``0 <= t - s < M * V``
(otherwise a bubble: it computes on a stand-in and the result is dropped), then passes the
result to device ``s + 1`` with one ``ppermute`` (a ``collective-permute``). Stage 0 takes a
fresh micro-batch in the first pass and, in later passes of the circular schedule, the one
the last stage sent round (held in a buffer of ``M`` micro-batches until its turn, as
MaxText's ``circ_storage``; ``M >= S`` so it is back before it is due). The last stage
keeps the finished micro-batches; one ``psum`` over the stage axis hands them to every
device at the end.

Gradients are autodiff of this loop: the backward is the loop transposed (a GPipe
backward: all forward steps first, then all backward steps; each ``ppermute`` transposes
to the reverse ``ppermute``, the closing ``psum`` to a no-op). The input and the weights
are made varying before the loop, so their cotangents are summed once after it: the
input's over the stage axis, the weights' over ``batch_axes``.

What one step compiles to (per device; ``a`` the bytes of one example's carry, ``b = B/M``
over the ``batch_axes`` ways; ``tests/test_pipeline_runtime.py`` reads these from the HLO):

- forward loop: one collective-permute of ``b * a`` bytes per step, ``T`` runs, over the
  stage axis (``S - 1`` pairs ``s -> s + 1``; ``S`` pairs, the ring, where ``V > 1``);
- after it: one all-reduce of the finished micro-batches, ``M * b * a`` bytes, stage axis;
- backward loop: the same collective-permute, reversed, ``T`` runs;
- after it: one all-reduce of the input's cotangent, ``M * b * a`` bytes, stage axis (where
  the input is differentiated), and one all-reduce of the stage's weight gradients over
  ``batch_axes`` (where there are any);
- the weights stay split over the stage axis; a caller's other layout of them is converted
  before and after (for ``"circular"``, whose chunks interleave, a contiguous split of the
  layer dim is not theirs: an all-to-all or permute of the weights each way).

What a stage holds live for the backward: ``T`` steps of what autodiff of ``layer_fn``
saves for ``K`` layers on ``b`` examples (the unpipelined scan's residuals times
``T * K * b / (L * B)``: ``(M + S - 1) / (M * S)`` of them for GPipe), and, not those, for
``"circular"``: ``T`` chunk inputs of ``b * a`` (each step's chunk is recomputed in the
backward, one extra forward of the stack); besides, the micro-batched input, the
finished micro-batches and (circular) the buffer of returning ones, ``M * b * a`` each.

Schedules: ``"gpipe"`` and ``"circular"``. ``"1f1b"`` runs each micro-batch's backward
soon after its forward, which needs the loss inside the loop: a stack and its loss run so
with :func:`shardc.pipeline.onefb.pipeline_loss`; asked of this function, it raises.

References:
  Huang et al., "GPipe" (NeurIPS 2019): micro-batches through stages, the bubble.
  Narayanan et al., "Efficient large-scale language model training on GPU clusters using
  Megatron-LM" (SC 2021) §2.2: the interleaved schedule, chunk ``v * S + s`` on device ``s``.
  MaxText ``layers/pipeline.py`` (github:AI-Hypercomputer/maxtext): the step count
  ``M * V + S - 1``, micro-batch ``(t - s) % M`` and repeat ``(t - s) // M`` of stage ``s``,
  the circular storage for ``M > S``, rotation by ``ppermute``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardc.errors import MeshAxisError, PipelineError, closest
from shardc.pipeline.schedule import Pipeline

__all__ = ["at", "carry_of", "check_axis", "check_batch_axes", "check_pipeline", "leading",
           "pipeline_scan", "psum", "put", "sums_wide", "varying"]


def sums_wide(mesh) -> bool:
    """Whether a pipeline's sums over ``mesh``'s axes run a float narrower than 32 bits in
    float32: on XLA:CPU, whose compiler aborts the process on a bfloat16 all-reduce made
    inside a ``shard_map`` ("Invalid binary instruction opcode copy", jaxlib 0.10.2; its
    own partitioner's bfloat16 all-reduces compile). NCCL and TPUs sum them as they are."""
    devices = getattr(mesh, "devices", None)
    return devices is not None and devices.size > 0 and devices.flat[0].platform == "cpu"


def _narrow(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def psum(tree, axes, wide: bool):
    """``jax.lax.psum(tree, axes)``; with ``wide`` (:func:`sums_wide`) a narrow float
    leaf is summed in float32 and returned in its own dtype."""
    if not wide:
        return jax.lax.psum(tree, axes)
    return jax.tree.map(lambda x: jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
                        if _narrow(x) else jax.lax.psum(x, axes), tree)


def varying(x, axes, wide: bool = False):
    """``x`` made varying over those of ``axes`` it does not vary over yet, inside a
    ``shard_map`` (its cotangent summed over them in the backward); with ``wide`` a narrow
    float's cotangent is summed in float32 (:func:`sums_wide`)."""
    have = jax.typeof(x).manual_axis_type.varying
    missing = tuple(n for n in axes if n not in have)
    if not missing:
        return x
    if wide and _narrow(x):
        return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, missing, to="varying")


def leading(tree, what: str) -> int:
    sizes = {x.shape[0] if getattr(x, "ndim", 0) else None for x in jax.tree.leaves(tree)}
    if len(sizes) != 1 or None in sizes:
        raise PipelineError(f"pipeline_scan: every leaf of the {what} needs the same leading "
                            f"dimension, got leading sizes {sorted(map(str, sizes))}")
    return sizes.pop()


def check_axis(pipeline: Pipeline, mesh) -> None:
    """Raise a ValueError naming the fix when ``mesh`` has no axis of ``pipeline.stages``
    devices named ``pipeline.axis``."""
    p, shape = pipeline, dict(mesh.shape)
    if p.axis not in shape:
        raise MeshAxisError(f"Pipeline(axis={p.axis!r}): the mesh has axes {tuple(shape)}"
                            f"{closest(p.axis, shape)}; name one of them")
    if shape[p.axis] != p.stages:
        raise PipelineError(f"Pipeline(stages={p.stages}) over mesh axis {p.axis!r} of size "
                            f"{shape[p.axis]}: one stage per device of the axis; use "
                            f"stages={shape[p.axis]}")


def check_pipeline(pipeline: Pipeline, mesh, batch: int, layers: int) -> None:
    """Raise a ValueError naming the fix when ``pipeline`` cannot run a stack of ``layers``
    layers on a batch of ``batch`` over ``mesh``."""
    p = pipeline
    check_axis(p, mesh)
    chunks = p.stages * p.virtual
    if layers % chunks:
        raise PipelineError(f"Pipeline(stages={p.stages}, virtual={p.virtual}) cuts {layers} "
                            f"layers into {chunks} chunks of equal size; use a stage count "
                            f"(times virtual stages) that divides {layers}")
    if batch % p.microbatches:
        raise PipelineError(f"Pipeline(microbatches={p.microbatches}) cuts a batch of {batch}; "
                            f"use a micro-batch count that divides {batch}")
    if p.virtual > 1 and p.microbatches < p.stages:
        raise PipelineError(f"Pipeline(schedule='circular', microbatches={p.microbatches}, "
                            f"stages={p.stages}): a micro-batch must be back at stage 0 before "
                            f"its next pass is due; use microbatches >= {p.stages}")


def carry_of(layer_fn: Callable, who: str) -> Callable:
    """``layer_fn`` returning its carry only; per-layer outputs (a scan's ys) raise."""
    def one(c, w):
        c, ys = layer_fn(c, w)
        if ys is not None and jax.tree.leaves(ys):
            raise PipelineError(f"{who}: layer_fn returns per-layer outputs (the scan's ys); a "
                                "layer stack carries its activations only: return (carry, "
                                "None), or use jax.lax.scan for this loop")
        return c
    return one


def check_batch_axes(p: Pipeline, mesh, batch_axes, batch: int) -> None:
    shape = dict(mesh.shape)
    others = tuple(a for a in shape if a != p.axis)
    bad = [a for a in batch_axes if a not in others]
    if bad:
        raise MeshAxisError(f"pipeline_scan(batch_axes={tuple(batch_axes)}): {bad} are not mesh "
                            f"axes other than the stage axis {p.axis!r}; name axes of "
                            f"{others}{closest(bad[0], others)}")
    ways = math.prod(shape[a] for a in batch_axes)
    if (batch // p.microbatches) % ways:
        raise PipelineError(f"pipeline_scan(batch_axes={tuple(batch_axes)}): a micro-batch of "
                            f"{batch // p.microbatches} does not split {ways} ways; use fewer "
                            "micro-batches or fewer batch axes")


def at(tree, i):
    """``tree[i]``: every leaf indexed at ``i`` (a traced index) on its leading dim."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def put(tree, i, new, keep):
    """``tree[i] = new`` where ``keep`` is false; unchanged where it is true."""
    def one(x, y):
        old = jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(x, jnp.where(keep, old, y), i, 0)
    return jax.tree.map(one, tree, new)


def _where(c, a, b):
    return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


def _handed_over(axis: str, stages: int, check_vma: bool, wide: bool) -> Callable:
    """The last stage's finished micro-batches on every stage: one ``psum`` over ``axis``
    of them (zeros elsewhere). Its transpose under a ``shard_map`` that checks
    replication is a no-op; under one that does not, a ``psum`` is its own transpose, so
    the backward would sum the cotangent over the stages once more: there it is the
    cotangent handed to the last stage, which the ``shard_map``'s transpose passed divided
    by the stages (an output unsplit over them)."""
    def over(o):
        last = jax.lax.axis_index(axis) == stages - 1
        return psum(jnp.where(last, o, jnp.zeros_like(o)), axis, wide)

    if check_vma:
        return over

    @jax.custom_vjp
    def handed(o):
        return over(o)

    def back(_, ct):
        last = jax.lax.axis_index(axis) == stages - 1
        return (jnp.where(last, ct * stages, jnp.zeros_like(ct)),)

    handed.defvjp(lambda o: (over(o), None), back)
    return handed


def _stages(layer_fn: Callable, pipeline: Pipeline, steps: int, batch_axes: tuple[str, ...],
            check_vma: bool = True, wide: bool = False, dtypes=None):
    """The per-device loop (the body of the ``shard_map``): ``params`` leaves
    ``[V, 1, K, ...]`` (this device's chunks; ``[K, ...]`` where V = 1), ``mbs`` leaves
    ``[M, b, ...]`` (this device's part of every micro-batch over ``batch_axes``); sums in
    float32 with ``wide`` (:func:`sums_wide`), where ``dtypes`` (the operands' own, for
    an unchecked ``shard_map`` whose operands came in float32) are cast back to."""
    p = pipeline
    s_n, m_n, v_n, axis = p.stages, p.microbatches, p.virtual, p.axis
    ring = [(i, (i + 1) % s_n) for i in range(s_n)] if v_n > 1 else \
        [(i, i + 1) for i in range(s_n - 1)]

    one = carry_of(layer_fn, "pipeline_scan")

    def layers_of(w, x):
        return jax.lax.scan(lambda c, wl: (one(c, wl), None), x, w)[0]

    @jax.checkpoint
    def picked(params, v, x):
        """Chunk ``v`` of the stage's ``[V, K, ...]`` weights on ``x``, recomputed in the
        backward: weights sliced by a step's ``v`` are saved per step otherwise (a copy
        of a chunk's weights per step, ``T / V`` copies of the stage's)."""
        return layers_of(at(params, v), x)

    def run(params, mbs):
        # made varying once, before the loop: the cotangents' sums over the axes (the
        # input's over the stages, the weights' over the batch axes: data parallelism's
        # gradient all-reduce) run once after the backward loop, not once per step
        if dtypes is not None:
            params, mbs = jax.tree.map(lambda x, d: x.astype(d), (params, mbs), dtypes)
        mbs = jax.tree.map(lambda x: varying(x, (axis,), wide), mbs)
        if v_n > 1:  # [V, 1, K, ...] -> [V, K, ...]; V = 1 comes as this stage's [K, ...]
            params = jax.tree.map(lambda w: w[:, 0], params)
        if batch_axes:
            params = jax.tree.map(lambda w: varying(w, batch_axes, wide), params)
        only = params  # V = 1: the stage's one chunk, outside the loop
        s = jax.lax.axis_index(axis)
        first = at(mbs, 0)  # a stand-in for the bubble steps
        outs = jax.tree.map(jnp.zeros_like, mbs)
        circ = outs if v_n > 1 else None

        def step(state, t):
            cur, circ, outs = state
            done = jnp.maximum(t - s, 0)
            m, v = done % m_n, jnp.minimum(done // m_n, v_n - 1)
            live = (t - s >= 0) & (t - s < m_n * v_n)
            head = at(mbs, m) if circ is None else \
                _where(v == 0, at(mbs, m), at(circ, m))
            x = _where(s == 0, head, cur)
            y = layers_of(only, x) if v_n == 1 else picked(params, v, x)
            outs = put(outs, m, y, ~(live & (s == s_n - 1) & (v == v_n - 1)))
            nxt = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), y)
            if circ is not None:  # stage 0 keeps what came round for its next pass
                back = t - (s_n - 1)
                circ = put(circ, jnp.maximum(back, 0) % m_n, nxt,
                            ~((s == 0) & (back >= 0) & (back < m_n * (v_n - 1))))
            return (nxt, circ, outs), None

        (_, _, outs), _ = jax.lax.scan(step, (first, circ, outs), jnp.arange(steps))
        return jax.tree.map(_handed_over(axis, s_n, check_vma, wide), outs)

    return run


def pipeline_scan(layer_fn: Callable, carry: Any, stacked_params: Any, *,
                  pipeline: Pipeline, mesh: Mesh, batch_axes: tuple[str, ...] = (),
                  check_vma: bool = True) -> tuple[Any, None]:
    """``jax.lax.scan(layer_fn, carry, stacked_params)`` run as ``pipeline`` on ``mesh``:
    ``carry``'s leaves share a leading batch dim (cut into ``pipeline.microbatches``),
    ``stacked_params``' leaves a leading layer dim (cut into ``stages * virtual`` chunks,
    chunk ``v * stages + s`` on stage ``s``); ``layer_fn(carry, layer_params)`` returns
    ``(carry, None)``. Returns ``(carry, None)``, as the scan does. Differentiable; see the
    module docstring for the schedules (``"1f1b"`` is
    :func:`shardc.pipeline.onefb.pipeline_loss`'s). The layers must treat the examples of
    a batch apart (as a transformer's layers do, not a batch norm):
    micro-batch ``m`` holds examples ``m, m + M, m + 2M, ...``.

    ``batch_axes`` (mesh axes other than the stage axis) split every micro-batch's batch
    dim inside the pipeline: data parallelism within each stage, the ``shard_map`` manual
    over them too (so ``layer_fn`` must not constrain its values over them); the weight
    gradients are summed over them once, after the backward loop. Without, the other
    axes stay Auto and XLA lays the micro-batches out as it likes. ``check_vma``: the
    ``shard_map``'s own (False for a layer run from traces made outside it, whose ops
    carry no manual-axis types: the same program, its replication unchecked)."""
    p = pipeline
    if p.schedule == "1f1b":
        raise PipelineError(f"pipeline_scan({p}): 1F1B runs each micro-batch's backward right "
                            "after its forward, so the loss must be inside the pipeline: write "
                            "the stack and its loss as shardc.pipeline.layers_loss(layer_fn, "
                            "loss_fn, carry, stacked_params, head, targets), or use "
                            "schedule='gpipe'")
    batch, layers = leading(carry, "carry"), leading(stacked_params, "stacked params")
    check_pipeline(p, mesh, batch, layers)
    s_n, m_n, v_n = p.stages, p.microbatches, p.virtual
    k = layers // (s_n * v_n)
    # V = 1: the layer dim split over the stage axis as it is (a plan's layout of it, split
    # over the stages, stays put: reshaped to [V, S, K] first, XLA gathered it whole)
    params = stacked_params if v_n == 1 else \
        jax.tree.map(lambda w: w.reshape((v_n, s_n, k) + w.shape[1:]), stacked_params)
    weights = PartitionSpec(p.axis) if v_n == 1 else PartitionSpec(None, p.axis)
    check_batch_axes(p, mesh, batch_axes, batch)
    # micro-batch m is rows m, m + M, m + 2M, ...: a batch split over mesh axes (in blocks)
    # stays split within every micro-batch, not across them
    mbs = jax.tree.map(
        lambda x: x.reshape((batch // m_n, m_n) + x.shape[1:]).swapaxes(0, 1), carry)
    split = PartitionSpec(None, batch_axes or None)
    wide, dtypes = sums_wide(mesh), None
    if wide and not check_vma:
        # unchecked, the shard_map's own transpose sums its operands' cotangents: in
        # float32, the operands cast there and back inside
        dtypes = jax.tree.map(lambda x: x.dtype, (params, mbs))
        params, mbs = jax.tree.map(lambda x: x.astype(jnp.float32) if _narrow(x) else x,
                                   (params, mbs))
    run = jax.shard_map(_stages(layer_fn, p, m_n * v_n + s_n - 1, tuple(batch_axes),
                                check_vma, wide, dtypes),
                        mesh=mesh, in_specs=(weights, split),
                        out_specs=split, axis_names={p.axis, *batch_axes},
                        check_vma=check_vma)
    out = run(params, mbs)
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape((batch,) + o.shape[2:]), out), None
