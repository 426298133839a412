"""The cost graph: follow-merging keeps plans exact where it claims to, and a value used
more than once is converted once."""

import jax
import jax.numpy as jnp
import pytest

from shardc.cost.cluster import Cluster
from shardc.ir.sbp import B, NdSbp, P, S
from shardc.ir.trace import trace
from shardc.plan.assemble import assemble
from shardc.solve import descent
from shardc.solve.costgraph import Settle
from shardc.solve.problem import build

CLUSTER = Cluster(axis_bandwidth={"x": 50e9}, axis_latency={"x": 5e-6}, device_flops=2e11)


def _mlp_grad(x, w1, w2):
    def loss(w1, w2):
        h = jnp.tanh(x @ w1)
        return jnp.mean((h @ w2) ** 2)

    return jax.grad(loss, argnums=(0, 1))(w1, w2)


ARGS = (jnp.ones((64, 16)), jnp.ones((16, 32)), jnp.ones((32, 16)))


def test_follow_merging_keeps_the_replicated_plan_exact():
    """Followers of a replicated operand stay replicated (a broadcast B -> S(d) would cut the
    chain and make its consumers re-gather)."""
    graph = trace(_mlp_grad, *ARGS).graph
    cg = build(graph, (4,), ("x",), CLUSTER)
    before = descent.objective(cg, dict.fromkeys(range(len(cg.choices)), 0))
    cg.merge_followers()
    after = descent.objective(cg, dict.fromkeys(cg.live, 0))
    assert after == pytest.approx(before, rel=1e-12)


def test_a_value_used_twice_is_reduced_once():
    """``g`` is partial when the batch is split; both uses read it replicated: one
    all-reduce, on the value's settle node, not one per use, in the plan and in the cost
    graph's objective alike."""

    def f(x, y):
        g = x.T @ y  # contracts the (split) batch: partial
        return jnp.tanh(g) + jnp.sin(g)

    graph = trace(f, jnp.ones((256, 32)), jnp.ones((256, 32))).graph
    cg = build(graph, (4,), ("x",), CLUSTER)
    (g,) = [op.outputs[0] for op in graph.ops if op.name == "dot_general"]
    assert isinstance(cg.refs[cg.settle[g.id]], Settle)

    def pick(node, ins, outs):
        return next(a for a, c in enumerate(cg.choices[node])
                    if (c.ins, c.outs) == (tuple(map(NdSbp, ins)), tuple(map(NdSbp, outs))))

    choice = [0] * len(cg.choices)  # replicated everywhere ...
    choice[0] = choice[1] = cg.choices[0].index(NdSbp((S(0),)))  # ... but the batch split
    n = len(graph.inputs)
    transpose = n + graph.ops.index(g.producer.inputs[0].producer)
    choice[transpose] = pick(transpose, [(S(0),)], [(S(1),)])
    dot = n + graph.ops.index(g.producer)
    choice[dot] = pick(dot, [(S(1),), (S(0),)], [(P,)])
    plan = assemble(graph, cg, choice, (), {})
    assert plan.values[g.id] == NdSbp((P,)) and plan.settled[g.id] == NdSbp((B,))
    reduces = [r for r in plan.reshards if r.value == g.id]
    assert [(r.consumer, r.collectives) for r in reduces] == [(None, ("all-reduce@x",))]
    objective = descent.objective(cg, dict(enumerate(choice)))
    assert objective == pytest.approx(plan.predicted.step_time, rel=1e-9)
