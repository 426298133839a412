"""The cost graph the solvers work on.

One node per graph input (its choices: the NdSbps it may be laid out with) and per op (its
choices: the rule's strategies); one edge per producer→consumer value with a resharding
cost matrix ``R[a, b]`` (seconds). Memory is a list of sampled program points, each a sum of
per-node, per-choice byte vectors that must stay under the budget (:mod:`shardc.solve.memory`).

``merge_followers`` shrinks the problem before any search:

* an op whose inputs all come from one node *follows* it (Alpa): it takes the operand's
  layout as it is where a strategy allows (else its cheapest), so elementwise / reshape /
  transpose / softmax chains add no variables;
* an op with no inputs from other nodes (iota, broadcast constants) is absorbed into its only
  consumer, choosing its best layout per consumer choice (exact: nothing else depends on it).

References:
  Alpa (OSDI'22) §4.2 ILP formulation and follow-merging; OneFlow ``sbp_graph.cpp``
  (eliminating single-input nodes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from shardc.cost.cluster import Cluster
from shardc.cost.combine import alpha_scales
from shardc.cost.comm import Conversion, conversion
from shardc.ir.flow import carry_exit, loop_tests, loop_ties, read_runs, reads, unrolled_sums
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.sbp import B, Broadcast, NdSbp, Partial, Split
from shardc.ir.trace import SCAN_ENTER, SCAN_EXIT
from shardc.rules.registry import strategies
from shardc.solve.memory import memory_points
from shardc.solve.reduced_ys import stacked_ys, whole_partial, ys_exits, ys_reduction, ys_shares


@dataclass
class Edge:
    u: int
    v: int
    cost: np.ndarray  # [len(choices[u]), len(choices[v])] seconds
    value: Value
    k: int = -1  # which input of the consumer op (-1: a tie back to a graph input)
    src: tuple[int, int] = (-1, 0)  # the (node, slot) whose layouts the rows are


@dataclass(frozen=True, eq=False)
class Settle:
    """The layout a value used more than once is converted to, once, before its uses.

    Every use of a value in the same layout reads one conversion (XLA emits one all-reduce of
    a gradient that two optimizer slots read, one all-gather of a parameter that the forward
    and the backward pass read); pricing each use's conversion alone would charge it per
    use. A settle node chooses that shared layout (never partial); its uses convert from it.
    """

    value: Value


@dataclass(frozen=True)
class Fixed:
    """Layouts a plan must keep, by graph input and output index: placed arguments the user
    asked to keep, and results whose type fixes their layout (Explicit mesh axes)."""

    inputs: Mapping[int, NdSbp] = field(default_factory=dict)
    outputs: Mapping[int, NdSbp] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)


#: the default: nothing pinned
NOTHING_FIXED = Fixed()


@dataclass
class CostGraph:
    graph: Graph
    axis_sizes: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: Cluster
    choices: list[list] = field(default_factory=list)  # NdSbp (inputs) or Strategy (ops)
    refs: list = field(default_factory=list)  # graph input Value or Op per node
    cost: list[np.ndarray] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    memory: list[dict[int, np.ndarray]] = field(default_factory=list)  # per sampled point
    producer: dict[int, tuple[int, int]] = field(default_factory=dict)  # value id -> node, slot
    follows: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # v -> (u, f[a])
    spans: list = field(default_factory=list)  # (first, last program point, node, slot, bytes)
    stack_spans: list = field(default_factory=list)  # (first, last, enter, node, slot, bytes)
    ys_spans: list = field(default_factory=list)  # (first, last, ys exit node, bytes)
    results: set = field(default_factory=set)  # indices of spans holding a graph result
    #: (t, op node, input k, node, slot, bytes, value id, made) per operand read, ``made``
    #: the program point that makes the value and ``combined`` whether its collectives join
    #: XLA's combined tuple collective (a tail value's: see ``cost/combine.py``)
    read_spans: list = field(default_factory=list)
    settle_spans: list = field(default_factory=list)  # (first, last, settle, node, slot, bytes)
    #: (ids of the values XLA fuses into their readers, value id -> its last read before a
    #: fused reader extends it, value id -> the program point making it): ``solve/memory.py``
    fusion: tuple = (frozenset(), {}, {})
    conversions: dict = field(default_factory=dict)  # (src, dst) -> Conversion
    terms: dict = field(default_factory=dict)  # (srcs, dsts) -> reshard_matrix's cost terms
    carried: set = field(default_factory=set)  # input nodes tied to an output (the state)
    resident: set = field(default_factory=set)  # other inputs kept on the devices: no feed
    settle: dict = field(default_factory=dict)  # value id -> its Settle node
    order: list = field(default_factory=list)  # every node, producers before their uses
    ties: list = field(default_factory=list)  # (output index, input index) pairs
    fixed: Fixed = NOTHING_FIXED
    adjacency: tuple = ()  # (edges, their count, node -> its edges): :mod:`shardc.solve.descent`

    # ---- construction ---------------------------------------------------------------------
    def out_sbp(self, node: int, slot: int, choice: int) -> NdSbp:
        c = self.choices[node][choice]
        return c if isinstance(c, NdSbp) else c.outs[slot]

    def out_sbps(self, node: int, slot: int) -> list[NdSbp]:
        return [self.out_sbp(node, slot, a) for a in range(len(self.choices[node]))]

    def reshard_matrix(self, src: Sequence[NdSbp], dst: Sequence[NdSbp], nbytes: float,
                       alpha_scale: float = 1.0) -> np.ndarray:
        usrc, si = _unique(src)
        udst, di = _unique(dst)
        key = (tuple(usrc), tuple(udst))
        terms = self.terms.get(key)
        if terms is None:  # the pairs' distinct collectives, and how often each pair runs one
            convs = [self._conversion(a, b) for a in usrc for b in udst]
            steps: dict = {}
            for c in convs:
                for step in c.collectives:
                    steps.setdefault(step, len(steps))
            runs = np.zeros((len(convs), max(len(steps), 1)))
            for i, c in enumerate(convs):
                for step in c.collectives:
                    runs[i, steps[step]] += 1
            local = np.array([c.local if c.collectives else 0.0 for c in convs])
            terms = (tuple(steps), runs, local)
            self.terms[key] = terms
        steps, runs, local = terms
        model = self.cluster.collective_model
        t = np.array([c.seconds(nbytes, model, alpha_scale) for c in steps] or [0.0])
        small = (runs @ t + local).reshape(len(usrc), len(udst))
        return small[np.ix_(si, di)]

    def _conversion(self, a: NdSbp, b: NdSbp) -> Conversion:
        key = (a, b)
        hit = self.conversions.get(key)
        if hit is None:
            hit = conversion(a, b, self.axis_sizes, self.axis_names, self.cluster)
            self.conversions[key] = hit
        return hit

    @property
    def live(self) -> list[int]:
        """Nodes that are decided (not following another), producers first."""
        return [i for i in self.order if i not in self.follows]

    def resolve(self, node: int) -> tuple[int, np.ndarray]:
        """The variable node deciding ``node``, and the map from its choice to ``node``'s."""
        f = np.arange(len(self.choices[node]))
        while node in self.follows:
            node, g = self.follows[node]
            f = f[g]
        return node, f

    def decode(self, assignment: dict[int, int]) -> list[int]:
        """Choices of every node from the choices of the live ones."""
        out = []
        for i in range(len(self.choices)):
            root, f = self.resolve(i)
            out.append(int(f[assignment[root]]))
        return out

    # ---- follow merging -------------------------------------------------------------------
    def _same_layout(self, ins: list[Edge], u: int, v: int) -> np.ndarray:
        """[|Su|, |Sv|] True where every edge from u into v needs no conversion at all."""
        ok = np.ones((len(self.choices[u]), len(self.choices[v])), dtype=bool)
        for e in ins:
            if e.k < 0:
                continue  # a tie or a re-pointed edge: no input slot of v to compare
            node, slot = e.src
            _, g = self.resolve(node)  # u's choice -> the producer's choice
            src = self.out_sbps(node, slot)
            dst = [c.ins[e.k] for c in self.choices[v]]
            index: dict = {}
            si = np.array([index.setdefault(x, len(index)) for x in src])[g]
            di = np.array([index.setdefault(x, len(index)) for x in dst])
            ok &= si[:, None] == di[None, :]
        return ok

    def _generates(self, v: int, ins: list[Edge]) -> bool:
        """``v`` makes far more data than it reads from the node it would follow (random
        bits from a key, a bias broadcast over the batch): at least a device count's worth
        more. Following would fix its output to its tiny operand's layout (replicated), so
        the whole chain it starts runs replicated and is sliced where it meets split data;
        as a node of its own, its output takes the layout its consumers want, each device
        making its own slice."""
        made = sum(o.nbytes for o in self.refs[v].outputs)
        return made >= math.prod(self.axis_sizes) * sum(e.value.nbytes for e in ins) > 0

    def merge_followers(self) -> None:
        ins_of: dict[int, list[Edge]] = {}
        outs_of: dict[int, list[Edge]] = {}
        fresh_of: dict[tuple, np.ndarray] = {}
        for e in self.edges:
            ins_of.setdefault(e.v, []).append(e)
            outs_of.setdefault(e.u, []).append(e)
        for v in self.order:
            ins = ins_of.get(v, [])
            if not ins or not isinstance(self.refs[v], Op):
                continue
            if len({e.u for e in ins}) > 1:
                if not facts(self.refs[v].name).elementwise:
                    continue
                # an elementwise op of several producers follows its largest operand (its
                # output layout is one of its operands'), one computed from the inputs
                # before a constant broadcast to the same size (the 1/N of a mean: following
                # it would replicate the loss's backward); the others' edges are re-pointed
                # to that operand's node (Alpa / XLA "follow")
                lead = max(ins, key=lambda e: (e.value.nbytes, bool(ins_of.get(e.u)), -e.k))
                u = lead.u
                others = [e for e in ins if e.u != u]
                ins = [e for e in ins if e.u == u]
            else:
                u, others = ins[0].u, []
            if self._generates(v, ins):
                continue  # its own layout is a decision: see _generates
            local = self.cost[v][None, :] + sum(e.cost for e in ins)  # [|Su|, |Sv|]
            # follow: take the operand's layout as it is (no conversion, not even a free
            # slice) and split nothing the operand does not (a broadcast_in_dim B -> S(d)
            # would save its own compute but make every consumer of a replicated chain
            # re-gather); the cheapest such strategy, else the cheapest keeping the layout,
            # else the cheapest
            same = self._same_layout(ins, u, v)
            if not same.any(axis=1).all():
                continue  # some layout of u must convert first: a decision of v's own
            f = np.argmin(local, axis=1)
            ks = tuple(sorted({e.k for e in ins if e.k >= 0}))
            key = (id(self.choices[v]), ks)  # ops of one signature share their strategy list
            if key not in fresh_of:
                fresh_of[key] = _fresh_splits(self.choices[v], ks)
            fresh = fresh_of[key]
            for allowed in (same, same & ~fresh[None, :]):
                masked = np.where(allowed, local, np.inf)
                g = np.argmin(masked, axis=1)
                ok = np.isfinite(masked[np.arange(len(g)), g])
                f[ok] = g[ok]
            self.cost[u] = self.cost[u] + local[np.arange(len(f)), f]
            self.follows[v] = (u, f)
            gone = {id(e) for e in ins}
            outs_of[u] = [e for e in outs_of.get(u, []) if id(e) not in gone]
            ins_of[v] = []
            for e in others:  # a -> v becomes a -> u, priced at v's choice for u's
                e.v, e.cost, e.k = u, e.cost[:, f], -2
                ins_of.setdefault(u, []).append(e)
            for e in outs_of.pop(v, []):
                e.u, e.cost = u, e.cost[f, :]
                if e.v == u:  # a tie back to u: a cost on u alone
                    self.cost[u] = self.cost[u] + np.diag(e.cost)
                    ins_of[u] = [x for x in ins_of[u] if x is not e]
                else:
                    outs_of[u].append(e)
            for point in self.memory:
                if v in point:
                    vec = point.pop(v)[f]
                    point[u] = point[u] + vec if u in point else vec
        self.edges = [e for es in outs_of.values() for e in es]
        self._absorb_sources()

    def _absorb_sources(self) -> None:
        """Fold ops with no inputs from other nodes (iota, broadcasts of constants, and what
        follows them) into their only consumer: the best choice of such a source given its
        consumer's choice is exact, since nothing else depends on it."""
        ins_of: dict[int, list[Edge]] = {}
        outs_of: dict[int, list[Edge]] = {}
        for e in self.edges:
            ins_of.setdefault(e.v, []).append(e)
            outs_of.setdefault(e.u, []).append(e)
        for u in self.live:
            outs = outs_of.get(u, [])
            if ins_of.get(u) or not outs or not isinstance(self.refs[u], Op):
                continue
            v = outs[0].v
            if any(e.v != v for e in outs) or v == u:
                continue
            total = self.cost[u][:, None] + sum(e.cost for e in outs)  # [|Su|, |Sv|]
            g = np.argmin(total, axis=0)
            self.cost[v] = self.cost[v] + total[g, np.arange(len(g))]
            self.follows[u] = (v, g)
            gone = {id(e) for e in outs}
            ins_of[v] = [e for e in ins_of.get(v, []) if id(e) not in gone]
            outs_of[u] = []
            for point in self.memory:
                if u in point:
                    vec = point.pop(u)[g]
                    point[v] = point[v] + vec if v in point else vec
        self.edges = [e for es in outs_of.values() for e in es]


class CostGraphError(ValueError):
    """A cost graph breaks one of the invariants :func:`check_cost_graph` names."""


def check_cost_graph(cg: CostGraph) -> None:
    """Verify what the solvers assume of ``cg``; raise :class:`CostGraphError` naming the
    broken invariant. Run after building and after every pass that transforms a cost graph
    (follow-merging, folding into a quotient, restricting choices):

    * every node has a ref, a non-empty choice list and one finite, non-negative cost per
      choice;
    * ``order`` lists every node once; a follower follows a live node through a choice map
      map with one entry per leader choice, each one of the follower's own choices;
    * every edge joins two distinct live nodes with a ``[|S_u|, |S_v|]`` finite,
      non-negative cost matrix;
    * every memory point holds live nodes only, one byte count per choice.
    """
    n = len(cg.choices)
    if len(cg.refs) != n or len(cg.cost) != n:
        raise CostGraphError(f"{n} choice lists but {len(cg.refs)} refs and {len(cg.cost)} "
                             "cost vectors: every node needs one of each")
    for i in range(n):
        if not cg.choices[i]:
            raise CostGraphError(f"node {i} ({cg.refs[i]}) has no choices")
        c = np.asarray(cg.cost[i])
        if c.shape != (len(cg.choices[i]),):
            raise CostGraphError(f"node {i} ({cg.refs[i]}): cost vector of shape {c.shape} "
                                 f"for {len(cg.choices[i])} choices")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise CostGraphError(f"node {i} ({cg.refs[i]}): costs must be finite and >= 0")
    if sorted(cg.order) != list(range(n)):
        raise CostGraphError(f"order must list each of the {n} nodes once, got "
                             f"{len(cg.order)} entries ({len(set(cg.order))} distinct)")
    for v, (u, f) in cg.follows.items():
        if not (0 <= u < n) or u == v:
            raise CostGraphError(f"node {v} follows {u}, which is not another node")
        if len(f) != len(cg.choices[u]) or np.any(f < 0) or np.any(f >= len(cg.choices[v])):
            raise CostGraphError(f"node {v} follows {u} with a choice map of length {len(f)} "
                                 f"into {len(cg.choices[v])} choices; it must map each of "
                                 f"{u}'s {len(cg.choices[u])} choices to one of {v}'s")
    live = set(cg.live)
    for k, e in enumerate(cg.edges):
        if e.u not in live or e.v not in live:
            raise CostGraphError(f"edge {k} ({e.u} -> {e.v}, value {e.value}) touches a node "
                                 "that follows another: re-point it to the leader")
        if e.u == e.v:
            raise CostGraphError(f"edge {k} is a self-loop on node {e.u}: fold its diagonal "
                                 "into the node's cost")
        want = (len(cg.choices[e.u]), len(cg.choices[e.v]))
        if e.cost.shape != want:
            raise CostGraphError(f"edge {k} ({e.u} -> {e.v}): cost matrix {e.cost.shape}, "
                                 f"expected {want}")
        if not np.all(np.isfinite(e.cost)) or np.any(e.cost < 0):
            raise CostGraphError(f"edge {k} ({e.u} -> {e.v}): costs must be finite and >= 0")
    for t, point in enumerate(cg.memory):
        for i, vec in point.items():
            if i not in live:
                raise CostGraphError(f"memory point {t} counts node {i}, which is not live")
            if np.shape(vec) != (len(cg.choices[i]),):
                raise CostGraphError(f"memory point {t}, node {i}: {np.shape(vec)} byte "
                                     f"counts for {len(cg.choices[i])} choices")


def _fresh_splits(strategies: Sequence, followed: Sequence[int]) -> np.ndarray:
    """Per strategy: True when some output is split along a mesh axis on which every
    ``followed`` input is broadcast (the op would cut a replicated value on its own)."""
    out = np.zeros(len(strategies), dtype=bool)
    for b, s in enumerate(strategies):
        for axis in range(len(s.outs[0]) if s.outs else 0):
            if (all(isinstance(s.ins[k].sbps[axis], Broadcast) for k in followed)
                    and any(isinstance(nd.sbps[axis], Split) for nd in s.outs)):
                out[b] = True
                break
    return out


def _unique(items: Sequence) -> tuple[list, np.ndarray]:
    index: dict = {}
    idx = np.array([index.setdefault(x, len(index)) for x in items], dtype=np.int64)
    return list(index), idx


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


def _unreduce(nd: NdSbp) -> NdSbp:
    return NdSbp(tuple(B if isinstance(s, Partial) else s for s in nd.sbps))


def build(graph: Graph, axis_sizes: Sequence[int], axis_names: Sequence[str], cluster: Cluster,
          ties: Sequence[tuple[int, int]] = (), *, fixed: Fixed = NOTHING_FIXED,
          resident: Collection[int] = ()) -> CostGraph:
    """Build the cost graph. ``ties`` pairs (output index, input index) whose layouts should
    agree (a train step's new state feeds the next step's state). ``fixed`` pins graph
    inputs and outputs to one layout each. The tied inputs and the ``resident`` ones stay
    on the devices between calls; every other input pays its host feed."""
    axis_sizes, axis_names = tuple(axis_sizes), tuple(axis_names)
    cg = CostGraph(graph, axis_sizes, axis_names, cluster)
    rate = cluster.device_flops * cluster.utilization
    carried = {i for _, i in ties}
    cg.carried = carried
    cg.resident = set(resident)
    cg.ties = list(ties)
    cg.fixed = fixed
    layouts: dict = {}
    for k, v in enumerate(graph.inputs):
        cg.producer[v.id] = (len(cg.choices), 0)
        if k in fixed.inputs:
            cg.choices.append([fixed.inputs[k]])
        else:
            if v.shape not in layouts:
                layouts[v.shape] = input_choices(v, axis_sizes)
            cg.choices.append(layouts[v.shape])
        cg.refs.append(v)
        cg.cost.append(np.array([feed_time(v, nd, axis_sizes, cluster,
                                           k in carried or k in cg.resident)
                                 for nd in cg.choices[-1]]))
    matrices: dict = {}  # identical edges (repeated layers) share one cost matrix

    def edge_matrix(src_owner: list, slot: int, src, dst_owner: list, k: int, dst, nbytes,
                    a_scale):
        key = (id(src_owner), slot, id(dst_owner), k, nbytes, a_scale)
        mat = matrices.get(key)
        if mat is None:
            mat = cg.reshard_matrix(src, dst, nbytes, a_scale)
            matrices[key] = mat
        return mat

    scale = alpha_scales(graph)
    ties_in = loop_ties(graph)
    uses: dict[int, int] = {}
    # a carry's exit reads the loop-carried value as made (:func:`carry_exit`), so it does
    # not make that value shared: an accumulator read once in the body may stay partial
    read = [v for op in graph.ops if not carry_exit(op) for _, v in reads(op)] + \
        [v for _, v in ties_in]
    for val in read + list(graph.outputs):
        if not val.is_const:
            uses[val.id] = uses.get(val.id, 0) + 1
    shared = [v for v in graph.values() if uses.get(v.id, 0) > 1]
    first_settle = len(graph.inputs) + len(graph.ops)
    cg.settle = {v.id: first_settle + k for k, v in enumerate(shared)}

    def source(val: Value) -> tuple[int, int]:
        """(node, slot) its uses read ``val`` from: its settle node, else its producer."""
        return (cg.settle[val.id], 0) if val.id in cg.settle else cg.producer[val.id]

    runs = graph.runs()
    folded = graph.constants()

    def edge(u: int, slot: int, val: Value, v: int, k: int, dst, dst_owner, times: int
             ) -> Edge:
        """The edge reading ``val`` from ``(u, slot)`` into node ``v``'s slot ``k``, its
        conversion run ``times`` per call."""
        if u >= first_settle:
            owner = src = _settle_choices(val, axis_sizes, layouts)
        else:
            owner, src = cg.choices[u], cg.out_sbps(u, slot)
        mat = edge_matrix(owner, slot, src, dst_owner, k, dst, val.nbytes,
                          scale.get(val.id, 1.0))
        if val.id in folded:  # a constant read partial is made so: no reduction to undo
            mat = np.where([d.has_partial for d in dst], 0.0, mat)
        return Edge(u, v, mat * times, val, k, (u, slot))

    reduced_ys = ys_exits(graph)
    ys_share = ys_shares(graph, reduced_ys)
    op_strategies = graph.memo(("strategies", axis_sizes, axis_names),
                               lambda g: _op_strategies(g, axis_sizes, axis_names))
    for op, strats in zip(graph.ops, op_strategies):
        node = len(cg.choices)
        cg.choices.append(strats)
        cg.refs.append(op)
        cg.cost.append(np.array([s.flops / rate * op.weight for s in strats]))
        if op.id in reduced_ys:  # a ys reduced after the loop: one all-reduce of the stack
            cg.cost[-1] = cg.cost[-1] + ys_reduction(cg, strats, op.outputs[0],
                                                     ys_share[op.outputs[0].id])
        for slot, out in enumerate(op.outputs):
            cg.producer[out.id] = (node, slot)
        for k, val in reads(op):
            if not val.is_const:
                u, slot = cg.producer[val.id] if carry_exit(op) else source(val)
                cg.edges.append(edge(u, slot, val, node, k, [s.ins[k] for s in strats], strats,
                                     read_runs(runs, val, op)))
    for val in shared:
        w = len(cg.choices)
        u, slot = cg.producer[val.id]
        cg.choices.append(_settle_choices(val, axis_sizes, layouts))
        cg.refs.append(Settle(val))
        cg.cost.append(np.zeros(len(cg.choices[w])))
        cg.edges.append(Edge(u, w, cg.reshard_matrix(cg.out_sbps(u, slot), cg.choices[w],
                                                     val.nbytes, scale.get(val.id, 1.0))
                             * runs.get(val.id, 1), val, 0, (u, slot)))
    for enter, val in ties_in:  # the body's carry, converted back every iteration
        u, slot = source(val)
        v = cg.producer[enter.outputs[0].id][0]
        cg.edges.append(edge(u, slot, val, v, -1, [s.outs[0] for s in cg.choices[v]],
                             cg.choices[v], runs.get(val.id, 1)))
    whole = NdSbp((B,) * len(axis_sizes))
    for val in loop_tests(graph):  # a while's predicate: every device runs alike
        u, slot = source(val)
        fix = cg.reshard_matrix(cg.out_sbps(u, slot), [whole], val.nbytes,
                                scale.get(val.id, 1.0))
        cg.cost[u] = cg.cost[u] + fix[:, 0] * runs.get(val.id, 1)
    after = {cg.producer[val.id][0]: [] for val in shared}
    for val in shared:
        after[cg.producer[val.id][0]].append(cg.settle[val.id])
    cg.order = [j for i in range(first_settle) for j in (i, *after.get(i, ()))]
    tied = dict(ties)
    for j, val in enumerate(graph.outputs):
        if val.is_const:
            continue
        u, slot = source(val)
        src = cg.out_sbps(u, slot)
        if j in fixed.outputs:  # converted to the layout its type fixes
            fix = cg.reshard_matrix(src, [fixed.outputs[j]], val.nbytes, scale.get(val.id, 1.0))
            cg.cost[u] = cg.cost[u] + fix[:, 0]
        elif j in tied:
            t = tied[j]
            if t != u and (val.id not in cg.settle or cg.producer[val.id][0] != t):
                cg.edges.append(Edge(u, t, cg.reshard_matrix(
                    src, cg.choices[t], val.nbytes, scale.get(val.id, 1.0)), val,
                    src=(u, slot)))
        else:
            fix = cg.reshard_matrix(src, [_unreduce(s) for s in src], val.nbytes,
                                    scale.get(val.id, 1.0))
            cg.cost[u] = cg.cost[u] + np.diag(fix)
    cg.memory = memory_points(cg)
    return cg


def _op_strategies(graph: Graph, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...]
                   ) -> list[list]:
    """Each op's strategies on the mesh (:func:`shardc.rules.registry.strategies`), one
    list shared by the ops of one signature; a ys reduced after its loop keeps those that
    read it whole or partial. Kept per graph and mesh (:meth:`Graph.memo`): a frontier
    builds the cost graph of one program many times."""
    consume = accumulators(graph)
    reduced_ys = ys_exits(graph)
    cache: dict = {}
    out = []
    for op in graph.ops:
        key = _op_key(op)
        if key is not None:
            key = (key, op.id in consume)
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
    (``lower/emit.py``), so micro-batches' partial gradients are reduced once after the loop,
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
    ins = tuple((v.shape, str(v.dtype), v.is_const) for v in op.inputs)
    outs = tuple((v.shape, str(v.dtype)) for v in op.outputs)
    return op.name, ins, outs, params
