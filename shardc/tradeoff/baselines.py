"""What the usual hand-written layouts would cost this program, on the plan's own cost model:
the margins ``explain`` prints beside the plan (``step.margins(*args)``).

The layouts are generic, derived from the program's arguments alone (no logical axis names,
which a plain JAX program does not have; the bench's experts in
:mod:`shardc.bench.experts` use the zoo's). The *state* is the arguments the step returns
updated (its ties; without any, the first positional argument), the *data* every other
argument:

- **data parallel**: state replicated, data split on its first dim over all mesh axes;
- **FSDP**: each state leaf split on its largest dim that the device count divides, data
  as in data parallel;
- **Megatron TP**: 2-D state leaves split alternately on their columns and rows over all
  axes (in argument order; optimizer slots that repeat the parameters' shapes in the same
  order get their parameter's split), other state replicated, data replicated;
- **DP x TP** (a mesh of two or more axes): Megatron's split over the last axis, data split
  over the others;
- **ZeRO-1** (a state with optimizer slots: inputs only the update reads): data parallel
  with those slots split as FSDP splits them.

A split that does not divide a dim evenly is left out (that leaf replicated). Each layout
fixes the graph inputs only. Where the mesh has devices, each layout is compiled as a user
would write it (``jax.jit`` with those input shardings, XLA placing the rest) and the plan's
own program too, and both are priced from the compiled HLO (:func:`shardc.inspect.price`,
the plan's cluster) plus the host feed of their inputs: a plan that compiles to data
parallelism's program reads 1.00x of it. On an abstract mesh (nothing to compile) the rest
of the program is placed as a seed is (:func:`shardc.solve.descent.from_inputs`: the
optimizer tail backwards from the state, the rest greedy in program order, then coordinate
descent) and priced by :func:`shardc.plan.assemble.assemble`, like the plan itself: the table says
these are estimates.

References:
  ZeRO-1 and ZeRO-3 / FSDP (Rajbhandari et al. 2020); Megatron-LM (Shoeybi et al. 2019) column/row
  split pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from shardc.cost.cluster import Cluster
from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.flow import tail_values
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Split
from shardc.plan.assemble import assemble
from shardc.plan.record import Plan, Predicted
from shardc.solve import descent
from shardc.solve.collector import gc_paused
from shardc.solve.fixed import NOTHING_FIXED, Fixed
from shardc.solve.problem import build
from shardc.solve.reuse import Reuse
from shardc.solve.search import Status
from shardc.util.tables import Table

__all__ = ["Baseline", "Margins", "generic_layouts", "layout_plan", "margins", "optimizer_state"]

CAPTION = ("generic layouts: DP replicates the state (the arguments the step returns "
           "updated) and splits the data's first dim; FSDP splits each state leaf's largest "
           "divisible dim; Megatron splits 2-D state leaves alternately by column and row, "
           "data whole; DP x TP: Megatron over the last axis, data over the rest; ZeRO-1: "
           "DP with the optimizer slots split as FSDP splits them. ")
HOW = {"compiled": "Each compiled with jax.jit from its input shardings, and this plan's "
                   "program, priced from the compiled HLO on the plan's cluster (+ input feed).",
       "estimate": "Estimates (an abstract mesh: nothing to compile): between the fixed "
                   "inputs the program is placed as a seed is (greedy from the inputs, then "
                   "coordinate descent) and priced on the plan's cost model."}
#: compiles the program with these input layouts (None: the plan's own program) and prices it
Compile = Callable[[dict[int, NdSbp] | None], Predicted]


@dataclass(frozen=True)
class Baseline:
    name: str
    axes: str  # the mesh axes it uses, as text
    predicted: Predicted | None  # None: not expressible on this mesh (``note`` says why)
    note: str = ""


@dataclass(frozen=True)
class Margins:
    """The plan's predicted step beside the generic layouts'."""

    step_time: float
    peak_memory: float
    baselines: tuple[Baseline, ...]
    source: str = "estimate"  # "compiled": every step priced from its compiled program

    def ratio(self, name: str) -> float | None:
        """This plan's predicted step over ``name``'s (0.74: 26% faster than it)."""
        b = next(b for b in self.baselines if b.name == name)
        return None if b.predicted is None else self.step_time / b.predicted.step_time

    def table(self) -> Table:
        rows = [("this plan", "", fmt_time(self.step_time), fmt_bytes(self.peak_memory), "")]
        for b in self.baselines:
            if b.predicted is None:
                rows.append((b.name, b.axes, "-", "-", b.note))
                continue
            rows.append((b.name, b.axes, fmt_time(b.predicted.step_time),
                         fmt_bytes(b.predicted.peak_memory),
                         f"this plan {self.ratio(b.name):.2f}x of {b.name}"))
        title = ("margins (compiled step per layout):" if self.source == "compiled" else
                 "margins (estimated step per layout, same cost model):")
        return Table(title, ("layout", "over", "step", "peak memory", "margin"), tuple(rows),
                     align="<<>><", header=False, indent=2,
                     caption=CAPTION + HOW[self.source])

    def __str__(self) -> str:
        return "\n".join(self.table().text())


def _split(shape: Sequence[int], dim: int | None, axes: Sequence[int],
           sizes: Sequence[int]) -> NdSbp:
    """``dim`` split over mesh ``axes`` if they divide it evenly, else replicated."""
    sbps = [B] * len(sizes)
    if dim is not None and axes and shape[dim] % math.prod(sizes[a] for a in axes) == 0:
        for a in axes:
            sbps[a] = Split(dim)
    return NdSbp(tuple(sbps))


def _largest(shape: Sequence[int], n: int) -> int | None:
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    return max(dims, key=lambda d: shape[d]) if dims else None


def _columns_rows(shapes: list[tuple[int, ...]]) -> list[int]:
    """Megatron's split dim per 2-D leaf: columns (1) and rows (0) alternately, counted
    within the shortest repeating run of shapes (the parameters, then optimizer slots
    shaped like them, split alike)."""
    n = len(shapes)
    period = next(p for p in range(1, n + 1)
                  if n % p == 0 and shapes == shapes[:p] * (n // p)) if n else 1
    return [1 - (k % period) % 2 for k in range(n)]


def optimizer_state(graph: Graph, state: Collection[int]) -> set[int]:
    """The state inputs that only the update reads (no forward or backward equation: an
    optimizer's moments and step count), which ZeRO-1 shards."""
    tail = tail_values(graph)
    return {k for k in state if graph.inputs[k].id in tail}


def generic_layouts(shapes: Sequence[tuple[int, ...]], state: set[int],
                    sizes: Sequence[int], optimizer: Collection[int] = ()
                    ) -> dict[str, dict[int, NdSbp] | str]:
    """Per baseline, the layout of every graph input (by flat index), or why the mesh
    cannot express it; ZeRO-1 where the state has ``optimizer`` inputs
    (:func:`optimizer_state`)."""
    every = list(range(len(sizes)))
    n = math.prod(sizes)
    data = [k for k in range(len(shapes)) if k not in state]

    def batch(axes) -> dict[int, NdSbp]:
        return {k: _split(shapes[k], 0 if shapes[k] else None, axes, sizes) for k in data}

    rep = {k: NdSbp((B,) * len(sizes)) for k in state}
    matrices = [k for k in sorted(state) if len(shapes[k]) == 2]
    cols_rows = dict(zip(matrices, _columns_rows([shapes[k] for k in matrices])))

    def megatron(axes) -> dict[int, NdSbp]:
        return {**rep, **{k: _split(shapes[k], d, axes, sizes) for k, d in cols_rows.items()}}

    out: dict[str, dict[int, NdSbp] | str] = {
        "data parallel": {**rep, **batch(every)},
        "FSDP": {**{k: _split(shapes[k], _largest(shapes[k], n), every, sizes)
                    for k in state}, **batch(every)},
        "Megatron TP": {**megatron(every), **batch([])},
    }
    out["DP x TP"] = {**megatron(every[-1:]), **batch(every[:-1])} if len(sizes) > 1 else \
        "needs a mesh of two or more axes"
    if optimizer:
        out["ZeRO-1"] = {**rep, **{k: _split(shapes[k], _largest(shapes[k], n), every, sizes)
                                   for k in optimizer}, **batch(every)}
    return out


def margins(graph: Graph, ties: Sequence[tuple[int, int]], plan: Plan,
            state: set[int] | None = None, compile: Compile | None = None,
            resident: Sequence[int] = ()) -> Margins:
    """``plan``'s step beside each generic layout's (module docstring) for the program
    ``graph`` with ``ties`` (output, input) on the plan's mesh and cluster; the state is
    the tied inputs unless ``state`` names them. With ``compile`` (a mesh with devices)
    every step is priced from its compiled program, else estimated on the plan's model;
    ``resident`` inputs (besides the tied ones) pay no host feed, as in the plan."""
    sizes, names = plan.axis_sizes, plan.axis_names
    state = set(state) if state is not None else {i for _, i in ties}
    shapes = [v.shape for v in graph.inputs]
    every = "+".join(names)
    over = {"data parallel": every, "FSDP": every, "Megatron TP": every, "ZeRO-1": every,
            "DP x TP": f"dp {'+'.join(names[:-1])}, tp {names[-1]}"}
    out = []
    for name, layouts in generic_layouts(shapes, state, sizes,
                                         optimizer_state(graph, state)).items():
        if isinstance(layouts, str):
            out.append(Baseline(name, "", None, layouts))
        elif compile is not None:
            out.append(Baseline(name, over[name], compile(layouts)))
        else:
            out.append(Baseline(name, over[name],
                                _estimate(graph, ties, plan, layouts, resident)))
    if compile is None:
        return Margins(plan.predicted.step_time, plan.predicted.peak_memory, tuple(out))
    mine = compile(None)
    return Margins(mine.step_time, mine.peak_memory, tuple(out), "compiled")


def _estimate(graph: Graph, ties: Sequence[tuple[int, int]], plan: Plan,
              layouts: dict[int, NdSbp], resident: Sequence[int]) -> Predicted:
    return layout_plan(graph, ties, plan.axis_sizes, plan.axis_names, plan.cluster, layouts,
                       resident=resident).predicted


@gc_paused()
def layout_plan(graph: Graph, ties: Sequence[tuple[int, int]], sizes: Sequence[int],
                names: Sequence[str], cluster: Cluster, layouts: Mapping[int, NdSbp],
                fixed: Fixed = NOTHING_FIXED, resident: Sequence[int] = (),
                remat: tuple[int, ...] = (), segments: int = 0, name: str = "",
                reuse: Reuse | None = None) -> Plan:
    """The plan a hand-written layout of the graph inputs leads to without a search:
    ``layouts`` pinned (``fixed`` too, which wins where both name an input), the rest placed
    as a seed is (greedy from the inputs, then coordinate descent) and priced by
    :func:`shardc.plan.assemble.assemble`, for ``graph``, a program that recomputes its forward
    segments ``remat`` of ``segments``; its solver record names the layout ``name``. A plan
    that runs: what the margins estimate, and
    what the frontier (:mod:`shardc.tradeoff.frontier`) holds beside its searched plans.
    ``reuse``: the problem's cost graph is built once there for every layout placed on it
    (:meth:`shardc.solve.reuse.Reuse.pinned`: the same graph, cut)."""
    pinned = fixed.pinning(layouts)
    if reuse is None:
        cg = build(graph, tuple(sizes), tuple(names), cluster, ties, fixed=pinned,
                   resident=resident)
        cg.merge_followers()
    else:  # merged already
        cg = reuse.pinned(graph, tuple(sizes), tuple(names), cluster, ties, fixed, resident,
                          layouts)
    x = descent.from_inputs(cg, pinned.inputs)
    if x is None:  # no input kept a layout of its own (every one merged into a use)
        x = descent.solve(cg)
    return assemble(graph, cg, cg.decode(x), ties,
                    {"status": Status.DESCENT_ONLY.value, "seed": name}, remat, segments)
