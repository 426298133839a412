"""A plan's pipeline in the lowering: the layer stacks of the program
(:func:`shardc.pipeline.stack.layers`) run as :func:`~shardc.pipeline.runtime.pipeline_scan`.

Which scans are pipelined: every stack written with :func:`~shardc.pipeline.stack.layers`
or :func:`~shardc.pipeline.stack.layers_loss`, found by the names of its inner ``jit``
calls (a plain ``jax.lax.scan`` is pipelined where ``auto_shard`` routed it to ``layers``
when tracing: its traced body is fixed at the full batch). A ``layers_loss`` stack runs
its loss after the pipeline, or, for ``"1f1b"``, inside it
(:func:`~shardc.pipeline.onefb.pipeline_loss`: its forward computes the gradient too).
The forward call runs the pipelined forward under ``jax.vjp`` and keeps its backward; the
backward call of the same operands (the program's gradient, traced in the same ``jit``)
runs that kept backward, so the step computes the pipelined forward once. A backward call
whose forward ran elsewhere (another trace: a recomputed segment, a user's gradient of the
whole step) recomputes the pipelined forward and differentiates it.

Within each stage, the micro-batches are split over the mesh axes the pipeline was priced
with (the stage plan's split of the stack's carry's batch dim, the stage axis aside;
recorded in the plan): the plan's data parallelism runs inside the pipeline.

A plan with a pipeline over a program without a stack raises: the pipeline would silently
run nothing. A step that takes no gradient inside keeps the stack's custom-derivative
call; it runs as the pipeline whole, so a gradient taken outside ``auto_shard``
(``jax.grad(step)``) differentiates the pipeline too (the call's own rules are the scan's).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from shardc.errors import NoStackError as NoStackError
from shardc.errors import PipelineError
from shardc.ir.sbp import shared_dim_splits
from shardc.ir.trace import Loop, Region
from shardc.pipeline.onefb import pipeline_loss
from shardc.pipeline.runtime import pipeline_scan
from shardc.pipeline.schedule import Pipeline
from shardc.pipeline.stack import Stack, stack_named

__all__ = ["NoStackError", "Stacks", "made_by"]


def batch_axes(region: Region, by_op: dict, names: tuple[str, ...], axis: str
               ) -> tuple[str, ...]:
    """The mesh axes but ``axis`` that the plan splits the batch dim (dim 0) of the carry of
    ``region``'s first scan over, as the scan reads it, in mesh order; none unless every
    carry leaf agrees."""
    at = next((k for k, st in enumerate(region.steps) if isinstance(st, Loop)), None)
    if at is None:
        return ()
    loop, params = region.steps[at], region.jaxpr.eqns[at].params
    nc, nk = params["num_consts"], params["num_carry"]
    planned = [by_op.get(e.id) for e in loop.enters[nc:nc + nk]]
    if any(p is None for p in planned):
        return ()
    others = [k for k, n in enumerate(names) if n != axis]
    return tuple(names[k] for k in shared_dim_splits((p.ins[0] for p in planned), others))


def made_by(region: Region, outvars=None) -> set[int]:
    """Ids of the graph values that ``region``'s results (those of ``outvars``, default all)
    are: the ops, loop exits or inner calls making them. A pipelined stack's results are
    laid out as the pipeline leaves them, not as the unpipelined plan made them: read from
    there, they are converted straight to the layouts their readers want (through the
    unpipelined layout, the layer gradients split over the stages were gathered first)."""
    where = {id(v): (k, j) for k, e in enumerate(region.jaxpr.eqns)
             for j, v in enumerate(e.outvars)}
    out: set[int] = set()
    for var in region.jaxpr.outvars if outvars is None else outvars:
        k, j = where.get(id(var), (None, None))
        if k is None:
            continue
        step = region.steps[k]
        if isinstance(step, Region):
            out |= made_by(step, [step.jaxpr.outvars[j]])
        elif isinstance(step, Loop):
            out.add(step.exits[j].outputs[0].id)
        elif getattr(step, "outputs", None):
            out.add(step.outputs[j].id)
    return out


class Stacks:
    """The lowering's pipelined stacks: ``call`` runs an inner ``jit`` call of a stack as
    the pipeline, or returns None for any other call."""

    __slots__ = ("pipeline", "mesh", "by_op", "batch", "kept", "ran")

    def __init__(self, pipeline: Pipeline, mesh: Mesh, by_op: dict,
                 batch: tuple[str, ...] | None = None):
        self.pipeline = pipeline
        self.mesh = mesh
        self.by_op = by_op  # the plan's ops by id
        #: the mesh axes each micro-batch is split over, as the pipeline was priced (the
        #: plan's record, ``solver["pipeline"]["batch_axes"]``); None: read off the plan's
        #: layout of the stack's carry (a plan made before the record had them)
        self.batch = None if batch is None else tuple(batch)
        #: ids of a forward call's operands -> (those operands, held so their ids are not
        #: reused, and the pipelined forward's backward)
        self.kept: dict[tuple[int, ...], tuple[list, object]] = {}
        self.ran = 0

    def _forward(self, stack: Stack, region: Region | None):
        """The stack's pipelined forward (of a :func:`~shardc.pipeline.stack.layers_loss`
        stack, its loss; 1F1B runs the backward with it): the user's ``layer_fn`` (and
        ``loss_fn``) traced again on micro-batches (the converted ones are jaxprs fixed at
        the full batch)."""
        closing = [(stack.fn, stack.consts, "the carry or the stacked params (a per-layer "
                    "copy)")]
        if stack.loss is not None:
            closing.append((stack.loss.fn, stack.loss.consts, "the head or the targets"))
        for fn, n, where in closing:
            if n:
                raise PipelineError(
                    f"shardc.pipeline: the function {fn.__qualname__} closes over {n} traced "
                    "array(s); a pipelined stack traces it again on micro-batches, where "
                    f"those values are gone: pass them in {where}, or leave pipeline=None")

        if self.batch is not None:
            axes = self.batch
        else:
            axes = () if region is None else batch_axes(
                region, self.by_op, tuple(self.mesh.axis_names), self.pipeline.axis)
        p, mesh = self.pipeline, self.mesh

        def fn(carry, params, consts, head=None, targets=None, loss_consts=()):
            if stack.loss is not None and p.schedule == "1f1b":
                return pipeline_loss(stack.fn, stack.loss.fn, carry, params, head, targets,
                                     pipeline=p, mesh=mesh, batch_axes=axes)
            out = pipeline_scan(stack.fn, carry, params, pipeline=p, mesh=mesh,
                                batch_axes=axes, check_vma=not stack.replayed)[0]
            return out if stack.loss is None else stack.loss.fn(out, head, targets)
        return fn

    def call(self, eqn, region: Region | None, args: list) -> list | None:
        """The results of the inner ``jit`` call ``eqn`` on ``args`` run as the pipeline, or
        None where it is not a stack's; ``region`` (the call as the trace walked it; None
        outside shardc's lowering) gives the plan's batch axes. A stack's own
        custom-derivative call (a step that takes no gradient inside) runs as the pipeline
        whole, differentiable as it is: a gradient taken outside pipelines too."""
        if eqn.primitive.name == "custom_vjp_call":
            return self._whole(eqn, region, args)
        if eqn.primitive.name not in ("jit", "pjit"):
            return None
        found = stack_named(str(eqn.params.get("name", "")))
        if found is None:
            return None
        stack, kind = found
        self.ran += 1
        operands = list(args[:stack.operands])
        key = tuple(map(id, operands))
        if kind == "fwd":
            out, back = jax.vjp(self._forward(stack, region), *stack.split(operands))
            self.kept[key] = (operands, back)
            outs = jax.tree.leaves(out)
            # the unpipelined scan's residuals, which the pipelined backward never reads
            outs += [jax.numpy.zeros(v.aval.shape, v.aval.dtype)
                     for v in eqn.outvars[len(outs):]]
        else:
            hit = self.kept.get(key)
            if hit is not None and all(a is b for a, b in zip(hit[0], operands)):
                back = hit[1]
            else:
                back = jax.vjp(self._forward(stack, region), *stack.split(operands))[1]
            ct = jax.tree.unflatten(stack.result, args[len(args) - stack.result.num_leaves:])
            outs = jax.tree.leaves(back(ct))
        if len(outs) != len(eqn.outvars):
            raise AssertionError(f"{eqn.params['name']}: {len(outs)} results for "
                                 f"{len(eqn.outvars)} outputs")
        return outs

    def _whole(self, eqn, region: Region | None, args: list) -> list | None:
        """A ``custom_vjp_call`` of :func:`~shardc.pipeline.stack.layers` (its body one
        forward call of a stack on the call's operands) run as the pipeline; None for
        another ``custom_vjp_call``."""
        body = eqn.params["call_jaxpr"].jaxpr
        if len(body.eqns) != 1 or eqn.params["num_consts"] or \
                body.eqns[0].primitive.name not in ("jit", "pjit"):
            return None
        inner = body.eqns[0]
        found = stack_named(str(inner.params.get("name", "")))
        if found is None or found[1] != "fwd" or list(inner.invars) != list(body.invars):
            return None
        stack = found[0]
        self.ran += 1
        step = region.steps[0] if region is not None else None
        out = self._forward(stack, step if isinstance(step, Region) else None)(
            *stack.split(list(args)))
        return jax.tree.leaves(out)

    def check_used(self) -> None:
        if not self.ran:
            raise NoStackError(self.pipeline)
