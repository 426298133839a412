"""One collective instruction of a compiled program, as read from its HLO.

:class:`HloCollective` is what :func:`shardc.inspect.hlo.collectives` finds and what both
pricings take: the serial one (:func:`shardc.inspect.hlo.price`) and the overlapped replay
(:func:`shardc.inspect.schedule.schedule`). It sits below both, so the replay needs nothing
of :mod:`shardc.inspect.hlo`, which calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost import comm
from shardc.inspect.groups import Groups

__all__ = ["HloCollective"]


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled module.

    ``result_bytes`` is per device: the sum over a tuple result's elements, the result part
    of an async ``-start`` op, or the kept slice of a CPU reduce-scatter. ``groups`` hold
    logical device ids (positions in ``mesh.devices.flat``). ``axes`` are the mesh axes the
    groups span, in mesh order, or None when the groups are not full lines/planes of mesh
    axes. ``computation`` is the HLO computation the instruction sits in.
    """

    kind: str
    name: str
    result_bytes: int
    shapes: tuple[str, ...]
    group_size: int
    groups: Groups
    axes: tuple[str, ...] | None
    from_all_reduce: bool = False
    computation: str = ""

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends (ring formulas of :func:`shardc.cost.comm.wire_bytes`)."""
        return comm.wire_bytes(self.kind, self.group_size, self.result_bytes)
