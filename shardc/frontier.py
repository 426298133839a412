"""The time-memory frontier: the plans no other plan beats on both predicted step time and
predicted peak memory per device.

TensorOpt's point is that no single plan is right: with few devices memory binds, with many
time does. :func:`sweep` plans a program at no budget (the fastest plan), at the smallest
budget a plan was found for (the leanest), and at budgets spaced geometrically between their
peaks; the non-dominated plans form a :class:`Frontier`, each a full :class:`shardc.Plan`
that runs (``step.use_plan(plan, ...)``). ``step.pareto(*args)`` and :func:`shardc.pareto`
call it.

References:
  TensorOpt (Cai et al., TPDS 2022) §3: the Pareto set of (time, memory) strategies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shardc.explain import fmt_bytes, fmt_time
from shardc.plan import Plan
from shardc.solve.search import MemoryBudgetError
from shardc.views import mesh_label

__all__ = ["Frontier", "sweep"]

BUDGETS = 6
"""Budgets planned between the leanest and the fastest plan's peaks (besides those two)."""


@dataclass(frozen=True)
class Frontier:
    """Non-dominated plans, leanest first (so step time falls along the tuple)."""

    plans: tuple[Plan, ...]

    def __post_init__(self):
        if not self.plans:
            raise ValueError("a frontier holds at least one plan")

    def points(self) -> list[tuple[float, float]]:
        """(predicted step seconds, predicted peak bytes per device) of each plan."""
        return [(p.predicted.step_time, p.predicted.peak_memory) for p in self.plans]

    def pick(self, memory_budget: float) -> Plan:
        """The fastest plan whose predicted peak fits ``memory_budget`` (bytes per device);
        :class:`MemoryBudgetError` naming the leanest plan's peak if none does."""
        fits = [p for p in self.plans if p.predicted.peak_memory <= memory_budget]
        if not fits:
            raise MemoryBudgetError(memory_budget, math.ceil(self.plans[0].predicted.peak_memory))
        return min(fits, key=lambda p: p.predicted.step_time)

    def table(self) -> str:
        rows = ["predicted step   peak per device   mesh"]
        for p in self.plans:
            rows.append(f"{fmt_time(p.predicted.step_time):>14}   "
                        f"{fmt_bytes(p.predicted.peak_memory):>15}   {mesh_label(p.mesh_axes)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | None = None, experts: Mapping[str, tuple[float, float]] | None
             = None, ax=None):
        """Time against memory: the frontier as a staircase of its plans, and ``experts``
        (name -> (step seconds, peak bytes), e.g. hand-written plans priced on the same
        cluster) as labelled points on the same axes. Saved to ``path`` if given; returns
        the matplotlib Axes."""
        try:
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("Frontier.plot needs matplotlib: pip install 'shardc[bench]'") \
                from exc
        if ax is None and path is not None:  # a figure of its own: the backend is left alone
            ax = Figure(figsize=(6, 4)).subplots()
        elif ax is None:
            import matplotlib.pyplot as plt

            _, ax = plt.subplots(figsize=(6, 4))
        mib = 2.0 ** 20
        t = [s * 1e3 for s, _ in self.points()]
        m = [b / mib for _, b in self.points()]
        ax.step(m, t, where="post", color="C0", alpha=0.5)
        ax.scatter(m, t, color="C0", label="shardc frontier", zorder=3)
        for name, (s, b) in sorted((experts or {}).items()):
            ax.scatter([b / mib], [s * 1e3], marker="x", color="C3", zorder=3)
            ax.annotate(name, (b / mib, s * 1e3), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set_xlabel("predicted peak memory per device (MiB)")
        ax.set_ylabel("predicted step (ms)")
        ax.legend(loc="upper right")
        if path is not None:
            ax.figure.tight_layout()
            ax.figure.savefig(path, dpi=120)
        return ax


def non_dominated(plans: list[Plan]) -> tuple[Plan, ...]:
    """The plans no other plan beats on both time and memory (ties keep the first), leanest
    first."""
    ordered = sorted(plans, key=lambda p: (p.predicted.peak_memory, p.predicted.step_time))
    out: list[Plan] = []
    for p in ordered:
        if not out or p.predicted.step_time < out[-1].predicted.step_time:
            out.append(p)
    return tuple(out)


def sweep(solve: Callable[[float | None], Plan], budgets: int = BUDGETS) -> Frontier:
    """Plans from ``solve(memory_budget)`` (None: no budget) at no budget, at the smallest
    budget one was found for, and at ``budgets`` budgets spaced geometrically between the
    two plans' peaks; their non-dominated set."""
    fastest = solve(None)
    try:
        leanest = solve(1.0)  # no plan fits a byte: the error names the leanest found
    except MemoryBudgetError as exc:
        leanest = solve(float(exc.needed))
    plans = [fastest, leanest]
    lo, hi = leanest.predicted.peak_memory, fastest.predicted.peak_memory
    if hi > lo:
        ratio = (hi / lo) ** (1.0 / (budgets + 1))
        for k in range(1, budgets + 1):
            try:
                plans.append(solve(lo * ratio ** k))
            except MemoryBudgetError:
                continue  # the sampled memory points let no plan through at this budget
    return Frontier(non_dominated(plans))
