"""Cost graphs built once and solved at many budgets (``shardc/solve/reuse.py``) plan what
a cost graph built for each solve does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardc.cost.cluster import Cluster
from shardc.ir.flow import tail_values
from shardc.ir.sbp import B, NdSbp, Split
from shardc.ir.trace import trace
from shardc.solve.memory import memory_profile
from shardc.solve.reuse import Reuse
from shardc.solve.search import MemoryBudgetError, SolveOptions, plan_graph

MESH = ((2, 4), ("node", "gpu"))
CLUSTER = Cluster.multi_node("node", "gpu")


def _step():
    def loss(w, x):
        h = jnp.tanh(x @ w[0])
        h = jnp.tanh(h @ w[1])
        return jnp.sum(h @ w[2])

    def step(w, x):
        g = jax.grad(loss)(w, x)
        return [a - 0.1 * b for a, b in zip(w, g)]

    args = ([jnp.ones((256, 512)), jnp.ones((512, 512)), jnp.ones((512, 256))],
            jnp.ones((64, 256)))
    return trace(step, *args).graph


def _plan(graph, budget, reuse=None):
    seeds = {"split rows": {k: NdSbp((Split(0), Split(0))) for k in range(3)},
             "data parallel": {3: NdSbp((Split(0), B))}}
    try:
        return plan_graph(graph, *MESH, CLUSTER, SolveOptions(budget, seeds=seeds),
                          ties=[(k, k) for k in range(3)], reuse=reuse)
    except MemoryBudgetError as exc:
        return exc


def test_a_reused_cost_graph_plans_what_a_fresh_one_does_at_every_budget():
    graph = _step()
    cg, free = _plan(graph, None)
    top = float(np.max(memory_profile(cg, free.choice)))
    reuse = Reuse()
    # no budget, budgets that bind (each adds memory cuts of its own), and one no plan meets
    kept_graphs = []
    for budget in (None, 0.8 * top, 0.6 * top, 0.45 * top, 0.8 * top, 1.0):
        fresh, kept = _plan(graph, budget), _plan(graph, budget, reuse)
        if isinstance(fresh, MemoryBudgetError):
            assert isinstance(kept, MemoryBudgetError)
            assert (kept.needed, kept.found) == (fresh.needed, fresh.found)
            continue
        (_, a), (kcg, b) = fresh, kept
        kept_graphs.append(kcg)
        assert (b.choice, b.status, b.objective) == (a.choice, a.status, a.objective), budget
        assert b.seed_choices == a.seed_choices
        assert b.stats["seeds"] == a.stats["seeds"]
    assert len(kept_graphs) >= 4
    # one build and merge: the solves share its edges; each has its own memory cuts
    assert all(g.edges is kept_graphs[0].edges for g in kept_graphs)
    assert len({id(g.memory) for g in kept_graphs}) == len(kept_graphs)


def test_what_a_graph_derives_from_itself_is_computed_once():
    graph = _step()
    assert graph.consumers() is graph.consumers()
    tail = tail_values(graph)
    assert tail is tail_values(graph) and isinstance(tail, frozenset)
    with pytest.raises(AttributeError):
        tail.add(0)  # shared between callers: not to be changed


def test_the_bytes_each_choice_holds_are_kept_per_graph_and_not_shared_with_a_cut():
    """descent's table of the bytes each choice holds (every lean start asks for it) is
    computed once per cost graph; a copy cut to a hand-written layout gets its own, sized
    to its own choices, equal to one made afresh."""
    from shardc.solve import descent
    from shardc.solve.reuse import pin_inputs

    cg, _ = _plan(_step(), None)
    held = descent._held_bytes(cg)
    assert descent._held_bytes(cg) is held
    cut = pin_inputs(cg, {k: NdSbp((Split(0), Split(0))) for k in range(3)})
    mine = descent._held_bytes(cut)
    assert mine is not held
    assert all(len(mine[i]) == len(cut.choices[i]) for i in mine)
    assert len(mine[0]) == 1 < len(held[0])
    cut.held = ()  # made afresh
    again = descent._held_bytes(cut)
    assert again.keys() == mine.keys()
    assert all(np.array_equal(again[i], mine[i]) for i in mine)


def test_a_searchs_descents_run_once_per_start_and_weight(monkeypatch):
    """A budgeted search descends again in every round from the same starts: with the
    search's memo each start and weight descends once, and the plan is the one descending
    afresh gives, also once the memory points have grown."""
    from shardc.solve import descent

    cg, free = _plan(_step(), None)
    budget = 0.6 * float(np.max(memory_profile(cg, free.choice)))
    calls = []
    real = descent.descend
    monkeypatch.setattr(descent, "descend", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    memo: dict = {}
    first = descent.solve(cg, budget, memo)
    n = len(calls)
    assert any(weight > 0 for weight in calls)  # the budget binds: weighted descents ran
    assert descent.solve(cg, budget, memo) == first and len(calls) == n
    cg.memory.append({i: 2 * vec for i, vec in cg.memory[0].items()})  # more bytes held
    again = descent.solve(cg, budget, memo)
    assert len(calls) > n and all(weight > 0 for weight in calls[n:])  # only weighted ones
    assert again == descent.solve(cg, budget)


def test_hand_written_layouts_place_on_the_graph_built_once_as_on_their_own():
    """Placing layouts of the inputs on the problem's merged graph cut to each (the frontier
    places a dozen) gives the plans that graphs built and merged with those inputs fixed
    give."""
    from shardc.solve.fixed import Fixed
    from shardc.tradeoff.baselines import layout_plan

    graph = _step()
    reuse = Reuse()
    fixed = Fixed(outputs={0: NdSbp((Split(0), B))})  # kept by every placement
    for layouts in ({k: NdSbp((Split(0), Split(0))) for k in range(3)},  # FSDP-like weights
                    {3: NdSbp((Split(0), B))},  # the batch split over the nodes only
                    {0: NdSbp((B, Split(1))), 3: NdSbp((Split(0), Split(0)))}):
        own = layout_plan(graph, (), *MESH, CLUSTER, layouts, fixed)
        cut = layout_plan(graph, (), *MESH, CLUSTER, layouts, fixed, reuse=reuse)
        assert cut.inputs == own.inputs and cut.values == own.values
        assert [o.strategy for o in cut.ops] == [o.strategy for o in own.ops]
        assert cut.predicted == own.predicted
    assert len(reuse._built) == 1  # the problem's graph, built once for every layout


def test_builds_sharing_one_record_build_what_fresh_builds_do():
    """Programs built on one mesh with one :class:`BuildShare` (a frontier's remat variants)
    get the cost graphs fresh builds give: the same choices, costs, edges and memory points;
    the second build finds the first's strategy lists and edge matrices."""
    from shardc.solve.problem import BuildShare, build

    def other_step():  # the same layers, one more: most ops shared, some not
        def loss(w, x):
            for k in range(4):
                x = jnp.tanh(x @ w[k])
            return jnp.sum(x)

        def step(w, x):
            g = jax.grad(loss)(w, x)
            return [a - 0.1 * b for a, b in zip(w, g)]

        return trace(step, [jnp.ones((256, 256))] * 4, jnp.ones((64, 256))).graph

    share = BuildShare(*MESH, CLUSTER)
    built = []
    for graph, ties in ((_step(), [(k, k) for k in range(3)]),
                        (other_step(), [(k, k) for k in range(4)])):
        before = len(share.matrices)
        kept = build(graph, *MESH, CLUSTER, ties, share=share)
        fresh = build(graph, *MESH, CLUSTER, ties)
        assert kept.choices == fresh.choices
        assert all(np.array_equal(a, b) for a, b in zip(kept.cost, fresh.cost))
        assert [(e.u, e.v, e.k) for e in kept.edges] == [(e.u, e.v, e.k) for e in fresh.edges]
        assert all(np.array_equal(a.cost, b.cost) for a, b in zip(kept.edges, fresh.edges))
        assert [sorted(p) for p in kept.memory] == [sorted(p) for p in fresh.memory]
        assert len(share.matrices) > before  # each program adds the matrices it alone has
        built.append(kept)
    first = {id(ch) for ch in built[0].choices}
    assert any(id(ch) in first for ch in built[1].choices)  # a tanh's strategies, found again
    with pytest.raises(ValueError, match="one per mesh"):
        build(_step(), (8,), ("x",), CLUSTER, share=share)
