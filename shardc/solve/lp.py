"""A budgeted search's LP relaxations as one HiGHS model, extended round by round.

Each memory round of a budgeted search (:func:`shardc.solve.search.solve`) solves the model
of the round before with one memory row more. :class:`LpChain` keeps that model in HiGHS
through ``highspy`` (HiGHS's own binding; OR-Tools' model builder, which
:mod:`shardc.solve.ilp` solves every other model with, has no warm start), adds the rows and
re-solves from the last optimal basis.

References:
  Huangfu & Hall, "Parallelizing the dual revised simplex method" (Mathematical Programming
  Computation, 2018): HiGHS's dual simplex and its hot start after a model change.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import scipy.sparse as sparse

__all__ = ["HIGHS_OPTIONS", "LP_PRESOLVE", "LpChain"]

#: HiGHS presolve for the LP relaxation: off. The pair-variable LPs have little for it to
#: remove, and dual simplex without it solves them sooner, to the same optimum
LP_PRESOLVE = "off"
#: the HiGHS options of every solve, through OR-Tools or ``highspy``: one thread and a fixed
#: seed, so a plan does not depend on the machine
HIGHS_OPTIONS = {"threads": 1, "random_seed": 0}


class LpChain:
    """The LP relaxations of one search's budgeted models (the module doc).

    A round's model is the last one's with memory rows added: the rows before them, the
    costs and the bounds are the same. Where a model extends the last one so, the new rows
    are added to the model HiGHS holds, and its dual simplex goes on from the last optimal
    basis, which the added rows leave dual feasible (a 3-layer MLP's 11 budgeted LPs on a
    2x8 mesh: 2.2 s against 5.3 s solved anew, the same optima). Any other model is built
    anew. One chain per search, used by one thread at a time: its answers depend on that
    search's rounds only.
    """

    def __init__(self):
        self._highs = None
        self._last: tuple | None = None  # (cost, lo, hi, matrix) of the model it holds

    def solve(self, cost: np.ndarray, lo: np.ndarray, hi: np.ndarray,
              matrix: sparse.csr_matrix, time_limit: float
              ) -> tuple[str, np.ndarray | None, np.ndarray | None]:
        """``min cost·z`` over ``0 <= z <= 1``, ``lo <= matrix z <= hi``: the status, the
        values and the rows' duals (None, None where it has no optimum)."""
        k = self._extends(cost, lo, hi, matrix)
        if k:
            new = matrix[k:]
            self._highs.addRows(new.shape[0], lo[k:], hi[k:], new.nnz,
                                new.indptr[:-1].astype(np.int32),
                                new.indices.astype(np.int32), new.data)
        else:
            self._highs = _lp_model(cost, lo, hi, matrix)
        self._last = (cost, lo, hi, matrix)
        h = self._highs
        h.setOptionValue("time_limit", max(time_limit, 1e-3))
        h.run()
        status = h.getModelStatus()
        if status == type(status).kInfeasible:
            return "INFEASIBLE", None, None
        if status != type(status).kOptimal:
            return "UNKNOWN", None, None
        solution = h.getSolution()
        return "OPTIMAL", np.asarray(solution.col_value), np.asarray(solution.row_dual)

    def _extends(self, cost: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 matrix: sparse.csr_matrix) -> int:
        """The rows of the held model where this one is it with rows added, else 0."""
        if self._last is None:
            return 0
        c0, lo0, hi0, m0 = self._last
        k = m0.shape[0]
        if matrix.shape[1] != m0.shape[1] or matrix.shape[0] <= k:
            return 0
        same = (np.array_equal(cost, c0) and np.array_equal(lo[:k], lo0)
                and np.array_equal(hi[:k], hi0)
                and np.array_equal(matrix.indptr[:k + 1], m0.indptr)
                and np.array_equal(matrix.indices[:m0.nnz], m0.indices)
                and np.array_equal(matrix.data[:m0.nnz], m0.data))
        return k if same else 0


def _lp_model(cost: np.ndarray, lo: np.ndarray, hi: np.ndarray, matrix: sparse.csr_matrix):
    """``min cost·z`` over ``0 <= z <= 1``, ``lo <= matrix z <= hi`` as a HiGHS model."""
    import highspy

    h = _quiet_highs()
    lp = highspy.HighsLp()
    lp.num_row_, lp.num_col_ = matrix.shape
    lp.col_cost_ = cost
    lp.col_lower_, lp.col_upper_ = np.zeros(lp.num_col_), np.ones(lp.num_col_)
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    h.passModel(lp)
    return h


def _quiet_highs():
    """A HiGHS instance set as every LP here is solved (silent, :data:`HIGHS_OPTIONS`,
    :data:`LP_PRESOLVE`). HiGHS writes its banner to the process's standard output when it
    makes its first instance, before any option can silence it, so that one is made with
    standard output sent to ``/dev/null``."""
    import highspy

    global _BANNER_SHOWN
    with contextlib.nullcontext() if _BANNER_SHOWN else _stdout_to_devnull():
        h = highspy.Highs()
    _BANNER_SHOWN = True
    for key, value in {"output_flag": False, **HIGHS_OPTIONS, "presolve": LP_PRESOLVE}.items():
        h.setOptionValue(key, value)
    return h


@contextlib.contextmanager
def _stdout_to_devnull():
    """The process's standard output (file descriptor 1, which C code writes to) sent to
    ``/dev/null`` while inside; left as it is where it cannot be duplicated."""
    sys.stdout.flush()
    try:
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no standard output to silence
        yield
        return
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


#: whether this process made a HiGHS instance (:func:`_quiet_highs`)
_BANNER_SHOWN = False
