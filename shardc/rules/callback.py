"""Host callbacks: ``jax.debug.print``, ``jax.debug.callback``, ``io_callback``,
``pure_callback``.

The host sees whole values: under ``jax.jit`` a callback that is not ``partitioned`` gets
every operand gathered and runs once, so its only signature is all-broadcast (the
registry's replicated one, priced as the gathers into it). A callback with effects and no
outputs is still a node of the plan: its operands' conversions are priced, and it runs in
program order (``Op.effects``). No FLOPs on the device.

References:
  JAX ``jax._src.debugging`` (``debug_callback`` lowers to one host call for the whole
  program unless ``partitioned=True``).
"""

from __future__ import annotations

from shardc.ir.graph import Op
from shardc.rules.registry import Signature, register

__all__ = ["callback_flops", "callback_rule"]


def callback_flops(op: Op) -> float:
    return 0.0


@register("debug_callback", "debug_print", "io_callback", "pure_callback", flops=callback_flops)
def callback_rule(op: Op) -> list[Signature]:
    return []
