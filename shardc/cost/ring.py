"""What a ring signature (a collective matmul, :mod:`shardc.rules.dot`) costs beyond its
product: ``n - 1`` sends round an axis of ``n`` devices, each of one block (an operand's
piece, or a block of partial sums), while each device computes with the block it holds.

The product runs as ``n`` products of a ``1/n`` share (each paying its kernel's own time:
:func:`shardc.cost.kernels.compute_seconds`). On a cluster that overlaps communication with
compute (:attr:`shardc.cost.cluster.Cluster.overlap`, as XLA:GPU's latency-hiding
scheduler runs an asynchronous collective-permute beside the product that does not wait for
it) each send hides behind one block's product and only what it outlasts is paid; else
every send is paid in full, after the product it follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.cost.kernels import compute_seconds
from shardc.ir.graph import Graph, Op

__all__ = ["Ring", "ring_cost"]


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring's cost beyond the product's.

    Attributes:
        axis: The mesh axis the blocks pass round.
        steps: The sends each device makes per run of the op (``n - 1``).
        block_bytes: Bytes of one send.
        send: Seconds of one send.
        step: Seconds of one block's product.
        sends: Seconds of the sends not hidden behind the products, over every run of
            the op (its ``weight``).
        products: Seconds the ``n`` block products take beyond the one product's, over
            every run.
    """

    axis: int
    steps: int
    block_bytes: float
    send: float
    step: float
    sends: float
    products: float

    @property
    def seconds(self) -> float:
        """Seconds the ring adds to the product."""
        return self.sends + self.products


def ring_cost(cluster, graph: Graph, op: Op, strategy, axis_sizes: Sequence[int],
              axis_names: Sequence[str]) -> Ring | None:
    """The ring of ``strategy`` (a :class:`~shardc.rules.registry.Strategy` of ``op``, a
    ``dot_general`` of ``graph``) on ``cluster`` (a :class:`~shardc.cost.cluster.Cluster`),
    or None for a strategy without one."""
    if not strategy.ring:
        return None
    axis, what = strategy.ring
    n = axis_sizes[axis]
    value, layout = (op.outputs[0], strategy.outs[0]) if what == 2 else \
        (op.inputs[what], strategy.ins[what])
    block = value.nbytes * layout.shard_fraction(axis_sizes)
    send = cluster.send_seconds([(axis_names[axis], n)], block)
    whole = compute_seconds(cluster, graph, op, strategy.flops)
    step = compute_seconds(cluster, graph, op, strategy.flops / n)
    paid = max(0.0, send - step) if cluster.overlap else send
    return Ring(axis, n - 1, block, send, step, (n - 1) * paid * op.weight,
                max(0.0, n * step - whole) * op.weight)
