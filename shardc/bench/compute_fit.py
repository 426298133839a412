"""The compute term against the steps and kernels measured on a GPU, held out.

Two checks of :mod:`shardc.cost.kernels` against what ``python -m shardc.bench.device``
measured (``steps.json``, ``kernels.json``):

- **Kernels, leave-one-out.** Each measured kernel priced by the curve of its kind and
  width rebuilt without it (:func:`kernel_holdout`).
- **Steps.** Each zoo model's one-device step: the planner's compute
  (``Plan.predicted.compute_time`` on a one-device mesh, the kernel model) plus a per-call
  runtime cost per array argument, the one constant fitted to the steps: what a call
  pays beside its kernels (each argument's and result's buffer handled by the runtime,
  the executable's launch), the same for every plan of a step. Fitted least squares on
  the other models' residuals (measured minus kernels) against their argument counts, and
  each model predicted with the constant fitted without it (:func:`step_holdout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.cost.kernels import H100, KernelModel, interpolate, monotone

__all__ = ["StepFit", "fit_per_argument", "kernel_holdout", "section", "step_holdout"]


@dataclass(frozen=True)
class StepFit:
    """One model's measured step against the prediction.

    Attributes:
        model: the zoo model.
        measured_s: the measured one-device step.
        kernels_s: the planner's compute (the kernel model).
        arguments: the step's array arguments.
        per_argument_s: the per-call cost per argument, fitted without this model.
    """

    model: str
    measured_s: float
    kernels_s: float
    arguments: int
    per_argument_s: float

    @property
    def predicted_s(self) -> float:
        return self.kernels_s + self.per_argument_s * self.arguments

    @property
    def ratio(self) -> float:
        """Measured over predicted."""
        return self.measured_s / self.predicted_s


def fit_per_argument(rows: Sequence[tuple[float, float, int]]) -> float:
    """The per-argument seconds fitting ``(measured, kernels, arguments)`` rows: least
    squares through the origin of measured minus kernels on arguments, at least 0."""
    num = sum(a * (m - k) for m, k, a in rows)
    den = sum(a * a for _, _, a in rows)
    return max(0.0, num / den) if den else 0.0


def step_holdout(rows: Sequence[tuple[str, float, float, int]]) -> list[StepFit]:
    """``(model, measured, kernels, arguments)`` rows, each predicted with the
    per-argument cost fitted on the others."""
    out = []
    for i, (name, m, k, a) in enumerate(rows):
        rest = [(m2, k2, a2) for j, (_, m2, k2, a2) in enumerate(rows) if j != i]
        out.append(StepFit(name, m, k, a, fit_per_argument(rest)))
    return out


def _curve_of(rows: Sequence[dict], kind: str, dtype: str):
    points = [(r["flops"] if kind == "dot" else r["bytes"], r["s"]) for r in rows
              if r["kind"] == kind and r.get("dtype", "float32") == dtype]
    return monotone(points) if points else None


def kernel_holdout(rows: Sequence[dict]) -> list[tuple[dict, float]]:
    """Each measured kernel (a ``kernels.json`` row) with the seconds the curve of its
    kind and dtype predicts when built from the other rows of that curve."""
    out = []
    for i, r in enumerate(rows):
        rest = [x for j, x in enumerate(rows) if j != i]
        dtype = r.get("dtype", "float32")
        curve = _curve_of(rest, r["kind"], dtype)
        if curve is None:
            continue
        out.append((r, interpolate(curve, r["flops"] if r["kind"] == "dot" else r["bytes"])))
    return out


def _spread(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def section(fits: Sequence[StepFit], kernels: Sequence[dict],
            model: KernelModel = H100) -> list[str]:
    """The page's compute section: the steps table, the fitted constant, the held-out
    checks."""
    everyone = fit_per_argument([(f.measured_s, f.kernels_s, f.arguments) for f in fits])
    out = ["| model | measured ms | kernels ms | arguments | per-call ms | predicted ms | "
           "measured / predicted (held out) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for f in fits:
        out.append(f"| {f.model} | {f.measured_s * 1e3:.3f} | {f.kernels_s * 1e3:.3f} | "
                   f"{f.arguments} | {f.per_argument_s * f.arguments * 1e3:.3f} | "
                   f"{f.predicted_s * 1e3:.3f} | {f.ratio:.2f} |")
    ratios = [f.ratio for f in fits]
    held = kernel_holdout(kernels)
    kr = [r["s"] / p for r, p in held]
    inside = sum(0.8 <= x <= 1.25 for x in ratios)
    out += ["", f"- **Steps:** measured / predicted {_spread(ratios)} held out ({inside} of "
            f"{len(ratios)} within 0.8-1.25); the kernels alone "
            f"{_spread([f.measured_s / f.kernels_s for f in fits])}. The per-call cost, "
            f"fitted on every model: {everyone * 1e6:.1f} us per array argument "
            f"(held out: {min(f.per_argument_s for f in fits) * 1e6:.1f}-"
            f"{max(f.per_argument_s for f in fits) * 1e6:.1f}); it is the same for every "
            "plan of a step, so it moves no ranking.",
            f"- **Kernels, leave-one-out:** each of the {len(held)} kernels above priced by "
            f"its curve ({model.name}'s, `shardc.cost.kernels`) rebuilt without it: "
            f"measured / predicted {_spread(kr)}, within 1.25x for "
            f"{sum(0.8 <= x <= 1.25 for x in kr)}."]
    return out
