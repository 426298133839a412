"""Batched linear algebra: the ``lax.linalg`` primitives (``cholesky``, ``triangular_solve``,
``lu``, ``qr``, ``eigh``, ``svd``, ...) and ``custom_linear_solve``.

Each ``lax.linalg`` primitive works on the last two dims of its operands (matrices; the last
one for a vector operand such as ``householder_product``'s ``taus`` or
``lu_pivots_to_permutation``'s pivots) and maps every leading dim through: all operands and
results share those batch dims (jax's shape rules require equal batch dims, e.g.
``triangular_solve``'s ``a`` and ``b``, whichever ``left_side``). Per mesh axis, a batch dim
may be split, every operand and result together, ``S(d)...->S(d)...`` (OneFlow's batched
``matmul`` / ``bmm`` signatures; XLA partitions jax's LAPACK / cuSOLVER custom calls along
their batch dims, which jax registers as batch-partitionable). A matrix dim is never split:
each factorisation reads its whole matrix. No partial: none of them is linear in its
matrix (``triangular_solve`` is linear in ``b`` alone, but its split dims already divide
the work; left out).

The batch rank is the first operand's rank less its core rank (:data:`CORE_RANK`); a split
of dim ``d`` is offered when every operand and result has the batch size at ``d``.

FLOPs, per matrix, times the batch (m x n operand, k = min(m, n); leading terms; LAPACK
Working Note 41 for the LAPACK routines jax calls on CPU, Golub & Van Loan for the iterative
eigen- and singular value solvers):

* ``cholesky`` (``potrf``): n^3 / 3;
* ``lu`` (``getrf``, partial pivoting): M k^2 - k^3 / 3 with M = max(m, n) (2 n^3 / 3
  square);
* ``triangular_solve`` (``trsm``): n^2 per right-hand side, n the order of ``a``: n x the
  elements of ``b``;
* ``geqrf`` (Householder QR's R): 2 M k^2 - 2 k^3 / 3; ``householder_product``
  (``orgqr``, Q's q columns from k reflectors): 4 m q k - 2 (m + q) k^2 + 4 k^3 / 3;
  ``qr`` is the two: geqrf, then orgqr for Q's m (``full_matrices``) or k columns
  (8 n^3 / 3 square);
* ``eigh`` (tridiagonalisation and the symmetric QR algorithm with eigenvectors): 9 n^3;
* ``svd`` (Golub-Reinsch, m >= n else transposed): 4 m n^2 - 4 n^3 / 3 for the singular
  values only, 14 m n^2 + 8 n^3 with thin U, V, 4 m^2 n + 8 m n^2 + 9 n^3 with full U;
* ``eig`` and ``schur`` (Hessenberg reduction and the Francis QR steps): 10 n^3 for the
  eigenvalues, 25 n^3 with eigenvectors (Schur vectors);
* ``hessenberg`` (``gehrd``): 10 n^3 / 3; ``tridiagonal`` (``sytrd``): 4 n^3 / 3;
* ``ormqr`` (apply Q of k reflectors to an m x n C): 4 m n k - 2 n k^2 from the left,
  4 m n k - 2 m k^2 from the right; ``symmetric_product`` (``syrk``, C = A A^T for an
  n x k A): n^2 k.

``custom_linear_solve`` (``jnp.linalg.solve``, ``jax.scipy.sparse.linalg.cg`` & co.) holds its
linear map as jaxprs; run, it evaluates its ``solve`` jaxpr on ``b`` (the others, ``matvec``,
``vecmat``, ``transpose_solve``, serve derivatives). Its signatures come from its jaxprs as a
``cond``'s come from its branches (``rules/control.py``, :func:`propagate`): for every dim
and size of ``b``'s leaves, the consts and ``b`` split there (a const without that dim
stays replicated, sliced if each of its uses slices it) are pushed through every jaxpr it
holds; a split is offered when all of them stay exact and most of the solve's work is split.
Its FLOPs are the solve jaxpr's.

References:
  L. S. Blackford and J. J. Dongarra, "Installation Guide for LAPACK", LAPACK Working Note
  41, Appendix C (operation counts of xPOTRF, xGETRF, xTRSM, xGEQRF, xORGQR, xORMQR, xGEHRD,
  xSYTRD, xSYRK);
  G. H. Golub and C. F. Van Loan, Matrix Computations, 4th ed. (2013), §8.3 (symmetric QR:
  9 n^3), §8.6.3 (Golub-Reinsch SVD counts), §7.5.6 (the QR algorithm: 10 n^3, 25 n^3),
  §7.4.3 (Hessenberg reduction), §8.3.1 (tridiagonalisation);
  OneFlow ``user/ops/matmul_op.cpp`` (batch splits); jax ``_src/lax/linalg.py`` (the
  primitives, shapes and params), ``_src/lax/control_flow/solves.py``
  (``custom_linear_solve``).
"""

from __future__ import annotations

import math

from shardc.ir.flops import op_flops
from shardc.ir.graph import Op, Value
from shardc.ir.sbp import B, Sbp, Split
from shardc.rules.control import body_graph
from shardc.rules.propagate import has_split, promote, propagate, seed, split_seeds
from shardc.rules.registry import Signature, register

__all__ = ["cholesky_flops", "CORE_RANK", "custom_linear_solve_flops",
           "custom_linear_solve_rule", "eig_flops", "eigh_flops", "FLOPS", "geqrf_flops",
           "hessenberg_flops", "householder_product_flops", "lu_flops", "ormqr_flops",
           "qr_flops", "schur_flops", "svd_flops", "symmetric_product_flops",
           "triangular_solve_flops", "tridiagonal_flops"]

#: the trailing (non-batch) rank of each primitive's first operand; the rest is batch
CORE_RANK = {
    "cholesky": 2, "triangular_solve": 2, "lu": 2, "qr": 2, "geqrf": 2, "geqp3": 2,
    "householder_product": 2, "eigh": 2, "svd": 2, "eig": 2, "schur": 2, "hessenberg": 2,
    "tridiagonal": 2, "symmetric_product": 2, "ormqr": 2, "lu_pivots_to_permutation": 1,
    "tridiagonal_solve": 1,
}


def _matrix(v: Value) -> tuple[int, int, int]:
    """(batch, m, n) of a value whose last two dims are matrices."""
    m, n = v.shape[-2:]
    return math.prod(v.shape[:-2]), m, n


def _getrf(m: int, n: int) -> float:
    big, k = max(m, n), min(m, n)
    return big * k * k - k ** 3 / 3


def _geqrf(m: int, n: int) -> float:
    big, k = max(m, n), min(m, n)
    return 2 * big * k * k - 2 * k ** 3 / 3


def _orgqr(m: int, q: int, k: int) -> float:
    return 4 * m * q * k - 2 * (m + q) * k * k + 4 * k ** 3 / 3


def cholesky_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    return b * n ** 3 / 3


def lu_flops(op: Op) -> float:
    b, m, n = _matrix(op.inputs[0])
    return b * _getrf(m, n)


def triangular_solve_flops(op: Op) -> float:
    a, rhs = op.inputs
    return float(a.shape[-1] * rhs.size)


def geqrf_flops(op: Op) -> float:
    b, m, n = _matrix(op.inputs[0])
    return b * _geqrf(m, n)


def householder_product_flops(op: Op) -> float:
    b, m, q = _matrix(op.inputs[0])
    return b * _orgqr(m, q, op.inputs[1].shape[-1])


def qr_flops(op: Op) -> float:
    b, m, n = _matrix(op.inputs[0])
    k = min(m, n)
    q = m if op.params.get("full_matrices") else k
    return b * (_geqrf(m, n) + _orgqr(m, q, k))


def eigh_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    return 9.0 * b * n ** 3


def svd_flops(op: Op) -> float:
    b, m, n = _matrix(op.inputs[0])
    m, n = max(m, n), min(m, n)
    if not op.params.get("compute_uv", True):
        return b * (4 * m * n * n - 4 * n ** 3 / 3)
    if op.params.get("full_matrices", True):
        return b * (4 * m * m * n + 8 * m * n * n + 9 * n ** 3)
    return b * (14 * m * n * n + 8 * n ** 3)


def eig_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    vectors = op.params.get("compute_left_eigenvectors") or \
        op.params.get("compute_right_eigenvectors")
    return b * (25.0 if vectors else 10.0) * n ** 3


def schur_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    return b * (25.0 if op.params.get("compute_schur_vectors", True) else 10.0) * n ** 3


def hessenberg_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    return b * 10 * n ** 3 / 3


def tridiagonal_flops(op: Op) -> float:
    b, n, _ = _matrix(op.inputs[0])
    return b * 4 * n ** 3 / 3


def ormqr_flops(op: Op) -> float:
    b, m, n = _matrix(op.inputs[2])
    k = op.inputs[1].shape[-1]
    return b * (4 * m * n * k - 2 * (n if op.params.get("left", True) else m) * k * k)


def symmetric_product_flops(op: Op) -> float:
    b, n, k = _matrix(op.inputs[0])
    return float(b * n * n * k)


FLOPS = {
    "cholesky": cholesky_flops, "lu": lu_flops, "triangular_solve": triangular_solve_flops,
    "geqrf": geqrf_flops, "geqp3": geqrf_flops, "householder_product": householder_product_flops,
    "qr": qr_flops, "eigh": eigh_flops, "svd": svd_flops, "eig": eig_flops,
    "schur": schur_flops, "hessenberg": hessenberg_flops, "tridiagonal": tridiagonal_flops,
    "ormqr": ormqr_flops, "symmetric_product": symmetric_product_flops,
}


def _batch_signatures(op: Op) -> list[Signature]:
    x = op.inputs[0]
    values = (*op.inputs, *op.outputs)
    sigs = []
    for d in range(x.ndim - CORE_RANK[op.name]):
        size = x.shape[d]
        if size > 1 and all(v.ndim > d and v.shape[d] == size for v in values):
            sigs.append(Signature((Split(d),) * len(op.inputs), (Split(d),) * len(op.outputs)))
    return sigs


for _name in CORE_RANK:
    register(_name, flops=FLOPS.get(_name))(_batch_signatures)


# ---- custom_linear_solve -----------------------------------------------------------------

def _groups(op: Op) -> list[tuple[object, slice]]:
    """(jaxpr, slice of the op's inputs holding its consts) of every jaxpr the solve holds."""
    lengths, jaxprs = op.params["const_lengths"], op.params["jaxprs"]
    out, start = [], 0
    for n, jaxpr in zip(lengths, jaxprs, strict=True):
        if jaxpr is not None:
            out.append((jaxpr, slice(start, start + n)))
        start += n
    return out


def _n_consts(op: Op) -> int:
    return sum(op.params["const_lengths"])


def custom_linear_solve_flops(op: Op) -> float:
    return float(sum(op_flops(o) for o in body_graph(op.params["jaxprs"].solve).ops))


def _placed(op: Op, consts: list[Sbp], rhs: list[Sbp], size: int) -> Signature | None:
    """The signature with the consts and ``b`` placed so, or None where a jaxpr the solve
    holds is not exact for it or the solve would run mostly replicated."""
    uses: list[set[Sbp]] = [set() for _ in consts]
    outs = None
    solve = op.params["jaxprs"].solve
    for jaxpr, where in _groups(op):
        flow = propagate(body_graph(jaxpr), [*consts[where], *rhs], size)
        if flow is None:
            return None
        for k, u in zip(range(where.start, where.stop), flow.uses):
            uses[k] |= u
        if jaxpr is solve:
            if not flow.divides_work:
                return None
            outs = flow.outs
    if outs is None:
        return None
    return Signature((*promote(consts, uses), *rhs), tuple(outs))


@register("custom_linear_solve", flops=custom_linear_solve_flops)
def custom_linear_solve_rule(op: Op) -> list[Signature]:
    nc = _n_consts(op)
    consts, rhs = op.inputs[:nc], op.inputs[nc:]
    sigs = []
    for d, size in split_seeds(rhs):
        seeded = [seed(v, d, size) for v in rhs]
        for placed in ([seed(v, d, size) for v in consts], [B] * nc):
            sig = _placed(op, placed, seeded, size)
            if sig is not None:
                break
        if sig is not None and has_split(sig) and sig not in sigs:
            sigs.append(sig)
    return sigs
