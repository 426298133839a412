"""A plan drawn: the layout of every op's output per mesh axis in program order (repeated
layers show as a repeating band), and where the step's time goes (compute against
communication, cumulative over the program, with the step's totals).

Drawn on a :class:`matplotlib.figure.Figure` of its own, never through pyplot, so the
process's backend and a notebook's inline plotting are left alone; matplotlib comes with
the ``bench`` extra.
"""

from __future__ import annotations

import numpy as np

from shardc.cost.units import fmt_time
from shardc.ir.sbp import Broadcast, Partial, Split
from shardc.report.explain import fold_repeats

__all__ = ["comm_by_op", "layout_codes", "plot_plan"]

#: colour index per layout kind: replicated, partial, split on dim 0, 1, 2, 3 or more
KINDS = ("B", "P", "S(0)", "S(1)", "S(2)", "S(3+)")


def _code(sbp) -> int:
    if isinstance(sbp, Broadcast):
        return 0
    if isinstance(sbp, Partial):
        return 1
    assert isinstance(sbp, Split)
    return 2 + min(sbp.dim, 3)


def layout_codes(plan) -> np.ndarray:
    """``[mesh axis, op]``: the :data:`KINDS` index of each op's first output's layout on
    each mesh axis (-1 for an op with no output), in program order."""
    out = np.full((len(plan.mesh_axes), len(plan.ops)), -1, dtype=int)
    for j, o in enumerate(plan.ops):
        if o.outs:
            out[:, j] = [_code(s) for s in o.outs[0].sbps]
    return out


def comm_by_op(plan) -> np.ndarray:
    """Seconds of communication per op in program order: each planned conversion where it
    runs (before the op that reads it; a value's settling right after the op that makes
    it, or before the first op for an argument; a result's at the end). Sums to the plan's
    predicted communication time."""
    at = {o.id: j for j, o in enumerate(plan.ops)}
    made = {vid: j for j, o in enumerate(plan.ops) for vid in o.writes}
    out = np.zeros(len(plan.ops))
    if not len(out):
        return out
    for r in plan.reshards:
        if r.consumer is None:
            j = made.get(r.value, 0)
        elif r.consumer >= 0:
            j = at.get(r.consumer, 0)
        else:
            j = len(out) - 1
        out[j] += r.time
    return out


def plot_plan(plan, path: str | None = None):
    """Two panels: the per-op layout per mesh axis (repeated runs of ops marked with their
    count) and the cumulative compute and communication time over the program; saved to
    ``path`` (PNG, by its suffix) if given. Returns the ``Figure``."""
    try:
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("Plan.plot needs matplotlib: pip install 'shardc[bench]'") from exc
    codes = layout_codes(plan)
    fig = Figure(figsize=(10, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 2))
    cmap = ListedColormap(["#d9d9d9", "#fdae61", "#2c7bb6", "#abd9e9", "#1a9641", "#a6d96a"])
    shown = np.ma.masked_less(codes, 0)
    image = top.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5,
                       vmax=len(KINDS) - 0.5)
    top.set_yticks(range(len(plan.mesh_axes)),
                   [f"{name}={size}" for name, size in plan.mesh_axes])
    top.set_title("output layout per mesh axis, ops in program order")
    bar = fig.colorbar(image, ax=top, ticks=range(len(KINDS)), pad=0.01)
    bar.ax.set_yticklabels(KINDS)
    sigs = [(o.prim, o.strategy, o.types) for o in plan.ops]
    for start, period, count in fold_repeats(sigs):
        if count > 1:
            top.axvspan(start - 0.5, start + period * count - 0.5, fill=False,
                        edgecolor="black", linewidth=0.8)
            top.text(start, -0.6, f"x{count}", fontsize=7, va="bottom")
    us = 1e6
    compute = np.cumsum([o.compute_time for o in plan.ops]) * us
    comm = np.cumsum(comm_by_op(plan)) * us
    x = np.arange(len(plan.ops))
    bottom.fill_between(x, 0, compute, step="post", color="C0", alpha=0.6, label="compute")
    bottom.fill_between(x, compute, compute + comm, step="post", color="C3", alpha=0.6,
                        label="communication")
    p = plan.predicted
    bottom.set_title(f"predicted step {fmt_time(p.step_time)}: compute "
                     f"{fmt_time(p.compute_time)}, comm {fmt_time(p.comm_time)}, input feed "
                     f"{fmt_time(p.feed_time)}",
                     fontsize=10)
    bottom.set_xlabel("op (program order)")
    bottom.set_ylabel("cumulative time (us)")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
