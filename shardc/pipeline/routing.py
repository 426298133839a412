"""Plain ``jax.lax.scan`` calls routed to :func:`shardc.pipeline.stack.layers`: within
:func:`scans_as_layers` (``auto_shard`` traces a function so unless ``pipeline=False``), a
scan shaped as a layer stack runs as a filed stack, so the planner may pipeline it and
``pipeline=Pipeline(...)`` pipelines it; any other scan runs as it is. A Flax NNX
``nnx.scan`` (its body hands each layer's state back as a per-layer output, and runs only
inside nnx's own context) is a stack whose layer is traced at every micro-batch size while
that context is there and run from those traces later."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
from jax.extend.core import jaxprs_in_params

from shardc.errors import PipelineError
from shardc.pipeline.fit import refusal
from shardc.pipeline.runtime import carry_of
from shardc.pipeline.stack import _ROUTING, _RUNNER, _SCAN, _filed, _holding, _not_routing, _refuse

__all__ = ["scans_as_layers"]


@contextlib.contextmanager
def scans_as_layers(asked: bool = True) -> Iterator[None]:
    """Within the block, a ``jax.lax.scan`` call that is a layer stack runs as
    :func:`layers` (``auto_shard`` traces its function so unless ``pipeline=False``: the
    planner may pipeline plain scans over layers too, and ``pipeline=Pipeline(...)``
    pipelines them; ``asked``: a scan that is not a stack only for what its layer does is
    a warning, else a note in the log). A stack is a scan forward (not ``reverse``) over
    stacked parameters (every ``xs`` leaf of one leading size) whose carry's leaves share a
    leading batch dim and whose body returns no per-layer outputs, closes over no traced
    value (a pipeline traces it again on micro-batches) and can run on micro-batches
    (:func:`shardc.pipeline.fit.refusal`); any other scan runs as it is.
    Only calls that look ``jax.lax.scan`` up when they run
    (``jax.lax.scan(...)``, ``lax.scan(...)``) are seen: not a name imported before
    (``from jax.lax import scan``), nor a scan inside a ``jax.jit`` function traced
    before."""
    before = jax.lax.scan  # a block within a block keeps the routing when it ends
    jax.lax.scan = _routed
    try:
        with _holding(_ROUTING, "asked" if asked else "offered"):
            yield
    finally:
        jax.lax.scan = before


def _routed(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
    """``jax.lax.scan`` within :func:`scans_as_layers`. The body is traced once, as
    ``jax.lax.scan`` traces it (a body with Python side effects, Flax's ``make_rng``
    counters, then draws what it would under ``jax.jit``): a scan that is not a stack runs
    that trace, a stack runs it unpipelined (its layer traced again only to check it, and
    by a pipeline on micro-batches)."""
    routing = _ROUTING.get()
    if routing is None or reverse or _split_transpose or not _stack_shaped(init, xs, length):
        return _SCAN(f, init, xs, length=length, reverse=reverse, unroll=unroll,
                     _split_transpose=_split_transpose)
    one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), xs)
    with _not_routing():
        body, consts = jax.closure_convert(f, init, one)
        traced, (_, ys) = jax.make_jaxpr(body, return_shape=True)(init, one, *consts)
        # a body closing over traced values is not one a pipeline can trace again on
        # micro-batches; nor is a gradient-accumulation loop over micro-batches, whose
        # carry (the gradients) would otherwise pass for a batch
        passed = _passed_through(traced.jaxpr, init, one)
        stack = not consts and (not jax.tree.leaves(ys) or passed is not None)
        if stack:
            layer = partial(_carry_only, body)
            live = f if passed is None else partial(_no_ys, f)
            why = refusal(carry_of(live, "jax.lax.scan"), layer, init, one)
    if stack and why is None:  # ys: a tree of no arrays, or the xs passed through
        run = _RUNNER.get()
        if passed is not None:
            ys = jax.tree.unflatten(jax.tree.structure(ys),
                                    [jax.tree.leaves(xs)[k] for k in passed])
            if run is None:
                # Flax NNX's scan: its body runs only inside nnx's own context, which is
                # gone by the time a pipeline runs the layer on micro-batches
                with _not_routing():
                    live = _traced_at_each_size(f, init, one)
        if run is not None:
            return run(live, init, xs), ys
        with _not_routing():
            return _filed(live, init, xs, routing=routing, traced=(layer, ()),
                          replayed=passed is not None), ys
    if stack:  # (the routing read outside the block, which unsets it)
        _refuse(routing, "a jax.lax.scan", next(iter(_leading(xs)))[0], why)
    if _holds_scan(traced.jaxpr):
        # traced again, routed: a scan inside (the layer scan of a gradient accumulation
        # loop over micro-batches) may be a stack
        return _SCAN(f, init, xs, length=length, unroll=unroll)
    return _SCAN(partial(_closed, body, consts), init, xs, length=length, unroll=unroll)


def _passed_through(jaxpr, init: Any, one: Any) -> tuple[int, ...] | None:
    """Where a scan body's per-layer outputs (the jaxpr's results after the carry's) are
    each one of its per-layer inputs (``one``'s leaves, after the carry's) passed through
    unchanged, the index of that input per output (Flax NNX's ``nnx.scan`` hands each
    layer's state back so); None where there are none or one is computed."""
    n_carry, n_xs = len(jax.tree.leaves(init)), len(jax.tree.leaves(one))
    xs_in = jaxpr.invars[n_carry:n_carry + n_xs]
    ys_out = jaxpr.outvars[n_carry:]
    if not ys_out:
        return None
    picked = []
    for v in ys_out:
        k = next((k for k, x in enumerate(xs_in) if v is x), None)
        if k is None:
            return None
        picked.append(k)
    return tuple(picked)


def _no_ys(f: Callable, c, w):
    """``f(c, w)`` as a stack's layer: its carry and no per-layer outputs."""
    return f(c, w)[0], None


def _traced_at_each_size(f: Callable, carry: Any, one: Any) -> Callable:
    """A stack's layer ``(carry, layer_params) -> (carry, None)``: ``f``'s carry, ``f``
    traced now at every batch size a micro-batch can have (the divisors of the batch: a
    stage's part of a micro-batch too) and run later from those traces, for a body that
    traces only within a context it is called in."""
    batch = jax.tree.leaves(carry)[0].shape[0]
    at = {}
    for n in (d for d in range(1, batch + 1) if batch % d == 0):
        c = jax.tree.map(lambda x, n=n: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype),
                         carry)
        at[n] = jax.make_jaxpr(lambda c, w: f(c, w)[0], return_shape=True)(c, one)
    layer = partial(_replay, at)
    layer.shardc_traced = f  # what names the stack (stack._origin)
    return layer


def _replay(at: dict, c, w):
    """A layer run from the traces ``at`` of a layer (batch size -> (closed jaxpr, result
    shape)): :func:`_traced_at_each_size`."""
    n = jax.tree.leaves(c)[0].shape[0]
    if n not in at:
        raise PipelineError(f"a layer traced at batch sizes {sorted(at)} (its context is gone) "
                            f"was run on {n} examples")
    closed, shape = at[n]
    out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts,
                              *jax.tree.leaves(c), *jax.tree.leaves(w))
    return jax.tree.unflatten(jax.tree.structure(shape), out), None


def _holds_scan(jaxpr) -> bool:
    """Whether ``jaxpr`` runs a ``scan``, at any depth."""
    return any(eqn.primitive.name == "scan" or
               any(_holds_scan(getattr(sub, "jaxpr", sub))
                   for sub in jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _closed(body: Callable, consts: tuple, c, w):
    return body(c, w, *consts)


def _carry_only(body: Callable, c, w, *consts):
    return body(c, w, *consts)[0]


def _leading(tree) -> set:
    return {getattr(x, "shape", ())[:1] for x in jax.tree.leaves(tree)}


def _stack_shaped(init: Any, xs: Any, length: int | None) -> bool:
    """Whether ``jax.lax.scan(f, init, xs, length)`` is shaped as a layer stack: every
    ``xs`` leaf of one leading size (the layers), every carry leaf of one leading size
    (the batch)."""
    lx, lc = _leading(xs), _leading(init)
    return len(lx) == 1 and len(lc) == 1 and () not in lx and () not in lc and \
        (length is None or lx == {(length,)})
