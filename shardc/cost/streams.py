"""The two-stream model both overlap replays share: a price with communication overlapped
(:class:`Overlap`) and which collective a free communication stream runs next
(:func:`next_collective`).

A compiled program's replay (:func:`shardc.inspect.schedule.schedule`) and a plan's
(:func:`shardc.plan.overlap.plan_overlap`) both build on these; they sit here, below both
the plan and the inspection of compiled programs, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Overlap", "next_collective"]

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Overlap:
    """A program (compiled, or a plan) priced with its communication overlapped: ``time``
    seconds end to end, ``compute`` seconds of compute and ``comm`` seconds of collectives
    run one after another (both the serial pricing's)."""

    time: float
    compute: float
    comm: float

    @property
    def exposed(self) -> float:
        """Communication seconds not hidden behind compute."""
        return self.time - self.compute

    @property
    def hidden(self) -> float:
        """Communication seconds that ran beside compute."""
        return self.comm - self.exposed


def next_collective(startable: Mapping[K, tuple[float, float]], free_at: float) -> K:
    """Which collective a communication stream free at ``free_at`` runs next, of
    ``startable`` ones by (earliest start, deadline): of those that can start by then,
    the one needed first; when none can, the one that can soonest."""
    now = [k for k, (t, _) in startable.items() if t <= free_at]
    if now:
        return min(now, key=lambda k: startable[k][1])
    return min(startable, key=startable.__getitem__)
