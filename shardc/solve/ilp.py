"""The exact placement ILP, a mixed-integer program on OR-Tools' model builder (HiGHS).

Variables: one-hot binaries ``s[i, a]`` per live node with more than one choice. Choices
with equal edge costs share a group (row groups X_p of the producer, column groups Y_q of
the consumer); every edge gets continuous pair variables ``e[p, q] >= 0`` with both
marginals fixed, ``Σ_q e[p, q] = X_p`` and ``Σ_p e[p, q] = Y_q``, priced ``R[p, q]``
(Alpa's formulation on groups). Its LP relaxation is tight on layout problems: on the
zoo's graphs the LP solution is integral, found far sooner than CP-SAT proved the same
optimum (docs/design-notes.md). Memory: at every
sampled program point ``Σ_i Σ_a m[i, a]·s[i, a] <= budget`` (KiB, rounded up).

The model is built as one sparse matrix (no per-term Python expressions). Its LP
relaxation is solved first; only when a choice comes out fractional is the MIP solved, to
a relative gap of ``GAP`` within ``MAX_NODES`` branch-and-bound nodes. Both are
deterministic, so the result depends on the model only; the wall-clock limit the caller
passes is a guard (a MIP it cuts returns its incumbent as ``FEASIBLE``, an LP it cuts
nothing).

References:
  Alpa (Zheng et al., OSDI'22) §4.2; XLA ``auto_sharding_solver.cc`` (hints, time limit,
  best incumbent on timeout); HiGHS (Huangfu & Hall, 2018), OR-Tools ``model_builder``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sparse

from shardc.errors import OptionsError
from shardc.solve.beside import beside, idle_core
from shardc.solve.costgraph import CostGraph
from shardc.solve.rows import Rows, groups, pair_rows

if TYPE_CHECKING:
    from ortools.linear_solver.python import model_builder_helper as mbh

__all__ = ["BISECTIONS", "DEFAULT_TIME_LIMIT", "DOUBLINGS", "GAP", "IlpResult", "INTEGRALITY",
           "LAMBDA_FLOOR", "LP_PRESOLVE", "MAX_NODES", "POLISH_SWEEPS", "problem_size",
           "SCALE_RANGE", "solve_ilp"]

#: the default wall-clock guard on each solve (seconds): every option that takes a
#: ``time_limit`` (``auto_shard``'s, :class:`shardc.solve.search.SolveOptions`', the CLI's)
#: defaults to this one
DEFAULT_TIME_LIMIT = 10.0
#: costs are scaled so the largest becomes this many units (HiGHS's tolerances are absolute
#: around 1e-6..1e-9; a 1e-6 share of the largest cost is far below any plan difference)
SCALE_RANGE = 1e6
#: relative optimality gap at which the MIP stops (HiGHS's default, 1e-4, would accept plans
#: 0.01% worse than proven ones; the LP is integral in practice, so this costs nothing)
GAP = 1e-7
#: branch-and-bound nodes before the MIP returns its incumbent: a deterministic bound on the
#: work (the tight relaxation closes at the root on every graph measured)
MAX_NODES = 2_000
#: HiGHS presolve for the LP relaxation: off. The pair-variable LPs have little for it to
#: remove, and dual simplex without it solves them sooner, to the same optimum
LP_PRESOLVE = "off"
#: how far from 0 or 1 an LP value may be and still count as integral
INTEGRALITY = 1e-6
#: Lagrangian search of a budgeted model (:class:`_Budgeted`): doublings of the multiplier
#: scale ``t`` until a relaxation's plan fits, then bisections between it and the last
#: that did not; sweeps of single-node moves polishing each plan. One bisection: four
#: planned the same plans on the zoo's models (the repair and polish of every relaxation's
#: plan settle what the further bisections refined), in less time
DOUBLINGS = 24
BISECTIONS = 1
POLISH_SWEEPS = 20
#: share of the largest memory row dual put on every row (so the scaled multipliers reach
#: the leanest plan even where the LP's duals leave a row at zero)
LAMBDA_FLOOR = 1e-3
#: the HiGHS statuses the search tells apart (any other reads as UNKNOWN)
_STATUS = ("OPTIMAL", "FEASIBLE", "INFEASIBLE")


def _helper():
    """OR-Tools' model builder, imported at the first solve: planning needs it, while
    importing shardc to run a saved plan (``use_plan``) or the model zoo does not."""
    from ortools.linear_solver.python import model_builder_helper

    return model_builder_helper


@dataclass(frozen=True)
class IlpResult:
    assignment: dict[int, int] | None
    # OPTIMAL | FEASIBLE (a limit cut it) | INFEASIBLE | FRACTIONAL | UNKNOWN (the clock cut
    # it, nothing found) | LAGRANGIAN (a budget's rows settled by :class:`_Budgeted`; no
    # assignment where no plan it reached fits)
    status: str
    wall_time: float


def solve_ilp(cg: CostGraph, *, time_limit: float = DEFAULT_TIME_LIMIT,
              memory_budget: float | None = None,
              hint: dict[int, int] | None = None, free: Sequence[int] | None = None,
              relaxation_only: bool = False, log: bool = False) -> IlpResult:
    """Solve for the live nodes in ``free`` (default: all), the others held at ``hint``.
    A node with one choice is a constant: its edges become costs of its neighbours.
    ``time_limit`` is a wall-clock guard on each HiGHS solve (seconds; one LP, one
    Lagrangian step or a node-bounded MIP each, so only a machine far slower than this one
    meets it: a deadline shared by a budget's Lagrangian steps could cut the later ones on a
    loaded machine, and the plan then depended on the load). ``relaxation_only``: where the LP
    relaxation is fractional, return status ``FRACTIONAL`` (no assignment) instead of
    solving the MIP."""
    if free is not None and hint is None:
        raise OptionsError("solve_ilp(free=...) needs hint= for the nodes held fixed")
    t0 = time.perf_counter()
    live, hint, unary, merged = _reduce(cg, free, hint)
    if not live:
        return IlpResult(hint, "OPTIMAL", time.perf_counter() - t0)
    biggest = max([float(np.max(c)) for c in unary.values()] +
                  [float(np.max(c)) for c in merged.values()] + [1e-30])
    unit = biggest / SCALE_RANGE
    base, objective, rows, n_vars = _structure(live, unary, merged, unit)
    n_struct = rows.n  # the one-hot and pair rows; the memory rows follow
    if memory_budget is not None and not _memory_rows(cg, rows, base, hint, set(live),
                                                      memory_budget):
        return IlpResult(None, "INFEASIBLE", time.perf_counter() - t0)
    n_choice = base[live[-1]] + len(unary[live[-1]])
    lo, hi = rows.bounds()
    matrix = rows.matrix(n_vars)
    cost = np.concatenate(objective)
    name, values, duals = _solve(_model(cost, lo, hi, matrix), None, time_limit, log)
    if name == "OPTIMAL" and not _integral(values[:n_choice]):
        if relaxation_only:
            return IlpResult(None, "FRACTIONAL", time.perf_counter() - t0)
        if rows.n > n_struct:  # memory rows: their Lagrangian, not branch and bound
            plan = _Budgeted(live, base, objective[:len(live)],
                             {(u, v): m / unit for (u, v), m in merged.items()},
                             matrix[n_struct:, :n_choice].toarray(), hi[n_struct:])
            choice = plan.search(cost, lo[:n_struct], hi[:n_struct], matrix[:n_struct],
                                 np.abs(duals[n_struct:]), values, hint, time_limit)
            return IlpResult(None if choice is None else {**hint, **choice}, "LAGRANGIAN",
                             time.perf_counter() - t0)
        name, values, _ = _solve(_model(cost, lo, hi, matrix), n_choice, time_limit, log)
    if values is None:
        return IlpResult(None, name, time.perf_counter() - t0)
    x = dict(hint)
    x.update({i: int(np.argmax(values[base[i]:base[i] + len(unary[i])])) for i in live})
    return IlpResult(x, name, time.perf_counter() - t0)


def _reduce(cg: CostGraph, free: Sequence[int] | None, hint: dict[int, int] | None
            ) -> tuple[list[int], dict[int, int], dict[int, np.ndarray], dict]:
    """The nodes to solve (live, more than one choice), the hint with the others held, each
    node's own costs (its edges to held nodes folded in) and the edges between solved nodes
    (parallel ones summed)."""
    live = list(cg.live if free is None else free)
    hint = dict(hint or {})
    for i in live:
        if len(cg.choices[i]) == 1:
            hint[i] = 0
    live = [i for i in live if len(cg.choices[i]) > 1]
    inside = set(live)
    unary = {i: np.asarray(cg.cost[i], dtype=float).copy() for i in live}
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in cg.edges:
        if e.u in inside and e.v in inside:
            key = (e.u, e.v)
            merged[key] = merged[key] + e.cost if key in merged else e.cost
        elif e.u in inside:
            unary[e.u] += e.cost[:, hint[e.v]]
        elif e.v in inside:
            unary[e.v] += e.cost[hint[e.u], :]
    return live, hint, unary, merged


def _structure(live: list[int], unary: dict, merged: dict, unit: float
               ) -> tuple[dict[int, int], list[np.ndarray], Rows, int]:
    """The model's choice variables (each node's first column in ``base``), its objective
    blocks, and its one-hot and pair rows (the pair variables follow the choices)."""
    base, n_vars = {}, 0
    for i in live:
        base[i] = n_vars
        n_vars += len(unary[i])
    objective = [(unary[i] - unary[i].min()) / unit for i in live]
    rows = Rows()
    sizes = np.array([len(unary[i]) for i in live])  # one-hot: Σ_a s[i, a] = 1
    rows.add_block(np.repeat(np.arange(len(live)), sizes), np.arange(sizes.sum()),
                   np.ones(sizes.sum()), len(live), 1.0, 1.0)
    edges = []  # (row groups' ids, column groups' ids, u's first column, v's first column)
    for (u, v), mat in merged.items():
        if not mat.any():
            continue
        by_row, ri = groups(mat / unit, 0)  # [row groups, |choices of v|]
        pairs, ci = groups(by_row, 1)  # [row groups, column groups]
        objective.append(pairs.reshape(-1))
        edges.append((ri, ci, base[u], base[v]))
    if edges:
        n_vars = pair_rows(rows, edges, n_vars)
    return base, objective, rows, n_vars


def _memory_rows(cg: CostGraph, rows: Rows, base: dict[int, int], hint: dict[int, int],
                 inside: set[int], memory_budget: float) -> bool:
    """Add a row per memory point holding it to the budget (KiB, rounded up); False where
    the held nodes alone exceed it at some point (no plan fits)."""
    kib = 1024.0
    for point in cg.memory:
        const, cols, vals = 0.0, [], []
        for i, vec in point.items():
            vq = np.ceil(np.asarray(vec) / kib)
            if i in inside:
                cols.append(base[i] + np.arange(len(vq)))
                vals.append(vq)
            else:
                const += float(vq[hint[i]])
        if cols:
            rows.add(np.concatenate(cols), np.concatenate(vals), -np.inf,
                     memory_budget // kib - const)
        elif const > memory_budget // kib:
            return False
    return True


def _model(cost: np.ndarray, lo: np.ndarray, hi: np.ndarray, matrix: sparse.csr_matrix
           ) -> mbh.ModelBuilderHelper:
    """``min cost·z`` over ``0 <= z <= 1``, ``lo <= matrix z <= hi``."""
    model = _helper().ModelBuilderHelper()
    n = matrix.shape[1]
    model.fill_model_from_sparse_data(np.zeros(n), np.ones(n), cost, lo, hi, matrix)
    return model


def _integral(values: np.ndarray) -> bool:
    return bool(np.all(np.minimum(values, 1.0 - values) <= INTEGRALITY))


def _solve(model: mbh.ModelBuilderHelper, n_integral: int | None, time_limit: float, log: bool
           ) -> tuple[str, np.ndarray | None, np.ndarray | None]:
    """Solve ``model`` with HiGHS: its LP relaxation (``n_integral`` None), or the MIP
    whose first ``n_integral`` variables are binary. Returns the status, the values and
    (for the LP) what the model builder reports as the rows' dual values: with HiGHS these
    are the rows' activities at the optimum, not their duals (``min 2x, x >= 3`` reports 3
    where GLOP reports the dual, 2; ``test_solver`` pins it), so the budgeted search's
    multipliers (:class:`_Budgeted`) weigh each memory row by its use."""
    for k in range(n_integral or 0):
        model.set_var_integrality(k, True)
    solver = _helper().ModelSolverHelper("highs")
    solver.set_time_limit_in_seconds(max(time_limit, 1e-3))
    solver.set_solver_specific_parameters(
        f"mip_rel_gap={GAP}\nmip_max_nodes={MAX_NODES}\nthreads=1\nrandom_seed=0\n"
        f"presolve={'on' if n_integral else LP_PRESOLVE}\n"
        f"output_flag={'true' if log else 'false'}")
    solver.enable_output(log)
    solver.solve(model)
    name = solver.status().name
    name = name if name in _STATUS else "UNKNOWN"
    if name not in ("OPTIMAL", "FEASIBLE") or not solver.has_solution():
        return name, None, None
    duals = None if n_integral else np.asarray(solver.dual_values())
    return name, np.asarray(solver.variable_values()), duals


class _Budgeted:
    """The choice part of a memory-budgeted model, to search it by its Lagrangian: the
    memory rows priced into the objective at multipliers ``t·λ`` (``λ``: what
    :func:`_solve` reports as their duals, their use at the LP optimum),
    each such problem an LP without memory rows (integral, like the unbudgeted model), and
    ``t`` bisected to the smallest that fits. Every plan it reaches is repaired to fit
    (the moves freeing the most bytes per unit of cost first) and polished by single-node
    moves that keep it fitting; the cheapest wins. Each step is an LP or a sweep run to its
    end, so the plan depends on the model only (no branch and bound cut by the clock: a
    budgeted MIP took 2-5 s a solve and stopped at the time limit, so budgeted plans
    depended on the machine's load).

    References:
      Fisher, "The Lagrangian relaxation method for solving integer programming problems"
      (Management Science, 1981) §3-4: multipliers from the LP duals, a feasible plan by
      adjusting the relaxation's solution."""

    def __init__(self, live: Sequence[int], base: dict[int, int], objective: list[np.ndarray],
                 pair: dict[tuple[int, int], np.ndarray],
                 mem: np.ndarray, cap: np.ndarray):
        pos = {i: k for k, i in enumerate(live)}
        self.live, self.objective, self.cap = live, objective, cap
        self.mem = [mem[:, base[i]:base[i] + len(objective[k])] for k, i in enumerate(live)]
        self.adj: list[list[tuple[np.ndarray, int]]] = [[] for _ in live]
        self.pairs = [(pos[u], pos[v], m) for (u, v), m in pair.items()]
        for ku, kv, m in self.pairs:
            self.adj[ku].append((m, kv))
            self.adj[kv].append((m.T, ku))
        self.offsets = np.cumsum([0] + [len(o) for o in objective])

    def cost(self, a: np.ndarray) -> float:
        return float(sum(o[a[k]] for k, o in enumerate(self.objective)) +
                     sum(m[a[ku], a[kv]] for ku, kv, m in self.pairs))

    def usage(self, a: np.ndarray) -> np.ndarray:
        return sum(m[:, a[k]] for k, m in enumerate(self.mem))

    def _local(self, a: np.ndarray, k: int) -> np.ndarray:
        local = self.objective[k].copy()
        for m, j in self.adj[k]:
            local += m[:, a[j]]
        return local

    def decode(self, values: np.ndarray) -> np.ndarray:
        return np.array([int(np.argmax(values[self.offsets[k]:self.offsets[k + 1]]))
                         for k in range(len(self.live))])

    def repair(self, a: np.ndarray) -> np.ndarray | None:
        """``a`` moved to fit: while a row is over, the single-node move with the least
        cost per byte it frees on the rows over (None if no move frees any, or the moves
        come back to a plan seen before: they cycle through plans that do not fit, as
        under a budget no plan meets)."""
        a = a.copy()
        use = self.usage(a)
        seen: set[bytes] = set()
        for _ in range(len(a) * 4):
            over = use > self.cap
            if not over.any():
                return a
            state = a.tobytes() + use.tobytes()  # the moves from here depend on both
            if state in seen:
                return None
            seen.add(state)
            best, pick = np.inf, None
            for k, m in enumerate(self.mem):
                freed = np.maximum(m[over, a[k]][:, None] - m[over], 0).sum(axis=0)
                if not freed.any():
                    continue
                local = self._local(a, k)
                ratio = np.where(freed > 0, (local - local[a[k]]) / np.maximum(freed, 1e-9),
                                 np.inf)
                b = int(np.argmin(ratio))
                if ratio[b] < best:
                    best, pick = ratio[b], (k, b)
            if pick is None:
                return None
            k, b = pick
            use += self.mem[k][:, b] - self.mem[k][:, a[k]]
            a[k] = b
        return None

    def polish(self, a: np.ndarray) -> np.ndarray:
        """Single-node moves to the cheapest choice that keeps the plan fitting, swept
        until none moves."""
        a = a.copy()
        use = self.usage(a)
        for _ in range(POLISH_SWEEPS):
            moved = False
            for k, m in enumerate(self.mem):
                local = self._local(a, k)
                fits = np.all(use[:, None] - m[:, [a[k]]] + m <= self.cap[:, None], axis=0)
                local[~fits] = np.inf
                b = int(np.argmin(local))
                if local[b] < local[a[k]] - 1e-9:
                    use += m[:, b] - m[:, a[k]]
                    a[k], moved = b, True
            if not moved:
                break
        return a

    def search(self, cost: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               matrix: sparse.csr_matrix, duals: np.ndarray, values: np.ndarray,
               hint: dict[int, int], time_limit: float) -> dict[int, int] | None:
        """The cheapest plan that fits, from the Lagrangian's plans at multipliers ``t·λ``
        (``λ`` the memory rows' ``duals`` as :func:`_solve` reports them, plus a small share
        on every row so a large ``t`` reaches the leanest plan), from the budgeted LP's
        rounded ``values`` and from ``hint``; None if none fits."""
        lam = duals + LAMBDA_FLOOR * max(float(duals.max()), SCALE_RANGE / max(
            float(self.cap.max()), 1.0))
        price = lam @ np.concatenate(self.mem, axis=1)
        n_choice = len(price)
        plans = [self.decode(values)]

        def relaxed(t: float) -> np.ndarray | None:
            obj = cost.copy()
            obj[:n_choice] += t * price
            name, values, _ = _solve(_model(obj, lo, hi, matrix), None, time_limit, False)
            return None if values is None else self.decode(values)

        t_lo, t_hi = 0.0, 1.0
        ahead: tuple[float, np.ndarray | None] | None = None
        for _ in range(DOUBLINGS):
            # the first bisection's relaxation solved beside the doubling's where a core is
            # idle (:func:`shardc.solve.beside.beside`): where this ``t`` fits, the
            # bisection is between it and the last that did not, and its answer is already
            # here (every search of GPT-2's frontier fitted at its first ``t``); else it is
            # dropped. The plan is the same either way: only the wall time changes
            mid = (t_lo + t_hi) / 2
            if BISECTIONS and idle_core():
                a, b = beside([partial(relaxed, t_hi), partial(relaxed, mid)])
                ahead = (mid, b)
            else:
                a = relaxed(t_hi)
            if a is None:
                break
            plans.append(a)
            if np.all(self.usage(a) <= self.cap):
                break
            t_lo, t_hi = t_hi, 2 * t_hi
        else:
            t_hi = None
        for _ in range(BISECTIONS if t_hi is not None else 0):
            t = (t_lo + t_hi) / 2
            a = ahead[1] if ahead is not None and ahead[0] == t else relaxed(t)
            ahead = None
            if a is None:
                break
            plans.append(a)
            if np.all(self.usage(a) <= self.cap):
                t_hi = t
            else:
                t_lo = t
        if all(i in hint for i in self.live):
            plans.append(np.array([hint[i] for i in self.live]))
        best, best_cost = None, np.inf
        for a in plans:
            a = self.repair(a)
            if a is None:
                continue
            a = self.polish(a)
            c = self.cost(a)
            if c < best_cost - 1e-9:
                best, best_cost = a, c
        return None if best is None else {i: int(b) for i, b in zip(self.live, best)}


def problem_size(cg: CostGraph, free: Sequence[int] | None = None) -> int:
    """A rough count of model terms: choice variables plus edge cost entries."""
    inside = set(cg.live if free is None else free)
    n = sum(len(cg.choices[i]) for i in inside)
    return n + sum(e.cost.size for e in cg.edges if e.u in inside and e.v in inside)
