"""The time-memory frontier: the plans no other plan beats on both predicted step time and
predicted peak memory per device.

TensorOpt's point is that no single plan is right: with few devices memory binds, with many
time does. :func:`sweep` plans a program at no budget (the fastest plan), at the smallest
budget a plan was found for (the leanest), and at budgets spaced geometrically between their
peaks, and plans that recompute forward segments' activations in the backward pass
(:mod:`shardc.ir.remat`); the non-dominated plans form a :class:`Frontier`, each a full
:class:`shardc.Plan` that runs (``step.use_plan(plan, ...)``). ``step.pareto(*args)`` and
:func:`shardc.pareto` call it. :func:`device_counts` and :class:`DeviceSweep` are
TensorOpt's other axis: the best plan on each sub-mesh of the devices
(``step.device_sweep(*args)``), to read how many devices a program needs.

References:
  TensorOpt (Cai et al., TPDS 2022) §3: the Pareto set of (time, memory) strategies.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from shardc.explain import fmt_bytes, fmt_time
from shardc.plan import Plan
from shardc.solve.search import MemoryBudgetError
from shardc.views import mesh_label

__all__ = ["DeviceCount", "DeviceSweep", "Frontier", "device_counts", "sweep"]

log = logging.getLogger("shardc")

BUDGETS = 6
"""Budgets planned between the leanest and the fastest plan's peaks (besides those two)."""


@dataclass(frozen=True)
class Frontier(Sequence[Plan]):
    """Non-dominated plans, leanest first (so step time falls along them): a sequence of
    :class:`shardc.Plan` (``frontier[0]`` the leanest, ``frontier[-1]`` the fastest,
    ``len``, iteration, slicing to a tuple), also held as ``plans``."""

    plans: tuple[Plan, ...]

    def __post_init__(self):
        if not self.plans:
            raise ValueError("a frontier holds at least one plan")

    def __len__(self) -> int:
        return len(self.plans)

    @overload
    def __getitem__(self, k: int) -> Plan: ...

    @overload
    def __getitem__(self, k: slice) -> tuple[Plan, ...]: ...

    def __getitem__(self, k):
        return self.plans[k]

    def __iter__(self) -> Iterator[Plan]:
        return iter(self.plans)

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
        rows = ["predicted step   peak per device       recomputes   mesh"]
        for p in self.plans:
            rows.append(f"{fmt_time(p.predicted.step_time):>14}   "
                        f"{fmt_bytes(p.predicted.peak_memory):>15}   {recomputes(p):>14}   "
                        f"{mesh_label(p.mesh_axes)}")
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
        kept = [k for k, p in enumerate(self.plans) if not p.remat]
        again = [k for k, p in enumerate(self.plans) if p.remat]
        for idx, marker, label in ((kept, "o", "shardc frontier"),
                                   (again, "s", "shardc frontier, with remat")):
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
    """``"3/24 segments"``: the forward segments whose activations ``plan`` recomputes in
    the backward pass; ``"-"`` when it keeps them all."""
    return f"{len(plan.remat)}/{plan.segments} segments" if plan.remat else "-"


def non_dominated(plans: list[Plan]) -> tuple[Plan, ...]:
    """The plans no other plan beats on both time and memory (ties keep the first), leanest
    first."""
    ordered = sorted(plans, key=lambda p: (p.predicted.peak_memory, p.predicted.step_time))
    out: list[Plan] = []
    for p in ordered:
        if not out or p.predicted.step_time < out[-1].predicted.step_time:
            out.append(p)
    return tuple(out)


def sweep(solve: Callable[..., Plan], budgets: int = BUDGETS,
          remat: Sequence[tuple[int, ...]] = ()) -> Frontier:
    """Plans from ``solve(memory_budget, remat=())`` (None: no budget; ``remat``: the
    forward segments the program recomputes): at no budget and at the smallest budget one
    was found for; for each remat choice in ``remat`` (most recomputed first) the fastest
    plan recomputing those segments, and for the first the leanest; then at ``budgets``
    budgets spaced geometrically between the leanest and the fastest plans' peaks, each
    planned with the choice that recomputes least among those the budget binds (its
    fastest plan does not fit) and whose leanest plan, where known, fits; a budget no
    choice can place a new plan in is skipped. Their non-dominated set."""
    plans: list[Plan] = []
    tried, total = 0, 2 + budgets + len(remat) + bool(remat)

    def found(what: str, plan: Plan | None) -> Plan | None:
        """Keep ``plan`` and say so at INFO (``shardc pareto`` prints these lines: a large
        model's frontier takes minutes)."""
        nonlocal tried
        tried += 1
        if plan is not None:
            plans.append(plan)
        log.info("shardc: frontier plan %d of %d (%s): %s", tried, total, what,
                 "none fits" if plan is None else f"{fmt_time(plan.predicted.step_time)} "
                 f"step, {fmt_bytes(plan.predicted.peak_memory)} peak")
        return plan

    def peak(plan: Plan) -> float:
        return plan.predicted.peak_memory

    fastest = {(): found("no budget", solve(None))}
    leanest = {(): found("the leanest", _leanest(solve, ()))}
    for k, segments in enumerate(remat):
        fastest[segments] = found(f"{len(segments)} segments recomputed", solve(None, segments))
        if k == 0:
            leanest[segments] = found(f"the leanest with {len(segments)} segments "
                                      "recomputed", _leanest(solve, segments))
    lo, hi = min(map(peak, plans)), peak(fastest[()])
    ratio = (hi / lo) ** (1.0 / (budgets + 1)) if hi > lo else 1.0
    for k in range(1, budgets + 1):
        budget = lo * ratio ** k
        useful = [c for c in ((), *reversed(remat)) if peak(fastest[c]) > budget and
                  (c not in leanest or peak(leanest[c]) <= budget)]
        if not useful:
            total -= 1  # every choice's fastest plan fits, or none of its plans can
            continue
        try:
            plan = solve(budget, useful[0])
        except MemoryBudgetError:
            plan = None  # the sampled memory points let no plan through at this budget
        found(f"budget {fmt_bytes(budget)}" + (
            f", {len(useful[0])} segments recomputed" if useful[0] else ""), plan)
    return Frontier(non_dominated(plans))


def _leanest(solve: Callable[..., Plan], remat: tuple[int, ...]) -> Plan:
    """The plan at the smallest budget one was found for: the search's leanest peak where
    planning at it succeeds, else the lean start's (which always does)."""
    try:
        return solve(1.0, remat)  # no plan fits a byte: the error names the leanest found
    except MemoryBudgetError as exc:
        if exc.found < exc.needed:
            with contextlib.suppress(MemoryBudgetError):
                return solve(float(math.ceil(exc.found)), remat)
        return solve(float(exc.needed), remat)


def device_counts(shape: Sequence[int], names: Sequence[str]
                  ) -> list[tuple[int, tuple[int, ...], tuple[str, ...]]]:
    """``(devices, sub-mesh shape, its axis names)`` for each device count that divides the
    mesh, fewest first: the first devices in row-major order, so a count fills the inner
    (fastest) axes before the outer ones (4 of ``(node=2, gpu=4)`` is ``(node=1, gpu=4)``).
    Every axis keeps its name, at size 1 where the count leaves it: the program's own
    ``with_sharding_constraint`` may name any of the mesh's axes, and a spec naming an axis
    of size 1 places the value as if it named none. A count whose devices are not a whole
    block of inner axes is skipped (6 of ``(2, 4)``: it divides nothing, as does no count
    that is not a divisor)."""
    n = math.prod(shape)
    out = []
    for k in range(1, n + 1):
        if n % k:
            continue
        sub, rem = [], k
        for size in reversed(shape):
            take = math.gcd(size, rem)
            if rem > 1 and take < min(size, rem):
                break
            sub.append(take)
            rem //= take
        else:
            if rem != 1:
                continue
            sub.reverse()
            out.append((k, tuple(sub), tuple(names)))
    return out


@dataclass(frozen=True)
class DeviceCount:
    """The best plan on ``devices`` devices (the sub-mesh ``mesh``), within the sweep's
    budget; ``plan`` is None when none fits, and ``needed`` the leanest plan's peak."""

    devices: int
    mesh: tuple[tuple[str, int], ...]
    plan: Plan | None
    needed: int | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class DeviceSweep:
    """One :class:`DeviceCount` per device count that divides the mesh, fewest first, each
    planned within ``memory_budget`` bytes per device."""

    counts: tuple[DeviceCount, ...]
    memory_budget: float

    def fewest(self) -> DeviceCount:
        """The fewest devices on which a plan fits the budget; :class:`MemoryBudgetError`
        naming the leanest plan on all of them if none does."""
        for c in self.counts:
            if c.fits:
                return c
        raise MemoryBudgetError(self.memory_budget, self.counts[-1].needed)

    def table(self) -> str:
        rows = ["devices   mesh                  predicted step   peak per device   fits "
                f"{fmt_bytes(self.memory_budget)}"]
        for c in self.counts:
            if c.plan is None:
                step, peak, fits = "-", f">= {fmt_bytes(c.needed, up=True)}", "no"
            else:
                step = fmt_time(c.plan.predicted.step_time)
                peak, fits = fmt_bytes(c.plan.predicted.peak_memory), "yes"
            rows.append(f"{c.devices:>7}   {mesh_label(c.mesh):<20}  {step:>14}   "
                        f"{peak:>15}   {fits}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()
