"""The cost model's units as people read them: seconds and bytes."""

from __future__ import annotations

from shardc.errors import fmt_bytes as fmt_bytes

__all__ = ["fmt_bytes", "fmt_time"]


def fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"
