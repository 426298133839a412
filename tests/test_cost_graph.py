"""check_cost_graph holds after building and after every pass that transforms a cost graph
(follow-merging, folding into a quotient, restricting choices), and names the invariant a
broken graph breaks."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import LOOP_X as X
from helpers import loss_scanned as _loss_scanned
from helpers import sgd_step as _step

from shardc.cost.cluster import Cluster
from shardc.ir.trace import trace
from shardc.models import gpt
from shardc.solve.costgraph import CostGraphError, check_cost_graph
from shardc.solve.fold import fold, restrict
from shardc.solve.problem import build


def _programs():
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=3))
    yield "gpt", trace(step, *args).graph
    scanned, state = _step(_loss_scanned)
    yield "scanned", trace(scanned, state, X).graph


@pytest.mark.parametrize("mesh", [((8,), ("x",)), ((2, 4), ("node", "gpu"))],
                         ids=["8", "2x4"])
def test_every_pass_keeps_the_cost_graph_well_formed(mesh):
    for name, graph in _programs():
        cg = build(graph, *mesh, Cluster.multi_node(*mesh[1]) if len(mesh[1]) > 1
                   else Cluster())
        check_cost_graph(cg)
        cg.merge_followers()
        check_cost_graph(cg)
        assert cg.follows, name  # something followed: the pass was exercised
        q, cls = fold(cg)
        check_cost_graph(q)
        if name == "gpt":  # three layers fold; a scan's body is in the graph once
            assert len(q.choices) < len(cg.live)
        first = {i: [0] + ([1] if len(ch) > 1 else []) for i, ch in enumerate(q.choices)}
        check_cost_graph(restrict(q, first))


def _small():
    graph = trace(jax.grad(lambda w, x: jax.numpy.sum(jax.numpy.tanh(x @ w))),
                  np.ones((16, 16), np.float32), np.ones((32, 16), np.float32)).graph
    cg = build(graph, (4,), ("x",), Cluster())
    cg.merge_followers()
    return cg


@pytest.mark.parametrize("break_it, message", [
    (lambda cg: cg.edges.__setitem__(0, type(cg.edges[0])(
        cg.edges[0].u, cg.edges[0].v, cg.edges[0].cost[:, :1], cg.edges[0].value)),
     "cost matrix"),
    (lambda cg: cg.cost.__setitem__(cg.live[0], -cg.cost[cg.live[0]] - 1.0), ">= 0"),
    (lambda cg: cg.order.pop(), "order must list"),
    (lambda cg: cg.edges.append(type(cg.edges[0])(
        next(iter(cg.follows)), cg.live[0], np.zeros((1, 1)), cg.edges[0].value)),
     "follows another"),
    (lambda cg: cg.memory.append({cg.live[0]: np.zeros(1)}), "byte counts"),
    (lambda cg: cg.follows.update({(v := next(iter(cg.follows))): (
        cg.follows[v][0], cg.follows[v][1] + len(cg.choices[v]))}), "choice map"),
    (lambda cg: cg.follows.update({(v := next(iter(cg.follows))): (v, cg.follows[v][1])}),
     "not another node"),
])
def test_a_broken_cost_graph_names_the_invariant(break_it, message):
    cg = _small()
    check_cost_graph(cg)
    break_it(cg)
    with pytest.raises(CostGraphError, match=message):
        check_cost_graph(cg)
