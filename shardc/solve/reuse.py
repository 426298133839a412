"""What solves of one cost graph at different memory budgets share, computed once.

A frontier (:mod:`shardc.tradeoff.frontier`) plans the same program on the same mesh at a dozen
budgets. Each solve used to build the cost graph anew and merge its followers (2.5 and 0.9
s of a 12-layer GPT-2 on (2, 4)), then place every seed and the lean plan on it and colour
its repeated layers again, though none of that depends on the budget: only the memory cuts
a solve adds do (:func:`shardc.solve.search.solve`). :class:`Reuse` keeps each problem's
merged cost graph and hands each solve a copy whose list of memory points is its own;
:class:`Starts` keeps what is derived from the merged graph before any cut. Every kept
value is what the solve would compute again, so a plan does not depend on what was solved
before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner
from shardc.ir.graph import Graph
from shardc.ir.sbp import NdSbp
from shardc.solve import descent
from shardc.solve.costgraph import CostGraph, Edge, check_cost_graph
from shardc.solve.fixed import Fixed
from shardc.solve.fold import colour_classes
from shardc.solve.memory import memory_profile
from shardc.solve.problem import BuildShare, build

__all__ = ["Reuse", "Starts", "exact_peak", "pin_inputs"]


class Starts:
    """Plans and facts of one merged cost graph that no memory cut changes: each seed's
    plans (:func:`descent.completions`, and its leanest, :meth:`seed_lean`), the lean plan
    (:func:`descent.lean`; it and a seed's leanest read the sampled memory points: asked
    for before any cut) and the repeated-layer classes
    (:func:`shardc.solve.fold.colour_classes`, from costs and edges only)."""

    def __init__(self, cg: CostGraph):
        self.cg = cg
        self._kept: dict[Any, Any] = {}

    def _get(self, key, make: Callable[[], Any]) -> Any:
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def _made_here(self, x: dict[int, int]) -> bool:
        """Whether ``x`` is a plan kept here (the lean plan, a seed's completions or its
        leanest)."""
        for key, kept in self._kept.items():
            plans = kept if isinstance(key, tuple) and key[0] == "seed" else (kept,)
            if any(x is y for y in plans):
                return True
        return False

    def peak(self, x: dict[int, int]) -> float:
        """The exact per-device peak of the plan ``x`` (every program point: no memory cut
        changes it), kept for the plans made here."""
        if not self._made_here(x):
            return exact_peak(self.cg, x)
        return self._get(("peak", id(x)), lambda: exact_peak(self.cg, x))

    def objective(self, x: dict[int, int]) -> float:
        """:func:`descent.objective` of ``x``, kept for the plans made here."""
        if not self._made_here(x):
            return descent.objective(self.cg, x)
        return self._get(("objective", id(x)), lambda: descent.objective(self.cg, x))

    def seed(self, layouts: Mapping[int, NdSbp]) -> list[dict[int, int]]:
        """A hand-written plan's completions (:func:`descent.completions`, cheapest
        first); none where no input keeps its layout."""
        def made() -> list[dict[int, int]]:
            inputs = descent.fixed_inputs(self.cg, layouts)
            return descent.completions(self.cg, inputs) if inputs else []
        return self._get(("seed", frozenset(layouts.items())), made)

    def lean(self) -> dict[int, int]:
        return self._get("lean", lambda: descent.lean(self.cg))

    def seed_lean(self, layouts: Mapping[int, NdSbp]) -> dict[int, int] | None:
        """A hand-written plan's leanest completion (:func:`descent.lean` with its input
        layouts kept); None where no input keeps its layout."""
        def made() -> dict[int, int] | None:
            inputs = descent.fixed_inputs(self.cg, layouts)
            return descent.lean(self.cg, inputs) if inputs else None
        return self._get(("seed-lean", frozenset(layouts.items())), made)

    def classes(self) -> dict[int, int]:
        return self._get("classes", lambda: colour_classes(self.cg))


def exact_peak(cg: CostGraph, x: dict[int, int]) -> float:
    """Exact per-device peak bytes of the plan ``x`` (every program point)."""
    return float(np.max(memory_profile(cg, cg.decode(x))))


def pin_inputs(base: CostGraph, layouts: Mapping[int, NdSbp]) -> CostGraph | None:
    """``base`` with graph input ``k`` cut to ``layouts[k]``: what
    :func:`shardc.solve.problem.build` makes with those inputs also fixed (their choices,
    feed costs, edge rows and bytes at the memory points are the same numbers, cut), without
    pricing the graph again. ``base`` may have its followers merged (a graph input never
    follows another node: it reads none), and a follower of a pinned input keeps its map's
    row for the input's layout: the merged graph of the pinned problem, except that a use
    which could follow the pinned layout but not every layout stays a node of its own
    (a choice more, not less). None where a layout is not one of its input's choices. The
    copy's lists, edges and memory points are its own (merging followers changes them in
    place); the rest is shared with ``base`` and read only."""
    keep: dict[int, list[int]] = {}
    for k, nd in layouts.items():
        if nd not in base.choices[k]:
            return None
        keep[k] = [base.choices[k].index(nd)]
    every = slice(None)
    edges = [Edge(e.u, e.v, e.cost[keep.get(e.u, every), :][:, keep.get(e.v, every)]
                  if e.u in keep or e.v in keep else e.cost, e.value, e.k, e.src)
             for e in base.edges]  # made whole, not by dataclasses.replace (5,000 a cut)
    out = dataclasses.replace(
        base,
        choices=[[ch[a] for a in keep[i]] if i in keep else ch
                 for i, ch in enumerate(base.choices)],
        cost=[c[keep.get(i, every)] for i, c in enumerate(base.cost)],
        edges=edges,
        memory=[{i: vec[keep.get(i, every)] for i, vec in point.items()}
                for point in base.memory],
        follows={v: (u, f[keep[u]] if u in keep else f) for v, (u, f) in base.follows.items()},
        fixed=dataclasses.replace(base.fixed, inputs={**base.fixed.inputs, **layouts}),
        adjacency=())
    check_cost_graph(out)
    return out


class Reuse:
    """Merged cost graphs by problem (graph, mesh, cluster, ties, fixed layouts, resident
    inputs, the backend's combiners), for one caller that solves the same problems at
    several budgets and places hand-written layouts of their inputs on them (keep it no
    longer than that: a large model's cost graph holds gigabytes)."""

    def __init__(self):
        self._built: dict[tuple, tuple[tuple, CostGraph, Starts]] = {}
        self._shares: dict[tuple, BuildShare] = {}

    def share(self, axis_sizes: Sequence[int], axis_names: Sequence[str], cluster: Cluster,
              combiner: Combiner = XLA_CPU) -> BuildShare:
        """What every build on this mesh, cluster and backend shares (:class:`BuildShare`:
        the programs a frontier builds are mostly the same ops)."""
        share = BuildShare(axis_sizes, axis_names, cluster, combiner)
        return self._shares.setdefault(share.key, share)

    def _merged(self, graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
                cluster: Cluster, ties: Sequence[tuple[int, int]], fixed: Fixed,
                resident: Collection[int], combiner: Combiner,
                offloaded: frozenset[int] = frozenset()) -> tuple[CostGraph, Starts]:
        """The problem's merged cost graph, built and merged on the first call, and its
        :class:`Starts`: not to be changed (callers take copies)."""
        held, key = _problem_key(graph, axis_sizes, axis_names, cluster, ties, fixed, resident)
        key = (*key, combiner, frozenset(offloaded))
        hit = self._built.get(key)
        if hit is None:
            cg = build(graph, axis_sizes, axis_names, cluster, ties, fixed=fixed,
                       resident=resident, combiner=combiner, offloaded=offloaded,
                       share=self.share(axis_sizes, axis_names, cluster, combiner))
            cg.merge_followers()
            hit = self._built[key] = (held, cg, Starts(cg))
        return hit[1], hit[2]

    def pinned(self, graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
               cluster: Cluster, ties: Sequence[tuple[int, int]], fixed: Fixed,
               resident: Collection[int], layouts: Mapping[int, NdSbp]) -> CostGraph:
        """The problem's cost graph (XLA:CPU's combiners, as :func:`build` by default) with
        the inputs ``layouts`` names fixed as well, followers merged: cut from the
        problem's merged graph, built once and shared with its solves
        (:func:`pin_inputs`; a frontier places a dozen layouts on each program, and merging
        each cut anew took half a second of the 12-layer GPT-2's 1.7 s per layout), or
        built anew where a layout is not among its input's choices. ``fixed`` wins where it
        names an input ``layouts`` names too."""
        base, _ = self._merged(graph, axis_sizes, axis_names, cluster, ties, fixed, resident,
                               XLA_CPU)
        extra = {k: nd for k, nd in layouts.items() if k not in fixed.inputs}
        cg = pin_inputs(base, extra)
        if cg is None:
            cg = build(graph, axis_sizes, axis_names, cluster, ties,
                       fixed=fixed.pinning(extra), resident=resident,
                       share=self.share(axis_sizes, axis_names, cluster))
            cg.merge_followers()
        return cg

    def cost_graph(self, graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
                   cluster: Cluster, ties: Sequence[tuple[int, int]], fixed: Fixed,
                   resident: Collection[int], combiner: Combiner = XLA_CPU,
                   offloaded: frozenset[int] = frozenset()) -> tuple[CostGraph, Starts]:
        """A copy of the problem's merged cost graph that a solve may add memory cuts to,
        and its :class:`Starts` (``combiner``: the backend's, as :func:`build` takes it;
        ``offloaded``: as :func:`build` takes it)."""
        cg, starts = self._merged(graph, axis_sizes, axis_names, cluster, ties, fixed,
                                  resident, combiner, offloaded)
        return dataclasses.replace(cg, memory=list(cg.memory)), starts


def _problem_key(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str],
                 cluster: Cluster, ties: Sequence[tuple[int, int]], fixed: Fixed,
                 resident: Collection[int]) -> tuple[tuple, tuple]:
    """``(held, key)``: the objects a problem's entry keeps alive (so that their ids, in the
    key, stay theirs) and the key :class:`Reuse` files its cost graphs under."""
    held = (graph, cluster, fixed)
    return held, (*map(id, held), tuple(axis_sizes), tuple(axis_names), tuple(ties),
                  frozenset(resident))
