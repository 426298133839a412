"""The placement ILP's constraint matrix: rows collected a block at a time, and the pair
rows that price an edge on the groups of its producer's and consumer's choices with equal
costs (:mod:`shardc.solve.ilp`)."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sparse

__all__ = ["Rows", "groups", "pair_rows"]


def groups(mat: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows (``axis=0``) or columns (``axis=1``) of ``mat`` in order of first
    appearance, and each row's (column's) group."""
    lines = np.ascontiguousarray(mat if axis == 0 else mat.T)
    data, width = lines.tobytes(), lines.shape[1] * lines.itemsize
    first: dict[bytes, int] = {}
    inverse = [first.setdefault(data[k:k + width], len(first))
               for k in range(0, len(data), width)] if width else [0] * len(lines)
    where = np.unique(inverse, return_index=True)[1] if len(first) < len(lines) else \
        np.arange(len(lines))
    uniq = lines[where]
    return (uniq if axis == 0 else uniq.T), np.array(inverse, dtype=int)


class Rows:
    """A sparse constraint matrix collected a block of rows at a time: ``lo <= A x <= hi``."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.n = 0

    def add(self, cols: np.ndarray, vals: np.ndarray, lo: float, hi: float) -> None:
        """One row."""
        self.add_block(np.zeros(len(cols), dtype=int), cols, vals, 1, lo, hi)

    def add_block(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int,
                  lo: float, hi: float) -> None:
        """``n`` rows at once, all bounded by ``lo`` and ``hi``; entry ``k`` is at row
        ``rows[k]`` of the block, column ``cols[k]``."""
        self.rows.append(self.n + rows)
        self.cols.append(cols)
        self.vals.append(vals)
        self.lo.append(np.full(n, lo))
        self.hi.append(np.full(n, hi))
        self.n += n

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.lo:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(self.lo), np.concatenate(self.hi)

    def matrix(self, n_vars: int) -> sparse.csr_matrix:
        if not self.n:
            return sparse.csr_matrix((0, n_vars))
        return sparse.csr_matrix(
            (np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
            shape=(self.n, n_vars))


def pair_rows(rows: Rows, edges: list[tuple[np.ndarray, np.ndarray, int, int]],
               n_vars: int) -> int:
    """Every edge's pair variables ``e[p, g]`` (numbered from ``n_vars``, edge by edge, row
    group by row group) and rows, ``Σ_g e[p, g] = X_p`` then ``Σ_p e[p, g] = Y_g``, added
    as one block (each edge's rows in turn, entries in the order one block per edge gave:
    the same matrix). ``edges``: per edge, each row's and column's group and the first
    columns of its two nodes' choices. Returns the variable count after them."""
    ri, ci = [e[0] for e in edges], [e[1] for e in edges]
    n_p = np.array([r.max() + 1 for r in ri])
    n_g = np.array([c.max() + 1 for c in ci])
    first_row = _starts(n_p + n_g)
    of, local = _spread(n_p * n_g)  # each pair variable's edge and place in it
    p, g = local // n_g[of], local % n_g[of]
    of_r, at_r = _spread(np.array([len(r) for r in ri]))  # u's choices
    of_c, at_c = _spread(np.array([len(c) for c in ci]))  # v's choices
    e = n_vars + np.arange(len(of))
    x_rows, y_rows = first_row, first_row + n_p
    rows.add_block(
        np.concatenate([x_rows[of] + p, x_rows[of_r] + np.concatenate(ri),
                        y_rows[of] + g, y_rows[of_c] + np.concatenate(ci)]),
        np.concatenate([e, np.array([u for _, _, u, _ in edges])[of_r] + at_r,
                        e, np.array([v for _, _, _, v in edges])[of_c] + at_c]),
        np.concatenate([np.ones(e.size), -np.ones(len(of_r)), np.ones(e.size),
                        -np.ones(len(of_c))]),
        int((n_p + n_g).sum()), 0.0, 0.0)
    return n_vars + e.size


def _starts(sizes: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of ``sizes`` starts."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)


def _spread(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive runs of ``sizes``: each element's run and its place in that run."""
    of = np.repeat(np.arange(len(sizes)), sizes)
    return of, np.arange(len(of)) - _starts(sizes)[of]
