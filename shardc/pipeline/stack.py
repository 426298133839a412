"""The layer stack a pipeline may run: :func:`layers`, a drop-in for
``jax.lax.scan(layer_fn, carry, stacked_params)`` that ``auto_shard`` can pipeline, and
:func:`layers_loss`, the stack and the loss it ends in (which a 1F1B pipeline can run:
:mod:`shardc.pipeline.onefb`), filed and run the same way with the loss inside the calls.

A scan in a traced program is fixed at the batch it was traced for (its reshapes and
broadcasts name the batch size), so it cannot be re-run on micro-batches; running a stack as
a pipeline needs the layer as a function. :func:`layers` keeps it: it closure-converts
``layer_fn`` (closed-over traced arrays become explicit operands), files both under a
name that is a digest of its code's place, its jaxpr and the operands' structure (the
same function traced again replaces its entry), and runs the stack as a
``jax.custom_vjp`` whose forward and backward are inner ``jit`` calls with that name
(``shardc_layers_<digest>_fwd`` and ``_bwd``; the forward keeps the scan's residuals, as
``jax.lax.scan`` under ``jax.grad`` does, and the backward runs the scan's backward on
them). Everywhere but a pipelined ``auto_shard`` these compute exactly
``jax.lax.scan``'s results and gradients; the lowering of a plan with a pipeline
(:mod:`shardc.pipeline.lowering`) finds the calls by name and runs
:func:`~shardc.pipeline.runtime.pipeline_scan` in their place.

The backward call also takes the stack's operands (its carry, its stacked parameters and
the closed-over arrays): a pipelined lowering replaces both calls, runs its own backward
from the operands and leaves the scan's residuals unused (XLA removes them), so the
forward and the backward exchange nothing a pipeline would have to lay out as the scan
did.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
from jax.extend.core import jaxprs_in_params

from shardc.pipeline.fit import refusal
from shardc.pipeline.runtime import carry_of

log = logging.getLogger("shardc")

__all__ = ["PREFIX", "Loss", "Stack", "has_stack", "layers", "layers_loss", "running",
           "scans_as_layers", "stack_named"]

#: the name prefix of the inner ``jit`` calls of a layer stack
PREFIX = "shardc_layers_"

#: ``jax.lax.scan`` itself: a stack's scan and :func:`scans_as_layers`' fallback call it, never
#: the routed one
_SCAN = jax.lax.scan


@dataclass(frozen=True, slots=True)
class Loss:
    """The loss a stack of :func:`layers_loss` ends in: the user's ``loss_fn``, its
    closure-converted form ``loss(final_carry, head, targets, *consts) -> scalar``, and the
    trees of its operands (``head``, ``targets``, ``consts`` closed-over arrays)."""

    fn: Callable
    loss: Callable
    head: Any  # treedef
    targets: Any  # treedef
    consts: int


@dataclass(frozen=True, slots=True)
class Stack:
    """A filed layer stack: the user's ``layer_fn``, its closure-converted form
    ``layer(carry, layer_params, *consts) -> carry`` (closed-over traced arrays as
    operands), the trees of its flat operands (carry, stacked parameters, ``consts``
    closed-over arrays), for :func:`layers_loss` the loss it ends in (then the head, the
    targets and the loss's closed-over arrays follow those operands), and why it cannot
    run as a pipeline, if it cannot."""

    fn: Callable
    layer: Callable
    carry: Any  # treedef
    params: Any  # treedef
    consts: int
    loss: Loss | None = None
    #: why the stack cannot run as a pipeline (:func:`refusal`), in words; None: it can
    refused: str | None = None
    #: ``fn`` runs from traces made while the scan was traced, one per micro-batch size
    #: (Flax NNX's scan body, which traces only inside nnx's context): their ops carry
    #: no manual-axis types, so a pipeline's ``shard_map`` runs them unchecked
    replayed: bool = False

    @property
    def operands(self) -> int:
        """How many flat operands the stack's calls take (before a backward's own)."""
        n = self.carry.num_leaves + self.params.num_leaves + self.consts
        if self.loss is not None:
            n += self.loss.head.num_leaves + self.loss.targets.num_leaves + self.loss.consts
        return n

    @property
    def result(self) -> Any:
        """The tree of the forward's result: the carry's, or a scalar loss's."""
        return self.carry if self.loss is None else jax.tree.structure(0.0)

    def split(self, flat) -> tuple:
        """Flat operands -> (carry, stacked params, consts), and for a loss stack (head,
        targets, the loss's consts) after them."""
        out, at = [], 0
        trees = [self.carry, self.params, self.consts]
        if self.loss is not None:
            trees += [self.loss.head, self.loss.targets, self.loss.consts]
        for tree in trees:
            n = tree if isinstance(tree, int) else tree.num_leaves
            part = flat[at:at + n]
            out.append(tuple(part) if isinstance(tree, int) else jax.tree.unflatten(tree, part))
            at += n
        return tuple(out)

    def scan(self, carry, params, consts):
        def body(c, w):
            return self.layer(c, w, *consts), None
        return _SCAN(body, carry, params)[0]

    def run(self, *operands):
        """What the stack computes unpipelined: the scan's carry, or its loss."""
        out = self.scan(*operands[:3])
        if self.loss is None:
            return out
        head, targets, consts = operands[3:]
        return self.loss.loss(out, head, targets, *consts)


#: stack name -> Stack; a name is a digest of the layer function's code location and of
#: what it computes at the full batch, so a stack filed again under the same name (the
#: next trace of the same function) replaces one that computes the same
_STACKS: dict[str, Stack] = {}


def stack_named(name: str) -> tuple[Stack, str] | None:
    """The filed stack an inner ``jit`` call of this name runs, and whether it is the
    stack's ``"fwd"`` or ``"bwd"``; None for any other name, and for a stack whose layer
    cannot run as a pipeline (:attr:`Stack.refused`: it runs as its scan, never as a
    pipeline)."""
    if not name.startswith(PREFIX):
        return None
    base, _, kind = name.rpartition("_")
    stack = _STACKS.get(base)
    if stack is None or stack.refused is not None or kind not in ("fwd", "bwd"):
        return None
    return stack, kind


def has_stack(jaxpr, loss: bool = False) -> bool:
    """Whether ``jaxpr`` (open or closed; None: no program) calls a filed layer stack that
    can run as a pipeline (with ``loss``, one of :func:`layers_loss`), at any depth."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if jaxpr is None:
        return False
    for eqn in jaxpr.eqns:
        found = stack_named(str(eqn.params.get("name", "")))
        if found is not None and (not loss or found[0].loss is not None):
            return True
        for sub in jaxprs_in_params(eqn.params):
            if has_stack(sub, loss):
                return True
    return False


def _origin(fn: Callable) -> str:
    """Where ``fn``'s code is (the wrapped function's, for a ``functools.partial``): two
    layer functions of one jaxpr at the full batch may differ on micro-batches."""
    if isinstance(fn, partial) and fn.func is _replay:
        fn = fn.args[0]
    fn = getattr(fn, "func", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn).__qualname__
    return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def _forward(name: str, *operands):
    stack = _STACKS[name]
    return _named(lambda *ops: stack.run(*ops), f"{name}_fwd")(*operands)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(name: str, *operands):
    return _forward(name, *operands)


def _fwd(name, *operands):
    stack = _STACKS[name]

    def forward(*ops):  # the stack's own backward, kept: jax.vjp's is a pytree of arrays
        return jax.vjp(stack.run, *ops)

    out, back = _named(forward, f"{name}_fwd")(*operands)
    return out, (operands, back)


def _bwd(name, res, ct):
    operands, back = res

    def backward(*args):  # the operands ride along: a pipeline's backward
        return args[-2](args[-1])  # (shardc.pipeline.lowering) is keyed by them

    return _named(backward, f"{name}_bwd")(*operands, back, ct)


_run.defvjp(_fwd, _bwd)


#: a hand-written pipeline :func:`layers` runs in place of its stack (:func:`running`)
_RUNNER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "shardc_pipeline_runner", default=None)
#: a hand-written pipeline :func:`layers_loss` runs in place of its stack and loss
_LOSS_RUNNER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "shardc_pipeline_loss_runner", default=None)


@contextlib.contextmanager
def running(run: Callable, loss: Callable | None = None) -> Iterator[None]:
    """Within the block, :func:`layers` returns ``run(layer_fn, carry, stacked_params)`` in
    place of its stack: a pipeline written by hand (``pipeline_scan`` with the caller's
    stages and micro-batches, as MaxText's pipeline module wraps its decoder layers) under
    plain ``jax.jit``, the bench's pipelined experts. :func:`layers_loss` returns
    ``loss(layer_fn, loss_fn, carry, stacked_params, head, targets)`` (a 1F1B pipeline,
    :func:`~shardc.pipeline.onefb.pipeline_loss`), or without ``loss``, ``loss_fn`` of
    ``run``'s result."""
    with _holding(_RUNNER, run), _holding(_LOSS_RUNNER, loss):
        yield


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar, value) -> Iterator[None]:
    """``var`` set to ``value`` within the block, as it was after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


#: whether ``jax.lax.scan`` calls made here are routed to :func:`layers`
#: (:func:`scans_as_layers`: "asked" or "offered"; None: not, as while a stack's own layer
#: is traced)
_ROUTING: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardc_scans_as_layers",
                                                                      default=None)


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


def _not_routing():
    """A block in which ``jax.lax.scan`` calls run as they are."""
    return _holding(_ROUTING, None)


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
    return partial(_replay, f, at)


def _replay(_f: Callable, at: dict, c, w):
    """A layer run from the traces ``at`` of ``f`` (batch size -> (closed jaxpr, result
    shape)): :func:`_traced_at_each_size`; ``f`` names it (:func:`_origin`)."""
    n = jax.tree.leaves(c)[0].shape[0]
    if n not in at:
        raise ValueError(f"a layer traced at batch sizes {sorted(at)} (its context is gone) "
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


def _refuse(routing: str | None, what: str, n_layers: int, why: str) -> None:
    """Log that a stack is not run as a pipeline, and ``why`` (:func:`refusal`): a warning
    where a pipeline was asked for (``routing``, :data:`_ROUTING`), a note where the
    planner might have chosen one, nothing outside ``auto_shard``."""
    if routing is not None:
        log.log(logging.WARNING if routing == "asked" else logging.INFO,
                "shardc: %s over %d layers is not run as a pipeline: %s", what, n_layers, why)


def layers(layer_fn: Callable, carry: Any, stacked_params: Any) -> tuple[Any, None]:
    """``jax.lax.scan(layer_fn, carry, stacked_params)`` for a layer stack: ``layer_fn(carry,
    layer_params)`` returns ``(carry, None)`` (no per-layer outputs); ``carry``'s leaves share
    the leading batch dim, ``stacked_params``' leaves the leading layer dim. Returns
    ``(carry, None)``. Under ``auto_shard(..., pipeline=Pipeline(...))`` the stack runs as
    that pipeline, within :func:`running` as its runner has it; everywhere else it is the
    scan, its gradient as ``jax.lax.scan``'s (the forward's residuals kept, nothing
    recomputed)."""
    run = _RUNNER.get()
    if run is not None:
        return run(layer_fn, carry, stacked_params), None
    routing = _ROUTING.get()
    with _not_routing():  # a scan inside the layer is the layer's own
        return _filed(layer_fn, carry, stacked_params, routing=routing), None


def layers_loss(layer_fn: Callable, loss_fn: Callable, carry: Any, stacked_params: Any,
                head: Any, targets: Any) -> jax.Array:
    """``loss_fn(jax.lax.scan(layer_fn, carry, stacked_params)[0], head, targets)``: a layer
    stack (as :func:`layers`) and the loss it ends in, which a pipeline can run as 1F1B
    (each micro-batch's backward as soon as its loss is known: ``Pipeline(...,
    schedule="1f1b")``, :mod:`shardc.pipeline.onefb`). ``loss_fn(final_carry, head,
    targets)`` returns a scalar, the mean over the batch's examples of a per-example term
    (a pipeline's loss is the mean of its micro-batches'); ``head`` is what it reads
    besides (the output layer's weights: a pytree, differentiated), ``targets``' leaves lead
    with the batch dim, as ``carry``'s. Everywhere but a pipelined ``auto_shard`` it is that
    expression, its gradient autodiff's; within :func:`running`, the stack runs as its
    runner has it."""
    run, whole = _RUNNER.get(), _LOSS_RUNNER.get()
    if whole is not None:
        return whole(layer_fn, loss_fn, carry, stacked_params, head, targets)
    if run is not None:
        return loss_fn(run(layer_fn, carry, stacked_params), head, targets)
    routing = _ROUTING.get()
    with _not_routing():
        return _filed(layer_fn, carry, stacked_params, (loss_fn, head, targets), routing)


def _filed(layer_fn: Callable, carry: Any, stacked_params: Any, loss=None,
           routing: str | None = None, traced: tuple[Callable, tuple] | None = None,
           replayed: bool = False):
    """:func:`layers` (and, with ``loss`` = (loss_fn, head, targets), :func:`layers_loss`)
    outside a hand-written pipeline: the stack filed and run (``routing``: the block it was
    called in, :data:`_ROUTING`; ``replayed``: ``layer_fn`` runs from its traces,
    :attr:`Stack.replayed`)."""
    one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), stacked_params)
    who = "shardc.pipeline.layers" if loss is None else "shardc.pipeline.layers_loss"
    carried = carry_of(layer_fn, who)
    layer, consts = traced or jax.closure_convert(carried, carry, one)
    text = str(jax.make_jaxpr(layer)(carry, one, *consts))
    trees = (jax.tree.structure(carry), jax.tree.structure(stacked_params))
    key = f"{_origin(layer_fn)}|{text}|{trees}"
    operands = [carry, stacked_params, tuple(consts)]
    filed_loss = None
    if loss is not None:
        loss_fn, head, targets = loss
        # the stack's result is shaped as its carry (a scan's carry keeps its type): the
        # loss is traced on the carry, not on a trace of the layer
        fn, lconsts = jax.closure_convert(loss_fn, carry, head, targets)
        filed_loss = Loss(loss_fn, fn, jax.tree.structure(head), jax.tree.structure(targets),
                          len(lconsts))
        key += f"|{_origin(loss_fn)}|{jax.make_jaxpr(fn)(carry, head, targets, *lconsts)}"
        operands += [head, targets, tuple(lconsts)]
    name = f"{PREFIX}{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    # a routed scan comes checked (traced: its layer, traced once, passed)
    why = None if traced else refusal(carried, layer, carry, one, consts)
    if why is not None:
        _refuse(routing, who, jax.tree.leaves(stacked_params)[0].shape[0], why)
    _STACKS[name] = Stack(layer_fn, layer, *trees, len(consts), filed_loss, why, replayed)
    return _run(name, *operands)
