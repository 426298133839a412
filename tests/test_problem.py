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


def test_a_zeroing_is_listed_and_free():
    """A replicated value added to a partial sum is zeroed on all but one device (``B ->
    P``): the plan lists the step, but no collective runs for it (the compiled program
    selects the value on one device, fused into the add), so neither the search nor the
    prediction charges it (a latency each had the wide ResNet's weight decay, 29 zeroings,
    priced at 99 us: its search ranked ZeRO-1's layouts 0.7% above its own plan, which
    compiled 0.7% slower)."""

    def f(x, y, z):  # the sum on its way out may read partial values (a Python loop's)
        return x.T @ y + z * 2.0

    graph = trace(f, jnp.ones((256, 32)), jnp.ones((256, 32)), jnp.ones((32, 32))).graph
    cg = build(graph, (4,), ("x",), CLUSTER)

    def pick(node, ins, outs):
        return next(a for a, c in enumerate(cg.choices[node])
                    if (c.ins, c.outs) == (tuple(map(NdSbp, ins)), tuple(map(NdSbp, outs))))

    choice = [0] * len(cg.choices)
    choice[0] = choice[1] = cg.choices[0].index(NdSbp((S(0),)))
    choice[2] = cg.choices[2].index(NdSbp((B,)))
    n = len(graph.inputs)
    (dot_op,) = [op for op in graph.ops if op.name == "dot_general"]
    (add_op,) = [op for op in graph.ops if op.name == "add"]
    transpose = n + graph.ops.index(dot_op.inputs[0].producer)
    choice[transpose] = pick(transpose, [(S(0),)], [(S(1),)])
    choice[n + graph.ops.index(dot_op)] = pick(n + graph.ops.index(dot_op),
                                               [(S(1),), (S(0),)], [(P,)])
    choice[n + graph.ops.index(add_op)] = pick(n + graph.ops.index(add_op),
                                               [(P,), (P,)], [(P,)])
    plan = assemble(graph, cg, choice, (), {})
    zeroed = [r for r in plan.reshards if r.collectives == ("local@x",)]
    (mul_op,) = [op for op in graph.ops if op.name == "mul"]
    assert len(zeroed) == 1 and zeroed[0].value == mul_op.outputs[0].id
    assert zeroed[0].time == 0.0 and zeroed[0].wire_bytes == 0.0
    p = plan.predicted
    assert p.comm_time == pytest.approx(sum(r.time for r in plan.reshards))
    assert p.comm_time > 0  # the partial sum's all-reduce
    objective = descent.objective(cg, dict(enumerate(choice)))
    assert objective == pytest.approx(p.step_time, rel=1e-9)  # the search's price, whole
