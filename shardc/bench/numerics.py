"""Whether a sharded train step's results equal the unsharded step's, to a tolerance derived
from the step itself.

A sharded step sums its reductions in another order, so its results differ from the
unsharded ones by rounding, relative to each leaf's largest value rather than to each
element: a gradient element that is the small difference of large summands keeps their
absolute error. Every element may therefore differ by :data:`ULPS` units in the last place
of its leaf's largest magnitude, beside the plain ``atol + rtol * |want|``. Most results
inherit that error at its size. Adam's update does not: it divides each gradient element by its own
magnitude, ``lr * g / (|g| + eps)``, so an element whose gradient is small against its
leaf's largest moves by up to ``lr`` on a rounding-sized change of ``g`` (its derivative is
``lr * eps / (|g| + eps)**2 <= lr / |g|``). Each parameter element may therefore differ by
``lr * min(2, GRAD_RTOL * max|g| / |g_i|)`` on top of the plain tolerance, read off the
unsharded step's own second moments (``nu = (1 - b2) g**2`` after one step: ``sqrt(nu)``
is ``|g|`` up to a factor common to the leaf). The gradients themselves, the moments,
are held to the plain tolerance, so a wrong gradient still fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardc.errors import BenchError

__all__ = ["ATOL", "GRAD_RTOL", "mismatches", "RTOL", "step_close", "ULPS"]

#: the plain tolerance of every result: ``|got - want| <= ATOL + RTOL * |want|``
RTOL, ATOL = 1e-4, 1e-5
#: units in the last place of a leaf's largest magnitude that reassociated sums may move any
#: of its elements by (float32: 1.9e-6 of the leaf's scale; a pipelined SGD step's
#: gradients on 8 CPU devices differ by up to 7e-8 of theirs, elementwise by 6.6e-5)
ULPS = 16
#: a gradient element is trusted to this fraction of its leaf's largest element (float32
#: reductions of at most a few thousand terms round far below it)
GRAD_RTOL = 1e-4


def step_close(got, want, lr: float = 0.0) -> bool:
    """Whether results ``got`` equal ``want`` (pytrees of one structure) to the tolerance the
    module doc derives; ``lr``: the Adam learning rate of the step that made them (0: no
    parameter gets more than the plain tolerance)."""
    return not mismatches(got, want, lr)


def mismatches(got, want, lr: float = 0.0, *, rtol: float = RTOL,
               atol: float = ATOL) -> list[str]:
    """The leaves of ``got`` that differ from ``want`` beyond the tolerance, each named by
    its path with its largest difference, or ``[]``.

    Args:
        got: the sharded run's results.
        want: the reference run's (a tree of the same structure).
        lr: the Adam learning rate of the step that made them (0: no Adam bound).
        rtol: the elementwise relative tolerance.
        atol: the elementwise absolute tolerance.

    Returns:
        One line per leaf that differs, naming its path.

    Raises:
        ValueError: where the two trees differ in structure.
    """
    flat, tree = jax.tree_util.tree_flatten_with_path(want)
    if jax.tree.structure(got) != tree:
        raise BenchError(f"results differ in structure: {jax.tree.structure(got)} "
                         f"against {tree}")
    bounds = _update_bounds(flat, lr)
    out = []
    for (path, w), g in zip(flat, jax.tree.leaves(got), strict=True):
        w = np.asarray(w)
        ulp = float(jnp.finfo(w.dtype).eps) if jnp.issubdtype(w.dtype, jnp.inexact) else 0.0
        g = np.asarray(g)
        wide = np.complex128 if np.iscomplexobj(w) or np.iscomplexobj(g) else np.float64
        w, g = w.astype(wide), g.astype(wide)
        if w.shape != g.shape:
            out.append(f"{jax.tree_util.keystr(path)}: shape {g.shape} against {w.shape}")
            continue
        scale = float(np.nanmax(np.abs(w), initial=0.0)) if w.size else 0.0
        tol = (atol + rtol * np.abs(w) + ULPS * ulp * scale
               + bounds.get(_names(path), 0.0))
        over = np.abs(g - w) - tol
        bad = np.isnan(over) & ~(np.isnan(g) & np.isnan(w)) | (over > 0)
        if bad.any():
            worst = float(np.nanmax(np.where(bad, np.abs(g - w), 0.0), initial=np.nan))
            out.append(f"{jax.tree_util.keystr(path)}: {int(bad.sum())} elements, "
                       f"largest difference {worst:.3g}")
    return out


def _names(path) -> tuple[str, ...]:
    return tuple(jax.tree_util.keystr((k,)) for k in path)


def _update_bounds(flat, lr: float) -> dict[tuple[str, ...], np.ndarray]:
    """Parameter path -> the extra difference each element's Adam update may show: the
    parameters are the leaves under a ``["params"]`` key, matched by the rest of their
    path to the ``.nu`` leaves of an Adam state (the zoo's ``{"params", "opt"}`` state)."""
    if lr <= 0:
        return {}
    nu: dict[tuple[str, ...], np.ndarray] = {}
    for path, leaf in flat:
        names = _names(path)
        if ".nu" in names:
            nu[names[names.index(".nu") + 1:]] = np.asarray(leaf, dtype=np.float64)
    out = {}
    for path, leaf in flat:
        names = _names(path)
        if "['params']" not in names:
            continue
        rest = names[names.index("['params']") + 1:]
        second = nu.get(rest)
        if second is None or second.shape != np.shape(leaf):
            continue
        g = np.sqrt(np.maximum(second, 0.0))
        top = g.max(initial=0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(g > 0, GRAD_RTOL * top / g, 2.0)
        out[names] = lr * np.minimum(2.0, rel) if top > 0 else np.zeros_like(g)
    return out
