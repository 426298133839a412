"""FLOPs per primitive: one table keyed by primitive name, filled by the sharding rules'
``@register(..., flops=...)`` (``shardc/rules/``) as they are imported with ``shardc``;
a primitive without an entry counts one FLOP per output element. The trace weighs a cond's
branches by it, the cost model prices compute by it."""

from __future__ import annotations

from collections.abc import Callable

from shardc.ir.graph import Op

__all__ = ["FLOPS", "FlopsFn", "elementwise_flops", "op_flops"]


FlopsFn = Callable[[Op], float]


FLOPS: dict[str, FlopsFn] = {}


def elementwise_flops(op: Op) -> float:
    return float(sum(v.size for v in op.outputs))


def op_flops(op: Op) -> float:
    """Total FLOPs of the op on one device holding everything."""
    return float(FLOPS.get(op.name, elementwise_flops)(op))
