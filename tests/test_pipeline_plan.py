"""A pipeline as the planner's choice (shardc.pipeline.choose.adopt through auto_shard) on 8
CPU devices: a program with a layer stack (shardc.pipeline.layers, or a plain scan over
layers) pipelines where its stage axis is slow, runs
what was priced (the compiled collective-permutes are the plan's, count and bytes; a
stage's compiled peak within 15% of the predicted one), equals the unpipelined step, and
is not pipelined with pipeline=False or where no pipeline pays."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import MIB, assert_close

import shardc
from shardc.cost.cluster import Cluster
from shardc.inspect.hlo import collectives, compiled_peak_memory
from shardc.inspect.loops import multiplicity
from shardc.pipeline import Pipeline, layers

WIDTH, LAYERS, BATCH = 1024, 8, 64
#: the stage axis across nodes on Ethernet, the other within a node (NVLink), on devices
#: of 1 TFLOP/s, so that a small model's compute counts beside the sends
SLOW = dataclasses.replace(Cluster.ethernet_nodes("stage", "data"), device_flops=1e12)


def layer(c, w):
    return c + jnp.tanh(c @ w), None


def train_step(stack):
    """(weights, x) -> (weights after one SGD step, loss)."""
    def loss(w, x):
        return jnp.mean(stack(layer, x, w)[0] ** 2)

    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, value
    return step


def args(n_layers=LAYERS, width=WIDTH, batch=BATCH):
    k = jax.random.split(jax.random.key(0))
    return (jax.random.normal(k[0], (n_layers, width, width)) / width,
            jax.random.normal(k[1], (batch, width)))


def mesh():
    return jax.make_mesh((4, 2), ("stage", "data"))


def close(got, want):
    assert_close(got, want, rtol=2e-5, atol=2e-6)


def loop_permutes(compiled, m):
    runs = multiplicity(compiled.as_text())
    return [(c.result_bytes, runs[c.computation]) for c in collectives(compiled, m)
            if c.kind == "collective-permute" and runs[c.computation] > 1]


def scan(layer_fn, carry, xs):  # a plain scan, looked up when it runs (as user code does)
    return jax.lax.scan(layer_fn, carry, xs)


@pytest.mark.parametrize("stack", [layers, scan])
def test_the_planner_pipelines_a_stack_over_a_slow_axis_and_runs_what_it_priced(stack):
    # a stack written with shardc.pipeline.layers, or as a plain jax.lax.scan; over a
    # 1 GB/s stage axis a pipeline pays (priced: 2.35 ms pipelined over the stages,
    # 2.95 ms not; on Ethernet's 12.5 GB/s no pipeline saves 5% of this small model's step)
    w, x = args()
    m = mesh()
    slower = dataclasses.replace(SLOW, axis_bandwidth={**SLOW.axis_bandwidth, "stage": 1e9})
    step = shardc.auto_shard(train_step(stack), mesh=m, cluster=slower)
    plan = step.plan(w, x)
    assert plan.pipeline is not None and plan.pipeline.axis == "stage", plan.solver
    priced = plan.solver["pipeline"]
    # the priced compute; the communication is the conversions the program runs (to the
    # batch's host feed, a few us: the pipelined plan lays the batch out again)
    assert plan.predicted.step_time - plan.predicted.comm_time == \
        pytest.approx(priced["step_s"] - priced["comm_s"], abs=5e-6)
    assert priced["step_s"] < 0.95 * priced["unpipelined_s"]
    close(step(w, x), jax.jit(train_step(jax.lax.scan))(w, x))
    compiled = step.lower(w, x).compile()
    got = loop_permutes(compiled, m)
    assert sum(runs for _, runs in got) == priced["permutes"]
    assert {b for b, _ in got} == {priced["permute_bytes"]}
    # every collective compiled is one the plan priced (shardc.pipeline.runs)
    check = plan.verify(compiled, m)
    assert check.counts_match and abs(check.time_error) < 0.05, check.report()
    text = plan.explain(max_rows=2)
    assert "pipeline: 4 stages over mesh axis 'stage'" in text
    assert "stage 0: layers 0-1; stage 1: 2-3; stage 2: 4-5; stage 3: 6-7" in text
    assert "of the step" in text
    # the stack's loops named by the user's lines inside them, not shardc's own
    assert "loop at " + __file__ in text and "pipeline/stack.py" not in text, text
    # the stack's loop markers too (its scan, made in shardc, named by the layer's line)
    assert "stack.py" not in plan.explain(max_rows=100)
    # the pipeline's sends among the top resharding edges, named as the pipeline's
    edges = plan.explain(max_rows=1, top=3).split("resharding edges:")[1]
    assert re.search(r"pipeline\s+its stages\s+-\s+-\s+collective-permute@stage", edges), edges


@pytest.mark.parametrize("pipe", [Pipeline("stage", 4, 4), Pipeline("stage", 4, 8),
                                  Pipeline("stage", 4, 4, "circular", 2)])
def test_a_stage_peak_is_the_predicted_one(pipe):
    """The compiled program's peak (memory_analysis: arguments, results, temporaries) is
    within 15% of the plan's predicted per-stage peak."""
    w, x = args()
    m = mesh()
    step = shardc.auto_shard(train_step(layers), mesh=m, cluster=SLOW, pipeline=pipe)
    plan = step.plan(w, x)
    assert plan.pipeline == pipe and plan.solver["pipeline"]["reason"] == "requested"
    compiled = step.lower(w, x).compile()
    peak = compiled_peak_memory(compiled)
    assert peak == pytest.approx(plan.predicted.peak_memory, rel=0.15), \
        (peak, plan.predicted.peak_memory)
    got = loop_permutes(compiled, m)
    assert sum(runs for _, runs in got) == plan.solver["pipeline"]["permutes"]


def test_a_stage_peak_counts_what_the_rest_of_the_program_holds():
    """A Llama whose embedding and head outweigh its layers (a 4096-word vocabulary, Adam):
    a stage holds the rest's state, its updated copy and the head's working values beside
    its layers, and the layers' weights at work partly in the buffers of the moments'
    updated copy; the compiled peak is within 15% of the predicted one (the rest was
    counted from the unpipelined plan's working memory: 18.0 MiB predicted against 29.0
    compiled)."""
    from shardc.models import llama

    cfg = dataclasses.replace(llama.LlamaConfig.deep_tiny(), vocab=4096, d_model=128,
                              n_layers=8)
    step, (state, batch) = llama.make_train_step(cfg)
    pipe = Pipeline("node", 4, 4, "circular", 2)
    run = shardc.auto_shard(step, mesh=jax.make_mesh((4, 2), ("node", "gpu")),
                            cluster=Cluster.ethernet_nodes(), pipeline=pipe)
    plan = run.plan(state, batch)
    assert plan.pipeline == pipe
    peak = compiled_peak_memory(run.lower(state, batch).compile())
    assert peak == pytest.approx(plan.predicted.peak_memory, rel=0.15), \
        (peak, plan.predicted.peak_memory)


def test_pipelines_forbidden_or_not_worth_it_run_none():
    w, x = args()
    m = mesh()
    forbidden = shardc.auto_shard(train_step(layers), mesh=m, cluster=SLOW, pipeline=False)
    plan = forbidden.plan(w, x)
    assert plan.pipeline is None and "pipeline" not in plan.solver
    assert loop_permutes(forbidden.lower(w, x).compile(), m) == []
    # one node (every axis NVLink): data parallelism's all-reduce is cheap
    fast = shardc.auto_shard(train_step(layers), mesh=m,
                             cluster=Cluster.nvlink_node(("stage", "data")))
    assert fast.plan(w, x).pipeline is None


@pytest.mark.slow
def test_the_deep_zoo_model_runs_pipelined():
    """The zoo's deep model (a Llama whose layers are a stack) at test size, its train step
    pipelined over 4 stages of 8 layers: the Adam step of jax.jit, to rounding (Adam divides
    by the gradient's size: a gradient near zero summed in another order moves its update
    by a few percent of the learning rate, 1e-3)."""
    from shardc.models import llama

    cfg = llama.LlamaConfig.deep_tiny()
    step, (state, batch) = llama.make_train_step(cfg)
    want = jax.jit(step)(state, batch)
    m = jax.make_mesh((4, 2), ("node", "gpu"))
    run = shardc.auto_shard(step, mesh=m, pipeline=Pipeline("node", 4, 4))
    assert_close(run(state, batch), want, rtol=1e-4, atol=5e-5)
    assert run.plan(state, batch).pipeline == Pipeline("node", 4, 4)


def test_the_optimizer_moments_are_held_split_over_the_stages():
    """Adam's moments of the stacked blocks are held with the layer dim split over the
    stages, as the pipeline's gradients leave it, though the stage plan splits their layer
    dim over the data axis (left to the re-solve, they were split over the stages on
    another dim and converted by all-to-alls every step, 8 MiB of them): no all-to-all."""
    import optax

    from shardc.ir.sbp import Split
    from shardc.pipeline.scans import find_layers

    d, n_layers, batch, classes = 512, 8, 512, 10
    opt = optax.adam(1e-3)

    def block(h, w):
        return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None

    def step(state, data):
        params, opt_state = state
        x, y = data

        def loss(p):
            h = layers(block, x @ p["embed"], p["blocks"])[0]
            logits = h @ p["head"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, g = jax.value_and_grad(loss)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state), value

    k = jax.random.split(jax.random.key(42), 6)
    params = {"embed": jax.random.normal(k[0], (64, d)) / 8,
              "blocks": {"up": jax.random.normal(k[1], (n_layers, d, 2 * d)) / d ** 0.5,
                         "down": jax.random.normal(k[2], (n_layers, 2 * d, d)) / (2 * d) ** 0.5},
              "head": jax.random.normal(k[3], (d, classes)) / d ** 0.5}
    state = (params, opt.init(params))
    data = (jax.random.normal(k[4], (batch, 64)), jax.random.randint(k[5], (batch,), 0, classes))
    m = mesh()
    slow = dataclasses.replace(SLOW, axis_bandwidth={**SLOW.axis_bandwidth, "stage": 1e9})
    run = shardc.auto_shard(step, mesh=m, cluster=slow, pipeline=Pipeline("stage", 4, 32))
    plan = run.plan(state, data)
    _, tr, _ = run._plan(run.convention.split((state, data), {}))
    stacked = find_layers(tr.traced.graph, tr.ties, tr.resident).stacked
    at = plan.axis_names.index("stage")
    held = [nd for v, nd in zip(tr.traced.graph.inputs, plan.inputs) if v.id in stacked]
    assert held and all(nd.sbps[at] == Split(0) for nd in held), held
    compiled = run.lower(state, data).compile()
    assert not [c for c in collectives(compiled, m) if c.kind == "all-to-all"]


def test_inputs_fed_beside_the_batch_are_not_the_batch():
    """The batch is the carry's leading dim where a fed input it is made from leads with
    it: a learning rate of shape (1,), per-layer keys or a forward-only step's weights fed
    beside it do not hide it (they did: the batch was the leading dim every fed input
    shared, and those steps were never pipelined)."""
    from shardc.ir.trace import trace
    from shardc.pipeline.scans import find_layers

    w, x = args(width=64, batch=32)

    def sgd_lr(w, x, lr):
        value, g = jax.value_and_grad(lambda w: jnp.mean(scan(layer, x, w)[0] ** 2))(w)
        return w - lr[0] * g, value

    def forward(w, x):
        return jnp.mean(scan(layer, x, w)[0] ** 2)

    def same_size(w, x):  # a batch of 8 examples beside 8 layers: the weights are not it
        return jnp.mean(scan(layer, x, w)[0] ** 2)

    for fn, a, ties in [(sgd_lr, (w, x, jnp.array([0.1])), [(0, 0)]), (forward, (w, x), []),
                        (same_size, (w, x[:8]), [])]:
        graph = trace(fn, *a).graph
        found = find_layers(graph, ties)
        assert found is not None, fn.__name__
        assert found.batch == (8 if fn is same_size else 32), fn.__name__
        assert {v.id for v in graph.inputs[:1]} <= found.params, fn.__name__
        assert not {v.id for v in graph.inputs[:1]} & found.per_sample, fn.__name__
    # a loop over the batch's examples is not a layer scan whose carry leads with the batch
    rnn = trace(lambda w, x: scan(lambda c, r: (c + r @ w[0], None), x[0], x)[0].sum(), w, x)
    assert find_layers(rnn.graph) is None

    # end to end: the planner pipelines the step fed a learning rate, as without it
    w, x = args()
    m = mesh()
    slower = dataclasses.replace(SLOW, axis_bandwidth={**SLOW.axis_bandwidth, "stage": 1e9})
    lr = jnp.array([0.1])
    step = shardc.auto_shard(sgd_lr, mesh=m, cluster=slower)
    assert step.plan(w, x, lr).pipeline is not None, step.pipeline_choice(w, x, lr)
    close(step(w, x, lr), jax.jit(sgd_lr)(w, x, lr))


def test_a_pipeline_asked_for_under_a_budget_met_by_recomputing_is_priced_on_that_program():
    """Two dense layers before a stack, a budget the unpipelined program meets only with
    those layers recomputed in the backward (remat): the pipeline asked for is priced on
    the recomputing program, the one its plan's values are of (it failed on a value the
    program without remat lacks), and runs equal to jax.jit's step."""
    def loss(state, x):
        w_in, stack = state
        return jnp.mean(layers(layer, jnp.tanh(jnp.tanh(x @ w_in[0]) @ w_in[1]), stack)[0] ** 2)

    def step(state, x):
        value, g = jax.value_and_grad(loss)(state, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), value

    w, x = args(n_layers=4, width=256, batch=256)
    state = (w[:2], w)
    run = shardc.auto_shard(step, mesh=jax.make_mesh((2, 4), ("stage", "data")),
                            cluster=Cluster.ethernet_nodes("stage", "data"),
                            memory_budget=0.85 * MIB, pipeline=Pipeline("stage", 2, 2))
    plan = run.plan(state, x)
    assert plan.pipeline == Pipeline("stage", 2, 2) and plan.remat, (plan.pipeline, plan.remat)
    close(run(state, x), jax.jit(step)(state, x))
