"""The time-memory frontier's search: the plans no other plan beats on time and memory.

No single plan is right (TensorOpt): with few devices memory binds, with many time does.
:func:`sweep` plans a program at no budget (the fastest plan) and at the smallest budget a
plan was found for (the leanest), places hand-written and its own plans' layouts at several
remat levels (:mod:`shardc.ir.remat`), and searches the gaps those leave; the
non-dominated plans form a :class:`Frontier`, each a full :class:`shardc.Plan` that runs
(``step.use_plan(plan, ...)``). ``step.pareto(*args)`` and :func:`shardc.pareto` call it;
the best plan on each sub-mesh of the devices is :mod:`shardc.tradeoff.sweep`.

References:
  TensorOpt (Cai et al., TPDS 2022) §3: the Pareto set of (time, memory) strategies.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.remat import Segment, prefixes
from shardc.ir.sbp import NdSbp
from shardc.plan.record import Plan
from shardc.solve.search import MemoryBudgetError
from shardc.tradeoff.staircase import Frontier, non_dominated

__all__ = ["BUDGETS", "FILLS", "Frontier", "GAP", "SEARCHES", "Sources", "sweep"]

log = logging.getLogger("shardc")

BUDGETS = 0
"""Budgets searched at points spaced geometrically between the leanest and the fastest plan's
peaks (besides those two). None by default: the gaps the placements leave are searched
anyway (:meth:`_Sweep.fill`, at most ``budgets +`` :data:`SEARCHES`), at a fraction of
fixed budgets' planning time (docs/design-notes.md)."""
GAP = 0.1
"""The widest gap between neighbouring plans :func:`sweep` leaves where it finds a plan: this
fraction of the frontier's memory range."""
FILLS = 12
"""Gaps :func:`sweep` tries to fill at most (each with a few cheap placements, and a search
where they land nothing in it)."""
SEARCHES = 9
"""Searches into the gaps at most, besides one per budget: where placements land in a gap,
none is spent."""


Layouts = Mapping[int, NdSbp]
"""Hand-written layouts of a program's graph inputs, by input index."""


@dataclass(frozen=True)
class Sources:
    """What :func:`sweep` plans a frontier from.

    Attributes:
        solve: ``solve(budget, remat)``, the fastest plan of the program recomputing the
            forward segments ``remat`` within ``budget`` bytes per device (None: no budget);
            raises :class:`MemoryBudgetError` when none fits.
        place: ``place(remat, layouts)``, that program's plan around each of ``layouts``
            (by name; input layouts on the physical mesh), placed without a search.
        layouts: Hand-written input layouts the frontier must not lose to (the generic
            layouts of :mod:`shardc.tradeoff.baselines`, the user's seeds).
        segments: The program's forward segments (:mod:`shardc.ir.remat`).
        inputs: Its graph inputs' bytes.
        shapes: Its graph inputs' shapes.
        optimizer: The inputs only its update reads
            (:func:`shardc.tradeoff.baselines.optimizer_state`).
        mesh: The physical mesh's axes (a plan on another view lends no layouts).
        offloaded: As ``solve``, the program keeping state in host memory
            (:mod:`shardc.step.offload`); None where nothing may be offloaded.
    """

    solve: Callable[..., Plan]
    place: Callable[[tuple[int, ...], Mapping[str, Layouts]], Sequence[Plan]] = \
        lambda remat, layouts: ()
    layouts: Mapping[str, Layouts] = field(default_factory=dict)
    segments: tuple[Segment, ...] = ()
    inputs: tuple[int, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    optimizer: frozenset[int] = frozenset()
    mesh: tuple[tuple[str, int], ...] = ()
    #: as ``solve``, the program keeping state in host memory (:mod:`shardc.step.offload`);
    #: None where nothing may be offloaded
    offloaded: Callable[..., Plan] | None = None


def sweep(sources: Sources, budgets: int = BUDGETS) -> Frontier:
    """The time-memory frontier of a program's sources.

    The non-dominated plans among: the fastest plan (no budget) and the leanest (the
    smallest budget one was found for), of the program as written and of the one that
    recomputes every forward segment; the hand-written layouts' plans and the fastest
    plan's layouts at a few remat choices, so no hand-written layout lies below the
    staircase; plans at fixed budgets; plans that fill each gap between neighbours wider
    than :data:`GAP` of the frontier's memory range (:meth:`_Sweep.fill`); and below them
    the leanest plans keeping state in host memory, where leaner. The remat choices are the
    greedy's (:func:`shardc.ir.remat.prefixes`: segments by bytes saved per recomputed
    FLOP); each budget takes the one :meth:`_Sweep.choose` picks for it.

    Args:
        sources: What to plan from.
        budgets: Budgets searched at points spaced geometrically between the leanest and
            the fastest peaks.

    Returns:
        The frontier, leanest first.
    """
    return _Sweep(sources, budgets).run()


class _Sweep:
    """The bookkeeping of one :func:`sweep`.

    The plans found, and the remat choices' bytes, to pick one per budget (:meth:`choose`).
    """

    def __init__(self, sources: Sources, budgets: int):
        self.src, self.budgets = sources, budgets
        self.chain = prefixes(sources.segments)  # remat choices, least recomputed first
        self.at = {c: k for k, c in enumerate(self.chain)}
        self.kept = [sum(sources.segments[i].kept for i in c) for c in self.chain]
        self.plans: list[Plan] = []
        self.fast: dict[int, Plan] = {}  # by remat choice (index in chain): no budget
        self.lean: dict[int, Plan] = {}  # every segment recomputed: the smallest budget planned
        self.lean_peak = math.inf  # recomputing nothing: the leanest peak, searched or named
        self.placed: set[tuple[int, frozenset]] = set()  # (remat choice, input layouts)
        self.tried, self.total = 0, 2 + budgets + 2 * bool(sources.segments)
        self.device_floor = -math.inf  # below it, plans keep state in host memory (offload)

    def found(self, what: str, plan: Plan | None) -> Plan | None:
        """Keep ``plan`` and log it at INFO.

        ``shardc pareto`` prints these lines: a large model's frontier takes minutes.
        """
        self.tried += 1
        self.total = max(self.total, self.tried)
        if plan is not None:
            self.plans.append(plan)
        log.info("shardc: frontier plan %d of %d (%s): %s", self.tried, self.total, what,
                 "none fits" if plan is None else f"{fmt_time(plan.predicted.step_time)} "
                 f"step, {fmt_bytes(plan.predicted.peak_memory)} peak")
        return plan

    def solve(self, what: str, budget: float, k: int) -> Plan | None:
        try:
            if budget < self.device_floor:  # as auto_shard plans it: no plan on the devices
                plan = self._offloaded(budget)
            else:
                plan = self.src.solve(budget, self.chain[k])
        except MemoryBudgetError:
            plan = None  # the sampled memory points let no plan through at this budget
        return self.found(f"{what} {fmt_bytes(budget)}" + (
            f", {len(self.chain[k])} segments recomputed" if k else ""), plan)

    def _offloaded(self, budget: float) -> Plan:
        """The plan keeping state in host memory within ``budget``.

        Recomputing nothing, else every segment (:func:`shardc.step.solving.offloaded_plans`'
        order).
        """
        try:
            return self.src.offloaded(budget, ())
        except MemoryBudgetError:
            if len(self.chain) == 1:
                raise
            return self.src.offloaded(budget, self.chain[-1])

    def place(self, k: int, layouts: Mapping[str, Layouts]) -> list[Plan]:
        """The plans recomputing ``chain[k]`` around ``layouts``.

        The plans of the program recomputing ``chain[k]`` around ``layouts``, but for
        those placed before (the cheap fills of neighbouring gaps often land on the same
        layouts).
        """
        fresh = {}
        for name, lay in layouts.items():
            key = (k, frozenset(lay.items()))
            if key not in self.placed:
                self.placed.add(key)
                fresh[name] = lay
        plans = list(self.src.place(self.chain[k], fresh)) if fresh else []
        self.plans.extend(plans)
        return plans

    def run(self) -> Frontier:
        src, n = self.src, len(self.chain) - 1
        self.fast[0] = self.found("no budget", src.solve(None))
        if n:
            self.fast[n] = self.found(f"{n} segments recomputed", src.solve(None, self.chain[n]))
        # searched, not placed from the leanest remat plan's layouts: a model's leanest plan
        # may recompute nothing. Not searched where its peak (the search's first, cheap ask
        # names it) is no leaner than the fastest plan recomputing every segment: a plan
        # between those two is what the budgets and the gaps' fills look for. A heuristic,
        # not an exact saving: such a plan faster than that remat plan would be on the
        # staircase, and is left to the fills (its peak stands in for the plan's where
        # ``choose`` reads it)
        lean, self.lean_peak = _leanest(src.solve, (), _peak(self.fast[n]) if n else math.inf)
        if lean is None:
            self.total -= 1
        else:
            self.found("the leanest", lean)
        if n:
            self.lean[n] = self.found(f"the leanest with {n} segments recomputed",
                                      _leanest(src.solve, self.chain[n])[0])
        # the hand-written layouts with no and every segment recomputed, and the fastest
        # plan's layouts recomputing a quarter, half and three quarters of the bytes (cheap)
        self.place(0, src.layouts)
        if n:
            self.place(n, src.layouts)
        for k in sorted({min(range(1, n), key=lambda k: abs(self.kept[k] - q * self.kept[n]))
                         for q in (0.25, 0.5, 0.75)} if n > 1 else ()):
            self.place(k, self._own(self.fast[0]))
        lo, hi = min(map(_peak, self.plans)), _peak(self.fast[0])
        ratio = (hi / lo) ** (1.0 / (self.budgets + 1)) if hi > lo else 1.0
        for j in range(1, self.budgets + 1):
            budget = lo * ratio ** j
            k = self.choose(budget)
            if k in self.fast and _peak(self.fast[k]) <= budget:
                self.total -= 1  # the budget does not bind this choice's fastest plan
                continue
            self.solve("budget", budget, k)
        self.offload(n)
        self.fill()
        return Frontier(non_dominated(self.plans))

    def offload(self, n: int) -> None:
        """The leanest plan keeping state in host memory.

        Recomputing every segment (the leanest such plan; one recomputing none was never
        leaner than the devices' leanest on the programs measured, and cost as much to
        search), where leaner than every plan found on the devices; from here on a budget
        below those (``device_floor``) is planned with state in host memory
        (:meth:`solve`), as ``auto_shard`` plans it, and the gap up to them is filled as
        any other (:meth:`fill`).
        """
        if self.src.offloaded is None:
            return
        floor = self.device_floor = min(map(_peak, self.plans))
        self.total += 1
        plan, peak = _leanest(self.src.offloaded, self.chain[n], floor)
        self.found("the leanest with state in host memory"
                   + (f", {n} segments recomputed" if n else ""),
                   plan if plan is not None and peak < floor else None)

    def choose(self, budget: float) -> int:
        """The remat choice to plan ``budget`` with.

        Where recomputing saves bytes more cheaply (in step time per byte, between the
        fastest plans with none and every segment recomputed) than sharding more does
        (between the fastest and the leanest plan recomputing every segment), the least
        recomputed whose fastest plan is estimated to fit (else all); otherwise the least
        recomputed whose leanest plan is. Peaks are estimated by interpolating the two ends
        in the bytes each choice stops holding.
        """
        n = len(self.chain) - 1
        if not n:
            return 0

        def est(ends: dict[int, float], k: int) -> float:
            return ends[0] + (ends[n] - ends[0]) * self.kept[k] / max(self.kept[n], 1)

        def rate(a: Plan, b: Plan) -> float:  # step time per byte b saves over a
            saved = _peak(a) - _peak(b)
            return (_time(b) - _time(a)) / saved if saved > 0 else math.inf

        ends = {0: _peak(self.fast[0]), n: _peak(self.fast[n])} \
            if rate(self.fast[0], self.fast[n]) <= rate(self.fast[n], self.lean[n]) \
            else {0: self.lean_peak, n: _peak(self.lean[n])}
        return next((k for k in range(n + 1) if est(ends, k) <= budget), n)

    def fill(self) -> None:
        """Plan into each gap between neighbouring plans.

        Each gap between ``a`` (leaner) and ``b`` wider than :data:`GAP` of the memory range,
        widest first: once cheaply, ``b``'s layouts
        recomputing enough more segments to reach the gap's middle, and where that lands
        nothing in the gap, ``b``'s layouts partly replaced by ``a``'s (:meth:`_mixed`);
        where none lands in the gap, a search
        at the middle's budget. A search that finds no plan in the gap shows that none
        below its budget beats ``a`` (as far as the search sees), so the gap left to
        explore is its upper part: searches split it until what is left is narrower than
        :data:`GAP`. At most :data:`FILLS` tries and ``budgets +`` :data:`SEARCHES` searches.
        """
        cheap_tried: set[tuple[float, float]] = set()
        explored: list[tuple[float, float]] = []  # (peak, budget): nothing better between
        searches = 0

        def floor(a: Plan, b: Plan) -> float:
            """Where the unexplored part of the gap from ``a`` to ``b`` starts.

            The explored stretches chained from ``a``'s peak: a search that lands below
            where the unexplored part started explores on from there.
            """
            at = _peak(a)
            while True:
                nxt = max([hi for lo, hi in explored if lo <= at and at < hi < _peak(b)],
                          default=at)
                if nxt == at:
                    return at
                at = nxt

        for _ in range(FILLS):
            front = non_dominated(self.plans)
            width = GAP * (_peak(front[-1]) - _peak(front[0]))
            gaps = [(_peak(b) - max(_peak(a), floor(a, b)), a, b)
                    for a, b in zip(front, front[1:])
                    if (searches < self.budgets + SEARCHES
                        or (_peak(a), _peak(b)) not in cheap_tried)
                    and _peak(b) - max(_peak(a), floor(a, b)) > width]
            if not gaps:
                return
            _, a, b = max(gaps, key=lambda g: g[0])
            start = max(_peak(a), floor(a, b))
            middle = (start + _peak(b)) / 2
            if (_peak(a), _peak(b)) not in cheap_tried:
                cheap_tried.add((_peak(a), _peak(b)))
                # the mixes only where more remat lands nothing (GPT-2: 25 placements, not
                # 27, the same staircase)
                if _lands(self._more_remat(b, middle), a, b) or \
                        _lands(self._mixed(a, b), a, b):
                    continue
                if searches >= self.budgets + SEARCHES:
                    continue
            # the search's budget: the middle, or where a gap several times too wide splits
            # into parts that need the fewest searches more (whole widths from its start:
            # a gap of ten widths takes nine searches, where halving took fifteen)
            units = math.ceil((_peak(b) - start) / width - 1e-9)
            budget = middle if units <= 2 else \
                start + (_peak(b) - start) / units * math.ceil(units / 2)
            self.total += 1
            searches += 1
            plan = self.solve("gap at", budget, self.choose(budget))
            explored.append((start if plan is None else min(_peak(plan), start), budget))

    def _more_remat(self, b: Plan, middle: float) -> list[Plan]:
        """``b``'s layouts on a program recomputing more segments.

        ``b``'s layouts on the program recomputing the fewest more segments (greedy
        order) estimated to bring its peak to ``middle``, at the rate the fastest plans'
        peaks fall per byte a segment stops holding.
        """
        n, k = len(self.chain) - 1, self.at.get(b.remat)
        if not n or k is None or k == n or _peak(self.fast[n]) >= _peak(self.fast[0]):
            return []
        per_byte = (_peak(self.fast[0]) - _peak(self.fast[n])) / max(self.kept[n], 1)
        need = (_peak(b) - middle) / per_byte
        more = next((j for j in range(k + 1, n + 1) if self.kept[j] - self.kept[k] >= need), n)
        return self.place(more, self._own(b))

    def _own(self, plan: Plan) -> dict[str, Layouts]:
        """``plan``'s input layouts, to place a program around (none from another view)."""
        if plan.mesh_axes != self.src.mesh:
            return {}
        return {f"the inputs of a plan recomputing {len(plan.remat)} segments":
                dict(enumerate(plan.inputs))}

    def _mixed(self, a: Plan, b: Plan) -> list[Plan]:
        """``b``'s input layouts partly replaced by ``a``'s.

        On ``b``'s program: ``a``'s layouts of some inputs, until half the bytes per device
        ``a``'s save over ``b``'s (the largest savings first; and the optimizer's slots
        first, ZeRO's trade: the update alone reads them); and ``a``'s layouts over some of
        the mesh axes only, ``b``'s over the rest (sharded within a node and replicated
        across, as HSDP is), where that splits every input evenly.
        """
        k = self.at.get(b.remat)
        if k is None or not self._own(a) or not self._own(b) or not self.src.shapes:
            return []
        sizes = a.axis_sizes
        saves = {i: self.src.inputs[i] * (y.shard_fraction(sizes) - x.shard_fraction(sizes))
                 for i, (x, y) in enumerate(zip(a.inputs, b.inputs)) if x != y}
        saves = {i: s for i, s in saves.items() if s > 0}
        mixes: dict[str, dict[int, NdSbp]] = {}
        for first in (frozenset(), self.src.optimizer):
            run, taken = 0.0, []
            for i in sorted(saves, key=lambda i: (i not in first, -saves[i], i)):
                if run >= sum(saves.values()) / 2:
                    break
                run += saves[i]
                taken.append(i)
            mix = {**dict(enumerate(b.inputs)), **{i: a.inputs[i] for i in taken}}
            if taken and mix not in mixes.values():
                mixes[f"{len(taken)} inputs laid out as a leaner plan's" + (
                    ", the optimizer's first" if first else "")] = mix
        names = [n for n, _ in a.mesh_axes]
        for r in range(1, len(sizes)):
            for axes in itertools.combinations(range(len(sizes)), r):
                mix = {i: NdSbp(tuple(x.sbps[j] if j in axes else y.sbps[j]
                                      for j in range(len(sizes))))
                       for i, (x, y) in enumerate(zip(a.inputs, b.inputs))}
                if all(nd.fits(self.src.shapes[i], sizes) for i, nd in mix.items()) and \
                        mix not in mixes.values():
                    mixes[f"a leaner plan's layouts over {'+'.join(names[j] for j in axes)}"
                          ] = mix
        return self.place(k, mixes)


def _lands(plans: list[Plan], a: Plan, b: Plan) -> bool:
    """Some plan lies in the gap from ``a`` to ``b`` and beats ``a``'s step."""
    return any(_peak(a) < _peak(p) < _peak(b) and _time(p) < _time(a) for p in plans)


def _peak(plan: Plan) -> float:
    return plan.predicted.peak_memory


def _time(plan: Plan) -> float:
    return plan.predicted.step_time


def _leanest(solve: Callable[..., Plan], remat: tuple[int, ...], above: float = math.inf
             ) -> tuple[Plan | None, float]:
    """The leanest plan and its peak.

    The plan at the smallest budget one was found for (the search's leanest peak where
    planning at it succeeds, else the lean start's, which always does); no plan, and the
    peak the search named, where that is ``above`` or more.
    """
    try:
        plan = solve(1.0, remat)  # no plan fits a byte: the error names the leanest found
        return plan, _peak(plan)
    except MemoryBudgetError as exc:
        if exc.found >= above:
            return None, exc.found
        if exc.found < exc.needed:
            with contextlib.suppress(MemoryBudgetError):
                plan = solve(float(math.ceil(exc.found)), remat)
                return plan, _peak(plan)
        plan = solve(float(exc.needed), remat)
        return plan, _peak(plan)
