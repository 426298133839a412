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
           "stack_named"]

#: the name prefix of the inner ``jit`` calls of a layer stack
PREFIX = "shardc_layers_"

#: ``jax.lax.scan`` itself: a stack's scan and the routing's fallback call it, never
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
    fn = getattr(fn, "shardc_traced", fn)  # a layer run from its traces (routing.py)
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
#: (:func:`shardc.pipeline.routing.scans_as_layers`: "asked" or "offered"; None: not, as
#: while a stack's own layer is traced)
_ROUTING: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardc_scans_as_layers",
                                                                      default=None)


def _not_routing():
    """A block in which ``jax.lax.scan`` calls run as they are."""
    return _holding(_ROUTING, None)


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
