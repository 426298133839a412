"""Building the cost graph (:class:`shardc.solve.costgraph.CostGraph`) of a program on a mesh.

:func:`build` makes one node per graph input (its choices: every even layout,
:func:`input_choices`; its cost: the host feed, :func:`feed_time`) and per op (its
choices: the rule's strategies, :func:`_op_strategies`; its cost: the compute), a settle node
per value read more than once, and one edge per producer→consumer value with its resharding
cost matrix; ties, a while's predicate, fixed and unreduced outputs add their conversions,
and the memory points come from :func:`shardc.solve.memory.memory_points`. Which ops may read
partial values (a scan's accumulators, :func:`accumulators`) is decided here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import jax.numpy as jnp
import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, Combiner, alpha_scales
from shardc.cost.kernels import compute_seconds
from shardc.cost.ring import ring_cost
from shardc.errors import LayoutError, OptionsError
from shardc.ir.flow import (
    carry_exit,
    loop_tests,
    loop_ties,
    read_runs,
    reads,
    settle_runs,
    unrolled_sums,
)
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.sbp import B, NdSbp, Partial, Split
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT
from shardc.rules.registry import strategies
from shardc.solve.costgraph import CostGraph, Edge, Settle, by_lists
from shardc.solve.fixed import NOTHING_FIXED, Fixed
from shardc.solve.memory import memory_points
from shardc.solve.reduced_ys import stacked_ys, whole_partial, ys_exits, ys_reduction, ys_shares

__all__ = ["accumulators", "build", "BuildShare", "feed_time", "input_choices", "input_cost"]


def input_choices(v: Value, axis_sizes: Sequence[int]) -> list[NdSbp]:
    """Every even layout of a graph input: broadcast or split on any dim, per axis (an axis
    of size 1 only broadcast: a split over one device is the same placement)."""
    per_axis = [B] + [Split(d) for d in range(v.ndim)]
    out = []
    for combo in itertools.product(*([B] if n == 1 else per_axis for n in axis_sizes)):
        nd = NdSbp(tuple(combo))
        if nd.fits(v.shape, axis_sizes):
            out.append(nd)
    return out


def feed_time(v: Value, nd: NdSbp, axis_sizes: Sequence[int], cluster: Cluster,
              carried: bool) -> float:
    """Host-to-device time of a graph input each step (zero for carried state)."""
    if carried:
        return 0.0
    return v.nbytes * nd.shard_fraction(axis_sizes) / cluster.host_bandwidth


def input_cost(cg: CostGraph, k: int, layouts: Sequence[NdSbp]) -> np.ndarray:
    """What passing graph input ``k`` costs each call in each of ``layouts``: nothing for
    the state (tied or resident: it stays on the devices) unless offloaded (its way to
    the devices and back each step), the conversion from where it
    is for an argument already placed on the mesh (:attr:`Fixed.placed`), else the host
    feed of its shard."""
    v = cg.graph.inputs[k]
    if k in cg.offloaded:  # to the devices and its new state back, at the host link's rate
        return np.array([2 * feed_time(v, nd, cg.axis_sizes, cg.cluster, False)
                         for nd in layouts])
    if k in cg.carried or k in cg.resident:
        return np.zeros(len(layouts))
    if k in cg.fixed.placed:
        return cg.reshard_matrix([cg.fixed.placed[k]], layouts, v.nbytes)[0]
    return np.array([feed_time(v, nd, cg.axis_sizes, cg.cluster, False) for nd in layouts])


def _unsplit(strats: list, axes: Collection[int]) -> list:
    """The strategies whose first result's leading dim no axis of ``axes`` splits (all of
    them where none is)."""
    kept = [s for s in strats if not any(isinstance(s.outs[0].sbps[i], Split)
                                         and s.outs[0].sbps[i].dim == 0 for i in axes)]
    return kept or strats


def _whole(strats: list, ins: Sequence[Collection[int]], outs: Sequence[Collection[int]]
           ) -> list:
    """The strategies that split none of the dims ``ins`` (per input) and ``outs`` (per
    output) name (all of them where none is left)."""
    def splits(nds, dims) -> bool:
        return any(isinstance(s, Split) and s.dim in d
                   for nd, d in zip(nds, dims) for s in nd.sbps)

    kept = [s for s in strats if not splits(s.ins, ins) and not splits(s.outs, outs)]
    return kept or strats


def _unreduce(nd: NdSbp) -> NdSbp:
    return NdSbp(tuple(B if isinstance(s, Partial) else s for s in nd.sbps))


class BuildShare:
    """What builds of different programs on one mesh, cluster and backend share (a frontier
    builds a dozen programs that recompute different forward segments, each mostly the same
    ops): each op signature's strategy list, each input shape's layouts, the conversions,
    and the edge cost matrices between those lists and where their layouts agree (found again
    by the lists' identity, which the entry keeps alive). Every kept value is what a build
    would compute again; the share grows with each build (a pinned input's one-layout
    list is new per build) for as long as its owner keeps it (a frontier's ``Reuse``)."""

    __slots__ = ("key", "strategies", "layouts", "conversions", "matrices", "agreements",
                 "ringless")

    def __init__(self, axis_sizes: Sequence[int], axis_names: Sequence[str], cluster: Cluster,
                 combiner: Combiner = XLA_CPU):
        self.key = (tuple(axis_sizes), tuple(axis_names), cluster, combiner)
        self.strategies: dict = {}
        self.layouts: dict = {}
        self.conversions: dict = {}
        self.matrices: dict = {}
        self.agreements: dict = {}
        self.ringless: dict = {}


def build(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str], cluster: Cluster,
          ties: Sequence[tuple[int, int]] = (), *, fixed: Fixed = NOTHING_FIXED,
          resident: Collection[int] = (), combiner: Combiner = XLA_CPU,
          share: BuildShare | None = None, offloaded: Collection[int] = ()) -> CostGraph:
    """Build the cost graph. ``ties`` pairs (output index, input index) whose layouts should
    agree (a train step's new state feeds the next step's state). ``fixed`` pins graph
    inputs and outputs to one layout each. The tied inputs and the ``resident`` ones stay
    on the devices between calls; every other input pays its host feed. ``combiner``: the
    backend's, whose combined collectives share latencies (:func:`alpha_scales`).
    ``share``: what other builds on this mesh, cluster and backend computed
    (:class:`BuildShare`). ``offloaded``: tied inputs kept in host memory between steps,
    moved to the devices and their new state back each step (:func:`input_cost`), held on
    the devices only while used (:func:`shardc.solve.lifetimes.offloaded_spans`)."""
    axis_sizes, axis_names = tuple(axis_sizes), tuple(axis_names)
    cg, share = _empty(graph, axis_sizes, axis_names, cluster, ties, fixed, resident,
                       combiner, share, offloaded)
    _add_inputs(cg, fixed, share.layouts)
    wiring = _Wiring(cg, share, combiner)
    shared = wiring.shared_values()
    _add_ops(cg, wiring, fixed, share)
    _add_settles(cg, wiring, shared)
    _add_loops(cg, wiring)
    after = {cg.producer[val.id][0]: [] for val in shared}
    for val in shared:
        after[cg.producer[val.id][0]].append(cg.settle[val.id])
    cg.order = [j for i in range(wiring.first_settle) for j in (i, *after.get(i, ()))]
    _add_outputs(cg, wiring, ties, fixed)
    cg.memory = memory_points(cg)
    return cg


def _empty(graph: Graph, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
           cluster: Cluster, ties, fixed: Fixed, resident, combiner: Combiner,
           share: BuildShare | None, offloaded) -> tuple[CostGraph, BuildShare]:
    """The cost graph with no nodes yet, its state and pins set, and the share to build with
    (a new one where none is given; one made for another mesh is refused)."""
    if share is None:
        share = BuildShare(axis_sizes, axis_names, cluster, combiner)
    elif share.key != (axis_sizes, axis_names, cluster, combiner):
        raise OptionsError(f"build: a BuildShare made for {share.key[:2]} and its cluster and "
                           f"combiner, asked for {(axis_sizes, axis_names)}: make one per mesh, "
                           "cluster and combiner")
    cg = CostGraph(graph, axis_sizes, axis_names, cluster, combined=combiner.kinds,
                   conversions=share.conversions, agreements=share.agreements)
    carried = {i for _, i in ties}
    cg.carried = carried
    cg.resident = set(resident)
    cg.offloaded = frozenset(offloaded)
    if not cg.offloaded <= carried:
        raise OptionsError(f"build: only state tied to an output can be offloaded, not inputs "
                           f"{sorted(cg.offloaded - carried)}")
    cg.ties = list(ties)
    cg.fixed = fixed
    return cg, share


def _add_inputs(cg: CostGraph, fixed: Fixed, layouts: dict) -> None:
    """A node per graph input: its pinned layout, the allowed ones, or every even one."""
    axis_sizes = cg.axis_sizes
    for k, v in enumerate(cg.graph.inputs):
        cg.producer[v.id] = (len(cg.choices), 0)
        if k in fixed.inputs:
            cg.choices.append([fixed.inputs[k]])
        elif k in fixed.among:
            allowed = [nd for nd in fixed.among[k] if nd.fits(v.shape, axis_sizes)]
            if not allowed:
                raise LayoutError(f"Fixed.among[{k}]: none of the layouts given for input {k} "
                                  f"({v.type_str()}) fits it on a mesh of {axis_sizes}; give "
                                  "at least one that divides its shape")
            cg.choices.append(allowed)
        else:
            if v.shape not in layouts:
                layouts[v.shape] = input_choices(v, axis_sizes)
            cg.choices.append(layouts[v.shape])
        cg.refs.append(v)
        cg.cost.append(input_cost(cg, k, cg.choices[-1]))


class _Wiring:
    """How a build reads values: from a shared value's settle node or its producer, through
    conversion matrices shared by identical edges (repeated layers share one)."""

    def __init__(self, cg: CostGraph, share: BuildShare, combiner: Combiner):
        graph = cg.graph
        self.cg, self.layouts, self.matrices = cg, share.layouts, share.matrices
        self.scale = alpha_scales(graph, combiner)
        self.ties_in = loop_ties(graph)
        self.first_settle = len(graph.inputs) + len(graph.ops)
        self.runs = graph.runs()
        self.folded = graph.constants()

    def shared_values(self) -> list[Value]:
        """The values read more than once (each gets a settle node, numbered in
        ``cg.settle``)."""
        graph, uses = self.cg.graph, {}
        # a carry's exit reads the loop-carried value as made (:func:`carry_exit`), so it
        # does not make that value shared: an accumulator read once in the body may stay
        # partial
        read = [v for op in graph.ops if not carry_exit(op) for _, v in reads(op)] + \
            [v for _, v in self.ties_in]
        for val in read + list(graph.outputs):
            if not val.is_const:
                uses[val.id] = uses.get(val.id, 0) + 1
        shared = [v for v in graph.values() if uses.get(v.id, 0) > 1]
        self.cg.settle = {v.id: self.first_settle + k for k, v in enumerate(shared)}
        return shared

    def source(self, val: Value) -> tuple[int, int]:
        """(node, slot) its uses read ``val`` from: its settle node, else its producer."""
        cg = self.cg
        return (cg.settle[val.id], 0) if val.id in cg.settle else cg.producer[val.id]

    def own_matrix(self, u: int, slot: int, w: int, val: Value) -> np.ndarray:
        """The matrix converting ``val`` from ``(u, slot)``'s layouts to node ``w``'s own
        (a settle's, a tied input's), kept as an op's reads are."""
        cg, a_scale = self.cg, self.scale.get(val.id, 1.0)
        return by_lists(self.matrices, (cg.choices[u], cg.choices[w]),
                        (slot, "own", val.nbytes, a_scale),
                        lambda: cg.reshard_matrix(cg.out_sbps(u, slot), cg.choices[w],
                                                  val.nbytes, a_scale))

    def fix(self, u: int, slot: int, val: Value, dst: list) -> np.ndarray:
        """The matrix converting ``val`` from ``(u, slot)``'s layouts to ``dst``."""
        return self.cg.reshard_matrix(self.cg.out_sbps(u, slot), dst, val.nbytes,
                                      self.scale.get(val.id, 1.0))

    def edge(self, u: int, slot: int, val: Value, v: int, k: int, dst, dst_owner,
             times: int) -> Edge:
        """The edge reading ``val`` from ``(u, slot)`` into node ``v``'s slot ``k``, its
        conversion run ``times`` per call."""
        cg = self.cg
        if u >= self.first_settle:
            owner = src = _settle_choices(val, cg.axis_sizes, self.layouts)
        else:
            owner, src = cg.choices[u], cg.out_sbps(u, slot)
        a_scale = self.scale.get(val.id, 1.0)
        mat = by_lists(self.matrices, (owner, dst_owner), (slot, k, val.nbytes, a_scale),
                       cg.reshard_matrix, src, dst, val.nbytes, a_scale)
        if val.id in self.folded:  # a constant read partial is made so: no reduction to undo
            mat = np.where([d.has_partial for d in dst], 0.0, mat)
        return Edge(u, v, mat * times, val, k, (u, slot))


def _add_ops(cg: CostGraph, wiring: _Wiring, fixed: Fixed, share: BuildShare) -> None:
    """A node per op (its strategies, their compute) and an edge per value it reads."""
    graph, axis_sizes, axis_names = cg.graph, cg.axis_sizes, cg.axis_names
    reduced_ys = ys_exits(graph)
    ys_share = ys_shares(graph, reduced_ys)
    op_strategies = graph.memo(("strategies", axis_sizes, axis_names),
                               lambda g: _op_strategies(g, axis_sizes, axis_names,
                                                        share.strategies))
    for op, strats in zip(graph.ops, op_strategies):
        if op.id in fixed.unsplit:
            strats = _unsplit(strats, fixed.unsplit[op.id])
        if op.id in fixed.whole:
            strats = _whole(strats, *fixed.whole[op.id])
        if not cg.cluster.overlap:  # a ring's sends paid in full: NCCL's all-gather is cheaper
            strats = _ringless(strats, share)
        node = len(cg.choices)
        cg.choices.append(strats)
        cg.refs.append(op)
        cg.cost.append(np.array([_op_seconds(cg, op, s) for s in strats]))
        if op.id in reduced_ys:  # a ys reduced after the loop: one all-reduce of the stack
            cg.cost[-1] = cg.cost[-1] + ys_reduction(cg, strats, op.outputs[0],
                                                     ys_share[op.outputs[0].id])
        for slot, out in enumerate(op.outputs):
            cg.producer[out.id] = (node, slot)
        for k, val in reads(op):
            if not val.is_const:
                u, slot = cg.producer[val.id] if carry_exit(op) else wiring.source(val)
                cg.edges.append(wiring.edge(u, slot, val, node, k, [s.ins[k] for s in strats],
                                            strats, read_runs(wiring.runs, val, op)))


def _ringless(strats: list, share: BuildShare) -> list:
    """``strats`` without its ring strategies, one list per list (kept by identity, as
    :func:`~shardc.solve.costgraph.by_lists` keeps its entries, so the ops that shared a
    list share its ringless one and the caches keyed by lists still hit)."""
    hit = share.ringless.get(id(strats))
    if hit is None or hit[0] is not strats:
        kept = [s for s in strats if not s.ring]
        hit = share.ringless[id(strats)] = (strats, kept if len(kept) < len(strats) else strats)
    return hit[1]


def _op_seconds(cg: CostGraph, op: Op, strategy) -> float:
    """Seconds of ``op`` under ``strategy``: its compute, and its ring's sends beyond it
    (:func:`shardc.cost.ring.ring_cost`)."""
    seconds = compute_seconds(cg.cluster, cg.graph, op, strategy.flops) * op.weight
    ring = ring_cost(cg.cluster, cg.graph, op, strategy, cg.axis_sizes, cg.axis_names)
    return seconds if ring is None else seconds + ring.seconds


def _add_settles(cg: CostGraph, wiring: _Wiring, shared: list[Value]) -> None:
    """A settle node per shared value, with the edge from its producer."""
    settling = settle_runs(cg.graph)
    for val in shared:
        w = len(cg.choices)
        u, slot = cg.producer[val.id]
        cg.choices.append(_settle_choices(val, cg.axis_sizes, wiring.layouts))
        cg.refs.append(Settle(val))
        cg.cost.append(np.zeros(len(cg.choices[w])))
        cg.edges.append(Edge(u, w, wiring.own_matrix(u, slot, w, val)
                             * settling.get(val.id, 1), val, 0, (u, slot)))


def _add_loops(cg: CostGraph, wiring: _Wiring) -> None:
    """A loop body's carry converted back every iteration; a while's predicate whole."""
    runs = wiring.runs
    for enter, val in wiring.ties_in:  # the body's carry, converted back every iteration
        u, slot = wiring.source(val)
        v = cg.producer[enter.outputs[0].id][0]
        cg.edges.append(wiring.edge(u, slot, val, v, -1, [s.outs[0] for s in cg.choices[v]],
                                    cg.choices[v], runs.get(val.id, 1)))
    whole = NdSbp((B,) * len(cg.axis_sizes))
    for val in loop_tests(cg.graph):  # a while's predicate: every device runs alike
        u, slot = wiring.source(val)
        cg.cost[u] = cg.cost[u] + wiring.fix(u, slot, val, [whole])[:, 0] * runs.get(val.id, 1)


def _add_outputs(cg: CostGraph, wiring: _Wiring, ties, fixed: Fixed) -> None:
    """Each graph output's conversion: to its fixed layout, to its tied input's (an edge),
    else out of partial sums."""
    tied = dict(ties)
    for j, val in enumerate(cg.graph.outputs):
        if val.is_const:
            continue
        u, slot = wiring.source(val)
        src = cg.out_sbps(u, slot)
        if j in fixed.outputs:  # converted to the layout its type fixes
            cg.cost[u] = cg.cost[u] + wiring.fix(u, slot, val, [fixed.outputs[j]])[:, 0]
        elif j in tied:
            t = tied[j]
            if t != u and (val.id not in cg.settle or cg.producer[val.id][0] != t):
                cg.edges.append(Edge(u, t, wiring.own_matrix(u, slot, t, val), val,
                                     src=(u, slot)))
        else:
            fix = wiring.fix(u, slot, val, [_unreduce(s) for s in src])
            cg.cost[u] = cg.cost[u] + np.diag(fix)


def _op_strategies(graph: Graph, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
                   cache: dict) -> list[list]:
    """Each op's strategies on the mesh (:func:`shardc.rules.registry.strategies`), one
    list shared by the ops of one signature (in ``cache``, for this mesh: shared with other
    programs' builds); a ys reduced after its loop keeps those that read it whole or
    partial. Kept per graph and mesh (:meth:`Graph.memo`): a frontier builds the cost graph
    of one program many times."""
    consume = accumulators(graph)
    reduced_ys = ys_exits(graph)
    out = []
    for op in graph.ops:
        key = _op_key(op)
        if key is not None:
            key = (key, op.id in consume, op.id in reduced_ys)
        strats = cache.get(key) if key is not None else None
        if strats is None:
            strats = strategies(op, axis_sizes, axis_names, consume_partial=op.id in consume)
            if op.id in reduced_ys:
                strats = [s for s in strats if whole_partial(s.ins[0], axis_sizes)]
            if key is not None:
                cache[key] = strats
        out.append(strats)
    return out


def accumulators(graph: Graph) -> set[int]:
    """Ids of the ops that may read partial values: a scan's accumulator carries (a float
    carry the body only adds to: ``acc + g``) with their exits, and the body's own ops that feed
    the carry's next value. There the lowering keeps partial sums apart per device
    (``lower/stacking.py``), so micro-batches' partial gradients are reduced once after the loop,
    not every iteration; each op's rule still decides which partial reads are exact.
    Elsewhere XLA reduces a partial value before its next use, so a plan must not count on
    reading one (:func:`shardc.rules.registry.strategies`)."""
    out: set[int] = set()
    users = graph.consumers()
    for enter, tie in loop_ties(graph):
        if enter.params.get("loop") == "while":
            continue  # its carries are never held partial (``rules/control.py``)
        acc = enter.outputs[0]
        depth = len(enter.where) + 1  # the body's own ops, not those of calls inside it
        if not (jnp.issubdtype(acc.dtype, jnp.inexact) and _adds_to(tie, acc, depth)):
            continue
        if any(not carry_exit(op) and (op.name not in ("add", "add_any", "sub") or
                                       op.name == "sub" and k == 1)
               for op, k in users.get(acc.id, ())):
            continue  # read by other work too (a residual stream's gradient): not an accumulator
        out.add(enter.id)
        todo = [tie]
        while todo:
            op = todo.pop().producer
            if op is None or op.id in out or len(op.where) != depth or \
                    op.prim in (SCAN_ENTER, SCAN_EXIT):
                continue
            out.add(op.id)
            todo.extend(v for v in op.inputs if not v.is_const)
    for op in graph.ops:
        if carry_exit(op) and op.params["enter"].producer.id in out:
            out.add(op.id)
    out |= stacked_ys(graph) | unrolled_sums(graph)
    return out


def _adds_to(v: Value, acc: Value, depth: int) -> bool:
    """``v`` is ``acc`` plus terms: a tree of adds (``add``, ``add_any``, the left operand
    of ``sub``) of the body's own ops with ``acc`` among its leaves."""
    todo = [v]
    while todo:
        v = todo.pop()
        if v is acc:
            return True
        op = v.producer
        if op is not None and len(op.where) == depth and op.name in ("add", "add_any", "sub"):
            todo.extend(op.inputs[:1] if op.name == "sub" else op.inputs)
    return False


def _settle_choices(v: Value, axis_sizes: Sequence[int], layouts: dict) -> list[NdSbp]:
    """The layouts a shared value may settle in: every even one but partial (one list per
    shape, shared like the graph inputs')."""
    if v.shape not in layouts:
        layouts[v.shape] = input_choices(v, axis_sizes)
    return layouts[v.shape]


def _op_key(op: Op):
    try:
        params = tuple(sorted((k, repr(v)) for k, v in op.params.items()))
    except Exception:  # noqa: BLE001 - unprintable params: do not cache
        return None
    # the dtypes as they are (hashable; numpy's ``str`` of a dtype is Python code, 20,000
    # calls a frontier's program)
    ins = tuple((v.shape, v.dtype, v.is_const) for v in op.inputs)
    outs = tuple((v.shape, v.dtype) for v in op.outputs)
    return op.name, ins, outs, params
