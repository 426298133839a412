"""The errors shardc raises on purpose, one hierarchy: every one is a :class:`ShardcError`
(``except shardc.ShardcError`` catches them all) and keeps the builtin type it has always
had (``except ValueError`` still catches a bad option). Each message names the problem and
the fix. This module imports nothing from shardc, so every layer can raise these.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

__all__ = [
    "ArgumentsError", "BenchError", "CalibrationError", "CheckpointCorruptError",
    "CheckpointError", "CheckpointNotFoundError", "CostGraphError", "DonatedArgumentError",
    "GraphError", "HloError", "LayoutError", "MemoryBudgetError", "MeshAxisError",
    "NeedsDevicesError", "NoRuleWarning", "NoStackError", "NotFoundError", "OptionsError",
    "OptionsTypeError", "PipelineError", "PlanError", "PlanFormatError",
    "PlanMismatchError", "ProgramError", "ShardcError", "ShardcWarning", "SignatureError",
    "closest", "fmt_bytes",
]


class ShardcError(Exception):
    """The base of every error shardc raises on purpose."""


class ShardcWarning(UserWarning):
    """The base of every warning shardc gives."""


# ---- what auto_shard and shardc's records are given ---------------------------------------
class OptionsError(ShardcError, ValueError):
    """An option of ``auto_shard`` or of one of shardc's records (``Cluster``,
    ``CalibrateOptions``, ``ChoiceOptions``, ``Checkpoints``) has a value it cannot take."""


class OptionsTypeError(ShardcError, TypeError):
    """An option, or an argument of one of shardc's functions, of a type it cannot take."""


class MeshAxisError(OptionsError):
    """An axis name the mesh does not have (the message names the closest one)."""


class SignatureError(ShardcError, ValueError):
    """``static_argnums`` / ``static_argnames`` / ``donate_argnums`` / ``donate_argnames``
    that do not fit the function's signature, as ``jax.jit`` refuses them."""


class ArgumentsError(ShardcError, TypeError):
    """A step's call arguments it cannot take: a leaf that is no array, an unhashable static
    argument, a pytree other than the planned one."""


class DonatedArgumentError(ShardcError, ValueError):
    """An argument whose buffers an earlier call donated (``donate_argnums`` /
    ``donate_argnames``), passed again; ``jax.jit``'s "Buffer has been deleted or donated"."""


# ---- plans and programs ---------------------------------------------------------------------
class PlanError(ShardcError, ValueError):
    """A plan used with a program, mesh or arguments it was not made for."""


class PlanFormatError(ShardcError, ValueError):
    """A plan file that cannot be read; the message names the field."""

    def __init__(self, what: str):
        self.what = what
        super().__init__(f"cannot read the plan: {what}. Plan again and save it with "
                         "plan.to_json()")


class PlanMismatchError(ShardcError, RuntimeError):
    """The processes of a job made different plans for the same step."""


class GraphError(ShardcError, ValueError):
    """A traced program shardc cannot plan (the message names the op and why)."""


class LayoutError(ShardcError, ValueError):
    """A layout that cannot be placed on the mesh being planned: a fixed one the user gave,
    a spelling of one, or one a registered rule returned."""


class CostGraphError(ShardcError, ValueError):
    """A cost graph breaks one of the invariants :func:`shardc.solve.costgraph.check_cost_graph`
    names."""


class ProgramError(ShardcError, ValueError):
    """The program named cannot be loaded; the message says why and what to write."""


class NeedsDevicesError(ShardcError, ValueError):
    """Lowering or running a function whose ``auto_shard`` was given an AbstractMesh: it
    plans, but running needs devices."""

    def __init__(self, mesh):
        shape, names = tuple(mesh.axis_sizes), tuple(mesh.axis_names)
        label = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
        super().__init__(
            f"auto_shard was given an AbstractMesh ({label}): it "
            "plans (step.plan, plan.explain, plan.to_json), but lowering and running need a "
            "concrete jax.sharding.Mesh of the same shape: jax.make_mesh("
            f"{shape!r}, {names!r}); make the step on that mesh and adopt this plan with "
            "step.use_plan(plan, *args)")


class MemoryBudgetError(ShardcError, ValueError):
    """No plan fits ``memory_budget``; ``needed`` is the smallest budget (bytes per device)
    for which one was found: planning again with it succeeds. ``found``: the smallest peak
    the search reached (at most ``needed``; planning at it is likely, not sure, to succeed:
    the planner tries it before naming a budget, :func:`shardc.step.solving.solve`).
    ``predicted``: set where plans predicted within the budget all compiled over it
    (:func:`shardc.step.solving.compiled_within`): the predicted peak of the one whose
    compiled peak (``found``) is the least; ``needed`` is then the budget raised by what
    that prediction missed, an estimate. ``hint``: another way to fit, appended."""

    def __init__(self, budget: float, needed: int, found: float | None = None,
                 predicted: float | None = None, hint: str = ""):
        self.budget, self.needed, self.predicted, self.hint = budget, needed, predicted, hint
        self.found = needed if found is None else min(found, needed)
        if predicted is None:
            why = (f"no plan fits memory_budget={fmt_bytes(budget)} per device; the leanest "
                   f"plan found needs {fmt_bytes(needed, up=True)}")
            fix = "Raise the budget to that, use more devices, or shrink the batch."
        else:
            why = (f"no plan compiles within memory_budget={fmt_bytes(budget)} per device: "
                   f"the leanest planned under it, predicted at {fmt_bytes(predicted)}, "
                   f"compiled to {fmt_bytes(self.found, up=True)} (XLA's memory_analysis(): "
                   "arguments + outputs + temporaries - aliased); a budget raised by what "
                   f"the prediction missed is about {fmt_bytes(needed, up=True)}")
            fix = ("Raise the budget to that, recompute activations in the backward pass "
                   "(jax.checkpoint around the layers), use more devices, or shrink the batch.")
        super().__init__(f"{why} (memory_budget={needed}). {fix}" + (f" {hint}" if hint else ""))

    def hinted(self, hint: str) -> MemoryBudgetError:
        """This error with ``hint`` appended to its fix."""
        return MemoryBudgetError(self.budget, self.needed, self.found, self.predicted, hint)


# ---- pipelines ------------------------------------------------------------------------------
class PipelineError(ShardcError, ValueError):
    """A pipeline that cannot run: its own settings, or the program, mesh or batch it is
    asked to run on."""


class NoStackError(PipelineError):
    """A pipeline was asked for, but the program has no layer stack to run as one."""

    def __init__(self, pipeline):
        super().__init__(
            f"auto_shard(pipeline={pipeline}): the function has no layer stack to pipeline; "
            "write the stack as shardc.pipeline.layers(layer_fn, carry, stacked_params), a "
            "drop-in for jax.lax.scan(layer_fn, carry, stacked_params), or leave "
            "pipeline=None (a jax.lax.scan is run as one where its layer returns no "
            "per-layer output, closes over no traced array, treats the batch's examples "
            "apart, draws no random bits and reads no batch size as a number; a warning "
            "says which a scan's layer does not)")


# ---- measuring, inspecting, checkpoints, benchmarks --------------------------------------------
class CalibrationError(ShardcError, RuntimeError):
    """The measurements do not determine a link (its time does not grow with size)."""


class HloError(ShardcError, ValueError):
    """HLO text (or a compiled program's) that shardc cannot read."""


class CheckpointError(ShardcError, ValueError):
    """A checkpoint that cannot be saved or restored as asked."""


class NotFoundError(ShardcError, FileNotFoundError):
    """Nothing shardc can read where it was pointed: no bench results, no checkpoint."""


class CheckpointNotFoundError(NotFoundError):
    """No checkpoint of the step asked for (or none at all) in the directory."""


class CheckpointCorruptError(ShardcError, RuntimeError):
    """Checkpoints in the directory, none of them complete."""


class BenchError(ShardcError, RuntimeError):
    """A benchmark that could not run on this machine, or whose own checks failed."""


class NoRuleWarning(ShardcWarning):
    """A primitive without a sharding rule runs replicated."""


# ---- helpers for messages ---------------------------------------------------------------------
def closest(name: str, choices: Iterable[str]) -> str:
    """A hint naming the choice closest to a mistyped ``name``.

    Args:
        name: what was given.
        choices: the names it should have been one of.

    Returns:
        ``" (did you mean 'data'?)"`` where one of ``choices`` is close to ``name``
        (:func:`difflib.get_close_matches`), else ``""``.
    """
    found = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {found[0]!r}?)" if found else ""


def fmt_bytes(b: float, up: bool = False) -> str:
    """``b`` bytes in the largest binary unit it fills, to 2 decimals; ``up`` rounds up (a
    budget printed this way is never below ``b``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            v = math.ceil(b / size * 100) / 100 if up else b / size
            return f"{v:.2f} {unit}"
    return f"{math.ceil(b) if up else b:.0f} B"
