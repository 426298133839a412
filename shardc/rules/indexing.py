"""Indexing rules: gather, scatter-add, scatter, dynamic_slice, dynamic_update_slice, iota.

``gather`` (OneFlow ``gather_op.cpp``, generalised to XLA's dimension numbers): an operand
dim taken whole and not indexed may be split, giving a split offset dim of the output
(indices B); an indices batch dim may be split, giving the matching output batch dim
(operand B); an operand/indices batching pair splits together. It is linear in the operand,
(P,B)->P, unless out-of-bounds reads fill a value that is not 0 or NaN. An indexed operand
dim read one element at a time (slice size 1) may be split too, (S(d),B)->P: each device
reads the indices that fall in its shard and zeros elsewhere, and the sum is the gather
(vocab-parallel embedding, Megatron; the label logits of a vocabulary-split cross entropy).
XLA's SPMD partitioner compiles exactly that, a masked local gather and an all-reduce of the
(small) result, for a floating operand with the same fill condition.

``scatter-add`` is gather's dual (OneFlow ``unsorted_segment_sum`` table): the updates' window
dims split with the operand's dims -> S; the updates' scatter dims split with the indices'
batch dims -> P, which needs the operand (the initial buffer) partial too, (P,S,S)->P;
batching pairs split all three -> S; and (P,B,P)->P since it is linear in operand+updates.
When the operand is zeros (jax's transpose of a gather: an embedding's gradient scatters the
token gradients into a zero table), a replicated operand serves as well: (B,S,S)->P(whole),
each device scattering its share of the updates into its own zeros. That is the
data-parallel embedding gradient XLA compiles (a local scatter, then the all-reduce every
gradient gets); without it the only batch-split form would need a partial input, which plans
never consume. The partial is *whole*: XLA's partitioner all-reduces the scatter's result in
full where it is made, so a split of it is an all-reduce and a slice, never a
reduce-scatter (seen on jax 0.10.2 CPU: the tied embedding gradient of a GPT planned
reduce-scattered compiled to an all-reduce, a slice and a collective-permute).
``scatter-sub`` has the same algebra (``operand - updates``), so the same signatures.
Gather's masked form has a dual for every scatter: an operand dim the indices select one
element of at a time may split with indices and updates replicated, (S(d),B,B)->S(d), each
device applying the updates that land in its shard (an embedding gradient into a
vocabulary-split table: no communication, as XLA compiles it).

``scatter`` (``x.at[i].set(v)``, and the id scatter of its gradient) keeps the splits that
do not cut the index space: an operand dim no index selects, taken whole by the updates'
window, splits with that window dim, (S,B,S)->S; a batching pair splits all three, (S,S,S)->S
(XLA's SPMD partitioner: ``spmd/gather_scatter_handler.cc`` partitions a scatter along
passthrough window dims and along batching dims). No partial: overwriting is not linear
(``set(a + b, i, v) != set(a, i, v) + set(b, i, v)``), and the indices' scatter dims cannot
split either (each device would keep the operand's old values where another device's
updates land). ``scatter-mul`` / ``scatter-min`` / ``scatter-max`` combine the operand
element with the updates landing on it, position by position, so the same splits are exact;
they get no partial either (a product is linear in the operand alone, but shardc does not
use it; min/max are not sums).

The index operand of gather/scatter uses jax's convention: the index vector dim is the last.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from shardc.ir.graph import Op
from shardc.ir.sbp import WHOLE, B, P, Split
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["dynamic_slice_rule", "dynamic_update_slice_rule", "gather_rule", "iota_rule",
           "scatter_add_rule", "scatter_rule", "scatter_signatures"]


def _batch_positions(out_ndim: int, window_dims) -> list[int]:
    """Output (or updates) positions of the batch dims, in indices-dim order."""
    return [d for d in range(out_ndim) if d not in set(window_dims)]


def _zeros(v) -> bool:
    """``v`` is all zeros: a zero constant, or a broadcast of one (jax's ``zeros``)."""
    if v.is_const:
        return not np.any(v.const)
    src = v.producer
    return (src is not None and src.name == "broadcast_in_dim" and src.inputs[0].is_const
            and not np.any(src.inputs[0].const))


def _gather_partial_ok(op: Op) -> bool:
    if not jnp.issubdtype(op.outputs[0].dtype, jnp.floating):
        return False
    if "FILL_OR_DROP" not in str(op.params.get("mode")):
        return True
    fill = op.params.get("fill_value")
    return fill is None or fill == 0 or bool(np.isnan(fill))  # None fills NaN for floats


@register("gather")
def gather_rule(op: Op) -> list[Signature]:
    operand, indices = op.inputs
    dn, sizes = op.params["dimension_numbers"], op.params["slice_sizes"]
    out_ndim = op.outputs[0].ndim
    sigs = []
    skipped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    operand_offset = [d for d in range(operand.ndim) if d not in skipped]
    for j, d in enumerate(operand_offset):
        if sizes[d] == operand.shape[d] and d not in dn.start_index_map:
            sigs.append(Signature((Split(d), B), (Split(dn.offset_dims[j]),)))
    batch_pos = _batch_positions(out_ndim, dn.offset_dims)
    paired = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
    for i in range(indices.ndim - 1):
        lhs = Split(paired[i]) if i in paired else B
        sigs.append(Signature((lhs, Split(i)), (Split(batch_pos[i]),)))
    if _gather_partial_ok(op):
        sigs.append(Signature((P, B), (P,)))
        sigs += [Signature((Split(d), B), (P,)) for d in _pointwise_indexed(
            op, operand, dn.start_index_map, sizes, dn.operand_batching_dims)]
    return sigs


def _pointwise_indexed(op: Op, operand, index_map, sizes, batching) -> list[int]:
    """Operand dims the indices pick single elements of (slice or window size 1), which a
    device may hold a shard of and serve only the indices that fall in it. Not under the
    CLIP mode: an out-of-bounds index is moved to the edge, which a shard cannot see."""
    if "CLIP" in str(op.params.get("mode")):
        return []
    return [d for d in dict.fromkeys(index_map)
            if sizes[d] == 1 and operand.shape[d] > 1 and d not in batching]


def scatter_signatures(op: Op, linear: bool) -> list[Signature]:
    """Window and batching-pair splits of any scatter; with ``linear`` (a scatter that adds
    its updates) also the partial signatures of the indices' scatter dims and of the
    updates."""
    operand, indices, updates = op.inputs[:3]
    extra = (B,) * (len(op.inputs) - 3)
    dn = op.params["dimension_numbers"]
    sigs = []
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    operand_window = [d for d in range(operand.ndim) if d not in skipped]
    for j, d in enumerate(operand_window):
        u = dn.update_window_dims[j]
        if updates.shape[u] == operand.shape[d] and d not in dn.scatter_dims_to_operand_dims:
            sigs.append(Signature((Split(d), B, Split(u)) + extra, (Split(d),)))
    scatter_pos = _batch_positions(updates.ndim, dn.update_window_dims)
    paired = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims, strict=True))
    for i in range(indices.ndim - 1):
        if i in paired:
            d = paired[i]
            sigs.append(Signature((Split(d), Split(i), Split(scatter_pos[i])) + extra,
                                  (Split(d),)))
        elif linear:
            sigs.append(Signature((P, Split(i), Split(scatter_pos[i])) + extra, (P,)))
            if _zeros(operand):
                sigs.append(Signature((B, Split(i), Split(scatter_pos[i])) + extra, (WHOLE,)))
    window = _scatter_window_sizes(operand, updates, dn)
    sigs += [Signature((Split(d), B, B) + extra, (Split(d),)) for d in _pointwise_indexed(
        op, operand, dn.scatter_dims_to_operand_dims, window, dn.operand_batching_dims)]
    if linear:
        sigs.append(Signature((P, B, P) + extra, (P,)))
    return sigs


def _scatter_window_sizes(operand, updates, dn) -> list[int]:
    """The size of the updates' window along each operand dim (1 where a dim is inserted or
    batched)."""
    sizes, window = [], iter(dn.update_window_dims)
    for d in range(operand.ndim):
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(updates.shape[next(window)])
    return sizes


@register("scatter-add", "scatter_add", "scatter-sub", "scatter_sub")
def scatter_add_rule(op: Op) -> list[Signature]:
    return scatter_signatures(op, linear=True)


@register("scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
          "scatter-max", "scatter_max")
def scatter_rule(op: Op) -> list[Signature]:
    return scatter_signatures(op, linear=False)


@register("dynamic_slice")
def dynamic_slice_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    idx = (B,) * (len(op.inputs) - 1)
    sizes = op.params["slice_sizes"]
    sigs = [Signature((Split(d),) + idx, (Split(d),))
            for d in range(x.ndim) if sizes[d] == x.shape[d]]
    if is_numeric(x.dtype):
        sigs.append(Signature((P,) + idx, (P,)))
    return sigs


@register("dynamic_update_slice")
def dynamic_update_slice_rule(op: Op) -> list[Signature]:
    x, upd = op.inputs[:2]
    idx = (B,) * (len(op.inputs) - 2)
    sigs = [Signature((Split(d), Split(d)) + idx, (Split(d),))
            for d in range(x.ndim) if upd.shape[d] == x.shape[d]]
    if is_numeric(x.dtype):
        sigs.append(Signature((P, P) + idx, (P,)))
    return sigs


@register("iota")
def iota_rule(op: Op) -> list[Signature]:
    """Each device makes its own slice (offset by its position along a split dimension)."""
    ins = (B,) * len(op.inputs)
    return [Signature(ins, (Split(d),)) for d in range(op.outputs[0].ndim)]
