"""The exact placement ILP on OR-Tools CP-SAT (the only module importing ortools).

Variables: one-hot ``s[i, a]`` per live node. Choices with equal edge costs share a
group (row groups X_p of the producer, column groups Y_q of the consumer). An edge with few
group pairs gets one-hot pair variables ``e[p, q]`` with ``Σ_q e[p, q] = X_p`` and
``Σ_p e[p, q] = Y_q`` (Alpa's formulation on groups, a tight relaxation); a larger one gets one
integer ``y_e >= Σ_p R[p, q]·X_p − M_q·(1 − Y_q)`` per column group q. Memory: at every sampled
program point ``Σ_i Σ_a m[i, a]·s[i, a] <= budget``. Costs are scaled to integers relative to
the largest finite cost.

References:
  Alpa (Zheng et al., OSDI'22) §4.2; XLA ``auto_sharding_solver.cc`` (CP-SAT, hints, time
  limit, best incumbent on timeout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from shardc.solve.problem import CostGraph

SCALE_RANGE = 1e8  # the largest cost becomes this many integer units
TIGHT_PAIRS = 144  # edges with at most this many (row, column) groups get pair variables
#: CP-SAT's portfolio (LP, max-LP, core-based, LNS workers), interleaved in fixed batches
#: (deterministic for any count). Chosen when the portfolio ran free: on the folded GPT-2
#: quotient 8 workers proved the optimum in ~2 s on a 2-core machine where 2 did not in 20 s.
#: Interleaved, on the 2x2 MLP sanity plan at 10 deterministic seconds, 1/2/4/8/16 workers
#: end at 3.131/3.204/3.225/3.225/3.225 ms predicted (optimum 3.126): the count is worth
#: re-measuring with the planning-speed work.
WORKERS = 8


#: a wall-clock guard far above any deterministic budget: it only stops a solver that hangs
#: (a plan cut by it would depend on the machine's load; none has been seen)
WALL_GUARD = 20.0


@dataclass(frozen=True)
class IlpResult:
    assignment: dict[int, int] | None
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    wall_time: float
    work: float  # CP-SAT's deterministic time spent (its budgets are counted in it)


def _groups(mat: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    uniq, inverse = np.unique(mat, axis=axis, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _tight_edge(m: cp_model.CpModel, cols: np.ndarray, X: list, Y: list):
    """One-hot pair variables with both marginals fixed (a tight LP relaxation)."""
    e = [[m.NewBoolVar("") for _ in range(cols.shape[1])] for _ in range(len(X))]
    for p in range(len(X)):
        m.Add(sum(e[p]) == X[p])
    for g in range(cols.shape[1]):
        m.Add(sum(e[p][g] for p in range(len(X))) == Y[g])
    return sum(int(cols[p, g]) * e[p][g] for p in range(len(X)) for g in range(cols.shape[1])
               if cols[p, g])


def _big_m_edge(m: cp_model.CpModel, cols: np.ndarray, X: list, Y: list):
    """One integer per edge bounded below per consumer group (compact, weaker relaxation)."""
    y = m.NewIntVar(0, int(cols.max()), "")
    for g in range(cols.shape[1]):
        col = cols[:, g]
        big = int(col.max())
        if big:
            m.Add(y >= sum(int(col[p]) * X[p] for p in range(len(X)) if col[p]) - big * (1 - Y[g]))
    return y


def solve_ilp(cg: CostGraph, *, time_limit: float = 10.0, memory_budget: float | None = None,
              hint: dict[int, int] | None = None, free: Sequence[int] | None = None,
              workers: int = WORKERS, log: bool = False) -> IlpResult:
    """Solve for the live nodes in ``free`` (default: all), the others held at ``hint``.
    A node with one choice is a constant: its edges become costs of its neighbours."""
    if free is not None and hint is None:
        raise ValueError("solve_ilp(free=...) needs hint= for the nodes held fixed")
    live = list(cg.live if free is None else free)
    hinted = hint is not None
    hint = dict(hint or {})
    for i in live:
        if len(cg.choices[i]) == 1:
            hint[i] = 0
    live = [i for i in live if len(cg.choices[i]) > 1]
    inside = set(live)
    unary = {i: cg.cost[i].astype(float).copy() for i in live}
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in cg.edges:
        if e.u in inside and e.v in inside:
            key = (e.u, e.v)
            merged[key] = merged[key] + e.cost if key in merged else e.cost
        elif e.u in inside:
            unary[e.u] += e.cost[:, hint[e.v]]
        elif e.v in inside:
            unary[e.v] += e.cost[hint[e.u], :]
    biggest = max([float(np.max(c)) for c in unary.values()] +
                  [float(np.max(c)) for c in merged.values()] + [1e-30])
    unit = biggest / SCALE_RANGE

    def q(x):
        return np.rint(np.asarray(x) / unit).astype(np.int64)

    m = cp_model.CpModel()
    s = {}
    for i in live:
        s[i] = [m.NewBoolVar("") for _ in range(len(cg.choices[i]))]
        m.AddExactlyOne(s[i])
    obj = []
    for i in live:
        c = q(unary[i])
        obj.extend(int(c[a] - c.min()) * s[i][a] for a in range(len(c)) if c[a] != c.min())
    for (u, v), mat in merged.items():
        R = q(mat)
        if not R.any():
            continue
        rows, ri = _groups(R, 0)  # rows: [n_row_groups, |Sv|]
        cols, ci = _groups(rows, 1)  # cols: [n_row_groups, n_col_groups]
        X = [sum(s[u][a] for a in np.flatnonzero(ri == p)) for p in range(len(rows))]
        Y = [sum(s[v][b] for b in np.flatnonzero(ci == g)) for g in range(cols.shape[1])]
        if cols.size <= TIGHT_PAIRS:
            obj.append(_tight_edge(m, cols, X, Y))
        else:
            obj.append(_big_m_edge(m, cols, X, Y))
    if memory_budget is not None:
        kib = 1024.0
        for point in cg.memory:
            terms, const = [], 0
            for i, vec in point.items():
                vq = np.ceil(vec / kib).astype(np.int64)
                if i not in inside:
                    const += int(vq[hint[i]])
                    continue
                low = int(vq.min())
                const += low
                terms.extend(int(vq[a] - low) * s[i][a] for a in range(len(vq)) if vq[a] != low)
            m.Add(sum(terms) + const <= int(memory_budget // kib))
    m.Minimize(sum(obj))
    if hinted:
        for i in live:
            for a, var in enumerate(s[i]):
                m.AddHint(var, a == hint[i])
    solver = cp_model.CpSolver()
    # deterministic: the workers' searches interleaved in fixed batches, the budget counted
    # in CP-SAT's deterministic time, so the plan does not depend on the machine's load
    solver.parameters.max_deterministic_time = float(time_limit)
    solver.parameters.max_time_in_seconds = WALL_GUARD * float(time_limit) + 1.0
    solver.parameters.interleave_search = True
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    solver.parameters.log_search_progress = log
    status = solver.Solve(m)
    name = solver.StatusName(status)
    work = solver.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return IlpResult(None, name, solver.WallTime(), work)
    x = dict(hint)
    x.update({i: next(a for a, var in enumerate(s[i]) if solver.BooleanValue(var))
              for i in live})
    return IlpResult(x, name, solver.WallTime(), work)


def problem_size(cg: CostGraph, free: Sequence[int] | None = None) -> int:
    """A rough count of model terms: choice variables plus edge cost entries."""
    inside = set(cg.live if free is None else free)
    n = sum(len(cg.choices[i]) for i in inside)
    return n + sum(e.cost.size for e in cg.edges if e.u in inside and e.v in inside)
