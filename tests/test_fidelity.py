"""Lowering fidelity per strategy: an op whose inputs arrive in a strategy's layouts, with
its outputs pinned to the strategy's, compiles to no collective at all (a partial output
only to the reduction that returning it needs). A strategy that compiled to more would make
XLA communicate where the plan priced nothing (Shardy's replicate-then-partition fallback).

Swept over the MoE transformer's non-elementwise primitives (gather, scatter-add, cumsum,
argmax, dot_general, reshape, reduce, broadcast, iota, ...), first op of each kind, every nd
strategy on a (2, 2) mesh of simulated CPU devices. (Every op of the tiny MoE step, 2,200
strategies, passed the same sweep when this test was written; it takes minutes, so the test
keeps the first op of each primitive.)
"""

import jax
import pytest
from jax.sharding import AxisType, NamedSharding

from shardc.inspect.hlo import collectives
from shardc.ir.sbp import to_partition_spec
from shardc.ir.trace import trace
from shardc.models import moe
from shardc.rules.registry import strategies

ELEMENTWISE = set(
    "add sub mul div neg max min exp log sqrt rsqrt tanh logistic integer_pow "
    "convert_element_type select_n eq ne lt le gt ge and or not abs sign pow square "
    "stop_gradient copy copy_p".split())
NAMES = ("a", "b")


def _ops():
    cfg = moe.MoEConfig.tiny()
    graph = trace(moe.build_step(cfg), *moe.abstract_args(cfg)).graph
    first = {}
    for op in graph.ops:
        if op.name not in ELEMENTWISE and not any(v.is_const for v in op.inputs):
            first.setdefault(op.name, op)
    return first


OPS = _ops()


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_strategy_compiles_to_the_collectives_it_priced(name):
    op = OPS[name]
    mesh = jax.make_mesh((2, 2), NAMES, axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in op.inputs]
    bad = []
    for s in strategies(op, (2, 2)):
        def f(*xs, s=s):
            ys = op.prim.bind(*xs, **op.params)
            ys = ys if op.prim.multiple_results else [ys]
            return [y if nd.has_partial else jax.lax.with_sharding_constraint(
                y, NamedSharding(mesh, to_partition_spec(nd, y.ndim, NAMES)))
                for y, nd in zip(ys, s.outs, strict=True)]

        shardings = [NamedSharding(mesh, to_partition_spec(nd, v.ndim, NAMES))
                     for nd, v in zip(s.ins, op.inputs, strict=True)]
        compiled = jax.jit(f, in_shardings=shardings).lower(*avals).compile()
        partial = any(nd.has_partial for nd in s.outs)
        extra = [c.kind for c in collectives(compiled, mesh)
                 if not (partial and c.kind in ("all-reduce", "reduce-scatter"))]
        if extra:
            bad.append((str(s.ins), str(s.outs), extra))
    assert not bad, bad
