"""The bench figure (``results.png``): shardc / best expert per cell, one panel per pricing.

Each panel is one pricing of the compiled programs (a collective model, serial or
overlapped; :data:`shardc.bench.harness.PRICINGS`): a bar per (model, preset) from 1.0 to
the ratio of shardc's plan made for that pricing over the best fitting expert under the
same pricing, on a log axis (left of 1.0 shardc is faster), the default plan's ratio a dot
where it differs. Results made before the pricings give one serial and one overlapped panel
from :func:`shardc.bench.report.summary`.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["draw"]

_TICKS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0)


def _gmean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def draw(labels: list[str], ps: list[dict], path: Path) -> None:
    """Draw the panels ``ps`` (:func:`shardc.bench.report.figure_panels`: per panel its
    ``title`` and, per label, the ``planned`` and ``default`` ratios) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    every = [x for p in ps for k in ("planned", "default") for x in p[k] if x]
    lo, hi = min(every + [1.0]) / 1.04, max(every + [1.0]) * 1.04
    ticks = [t for t in _TICKS if lo <= t <= hi]
    right = hi * 1.14  # a column for the ratios' values, right of every bar and dot
    fig, axes = plt.subplots(1, len(ps), sharey=True, squeeze=False,
                             figsize=(1.2 + 2.3 * len(ps), 1.6 + 0.32 * len(labels)))
    ys = range(len(labels))
    for ax, p in zip(axes[0], ps):
        for y, planned, default in zip(ys, p["planned"], p["default"]):
            if planned:
                ax.barh(y, planned - 1.0, left=1.0, height=0.7,
                        color="tab:green" if planned <= 1.0 else "tab:red")
                ax.text(right / 1.01, y, f"{planned:.2f}", va="center", ha="right", fontsize=7)
            if default and planned and abs(default - planned) > 5e-4:
                ax.plot([default], [y], "o", color="black", markersize=3.5)
        ax.axvline(1.0, color="black", linewidth=1.0)
        ax.set_xscale("log")
        ax.set_xlim(lo, right)
        ax.axvspan(hi, right, color="0.95", linewidth=0)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:.1f}" for t in ticks]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", color="0.85", linewidth=0.6)
        ax.set_axisbelow(True)
        gm = _gmean(p["planned"])
        ax.set_title(p["title"] + (f"\ngeomean {gm:.3f}" if gm else ""), fontsize=9)
    first = axes[0][0]
    first.set_yticks(list(ys), labels, fontsize=8)
    first.invert_yaxis()
    fig.supxlabel("compiled step, shardc / best expert under the same pricing "
                  "(log; < 1: shardc faster; dot: the default plan where it differs)",
                  fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
