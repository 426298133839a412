"""The solver: ILP optimum == brute force; plans an expert would recognise."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as Ps

import shardc
import shardc.step.signature
from shardc.cost.cluster import Cluster
from shardc.cost.units import fmt_time
from shardc.ir.sbp import B, NdSbp, P, Split
from shardc.ir.trace import trace
from shardc.models import mlp
from shardc.plan.assemble import assemble
from shardc.solve import descent
from shardc.solve.fold import fold, quotient, restrict
from shardc.solve.ilp import solve_ilp
from shardc.solve.problem import build
from shardc.solve.refine import sub_mesh_seeds


def _small_problem():
    def f(x, w1, w2):
        h = jnp.tanh(x @ w1)
        return jnp.sum((h @ w2) * 2.0)

    args = (jnp.ones((32, 16)), jnp.ones((16, 64)), jnp.ones((64, 16)))
    t = trace(jax.grad(f, argnums=1), *args)
    cg = build(t.graph, (4,), ("x",), Cluster())
    cg.merge_followers()
    return cg


def _brute_force(cg) -> float:
    live = cg.live
    sizes = [len(cg.choices[i]) for i in live]
    assert np.prod(sizes) <= 5_000_000
    axis = {node: k for k, node in enumerate(live)}

    def along(vec_or_mat, nodes):  # broadcast over the full choice grid
        shape = [1] * len(live)
        for node, n in zip(nodes, vec_or_mat.shape):
            shape[axis[node]] = n
        order = np.argsort([axis[n] for n in nodes])
        return np.transpose(vec_or_mat, order).reshape(shape) if len(nodes) > 1 and axis[
            nodes[0]] > axis[nodes[1]] else vec_or_mat.reshape(shape)

    grid = np.zeros(sizes)
    for i in live:
        grid = grid + along(cg.cost[i], [i])
    for e in cg.edges:
        grid = grid + along(e.cost, [e.u, e.v])
    best = float(grid.min())
    flat = np.unravel_index(int(grid.argmin()), grid.shape)
    assert descent.objective(cg, dict(zip(live, map(int, flat)))) == pytest.approx(best)
    return best


def test_ilp_optimum_equals_brute_force():
    cg = _small_problem()
    assert 1000 < np.prod([len(cg.choices[i]) for i in cg.live])
    best = _brute_force(cg)
    res = solve_ilp(cg, time_limit=30)
    assert res.status == "OPTIMAL"
    assert descent.objective(cg, res.assignment) == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_ilp_with_single_choice_nodes_equals_brute_force():
    """Nodes cut to one choice (as a per-axis restriction leaves many) are constants of the
    ILP: their edges become costs of their neighbours, and the optimum is unchanged."""
    cg = _small_problem()
    q, cls = fold(cg)
    worst = descent.solve(q)  # cut every other node to its descent choice
    allowed = {i: ([worst[i]] if i % 2 else list(range(len(ch))))
               for i, ch in enumerate(q.choices)}
    sub = restrict(q, allowed)
    assert any(len(ch) == 1 for ch in sub.choices) and any(len(ch) > 1 for ch in sub.choices)
    best = _brute_force(sub)
    res = solve_ilp(sub, time_limit=30)
    assert res.status == "OPTIMAL" and set(res.assignment) == set(sub.live)
    assert descent.objective(sub, res.assignment) == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_one_axis_seed_is_the_1d_plan_with_the_other_axes_idle():
    """A seed of a (2, 4) mesh using only axis 1 is the plan of the 4-device 1-D problem,
    lifted with B on axis 0: the same layouts and the same cost."""
    cg2 = build(_small_problem().graph, (2, 4), ("node", "gpu"),
                Cluster.multi_node("node", "gpu"))
    cg2.merge_followers()
    q = quotient(cg2, {i: k for k, i in enumerate(cg2.live)})  # every node its own class
    flat, x = sub_mesh_seeds(q, None, time_limit=30)  # node gets none
    for i in q.live:
        c = q.choices[i][x[i]]
        nds = (c,) if isinstance(c, NdSbp) else (*c.ins, *c.outs)
        assert all(nd.sbps[0] == B for nd in nds)
    cg1 = build(cg2.graph, (4,), ("gpu",), Cluster.multi_node("node", "gpu"))
    cg1.merge_followers()
    assert descent.objective(q, x) == pytest.approx(_brute_force(cg1), rel=1e-6)


def _mlp_plan(batch, hidden):
    cfg = mlp.MLPConfig(batch=batch, d_in=hidden, hidden=hidden, d_out=hidden, n_layers=6,
                        learning_rate=1e-2)
    step_fn, (state, data) = mlp.make_train_step(cfg)
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    # models this small are latency-bound on an H100 (replicating them is the honest optimum);
    # on slow devices (0.2 TFLOP/s, CPU-like) with 50 GB/s, 5 us links, compute, bytes and
    # latency all matter, which is where the textbook answers come from
    cluster = Cluster(axis_bandwidth={"x": 50e9}, axis_latency={"x": 5e-6}, device_flops=2e11)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster, time_limit=10.0)
    plan = step.plan(state, data)
    kernels = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_flatten_with_path((state, data))[0]]
    layout = {k: nd for k, nd in zip(kernels, plan.inputs)}
    hlo = step.lower(state, data).compile().as_text()
    return plan, layout, hlo


def _all_reduce_shapes(hlo: str) -> list[str]:
    """Result shapes of every all-reduce in compiled HLO text (tuple ones flattened)."""
    shapes = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        if m:
            shapes += re.findall(r"f32\[[\d,]*\]", m.group(1))
    return shapes


def _kernel_layouts(layout):
    keys = sorted((k for k in layout if "['params']" in k and "kernel" in k),
                  key=lambda k: int(re.search(r"\[(\d+)\]", k.split("['params']")[1]).group(1)))
    return [layout[k] for k in keys]


def test_large_batch_small_hidden_is_data_parallel():
    plan, layout, hlo = _mlp_plan(batch=256, hidden=32)
    kernels = _kernel_layouts(layout)
    assert len(kernels) == 6
    assert all(nd == NdSbp((B,)) for nd in kernels), [str(k) for k in kernels]
    assert layout["[1]['x']"] == NdSbp((Split(0),))  # the batch is split
    assert any("all-reduce" in c for r in plan.reshards for c in r.collectives)
    # the gradients are all-reduced: XLA combines them into one tuple all-reduce
    assert _all_reduce_shapes(hlo).count("f32[32,32]") == 6


def test_small_batch_large_hidden_is_megatron():
    plan, layout, hlo = _mlp_plan(batch=32, hidden=256)
    kernels = _kernel_layouts(layout)
    # column-split then row-split, alternating (Megatron-LM MLP)
    assert [str(k) for k in kernels] == ["(S(1))", "(S(0))"] * 3
    assert layout["[1]['x']"] == NdSbp((B,))
    shapes = _all_reduce_shapes(hlo)
    assert "f32[32,256]" in shapes  # activations are all-reduced after row-split layers
    assert "f32[256,256]" not in shapes  # weight gradients are not


def test_2d_mesh_is_data_parallel_on_the_slow_axis_and_megatron_on_the_fast_one():
    """A (2, 2) mesh whose axis 0 is 10x slower. At batch 512 / hidden 256 the weights and the
    activations are the same size, so the slow link carries what is smallest there (one
    combined gradient all-reduce of the shards) and the fast link the per-layer activation
    all-reduces of Megatron. (At batch 256 / hidden 32 the whole step is latency-bound and
    the cheapest plan is data parallel on both axes: one combined all-reduce against twelve
    activation all-reduces.)"""
    from shardc.inspect.hlo import collectives

    cfg = mlp.MLPConfig(batch=512, d_in=256, hidden=256, d_out=256, n_layers=6,
                        learning_rate=1e-2)
    step_fn, (state, data) = mlp.make_train_step(cfg)
    mesh = jax.make_mesh((2, 2), ("slow", "fast"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    # priced α-β: the trade-off pinned here is bandwidth against one latency per collective
    cluster = Cluster(axis_bandwidth={"slow": 5e9, "fast": 50e9},
                      axis_latency={"slow": 5e-6, "fast": 5e-6}, device_flops=2e11,
                      collective_model="alpha-beta")
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster, time_limit=30.0)
    plan = step.plan(state, data)
    layout = {jax.tree_util.keystr(p): nd for (p, _), nd in
              zip(jax.tree_util.tree_flatten_with_path((state, data))[0], plan.inputs)}
    assert [str(k) for k in _kernel_layouts(layout)] == ["(B, S(1))", "(B, S(0))"] * 3
    assert layout["[1]['x']"] == NdSbp((Split(0), B))  # batch split on the slow axis only
    reduces = {c.axes for c in collectives(step.lower(state, data).compile(), mesh)
               if c.kind == "all-reduce"}
    assert ("fast",) in reduces  # Megatron's activation all-reduces
    assert ("slow",) in reduces  # the gradients, reduced over the data-parallel axis
    assert ("slow", "fast") not in reduces


_SLOW = Cluster(axis_bandwidth={"x": 50e9}, axis_latency={"x": 5e-6}, device_flops=2e11)


@pytest.mark.parametrize("d_ff, parallel", [(1024, "expert"), (32, "data")])
def test_moe_is_expert_parallel_when_experts_are_large_and_data_parallel_when_small(
        d_ff, parallel):
    """GShard MoE on 8 devices (CPU-like devices, 50 GB/s links, so compute and bytes both
    count). With large experts (d_ff 1024, 4 MiB of expert weights) each device holds one
    expert and the dispatched tokens move by all-to-all; with small ones (d_ff 32) the expert
    weights are replicated, the tokens stay split by group, and the expert gradients are
    all-reduced: data parallelism."""
    from shardc.models import moe

    cfg = moe.MoEConfig(d_model=64, d_ff=d_ff, n_experts=8, batch=64, seq_len=32)
    step_fn, (state, batch) = moe.make_train_step(cfg)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=_SLOW, time_limit=5.0)
    plan = step.plan(state, batch)
    layout = {jax.tree_util.keystr(p): nd for (p, _), nd in
              zip(jax.tree_util.tree_flatten_with_path((state, batch))[0], plan.inputs)}
    wi = [nd for k, nd in layout.items() if k.startswith("[0]['params']") and "'wi'" in k]
    e, g, c = cfg.n_experts, cfg.batch, cfg.capacity
    # the expert FFN: [E, G, C, d] x [E, d, ffn] -> [E, G, C, ffn], forward and backward
    ffn = [o for o in plan.ops if o.prim == "dot_general"
           and o.types.endswith(f"->f32[{e},{g},{c},{d_ff}]")]
    assert len(ffn) == 2
    kinds = plan.verify(step.lower(state, batch).compile(), mesh)
    compiled = {r.kind: r for r in kinds.rows}
    if parallel == "expert":
        assert wi == [NdSbp((Split(0),))]
        assert all(o.outs[0] == NdSbp((Split(0),)) for o in ffn)
        assert compiled["all-to-all"].status == "matched"
    else:
        assert wi == [NdSbp((B,))]
        assert all(o.outs[0] == NdSbp((Split(1),)) for o in ffn)
        # the expert weights' gradients ([E, d, ffn] and [E, ffn, d]) are sums over the
        # split groups: partial, then all-reduced (XLA combines them with the others)
        grads = [o for o in plan.ops if o.prim == "dot_general" and o.types.split("->")[1]
                 in (f"f32[{e},{cfg.d_model},{d_ff}]", f"f32[{e},{d_ff},{cfg.d_model}]")]
        assert len(grads) == 2 and all(o.outs[0] == NdSbp((P,)) for o in grads)
        assert compiled["all-reduce"].status == "matched"
    assert not kinds.unplanned


def _mlp_2x2():
    cfg = mlp.MLPConfig(batch=64, d_in=64, hidden=64, d_out=64, n_layers=2)
    step_fn, (state, data) = mlp.make_train_step(cfg)
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    return step_fn, state, data, mesh


def test_seeds_bound_the_plan_and_are_reported():
    """Hand-written plans given as seeds (in_shardings per argument, prefixes allowed): the
    plan costs no more than any of them in the cost model, and explain() lists them, each
    plan with one predicted step (the seeds' and the plan's as the header shows it)."""
    step_fn, state, data, mesh = _mlp_2x2()
    seeds = {"data-parallel": (Ps(), Ps(("a", "b"))),
             "replicated": (None, jax.tree.map(lambda _: Ps(), data))}
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=_SLOW_2D, time_limit=0.0,
                             seeds=seeds)
    plan = step.plan(state, data)
    costs = plan.solver["seeds"]
    assert set(costs) == {"data-parallel", "replicated"}
    assert plan.predicted.step_time <= min(costs.values()) * (1 + 1e-9)
    text = plan.explain()
    shown = fmt_time(plan.predicted.step_time)
    assert f"predicted step: {shown} = " in text
    seeds_line = next(line for line in text.splitlines() if line.startswith("seeds ("))
    assert seeds_line.endswith(f"; this plan {shown}"), seeds_line
    for name, cost in costs.items():
        assert f"{name} {fmt_time(cost)}" in seeds_line
    # and on the plan's own prediction (which prices XLA's combined collectives as the one
    # collective they compile to, where the objective shares them out): no seed beats it
    from shardc.plan.assemble import assemble
    from shardc.solve.search import SolveOptions, plan_graph
    from shardc.step.solving import problem

    call = step.convention.split((state, data), {})
    traced = step._traced(call)[1]
    sopts = SolveOptions(None, 0.0, seeds=problem(step, call, traced)[1][0])
    cg, sol = plan_graph(traced.traced.graph, (2, 2), ("a", "b"), _SLOW_2D, sopts,
                         ties=traced.ties)
    assert set(sol.seed_choices) == {"data-parallel", "replicated"}
    for choice in sol.seed_choices.values():
        seeded = assemble(traced.traced.graph, cg, choice, traced.ties, {})
        assert plan.predicted.step_time <= seeded.predicted.step_time * (1 + 1e-9)


_SLOW_2D = Cluster(axis_bandwidth={"a": 5e9, "b": 50e9}, axis_latency={"a": 5e-6, "b": 5e-6},
                   device_flops=2e11)


@pytest.mark.parametrize("seeds, message", [
    ({"one": (Ps(),)}, "one entry per dynamic"),
    ({"bad": (Ps(), Ps("z"))}, "seed 'bad'"),
    ({"order": (Ps(), Ps(("b", "a")))}, "out of mesh order"),
])
def test_bad_seeds_name_the_seed_and_the_fix(seeds, message):
    step_fn, state, data, mesh = _mlp_2x2()
    with pytest.raises(TypeError, match="seeds takes"):
        shardc.auto_shard(step_fn, mesh=mesh, seeds=[(Ps(), Ps())])
    step = shardc.auto_shard(step_fn, mesh=mesh, time_limit=0.0, seeds=seeds)
    with pytest.raises(ValueError, match=message):
        step.plan(state, data)


def test_a_replicated_state_seed_all_reduces_its_gradients():
    """From data-parallel inputs (state replicated, batch split), the completion decides the
    optimizer update backwards from the replicated state it writes: each gradient is
    all-reduced once, not reduce-scattered and re-gathered for the replicated update."""
    step_fn, state, data, mesh = _mlp_2x2()
    t = trace(step_fn, state, data)
    ties = shardc.step.signature.tie_outputs(t.in_tree.children(), t.out_tree, t.graph)
    cg = build(t.graph, (4,), ("x",), Cluster(), ties)
    cg.merge_followers()
    n_state = len(jax.tree.leaves(state))
    layouts = {k: (NdSbp((B,)) if k < n_state else NdSbp((Split(0),)))
               for k in range(len(t.graph.inputs))}
    x = descent.from_inputs(cg, layouts)
    plan = assemble(t.graph, cg, cg.decode(x), ties, {})
    kinds = {c.split("@")[0] for r in plan.reshards for c in r.collectives}
    assert "all-reduce" in kinds and "reduce-scatter" not in kinds, kinds
    assert all(nd == NdSbp((B,)) for nd in plan.inputs[:n_state])  # ZeRO would split these


def test_an_fsdp_seed_keeps_the_batch_split_and_gathers_the_weights():
    """From FSDP's inputs (every leaf split on dim 0), XLA keeps the activations split on
    the batch and all-gathers each weight for the dot that reads it. The completion's
    second greedy pass does the same (:func:`descent.batch_nodes`), where each op's
    cheapest choice alone moves the activations instead: on the tiny GPT, cheaper."""
    from shardc.bench.zoo import ZOO

    zm = ZOO["gpt"]
    cfg, mod = zm.config("tiny"), zm.load()
    state, batch = mod.abstract_args(cfg)
    t = trace(mod.build_step(cfg), state, batch)
    ties = shardc.step.signature.tie_outputs(t.in_tree.children(), t.out_tree, t.graph)
    cg = build(t.graph, (8,), ("x",), Cluster.nvlink_node(("x",)), ties)
    cg.merge_followers()
    layouts = {k: NdSbp((Split(0),)) for k in range(len(t.graph.inputs))}
    seeded = descent.from_inputs(cg, layouts)
    inputs = descent.fixed_inputs(cg, layouts)
    cheapest = descent.descend(cg, descent.greedy(cg, inputs, descent.tail_nodes(cg)))
    assert descent.objective(cg, seeded) < 0.8 * descent.objective(cg, cheapest)


def test_the_collector_pause_restores_what_it_found():
    """Planning runs with Python's cyclic collector off (``gc_paused``): back on after, also
    after an error; a pause inside another, or one entered with the collector off, leaves
    it off."""
    import gc

    from shardc.solve.collector import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("planning failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_beside_answers_in_order_runs_the_rest_on_other_threads_and_raises(monkeypatch):
    """``beside``: the first call on this thread, the others on threads of their own (one
    core: all here, one after another); answers in the calls' order; an error raised."""
    import threading

    from shardc.solve import beside as module

    here = threading.get_ident()

    def where(k):
        return lambda: (k, threading.get_ident() == here)

    monkeypatch.setattr(module, "cores", lambda: 2)
    assert module.beside([where(k) for k in range(3)]) == [(0, True), (1, False), (2, False)]
    monkeypatch.setattr(module, "cores", lambda: 1)
    assert module.beside([where(k) for k in range(3)]) == [(0, True), (1, True), (2, True)]
    monkeypatch.setattr(module, "cores", lambda: 2)

    def fails():
        raise ValueError("an LP failed")

    with pytest.raises(ValueError, match="an LP failed"):
        module.beside([where(0), fails])


def test_a_budgeted_plan_is_the_same_on_one_core_and_two(monkeypatch):
    """The Lagrangian search's relaxations and the 1-D seeds run beside each other where
    two cores are free (:mod:`shardc.solve.beside`): the same LPs, so the same plan as one
    after another, and the searches did run them two at a time; on a loaded machine the
    speculative relaxation is not solved at all, and the plan is the same again."""
    import shardc.solve.beside as module
    import shardc.solve.ilp as ilp
    from shardc.models import gpt
    from shardc.solve.search import SolveOptions, plan_graph

    cfg = gpt.GPTConfig.tiny()
    t = trace(gpt.build_step(cfg), *gpt.abstract_args(cfg))
    cluster = Cluster.multi_node("node", "gpu")
    real, solve = ilp.beside, ilp._solve
    plans, pairs, lps = [], [], []
    monkeypatch.setattr(ilp, "beside", lambda calls: pairs[-1].append(len(calls)) or real(calls))
    monkeypatch.setattr(ilp, "_solve", lambda *a: lps.__setitem__(-1, lps[-1] + 1) or solve(*a))
    for n, load in ((2, 0.0), (1, 0.0), (2, 3.0)):
        monkeypatch.setattr(module, "cores", lambda n=n: n)
        monkeypatch.setattr(module.os, "getloadavg", lambda load=load: (load, load, load))
        pairs.append([])
        lps.append(0)
        _, sol = plan_graph(t.graph, (2, 4), ("node", "gpu"), cluster,
                            SolveOptions(memory_budget=2.0e6))
        plans.append(sol.choice)
    assert pairs[0] and set(pairs[0]) == {2}  # Lagrangian searches ran, each a pair of LPs
    assert not pairs[1] and not pairs[2]  # one core, or two busy: one LP at a time
    # busy: no relaxation solved on speculation (here every one was used: the first
    # doubling's multipliers fitted, so the count is the same)
    assert lps[0] == lps[1] >= lps[2]
    assert plans[0] == plans[1] == plans[2]


def test_the_budgeted_search_weighs_memory_rows_by_their_use_at_the_lp_optimum():
    """What the LP reports as a row's dual value, and the Lagrangian search's multipliers
    start from, is the row's activity at the optimum (OR-Tools' model builder with HiGHS),
    not its dual. Pinned: a dependency that reports true duals changes every budgeted
    plan, and must come with the bench re-measured."""
    import scipy.sparse as sparse

    from shardc.solve.ilp import _model, _solve

    # min 2x subject to x >= 3, 0 <= x <= 1 scaled: min 2z, z >= 0.75, z <= 1
    model = _model(np.array([2.0]), np.array([0.75]), np.array([np.inf]),
                   sparse.csr_matrix(np.array([[1.0]])))
    status, values, duals = _solve(model, None, 10.0, False)
    assert status == "OPTIMAL" and values.tolist() == [0.75]
    assert duals.tolist() == [0.75]  # the row's activity; its dual is 2.0


def test_a_seed_completion_keeps_the_seed_inputs_where_free_descent_strands_them():
    """Coordinate descent is path-dependent. From the wide ResNet's ZeRO-1 seed (the bench's
    configuration, abstract, on (2, 4) of one NVLink node) a descent free to move the
    inputs moved the replicated parameters to HSDP's split and stopped there; with the
    seed's inputs kept it reaches a cheaper plan (the optimizer's update stays sharded and
    the small parameters' gathers join the large ones', as XLA compiles the expert). The
    seed's plan is the cheapest end point, so the plan costs no more than it."""
    from shardc.bench import harness
    from shardc.bench.zoo import PRESETS, ZOO
    from shardc.solve.search import SolveOptions, plan_graph
    from shardc.step.solving import problem

    zm, preset = ZOO["wrn"], PRESETS["node-8"]
    mod, cfg = zm.load(), zm.config("bench", preset.devices)
    args = mod.abstract_args(cfg)
    expert = next(e for e in harness.experts(zm, preset) if e.name == "zero1-shard4")
    mesh = harness.make_mesh(preset)
    specs = harness.expert_seeds(zm, mesh, preset, args, True)["zero1-shard4"]
    view = expert.mesh(mesh)
    step = shardc.auto_shard(mod.build_step(cfg), mesh=view, cluster=expert.view.cluster,
                             time_limit=0.0, mesh_search=False, seeds={"zero1": specs})
    call = step.convention.split(args, {})
    traced = step._traced(call)[1]
    layouts = problem(step, call, traced)[1][0]["zero1"]
    cg, sol = plan_graph(traced.traced.graph, expert.view.shape, expert.view.names,
                         expert.view.cluster, SolveOptions(None, 0.0, seeds={"zero1": layouts}),
                         ties=traced.ties)
    inputs = descent.fixed_inputs(cg, layouts)
    tail = descent.tail_nodes(cg)
    free = min(descent.objective(cg, descent.descend(cg, descent.greedy(cg, dict(inputs), tail,
                                                                        kept)))
               for kept in (frozenset(), descent.batch_nodes(cg)))
    ends = descent.completions(cg, inputs)
    assert len({tuple(sorted(end.items())) for end in ends}) == len(ends)  # each once
    assert any(all(end[n] == c for n, c in inputs.items()) for end in ends)
    assert sol.stats["seeds"]["zero1"] == descent.objective(cg, ends[0])
    assert sol.stats["seeds"]["zero1"] < free * (1 - 1e-3), (sol.stats["seeds"], free)


def test_a_repair_whose_moves_cycle_stops_at_the_first_plan_seen_again():
    """Two nodes, two memory rows, a cap of 1 on each that no plan meets: moving node 0
    off row 0 puts it over row 1, and the cheapest move back restores the first plan. The
    repair gives up there (no plan fits) instead of cycling through its move limit."""
    import shardc.solve.ilp as ilp

    mem = np.array([[2.0, 0.0, 2.0, 0.0],    # row 0: choice 0 of each node holds 2
                    [0.0, 2.0, 0.0, 2.0]])   # row 1: choice 1 does
    plan = ilp._Budgeted([0, 1], {0: 0, 1: 2}, [np.array([0.0, 1.0])] * 2, {}, mem,
                         np.array([1.0, 1.0]))
    looked: list[int] = []
    local = plan._local

    def counted(a, k):
        looked.append(k)
        return local(a, k)

    plan._local = counted
    assert plan.repair(np.array([0, 0])) is None
    # plans [0, 0] and [1, 0] looked at (two nodes each), then [0, 0] seen again
    assert len(looked) == 4, looked
