"""Whether a layer stack can run as a pipeline: a pipeline runs the layer on slices of the
batch (micro-batches), traced again at their size, so the layer must treat the batch's
examples apart and draw no random bits (:func:`mixes_examples`) and trace at another batch
size to the program it is at this one (:func:`fixed_batch`); :func:`refusal` says why not.
:mod:`shardc.pipeline.stack` files a stack that fails as one never pipelined, and runs a
plain scan that fails as a scan."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["fixed_batch", "mixes_examples", "refusal"]


def refusal(fn: Callable, layer: Callable, carry: Any, params: Any,
            consts: tuple = ()) -> str | None:
    """Why a stack of ``fn(carry, layer_params) -> carry`` (``layer``: the same traced once,
    ``layer(carry, layer_params, *consts)``) cannot run as a pipeline, in words; None where
    it can. A pipeline traces ``fn`` again at its micro-batches' size and runs it on
    slices of the batch: the layer must treat the batch's examples apart and draw no
    random bits (:func:`mixes_examples`), and trace at another batch size to the program
    it is at this one, the batch size changed (:func:`fixed_batch`)."""
    return mixes_examples(layer, carry, params, consts) or fixed_batch(fn, carry, params)


def mixes_examples(layer: Callable, carry: Any, params: Any, consts: Any = ()) -> str | None:
    """Where ``layer(carry, params, *consts) -> carry`` computes an example's row of its
    result from other examples' rows (a batch norm, a sum over the batch), or from its
    position in the batch (an ``iota`` over it), or draws random bits (a pipeline traces
    the layer again per micro-batch, and a key held in Python state, Flax's ``make_rng``,
    is another each time), why, in words (the op, at the user's line); None where it
    treats the examples apart, so that micro-batches (slices of the batch) compute the
    rows the whole batch does. Each carry leaf is split over its leading (batch) dim and
    the params and consts whole, pushed through the layer's ops by their own rules
    (:func:`shardc.rules.propagate.push`): each op must compute its pieces from the
    pieces of its operands, no partial sum, no slice of a replicated value along a dim it
    varies on; and the result must come out split so."""
    from shardc.ir.prims import facts
    from shardc.ir.sbp import B, Split
    from shardc.ir.trace import graph_from_jaxpr
    from shardc.rules.propagate import push

    size = jax.tree.leaves(carry)[0].shape[0]
    if size < 2:
        return "its batch is one example"
    carry, params, consts = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         (carry, params, tuple(consts)))
    sbps = [Split(0)] * len(jax.tree.leaves(carry)) + \
        [B] * (len(jax.tree.leaves(params)) + len(consts))
    try:  # a check that cannot run refuses the pipeline; it never fails the user's trace
        graph = graph_from_jaxpr(jax.make_jaxpr(layer)(carry, params, *consts))
        draws = next((op for op in graph.ops if facts(op.name).draws), None)
        if draws is not None:
            return (f"its layer draws random bits ({draws.named}): a pipeline traces it "
                    "again per micro-batch")
        flow = push(graph, sbps, size, uniform_slices=True)
        if isinstance(flow, str):
            return (f"its layer mixes the batch's examples ({flow}): micro-batches would "
                    "compute otherwise")
    except Exception as exc:  # noqa: BLE001 (any error of the check, named)
        return f"the check of its layer could not run ({type(exc).__name__}: {exc})"
    if any(s != Split(0) for s in flow.outs):
        return "its layer's result is not laid out as its carry, split over the batch"
    return None


def fixed_batch(fn: Callable, carry: Any, params: Any) -> str | None:
    """Where ``fn(carry, params) -> carry`` traced at another batch size is not the program
    it is at this one with the batch size changed, why (a layer that reads the batch size
    as a number, ``x / x.shape[0]``, or writes it, ``x.reshape(32, ...)``); None where it
    is, so that a pipeline tracing it at its micro-batches' size runs the same layer. The
    other size is odd and unlike any dim of the operands, and only shapes and size tuples
    of the other trace are read back as the batch (a literal is compared as it is)."""
    size = jax.tree.leaves(carry)[0].shape[0]
    dims = {d for x in jax.tree.leaves((carry, params)) for d in x.shape}
    other = next(n for n in itertools.count(2 * size + 1, 2) if n not in dims)

    def traced(n: int) -> str:
        at = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype), carry)
        return str(jax.make_jaxpr(fn)(at, params))

    try:
        here, there = traced(size), traced(other)
    except Exception as exc:  # noqa: BLE001 (the layer's own error, named)
        return (f"its layer does not trace at a batch of {other} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]})")
    # the other size where it is a dim or a size tuple's element: not in a literal
    # (``65.0``, ``65:i32[]``) nor inside a longer number; the printer's line breaks aside
    there = re.sub(rf"(?<![\w.]){other}(?=[,\])])", str(size), there)
    if re.sub(r"\s+", "", there) != re.sub(r"\s+", "", here):
        return (f"its layer reads the batch size as a number (traced at a batch of {other} "
                f"it is another program than at {size} with the size changed)")
    return None
