"""The time-memory frontier as a record, its table and its plot.

The plans no other plan beats on both predicted step time and predicted peak memory per
device (:class:`Frontier`, which :func:`shardc.tradeoff.frontier.sweep` makes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from shardc.cost.units import fmt_bytes, fmt_time
from shardc.errors import PlanError
from shardc.plan.record import Plan
from shardc.report.explain import mesh_label
from shardc.solve.search import MemoryBudgetError

__all__ = ["Frontier", "non_dominated", "recomputes"]


@dataclass(frozen=True)
class Frontier(Sequence[Plan]):
    """Non-dominated plans, leanest first (so step time falls along them).

    A sequence of :class:`shardc.Plan`: ``frontier[0]`` is the leanest, ``frontier[-1]``
    the fastest; ``len``, iteration, and slicing to a tuple.

    Attributes:
        plans: The plans, leanest first.

    Raises:
        ValueError: At construction, without a plan.
    """

    plans: tuple[Plan, ...]

    def __post_init__(self):
        """Check there is a plan."""
        if not self.plans:
            raise PlanError("a frontier holds at least one plan")

    def __len__(self) -> int:
        """The number of plans."""
        return len(self.plans)

    @overload
    def __getitem__(self, k: int) -> Plan: ...

    @overload
    def __getitem__(self, k: slice) -> tuple[Plan, ...]: ...

    def __getitem__(self, k):
        """Plan ``k``, or a tuple of plans for a slice."""
        return self.plans[k]

    def __iter__(self) -> Iterator[Plan]:
        """The plans, leanest first."""
        return iter(self.plans)

    def points(self) -> list[tuple[float, float]]:
        """Each plan's point: (predicted step seconds, predicted peak bytes per device)."""
        return [(p.predicted.step_time, p.predicted.peak_memory) for p in self.plans]

    def pick(self, memory_budget: float) -> Plan:
        """The fastest plan whose predicted peak fits ``memory_budget``.

        Args:
            memory_budget: Bytes per device.

        Returns:
            The plan.

        Raises:
            MemoryBudgetError: Naming the leanest plan's peak, if none fits.
        """
        fits = [p for p in self.plans if p.predicted.peak_memory <= memory_budget]
        if not fits:
            raise MemoryBudgetError(memory_budget, math.ceil(self.plans[0].predicted.peak_memory))
        return min(fits, key=lambda p: p.predicted.step_time)

    def table(self) -> str:
        """The plans as a table: step, peak, what each recomputes and offloads, its mesh."""
        rows = ["predicted step   peak per device       recomputes   in host memory   mesh"]
        for p in self.plans:
            host = f"{len(p.offloaded)} leaves" if p.offloaded else "-"
            rows.append(f"{fmt_time(p.predicted.step_time):>14}   "
                        f"{fmt_bytes(p.predicted.peak_memory):>15}   {recomputes(p):>14}   "
                        f"{host:>14}   {mesh_label(p.mesh_axes)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        """:meth:`table`."""
        return self.table()

    def plot(self, path: str | None = None, experts: Mapping[str, tuple[float, float]] | None
             = None, ax=None):
        """Plot time against memory: the frontier as a staircase of its plans.

        Args:
            path: Where to save the figure; None: not saved.
            experts: Name -> (step seconds, peak bytes) of other plans (hand-written ones
                priced on the same cluster, say), drawn as labelled points.
            ax: The matplotlib Axes to draw on; None: a new figure's.

        Returns:
            The matplotlib Axes.

        Raises:
            ImportError: Without matplotlib.
        """
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
        kept = [k for k, p in enumerate(self.plans) if not p.remat and not p.offloaded]
        again = [k for k, p in enumerate(self.plans) if p.remat and not p.offloaded]
        host = [k for k, p in enumerate(self.plans) if p.offloaded]
        for idx, marker, label in ((kept, "o", "shardc frontier"),
                                   (again, "s", "shardc frontier, with remat"),
                                   (host, "D", "shardc frontier, state in host memory")):
            if idx:
                ax.scatter([m[k] for k in idx], [t[k] for k in idx], marker=marker, color="C0",
                           label=label, zorder=3)
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


def recomputes(plan: Plan) -> str:
    """The forward segments ``plan`` recomputes in the backward pass, ``"3/24 segments"``.

    Args:
        plan: The plan.

    Returns:
        The count of its segments; ``"-"`` when it keeps every activation.
    """
    return f"{len(plan.remat)}/{plan.segments} segments" if plan.remat else "-"


def non_dominated(plans: list[Plan]) -> tuple[Plan, ...]:
    """The plans no other plan beats on both time and memory, leanest first.

    Args:
        plans: The candidates.

    Returns:
        The non-dominated plans (of ties, the first).
    """
    ordered = sorted(plans, key=lambda p: (p.predicted.peak_memory, p.predicted.step_time))
    out: list[Plan] = []
    for p in ordered:
        if not out or p.predicted.step_time < out[-1].predicted.step_time:
            out.append(p)
    return tuple(out)
