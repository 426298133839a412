"""Reduction and scan rules.

Reductions (OneFlow ``reduce_ops.cpp`` table): a kept dim may be split, S(i)->S(i') with i'
the dim's position in the output; a reduced dim split gives a partial result, which is only a
*sum* for ``reduce_sum`` (S(i)->P, and P->P since the sum is linear). ``reduce_max`` /
``reduce_min`` over a split dim give a partial max / min, S(i)->P(max) (each device reduces
its shard; an all-reduce with max finishes it, which XLA's partitioner emits for a reduction
over a sharded dim: the max over a vocabulary split by Megatron's last layer); so do
``reduce_and`` / ``reduce_or`` of booleans, a min / max (a check that every gradient is
finite, on sharded gradients: a local check and an all-reduce of one flag). No op reads a
P(max) value (plans never consume partial inputs), so it is always resolved at its use. The
other non-sum reductions keep dims only (a product's partial is not what XLA emits; argmax
needs the value with its index). Scans (``cumsum`` & co.) split any dim except the scanned
one; ``cumsum`` is linear (P->P). FLOPs of a reduction = input elements.

Collectives over a ``jax.vmap`` axis name (pmap-style code run under ``jax.vmap(...,
axis_name=...)``): vmap's batching rules turn ``all_gather`` into a ``broadcast_in_dim``,
``axis_index`` into an ``iota``, ``ppermute`` / ``all_to_all`` / ``psum_scatter`` into
gathers, reshapes and sums, and ``pmean`` into a ``psum`` and a ``div``; ``psum``, ``pmax``
and ``pmin`` stay, with the vmapped dim as a *positional* axis (``axes=(0,)``), where they
are ``reduce_sum`` / ``reduce_max`` / ``reduce_min`` over it (jax's ``_psum_lowering`` lowers
positional axes to a reduce). Their rules are the reductions' for one operand; an operand
tuple gets the same signature on every operand when all share a shape. Named (mesh) axes
only occur inside a ``shard_map`` region, whose layout is fixed: no signature for those.

References:
  OneFlow ``user/ops/reduce_ops.cpp``, ``cum_ops.cpp``; jax ``_src/lax/parallel.py``
  (the collectives' batching rules and the positional-axis lowering).
"""

from __future__ import annotations

from jax import lax

from shardc.ir.graph import Op
from shardc.ir.sbp import P, Partial, Split
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["EXTREMA", "NON_SUM_REDUCTIONS", "POSITIONAL", "positional_collective_rule",
           "positional_flops", "reduce_keep_rule", "reduce_sum_rule", "reduction_flops",
           "scan_rule", "SCANS"]

NON_SUM_REDUCTIONS = ("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                      "reduce_xor", "argmax", "argmin")
EXTREMA = {"reduce_max": Partial("max"), "reduce_min": Partial("min"),
           "reduce_and": Partial("min"), "reduce_or": Partial("max")}
"""Reductions whose split dim leaves a partial extremum, and that partial (an ``and`` of
booleans is their min, an ``or`` their max)."""
SCANS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


def reduction_flops(op: Op) -> float:
    return float(op.inputs[0].size)


def _kept_signatures(op: Op) -> list[Signature]:
    x = op.inputs[0]
    axes = {a % x.ndim for a in op.params["axes"]}
    kept = [d for d in range(x.ndim) if d not in axes]
    return [Signature((Split(d),), (Split(i),)) for i, d in enumerate(kept)]


@register("reduce_sum", flops=reduction_flops)
def reduce_sum_rule(op: Op) -> list[Signature]:
    sigs = _kept_signatures(op)
    if is_numeric(op.inputs[0].dtype):
        x = op.inputs[0]
        sigs += [Signature((Split(a % x.ndim),), (P,)) for a in op.params["axes"]]
        sigs.append(Signature((P,), (P,)))
    return sigs


@register(*NON_SUM_REDUCTIONS, flops=reduction_flops)
def reduce_keep_rule(op: Op) -> list[Signature]:
    sigs = _kept_signatures(op)
    partial = EXTREMA.get(op.name)
    x = op.inputs[0]
    if partial is not None and (is_numeric(x.dtype) or x.dtype == bool):
        sigs += [Signature((Split(a % x.ndim),), (partial,)) for a in op.params["axes"]]
    return sigs


@register(*SCANS, flops=reduction_flops)
def scan_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    axis = op.params["axis"] % x.ndim
    sigs = [Signature((Split(d),), (Split(d),)) for d in range(x.ndim) if d != axis]
    if op.name == "cumsum" and is_numeric(x.dtype):
        sigs.append(Signature((P,), (P,)))
    return sigs


#: collectives over a vmapped (positional) axis and the reduction each one is
POSITIONAL = {"psum": lax.reduce_sum_p, "pmax": lax.reduce_max_p, "pmin": lax.reduce_min_p}


def positional_flops(op: Op) -> float:
    return float(sum(v.size for v in op.inputs))


@register(*POSITIONAL, flops=positional_flops)
def positional_collective_rule(op: Op) -> list[Signature]:
    if op.params.get("axis_index_groups") is not None or \
            not all(isinstance(a, int) for a in op.params["axes"]):
        return []
    first = op.inputs[0]
    if any(v.shape != first.shape or v.dtype != first.dtype for v in op.inputs):
        return []
    one = op.replace(prim=POSITIONAL[op.name], inputs=op.inputs[:1], outputs=op.outputs[:1])
    rule = reduce_sum_rule if op.name == "psum" else reduce_keep_rule
    n = len(op.inputs)
    return [Signature(s.ins * n, s.outs * n) for s in rule(one)]
