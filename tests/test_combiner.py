"""XLA's combiner run on a plan (shardc/cost/combiner.py): the predicted collectives are the
compiled ones, count for count."""

import dataclasses

import jax
import jax.numpy as jnp
from helpers import assert_close
from jax.sharding import AxisType

import shardc
from shardc.cost.cluster import Cluster
from shardc.cost.combine import XLA_CPU, XLA_GPU, Combiner
from shardc.cost.combiner import Pending, Use, combine_groups
from shardc.ir.trace import trace
from shardc.plan.assemble import _body_of


def _chain_and_branch():
    """``v = cos(sin(a))`` and ``w = exp(b)``, returned in that order."""
    def f(a, b):
        return jnp.cos(jnp.sin(a)), jnp.exp(b)

    graph = trace(f, jnp.ones(4), jnp.ones(4)).graph
    sin, cos, exp = graph.ops
    # reshards: sin's result read by cos, and each output on its way out
    uses = [Use(sin.outputs[0].id, cos.id), Use(cos.outputs[0].id, -1),
            Use(exp.outputs[0].id, -2)]
    via = {(u.consumer, u.value): i for i, u in enumerate(uses)}
    return graph, uses, via


def _pending(keys):
    return [Pending(i, 0, k, 16.0) for i, k in enumerate(keys)]


def test_combiner_joins_independent_collectives_in_post_order():
    graph, uses, via = _chain_and_branch()
    key = ("all-reduce", (0,), "sum", "f32", 1)
    # the first opens a set; the second reads the first's result (it cannot join), so it
    # opens the next set, which the independent third joins
    assert combine_groups(graph, uses, via, _pending([key] * 3), XLA_CPU) == [-1, 0, 0]


def test_combiner_keeps_keys_and_limits_apart():
    graph, uses, via = _chain_and_branch()
    key, other = ("all-reduce", (0,), "sum", "f32", 1), ("all-reduce", (0,), "max", "f32", 1)
    assert combine_groups(graph, uses, via, _pending([key, key, other]), XLA_CPU) == [-1] * 3
    one = Combiner("test", XLA_CPU.families, XLA_CPU.threshold_bytes, 1)
    assert combine_groups(graph, uses, via, _pending([key] * 3), one) == [-1] * 3
    small = Combiner("test", XLA_CPU.families, 24.0, 256)  # two of 16 bytes pass 24
    assert combine_groups(graph, uses, via, _pending([key] * 3), small) == [-1] * 3


def test_two_rings_sends_join_where_neither_waits_for_the_other():
    """XLA:GPU's permute combiner on two unrolled rings of 3 sends each (one reshard per
    ring, its sends a chain): in post order the first ring's last send and the second's
    first join where the second ring's block does not wait for the first ring's product;
    where it does (the second reads the first's result), nothing joins."""
    key = ("collective-permute", (0,), None, (), 1)

    def rings(f):
        graph = trace(f, jnp.ones((2, 4, 4)), jnp.ones((2, 4, 4))).graph
        first, second = [op for op in graph.ops if op.name == "dot_general"]
        uses = [Use(first.inputs[1].id, first.id, ring=0),
                Use(second.inputs[1].id, second.id, ring=1)]
        pending = [Pending(r, k, key, 16.0) for r in range(2) for k in range(3)]
        return combine_groups(graph, uses, {}, pending, XLA_GPU)

    apart = rings(lambda q, k: (jnp.einsum("bqd,bkd->bqk", q, k),
                                jnp.einsum("bqd,bkd->bqk", k, q)))
    assert apart == [-1, -1, 0, 0, -1, -1]
    chained = rings(lambda q, k: jnp.einsum("bqd,bkd->bqk", q,
                                            jnp.einsum("bqd,bkd->bqk", q, k)))
    assert chained == [-1] * 6


def test_a_ring_reusing_anothers_sends_waits_for_them():
    """Two rings passing the same blocks share one set of sends (the second's reshard has
    none): a third ring passing the second's result waits for those sends, so its first
    send joins none of them."""
    key = ("collective-permute", (0,), None, (), 1)

    def f(q, k, p):
        s2 = jnp.einsum("bqd,bkd->bqk", p, k)
        return jnp.einsum("bqd,bkd->bqk", q, k), jnp.einsum("bqd,bkd->bqk", q, s2)

    graph = trace(f, *[jnp.ones((2, 4, 4))] * 3).graph
    second, first, third = [op for op in graph.ops if op.name == "dot_general"]
    uses = [Use(first.inputs[1].id, first.id, ring=0),
            Use(second.inputs[1].id, second.id, ring=0),  # k's sends, the first ring's
            Use(third.inputs[1].id, third.id, ring=2)]
    pending = [Pending(r, k, key, 16.0) for r in (0, 2) for k in range(3)]
    assert combine_groups(graph, uses, {}, pending, XLA_GPU) == [-1] * 6


def test_each_loop_body_and_cond_branch_is_a_computation_of_its_own():
    """XLA combines collectives within one computation: the key of a ring's sends holds the
    loop body or cond branch its op is in (() at the top level)."""
    def f(x, p):
        def body(c, _):
            return c @ x, None

        loop, _ = jax.lax.scan(body, x, None, length=2)
        branch = jax.lax.cond(p > 0, lambda y: y @ y, lambda y: y @ y.T, x)
        return x @ x, loop, branch

    graph = trace(f, jnp.ones((4, 4)), jnp.float32(1.0)).graph
    places = [_body_of(graph, op) for op in graph.ops if op.name == "dot_general"]
    assert () in places and len(set(places)) == 4, places


def _planned(fn, shape: tuple[int, ...], names: tuple[str, ...]):
    """``fn`` auto-sharded on one NVLink node viewed as ``shape`` (no mesh search), and
    the mesh."""
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    return shardc.auto_shard(fn, mesh=mesh, cluster=Cluster.nvlink_node(names),
                             mesh_search=False), mesh


def test_tensor_parallel_mlp_predicts_the_compiled_collective_counts():
    """The bench's mlp on node-8 (view 2 x 4): its loss's all-reduce is independent of the
    backward pass, and XLA combines it with the first layer's input-gradient all-reduce
    (neither a gradient on its way into the optimizer), so the plan predicts one all-reduce
    fewer than it once did, and every kind's count is the compiled one."""
    from shardc.models.mlp import MLPConfig, abstract_args, build_step

    cfg = MLPConfig.realistic(n_layers=4)
    step, mesh = _planned(build_step(cfg), (2, 4), ("gpu2", "gpu4"))
    args = abstract_args(cfg)
    plan = step.plan(*args)
    check = plan.verify(step.lower(*args).compile(), mesh)
    assert check.counts_match, check.report()
    assert abs(check.time_error) < 0.01, check.report()


def test_the_demo_gpt_predicts_the_compiled_collective_counts():
    """The demo's GPT ties its embedding: the table's gradient is the gather's scatter-add
    (which XLA all-reduces where it is made) plus the output projection's partial
    gradient. XLA reduces the two summands in the one combined all-reduce and adds them;
    the plan, which adds them partial and reduces the sum, predicts that (the scatter's
    all-reduce keyed as the sum it is, over both axes at once, and read apart by the sum:
    :class:`shardc.cost.combiner.Use`), where it predicted two dependent all-reduces (3
    against 1 compiled here, 2 in ``shardc demo``)."""
    from shardc.models import gpt

    cfg = gpt.GPTConfig(vocab=2048, seq_len=128, d_model=256, n_heads=8, n_layers=2,
                        batch=32, learning_rate=1e-3)
    fn, (state, batch) = gpt.make_train_step(cfg)
    step, mesh = _planned(fn, (2, 4), ("node", "gpu"))
    plan = step.plan(state, batch)
    check = plan.verify(step.lower(state, batch).compile(), mesh)
    assert check.counts_match, check.report()
    assert abs(check.time_error) < 0.01, check.report()


def test_a_summand_reduced_apart_joins_the_sums_reduction():
    """``sin(a) + cos(b)``, its result reduced where made: the summand ``sin(a)`` made
    partial for the sum (a scatter-add's whole partial all-reduced) is read apart (XLA
    reduces the sum's partial summands before it, independently of that all-reduce), so
    the two all-reduces combine; read in the sum, the second waits for the first."""
    def f(a, b):
        return jnp.sin(a) + jnp.cos(b)

    graph = trace(f, jnp.ones(4), jnp.ones(4)).graph
    sin, _, add = graph.ops
    key = ("all-reduce", (0,), "sum", "f32", 1)
    for apart, want in ((False, [-1, -1]), (True, [0, 0])):
        uses = [Use(sin.outputs[0].id, add.id, apart), Use(add.outputs[0].id, None)]
        via = {(add.id, sin.outputs[0].id): 0}
        assert combine_groups(graph, uses, via, _pending([key] * 2), XLA_CPU) == want


def test_a_whole_partial_read_partial_is_one_all_reduce_keyed_as_a_sum():
    """A scatter-add's whole partial read partial over both axes of a (2, 4) mesh is one
    all-reduce over both (XLA reduces it where it is made; it was two, one per axis), and
    its collective is keyed as a sum (it was keyed apart from every gradient's)."""
    from shardc.cost.comm import conversion
    from shardc.ir.sbp import WHOLE, NdSbp, P

    names = ("node", "gpu")
    conv = conversion(NdSbp((WHOLE, WHOLE)), NdSbp((P, P)), (2, 4), names,
                      Cluster.nvlink_node(names))
    assert [(c.kind, c.axes) for c in conv.collectives] == [("all-reduce", (0, 1))]
    assert WHOLE.reduction == "sum" and P.reduction == "sum"


def _peak(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def test_micro_batched_step_predicts_the_reduce_scatters_whole_buffers():
    """Gradient accumulation unrolled over 4 micro-batches, planned on a (2, 4) NVLink node
    (the bench's accum cell; the step inside a ``jax.jit`` call, whose sums the lowering
    does not hold apart, so every micro-batch's gradients are reduced): each micro-batch's
    weight gradients are reduce-scattered, and XLA:CPU combines all eight into one
    all-reduce of the whole gradients (then slices them), its operands and results live at
    once, the summed gradients read after it. The predicted peak is within 10% of what XLA
    allocates (it was 30% under)."""
    from shardc.models.accum import AccumConfig, abstract_args, build_step

    cfg = AccumConfig.bench(n_layers=2)
    step, mesh = _planned(jax.jit(build_step(cfg)), (2, 4), ("gpu2", "gpu4"))
    args = abstract_args(cfg)
    plan = step.plan(*args)
    compiled = step.lower(*args).compile()
    scattered = [r for r in plan.reshards if any(c.startswith("reduce-scatter")
                                                 for c in r.collectives)]
    assert len(scattered) == 8  # 2 weights x 4 micro-batches: the case this pins
    assert abs(plan.predicted.peak_memory / _peak(compiled) - 1) <= 0.10, \
        (plan.predicted.peak_memory / 2**20, _peak(compiled) / 2**20)


def test_micro_batched_step_reduces_the_summed_gradients_once():
    """Gradient accumulation as a Python loop over 4 micro-batches (the bench's accum cell on
    one NVLink node): the micro-batches' partial gradients are summed apart per device and
    reduced once after the loop, so the step is no slower than data parallelism (which
    reduces every micro-batch's gradients) under each collective model: NCCL's, the
    pessimistic ring and alpha-beta. Once every micro-batch's gradients were
    reduce-scattered (ZeRO-1-like), 8% slower than data parallelism priced ring."""
    import dataclasses

    from shardc.bench.experts import compile_expert, seed_experts
    from shardc.bench.harness import feed_seconds
    from shardc.inspect.hlo import price_all
    from shardc.models import accum

    cfg = accum.AccumConfig.bench(n_layers=2)
    fn, args = accum.build_step(cfg), accum.abstract_args(cfg)
    step, mesh = _planned(fn, (8,), ("gpu",))
    cluster = Cluster.nvlink_node(("gpu",))
    plan = step.plan(*args)
    sums = {o.types for o in plan.ops if o.prim == "add" and o.outs[0].has_partial}
    assert "f32[1024,1024],f32[1024,1024]->f32[1024,1024]" in sums  # the kernels' sums
    models = [dataclasses.replace(cluster, collective_model=m)
              for m in ("nccl", "ring", "alpha-beta")]

    def priced(compiled) -> list[float]:
        feed = feed_seconds(compiled, args[1], cluster)
        return [c.time + feed for c in price_all(compiled, mesh, models)]

    compiled = step.lower(*args).compile()
    ours = priced(compiled)
    # the partial sums are pinned stacked, so XLA fuses none into its reader: each
    # micro-batch's gradient dies at the add that reads it (the peak was 18% over)
    assert abs(plan.predicted.peak_memory / _peak(compiled) - 1) <= 0.10, \
        (plan.predicted.peak_memory / 2**20, _peak(compiled) / 2**20)
    dp = next(e for e in seed_experts(mesh, cluster) if e.name == "data-parallel")
    theirs = priced(compile_expert(fn, *args, mesh, dp, accum.param_axes)[1].compile())
    assert all(a <= b for a, b in zip(ours, theirs, strict=True)), (ours, theirs)


def test_micro_batched_step_summed_apart_matches_jit():
    """The step whose micro-batches' gradients are summed apart per device (held stacked,
    ``lower/stacking.py``) and reduced once computes what ``jax.jit`` of it does."""

    from shardc.models import accum

    cfg = accum.AccumConfig.bench(n_layers=2)
    fn, (state, batch) = accum.make_train_step(cfg)
    step, _ = _planned(fn, (8,), ("gpu",))
    plan = step.plan(state, batch)
    assert any(o.prim == "add" and o.outs[0].has_partial for o in plan.ops)
    got, want = step(state, batch), jax.jit(fn)(state, batch)
    assert_close(got, want, lr=cfg.learning_rate)


def test_xla_gpu_shares_the_latency_of_parameter_gathers():
    """XLA:GPU combines independent all-gathers (to 30 MiB each): the search's objective
    shares one latency among the parameters (head values) the step's other ops read, as it
    does for the gradients entering the update; XLA:CPU, which runs each all-gather on its
    own, charges each its latency."""
    from shardc.cost.combine import XLA_GPU, alpha_scales
    from shardc.ir.flow import head_values, tail_values
    from shardc.models import mlp

    step_fn, (state, data) = mlp.make_train_step(mlp.MLPConfig.tiny())
    graph = trace(step_fn, state, data).graph
    head, tail = head_values(graph), tail_values(graph)
    params = {v.id for v in graph.inputs[:len(jax.tree.leaves(state))]}
    assert params <= head
    gpu, cpu = alpha_scales(graph, XLA_GPU), alpha_scales(graph, XLA_CPU)
    assert not any(v in cpu for v in head - tail)
    shares = {gpu[v] for v in head - tail}
    assert len(shares) == 1 and 0 < shares.pop() < 0.5
    assert all(gpu[v] == cpu[v] for v in tail)  # the tail is shared as before
    # a combiner whose byte limit no parameter fits runs each gather on its own
    tight = Combiner("gpu", XLA_GPU.families, 1.0, 256)
    assert all(alpha_scales(graph, tight)[v] == 1.0 for v in head - tail)


def test_xla_gpu_plans_price_fsdp_gathers_combined():
    """The combiner travels from the mesh's platform to the search: a plan for XLA:GPU
    builds its cost graph with all-gathers among the combined kinds (their latencies
    shared), one for XLA:CPU without."""
    from shardc.cost.combine import XLA_GPU
    from shardc.models import mlp
    from shardc.solve.problem import build

    step_fn, (state, data) = mlp.make_train_step(mlp.MLPConfig.tiny())
    graph = trace(step_fn, state, data).graph
    cluster = Cluster.multi_node("node", "gpu")
    gpu = build(graph, (2, 4), ("node", "gpu"), cluster, combiner=XLA_GPU)
    cpu = build(graph, (2, 4), ("node", "gpu"), cluster)
    assert "all-gather" in gpu.combined and "all-gather" not in cpu.combined
    # the same graph, cheaper or equal everywhere on XLA:GPU (latencies shared, never added)
    assert sum(float(c.min()) for c in gpu.cost) <= sum(float(c.min()) for c in cpu.cost)
    assert any((a.cost < b.cost - 1e-12).any() for a, b in zip(gpu.edges, cpu.edges))


def test_overlap_planning_on_xla_gpu_searches_under_both_objectives():
    """Under overlap the search's serial objective only proposes plans; on XLA:GPU it runs
    once with the gathers' latencies shared (XLA:GPU's combiners) and once charging each
    (XLA:CPU's), and the overlap replay ranks both searches' plans. Serially, or on a
    backend whose combiners are XLA:CPU's, one search; two serially under a collective
    model other than NCCL's."""
    import numpy as np

    from shardc.cost.combine import XLA_GPU
    from shardc.step.solving import objectives

    class _Gpu:  # a concrete mesh's devices, as platform_of reads them
        platform = "gpu"

    gpu_mesh = type("Mesh", (), {"devices": np.array([_Gpu()] * 8, dtype=object)})()
    cpu_mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    serial, overlap = Cluster(), Cluster(overlap=True)

    def searched(mesh, cluster):
        return [(o.combiner, o.cluster) for o in objectives(mesh, cluster)]

    assert searched(gpu_mesh, serial) == [(XLA_GPU, serial)]
    assert searched(gpu_mesh, overlap) == [(XLA_GPU, overlap), (XLA_CPU, overlap)]
    assert searched(cpu_mesh, overlap) == [(XLA_CPU, overlap)]
    # serially under another collective model, also a search under NCCL's (its plans
    # priced by the cluster's own model); one cluster object per cluster
    ring = Cluster(collective_model="ring")
    found = searched(gpu_mesh, ring)
    assert found[0] == (XLA_GPU, ring) and found[1][0] == XLA_GPU
    assert found[1][1] == dataclasses.replace(ring, collective_model="nccl")
    assert objectives(gpu_mesh, ring)[1].cluster is found[1][1]


def test_xla_gpu_reduces_an_add_of_two_partial_summands_once():
    """``(x @ w1 + x @ w2) @ w3`` with the contracted dim split: each of the first dots is
    partial and the add (not the step's last, so it reads no partial value) reads both
    reduced (here reduce-scattered). XLA:GPU reassociates (``add(reduce-scatter(a),
    reduce-scatter(b))`` -> ``reduce-scatter(add(a, b))``, each read by the add alone), so
    the plan made for it predicts one reduction of one summand's bytes; for XLA:CPU, two
    (which its combiner may join, as one collective of both)."""
    from shardc.ir.sbp import B, NdSbp, Split
    from shardc.plan.assemble import assemble
    from shardc.solve.fixed import Fixed
    from shardc.solve.search import SolveOptions, plan_graph

    def f(x, w1, w2, w3):
        return (x @ w1 + x @ w2) @ w3

    graph = trace(f, jnp.ones((64, 256)), jnp.ones((256, 128)), jnp.ones((256, 128)),
                  jnp.ones((128, 16))).graph
    fixed = Fixed(inputs={0: NdSbp((Split(1),)), 1: NdSbp((Split(0),)), 2: NdSbp((Split(0),)),
                          3: NdSbp((B,))}, outputs={0: NdSbp((B,))})
    cg, sol = plan_graph(graph, (8,), ("gpu",), Cluster.nvlink_node(("gpu",)),
                         SolveOptions(None, 0.0), fixed=fixed)
    reduced = {}
    for platform in ("gpu", "cpu"):
        plan = assemble(graph, cg, sol.choice, (), {}, platform=platform)
        kinds = [(name, b) for r in plan.reshards
                 for name, b in zip(r.collectives, r.collective_bytes, strict=True)]
        reduced[platform] = kinds
    def reductions(platform):
        return [(k, b) for k, b in reduced[platform] if k.split("@")[0] in
                ("all-reduce", "reduce-scatter")]

    cpu, gpu = reductions("cpu"), reductions("gpu")
    assert len(cpu) == 2 and cpu[0] == cpu[1], reduced  # each summand reduced
    assert gpu == cpu[:1], reduced  # their sum reduced once, one summand's bytes


def _deep_mlp_step(clip: bool, layers: int = 32, width: int = 64, rows: int = 2048):
    """A ``layers``-deep tanh MLP's Adam step (``optax.clip_by_global_norm`` first where
    ``clip``): its state and batch as arrays."""
    import optax

    tx = optax.adam(1e-3)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(1.0), tx)

    def loss(params, x, y):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean((x - y) ** 2)

    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    key = jax.random.PRNGKey(0)
    params = [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width ** 0.5
              for i in range(layers)]
    batch = (jax.random.normal(key, (rows, width)),
             jax.random.normal(jax.random.fold_in(key, layers), (rows, width)))
    return step, (params, tx.init(params)), batch


def test_global_norm_clipping_keeps_data_parallelism():
    """A 32-leaf MLP's gradients feed the global norm's sum of squares as well as Adam: XLA
    still combines their all-reduces into one (none depends on another), so the search
    charges them one latency and plans data parallelism, predicted as the step without
    clipping is; charged a latency each they made a replicated plan cheaper. The compiled
    step equals jax.jit's."""
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    predicted = {}
    for clip in (False, True):
        fn, state, batch = _deep_mlp_step(clip)
        step = shardc.auto_shard(fn, mesh=mesh)
        plan = step.plan(state, batch)
        predicted[clip] = plan.predicted.step_time
        compiled = step.lower(state, batch).compile()
        batch_specs = [s.spec for s in compiled.input_shardings[0][1]]
        assert batch_specs == [jax.sharding.PartitionSpec("gpu")] * 2, (clip, batch_specs)
        assert all(s.is_fully_replicated for s in jax.tree.leaves(compiled.input_shardings[0][0]))
        assert_close(compiled(state, batch), jax.jit(fn)(state, batch), lr=1e-3)
    assert predicted[True] <= 1.05 * predicted[False], predicted
