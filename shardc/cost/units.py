"""The cost model's units as people read them: seconds and bytes."""

from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_time"]


def fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def fmt_bytes(b: float, up: bool = False) -> str:
    """``b`` bytes in the largest binary unit it fills, to 2 decimals; ``up`` rounds up (a
    budget printed this way is never below ``b``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            v = math.ceil(b / size * 100) / 100 if up else b / size
            return f"{v:.2f} {unit}"
    return f"{math.ceil(b) if up else b:.0f} B"
