"""1F1B (shardc.pipeline.onefb, stack.layers_loss) on 8 CPU devices: a 2-, 4- and 8-stage
1F1B step equals the unpipelined one (loss, gradients of the layers, the head and the
input), by hand and through auto_shard; the compiled program runs the collectives the plan
priced (count and bytes); a stage's compiled peak is within 15% of the predicted one and
below GPipe's for the same micro-batches; 1F1B asked of a stack without its loss names
the fix; the planner picks 1F1B where only it fits the memory budget."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close
from jax.sharding import AxisType

import shardc
from shardc.cost.cluster import Cluster
from shardc.inspect.hlo import collectives, compiled_peak_memory
from shardc.inspect.loops import multiplicity
from shardc.pipeline import Pipeline, layers, layers_loss, pipeline_loss, pipeline_scan

#: the stage axis across nodes on Ethernet, on devices of 1 TFLOP/s
SLOW = dataclasses.replace(Cluster.ethernet_nodes("stage", "data"), device_flops=1e12)


def layer(c, w):
    """A residual layer that reshapes on the batch it is given (traced again per
    micro-batch)."""
    h = jnp.tanh(c @ w["w"] + w["b"]).reshape(c.shape[0], 2, -1)
    return c + (h - h.mean(axis=-1, keepdims=True)).reshape(c.shape), None


def loss_fn(y, head, targets):
    """The mean over the examples of a squared error."""
    return jnp.mean((y @ head - targets) ** 2)


def make(n_layers, width, batch, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    state = ({"w": jax.random.normal(k[0], (n_layers, width, width)) / width ** 0.5,
              "b": jax.random.normal(k[1], (n_layers, width)) / 3},
             jax.random.normal(k[2], (width, 4)) / width ** 0.5)
    return state, (jax.random.normal(k[3], (batch, width)),
                   jax.random.normal(k[4], (batch, 4)))


def reference(stacked, head, x, targets):
    return loss_fn(jax.lax.scan(layer, x, stacked)[0], head, targets)


def train_step(loss):
    """((stacked, head), (x, targets)) -> (state after one SGD step, the loss)."""
    def step(state, batch):
        (stacked, head), (x, targets) = state, batch
        value, g = jax.value_and_grad(lambda s, h: loss(s, h, x, targets),
                                      argnums=(0, 1))(stacked, head)
        new = jax.tree.map(lambda a, b: a - 0.1 * b, (stacked, head), g)
        return new, value
    return step


def stacked_loss(stacked, head, x, targets):
    return layers_loss(layer, loss_fn, x, stacked, head, targets)


def close(got, want, rtol=2e-5, atol=2e-6):
    assert_close(got, want, rtol=rtol, atol=atol)


def auto_mesh(stages):
    return jax.make_mesh((stages, 8 // stages), ("stage", "data"),
                         axis_types=(AxisType.Auto, AxisType.Auto))


def loop_permutes(compiled, mesh):
    runs = multiplicity(compiled.as_text())
    return sorted((c.result_bytes, runs[c.computation]) for c in collectives(compiled, mesh)
                  if c.kind == "collective-permute" and runs[c.computation] > 1)


@pytest.mark.parametrize("stages,micro,data", [(2, 4, ()), (4, 8, ()), (8, 2, ()),
                                               (4, 4, ("data",))])
def test_pipeline_loss_equals_the_scan_and_its_gradient(stages, micro, data):
    """The loss and its gradient in the layers, the head and the input, by hand."""
    (stacked, head), (x, targets) = make(8, 8, 32)
    mesh = auto_mesh(stages)
    pipe = Pipeline("stage", stages, micro, "1f1b")

    def mine(s, h, x):
        return pipeline_loss(layer, loss_fn, x, s, h, targets, pipeline=pipe, mesh=mesh,
                             batch_axes=data)

    def want(s, h, x):
        return reference(s, h, x, targets)

    grad = (0, 1, 2)
    close(jax.jit(jax.value_and_grad(mine, grad))(stacked, head, x),
          jax.jit(jax.value_and_grad(want, grad))(stacked, head, x))
    # not differentiated: the forward alone, the same value
    close(jax.jit(mine)(stacked, head, x), jax.jit(want)(stacked, head, x))


def test_a_bfloat16_1f1b_pipeline_compiles_and_equals_the_scan():
    """On CPU devices the loop's sums run in float32 (XLA:CPU aborts compiling a bfloat16
    all-reduce made inside a shard_map); the values are bfloat16's, to its rounding."""
    (stacked, head), (x, targets) = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                                 make(8, 8, 32))
    mesh, pipe = auto_mesh(4), Pipeline("stage", 4, 4, "1f1b")

    def mine(s, h):
        return pipeline_loss(layer, loss_fn, x, s, h, targets, pipeline=pipe, mesh=mesh,
                             batch_axes=("data",))

    got = jax.jit(jax.value_and_grad(mine, (0, 1)))(stacked, head)
    want = jax.jit(jax.value_and_grad(lambda s, h: reference(s, h, x, targets), (0, 1)))(
        stacked, head)
    close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
          jax.tree.map(lambda a: a.astype(jnp.float32), want), rtol=3e-2, atol=3e-2)


def test_the_loss_keeps_its_dtype():
    """The loop sums the loss in float32; the result has the loss function's dtype, as
    the unpipelined expression's (a custom_vjp's forward must match its primal)."""
    (stacked, head), (x, targets) = jax.tree.map(lambda a: a.astype(jnp.float16),
                                                 make(4, 8, 16))
    pipe, mesh = Pipeline("stage", 4, 4, "1f1b"), auto_mesh(4)

    def mine(s, h):
        return pipeline_loss(layer, loss_fn, x, s, h, targets, pipeline=pipe, mesh=mesh)

    value, grads = jax.jit(jax.value_and_grad(mine, (0, 1)))(stacked, head)
    want, want_grads = jax.jit(jax.value_and_grad(
        lambda s, h: reference(s, h, x, targets), (0, 1)))(stacked, head)
    assert value.dtype == want.dtype == jnp.float16
    close(value, want, rtol=1e-2, atol=1e-3)
    close(grads, want_grads, rtol=5e-2, atol=5e-3)


def test_a_loss_stack_unpipelined_is_its_expression():
    state, batch = make(4, 8, 16)
    want = jax.jit(train_step(reference))(state, batch)
    close(jax.jit(train_step(stacked_loss))(state, batch), want)
    run = shardc.auto_shard(train_step(stacked_loss), mesh=auto_mesh(2))
    close(run(state, batch), want)
    assert run.plan(state, batch).pipeline is None


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (8, 8)])
def test_auto_shard_runs_1f1b_and_what_it_priced(stages, micro):
    """Through auto_shard: the step equals jax.jit's; the loop runs two collective-permutes
    of a micro-batch's activation per tick, M + 2S - 2 ticks, as priced; every compiled
    collective is one the plan priced, the communication within 5%."""
    state, batch = make(8, 64, 64)
    mesh = jax.make_mesh((stages, 8 // stages), ("stage", "data"))
    pipe = Pipeline("stage", stages, micro, "1f1b")
    run = shardc.auto_shard(train_step(stacked_loss), mesh=mesh, cluster=SLOW, pipeline=pipe)
    close(run(state, batch), jax.jit(train_step(reference))(state, batch))
    plan = run.plan(state, batch)
    assert plan.pipeline == pipe
    priced = plan.solver["pipeline"]
    ticks = micro + 2 * stages - 2
    assert priced["permutes"] == 2 * ticks
    compiled = run.lower(state, batch).compile()
    got = loop_permutes(compiled, mesh)
    assert [runs for _, runs in got] == [ticks, ticks]
    assert {b for b, _ in got} == {priced["permute_bytes"]}
    check = plan.verify(compiled, mesh)
    assert check.counts_match and abs(check.time_error) < 0.05, check.report()
    text = " ".join(plan.explain(max_rows=1).split())
    assert "1f1b schedule" in text and "backward as soon as its loss is known" in text
    assert "1 all-reduce of the loss's gradient" in text


def test_1f1b_holds_fewer_micro_batches_than_gpipe_as_predicted():
    """Activations dominate (a narrow, deep stack on a large batch): 1F1B's compiled
    peak is within 15% of its prediction and below GPipe's at the same micro-batches."""
    state, batch = make(8, 128, 1024)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        pipe = Pipeline("stage", 4, 16, schedule)
        run = shardc.auto_shard(train_step(stacked_loss), mesh=mesh, cluster=SLOW,
                                pipeline=pipe)
        plan = run.plan(state, batch)
        peak = compiled_peak_memory(run.lower(state, batch).compile())
        assert peak == pytest.approx(plan.predicted.peak_memory, rel=0.15), \
            (schedule, peak, plan.predicted.peak_memory)
        peaks[schedule] = peak
    assert peaks["1f1b"] < 0.85 * peaks["gpipe"], peaks


def test_1f1b_needs_the_loss_inside_the_stack():
    state, batch = make(4, 8, 16)
    mesh = auto_mesh(2)
    (stacked, _), (x, _) = state, batch
    with pytest.raises(ValueError, match="layers_loss"):
        jax.jit(lambda s, x: pipeline_scan(layer, x, s, pipeline=Pipeline("stage", 2, 2,
                                                                          "1f1b"),
                                           mesh=mesh)).lower(stacked, x)

    def carry_only(stacked, head, x, targets):
        return loss_fn(layers(layer, x, stacked)[0], head, targets)

    run = shardc.auto_shard(train_step(carry_only), mesh=mesh,
                            pipeline=Pipeline("stage", 2, 2, "1f1b"))
    with pytest.raises(ValueError, match=r"layers_loss\(layer_fn, loss_fn"):
        run(state, batch)


def test_the_planner_chooses_1f1b_for_a_loss_stack_over_a_slow_axis():
    """Over a slow stage axis a pipeline pays; of a stack ending in its loss, 1F1B holds
    fewer micro-batches than GPipe at every micro-batch count over one, and, its loss
    computed on the last stage (no all-reduce of the finished micro-batches over the
    stages), is the planner's choice; it runs as jax.jit's step. (A stack returning its
    carry is not offered 1F1B: test_1f1b_needs_the_loss_inside_the_stack.)"""
    state, batch = make(4, 1024, 256)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    slower = dataclasses.replace(SLOW, axis_bandwidth={**SLOW.axis_bandwidth, "stage": 1e9})
    run = shardc.auto_shard(train_step(stacked_loss), mesh=mesh, cluster=slower)
    choice = run.pipeline_choice(state, batch)
    assert choice.pipeline is not None and choice.pipeline.schedule == "1f1b", \
        choice.summary()
    # per stage plan
    by = {(id(p.stage_plan), p.pipeline.microbatches, p.pipeline.schedule): p
          for p in choice.priced if p.pipeline.axis == "stage"}
    for (plan, m, schedule), p in by.items():
        if schedule == "1f1b" and m > 1:
            assert p.peak_memory < by[(plan, m, "gpipe")].peak_memory, m
    assert run.plan(state, batch).pipeline == choice.pipeline
    close(run(state, batch), jax.jit(train_step(reference))(state, batch),
          rtol=1e-4, atol=1e-5)


def test_under_overlap_each_schedule_is_compiled_and_the_fastest_kept():
    """With Cluster(overlap=True) on a mesh with devices, the chosen pipeline and the
    cheapest of each other schedule over its stage axis are compiled beside the
    unpipelined plan, and the fastest compiled program (overlapped) is the plan."""
    state, batch = make(4, 1024, 256)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    slower = dataclasses.replace(SLOW, axis_bandwidth={**SLOW.axis_bandwidth, "stage": 1e9},
                                 overlap=True)
    run = shardc.auto_shard(train_step(stacked_loss), mesh=mesh, cluster=slower,
                            rank_compiled=3)
    plan = run.plan(state, batch)
    assert plan.pipeline is not None, plan.solver.get("compiled_ranking")
    rows = plan.solver["pipeline"]["compiled_ranking"]
    assert {"gpipe", "1f1b"} <= {r["schedule"] for r in rows} and \
        rows[-1]["schedule"] is None, rows
    fastest = min(rows, key=lambda r: r.get("compiled_s", float("inf")))
    assert fastest["schedule"] == plan.pipeline.schedule, rows
    assert "compiled, overlapped: " in " ".join(plan.explain(max_rows=1).split())
    close(run(state, batch), jax.jit(train_step(reference))(state, batch),
          rtol=1e-4, atol=1e-5)
