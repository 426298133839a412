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
from shardc.ir.flow import loop_tests, loop_ties
from shardc.ir.graph import Graph, Op, Value
from shardc.ir.prims import facts
from shardc.ir.sbp import NdSbp, Split

__all__ = ["looped", "passed", "repeat_of", "repeated", "Ring", "ring_cost",
           "ring_workspace"]


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
    value, layout = passed(graph, op, strategy)
    block = value.nbytes * layout.shard_fraction(axis_sizes)
    send = cluster.send_seconds([(axis_names[axis], n)], block)
    whole = compute_seconds(cluster, graph, op, strategy.flops)
    step = compute_seconds(cluster, graph, op, strategy.flops / n)
    paid = max(0.0, send - step) if cluster.overlap else send
    return Ring(axis, n - 1, block, send, step, (n - 1) * paid * op.weight,
                max(0.0, n * step - whole) * op.weight)


def passed(graph: Graph, op: Op, strategy) -> tuple[Value, NdSbp]:
    """The value ``strategy``'s ring passes round and its layout: the partial sums of the
    result (ring 2), or an operand, as the smaller value it repeats where it repeats one
    (:func:`repeated`: grouped-query attention's keys and values)."""
    what = strategy.ring[1]
    if what == 2:
        return op.outputs[0], strategy.outs[0]
    value, nd = op.inputs[what], strategy.ins[what]
    return repeated(graph, value, nd) or value, nd


def looped(op: Op, strategy) -> bool:
    """Whether the lowering runs ``strategy``'s ring as a loop (:mod:`shardc.lower.local`):
    where a slice of the other operand feeds each step, the passed operand's split dim
    contracted or the partial sums passed; unrolled where each step writes a slice of the
    result."""
    axis, what = strategy.ring
    if what == 2:
        return True
    (lc, rc), _ = op.params["dimension_numbers"]
    return strategy.ins[what].sbps[axis].dim in (lc if what == 0 else rc)


def ring_workspace(graph: Graph, op: Op, strategy, axis_sizes: Sequence[int]) -> float:
    """Bytes per device a ring holds while it runs besides its operands and result, as
    XLA:GPU assigns them (0 without a ring). Unrolled (:func:`looped`), each step writes
    its block's product into a slice of zeros; XLA:GPU turns the chain of writes into one
    concatenation of the products and fuses it into the result's readers where they are
    all elementwise (a scaled or masked softmax's ``div`` or ``select_n``), so the
    products are the result's only buffer: nothing more. Where a reader is not (a
    ``reduce_max``, a dot) or the program keeps the result (an output, a loop's carry)
    the concatenation writes the result while the products, issued ahead to run beside
    the sends, are all live: the result's size again. As a loop, the slice of the other
    operand each step reads and the block passed, each twice (this step's and the
    next's), and where the block passed is a smaller value repeated, its repeated copy.
    Measured on XLA:GPU; XLA:CPU is priced alike (rings are offered only on clusters that
    overlap, which the CPU presets do not)."""
    if not strategy.ring:
        return 0.0
    axis, what = strategy.ring
    n = axis_sizes[axis]
    result = op.outputs[0].nbytes * strategy.outs[0].shard_fraction(axis_sizes)
    if not looped(op, strategy):
        return 0.0 if _fused_away(graph, op.outputs[0]) else result
    ins = [x.nbytes * nd.shard_fraction(axis_sizes) for x, nd in zip(op.inputs, strategy.ins)]
    value, nd = passed(graph, op, strategy)
    block = value.nbytes * nd.shard_fraction(axis_sizes)
    sliced = max(ins) if what == 2 else ins[1 - what]
    copy = ins[what] if what != 2 and value is not op.inputs[what] else 0.0
    return 2 * (block + sliced / n) + copy


def _fused_away(graph: Graph, value: Value) -> bool:
    """Whether XLA fuses the concatenation making ``value`` into every reader: each is
    elementwise, and the program keeps no buffer of it (no output, loop carry or loop
    test is it)."""
    readers = graph.consumers().get(value.id, [])
    kept = graph.memo("kept whole", lambda g: frozenset(
        [v.id for v in g.outputs] + [v.id for _, v in loop_ties(g)] +
        [v.id for v in loop_tests(g)]))
    return (bool(readers) and value.id not in kept
            and all(facts(r.name).elementwise for r, _ in readers))


def repeated(graph: Graph, value: Value, nd: NdSbp) -> Value | None:
    """The smaller value ``value`` repeats, where a ring passing ``value`` in layout ``nd``
    can pass it instead, else None: ``value`` a repeat of it (:func:`repeat_of`), ``nd``
    splitting only the leading dims the repeat keeps (the batch, the sequence) and
    holding no partial sum."""
    chain = repeat_of(graph, value)
    if chain is None or nd.has_partial or any(
            isinstance(s, Split) and s.dim >= chain[2] for s in nd.sbps):
        return None
    return chain[0]


def repeat_of(graph: Graph, value: Value) -> tuple[Value, Op, int] | None:
    """``(src, grow, kept)`` where ``value`` is a ``reshape`` of ``grow``, a
    ``broadcast_in_dim`` of the smaller ``src`` (``jnp.repeat``: each key/value head
    repeated for its query heads), ``kept`` the leading dims the two leave in place and
    of the same size; else None."""
    made = graph.producers()
    merge = made.get(value.id)
    if merge is None or merge.name != "reshape" or merge.params.get("dimensions"):
        return None
    grow = made.get(merge.inputs[0].id)
    if grow is None or grow.name != "broadcast_in_dim":
        return None
    src, wide = grow.inputs[0], grow.outputs[0]
    if src.nbytes >= value.nbytes:
        return None
    dims, kept = grow.params["broadcast_dimensions"], 0
    while (kept < min(src.ndim, value.ndim) and dims[kept] == kept and
           src.shape[kept] == wide.shape[kept] == value.shape[kept]):
        kept += 1
    return src, grow, kept
