"""Plain ``jax.lax.scan`` layer stacks (``auto_shard`` traces the function with its scans
over layers as :func:`shardc.pipeline.layers` unless ``pipeline=False``) pipelined when
asked: the pipelined step equals ``jax.jit``'s, the compiled program runs the stages'
collective-permutes, and a scan that is not a layer stack runs as it is, among them a
scan whose layer mixes the batch's examples (:func:`shardc.pipeline.fit.mixes_examples`),
which micro-batches would compute otherwise."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import shardc
from shardc.cost.cluster import Cluster
from shardc.pipeline import Pipeline
from shardc.pipeline.fit import mixes_examples
from shardc.pipeline.lowering import NoStackError
from shardc.pipeline.routing import scans_as_layers

WIDTH, LAYERS, BATCH = 64, 8, 32


def layer(c, w):
    return c + jnp.tanh(c @ w), None


def loss(w, x):
    # the scan looked up when it runs, as user code writes it
    return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)


def train_step(w, x):
    value, g = jax.value_and_grad(loss)(w, x)
    return w - 0.1 * g, value


def args():
    k = jax.random.split(jax.random.key(0))
    return (jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) / WIDTH,
            jax.random.normal(k[1], (BATCH, WIDTH)))


@pytest.mark.parametrize("pipe", [Pipeline("stage", 2, 4), Pipeline("stage", 4, 2),
                                  Pipeline("stage", 4, 4, "circular", 2)])
def test_a_plain_scan_over_layers_runs_as_the_pipeline_asked_for(pipe):
    w, x = args()
    m = jax.make_mesh((pipe.stages, 8 // pipe.stages), ("stage", "data"))
    step = shardc.auto_shard(train_step, mesh=m, pipeline=pipe)
    got, want = step(w, x), jax.jit(train_step)(w, x)
    assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert step.plan(w, x).pipeline == pipe
    text = step.lower(w, x).compile().as_text()
    assert "collective-permute" in text


def test_scans_that_are_not_layer_stacks_run_as_scans():
    w, x = args()

    def per_layer_outputs(w, x):  # ys: a scan, not a stack
        return jax.lax.scan(lambda c, wl: (c @ wl, jnp.sum(c)), x, w)

    def backwards(w, x):
        return jax.lax.scan(layer, x, w, reverse=True)

    def no_batch(w, x):  # a scalar carry has no batch to cut into micro-batches
        return jax.lax.scan(lambda c, wl: (c + jnp.sum(wl), None), 0.0, w)

    for fn in (per_layer_outputs, backwards, no_batch):
        with scans_as_layers():
            text = str(jax.make_jaxpr(fn)(w, x))
        assert "shardc_layers_" not in text and "scan[" in text, fn.__name__
        np.testing.assert_allclose(
            np.asarray(jax.tree.leaves(jax.jit(fn)(w, x))[0]),
            np.asarray(jax.tree.leaves(fn(w, x))[0]), rtol=1e-6)
    assert jax.lax.scan.__module__.startswith("jax")  # the block put the scan back
    with scans_as_layers():
        with scans_as_layers():
            pass
        assert "shardc_layers_" in str(jax.make_jaxpr(loss)(w, x))  # still routed
    assert jax.lax.scan.__module__.startswith("jax")

    # a loop over micro-batches closing over the weights is not a stack; the layer scan
    # inside its body is
    def accumulated(w, x):
        def one(g, xb):
            return g + jax.grad(loss)(w, xb), None
        return jax.lax.scan(one, jnp.zeros_like(w), x.reshape(4, BATCH // 4, WIDTH))[0]

    with scans_as_layers():
        jaxpr = jax.make_jaxpr(accumulated)(w, x).jaxpr
    outer = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(outer) == 1 and "shardc_layers_" in str(outer[0].params["jaxpr"])
    # asked to pipeline a function with no stack: the error names the fix
    m = jax.make_mesh((2, 4), ("stage", "data"))
    with pytest.raises(NoStackError, match="shardc.pipeline.layers"):
        shardc.auto_shard(lambda w, x: per_layer_outputs(w, x)[0], mesh=m,
                          pipeline=Pipeline("stage", 2, 4)).lower(w, x)


def test_a_flax_nn_scan_over_blocks_runs_as_the_pipeline_asked_for():
    """Flax's ``nn.scan`` over blocks (parameters stacked on axis 0) calls ``lax.scan`` with
    a body that closes over no traced value: it pipelines as a plain scan does."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + jnp.tanh(nn.Dense(WIDTH)(x)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=4)
            return blocks()(x, None)[0]

    net = Net()
    x = args()[1]
    p = net.init(jax.random.key(1), x)

    def step(p, x):
        value, g = jax.value_and_grad(lambda p: jnp.mean(net.apply(p, x) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

    m = jax.make_mesh((2, 4), ("stage", "data"))
    run = shardc.auto_shard(step, mesh=m, pipeline=Pipeline("stage", 2, 4))
    assert_close(run(p, x), jax.jit(step)(p, x), rtol=2e-5, atol=2e-6)
    assert run.plan(p, x).pipeline == Pipeline("stage", 2, 4)
    assert "collective-permute" in run.lower(p, x).compile().as_text()


@pytest.mark.parametrize("pipe", [Pipeline("stage", 4, 4), Pipeline("stage", 2, 4, "circular", 2)])
def test_a_flax_nnx_scan_over_blocks_runs_as_the_pipeline_asked_for(pipe):
    """Flax NNX's ``nnx.scan`` hands each block's state back as a per-layer output (its
    ``xs`` passed through) and its body traces only inside nnx's own context: the stack's
    layer is traced then at every micro-batch size and the pipeline runs those traces.
    The step (gradient and update of the blocks' parameters) equals ``jax.jit``'s; the
    compiled program's collectives are the plan's, kind by kind (the stages' sends, the
    closing all-reduces: none more in the backward)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x) + jnp.zeros_like(x))  # a broadcast of the batch

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    graphdef, params = nnx.split(make(jax.random.split(jax.random.key(0), LAYERS)))

    def step(params, x):
        def loss(params):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block, h):
                return block(h)
            return jnp.mean(run(nnx.merge(graphdef, params), x) ** 2)
        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), value

    x = args()[1]
    m = jax.make_mesh((pipe.stages, 8 // pipe.stages), ("stage", "data"))
    run = shardc.auto_shard(step, mesh=m, pipeline=pipe)
    assert_close(run(params, x), jax.jit(step)(params, x), rtol=2e-5, atol=2e-6)
    plan = run.plan(params, x)
    assert plan.pipeline == pipe
    check = plan.verify(run.lower(params, x).compile(), run.mesh_for(plan))
    assert check.counts_match and "collective-permute" in {r.kind for r in check.rows}, \
        check.report()


def batch_norm(c, w):  # statistics over the batch: each row reads every other
    return layer((c - c.mean(0)) / (c.std(0) + 1e-5), w)


def position(c, w):  # a row's own index in the batch: a micro-batch's rows count from 0
    return layer(c + jnp.arange(c.shape[0], dtype=c.dtype)[:, None], w)


def dropout(c, w):  # a mask of the batch's shape, drawn again at a micro-batch's
    return layer(c * jax.random.bernoulli(jax.random.key(0), 0.9, c.shape), w)


def row_norm(c, w):  # each row normalised by itself
    return layer(c / jnp.linalg.norm(c, axis=1, keepdims=True), w)


def weight_bias(c, w):  # a row of the weights added to every example (broadcast over them)
    return layer(c + w[0] + jnp.zeros_like(c), w)


def inner_loop(c, w):  # a loop inside the layer, over steps, not examples
    return jax.lax.fori_loop(0, 2, lambda _, h: layer(h, w)[0], c), None


def batch_size(c, w):  # the batch size read as a number: another at a micro-batch's
    return layer(c * (8.0 / c.shape[0]), w)


def fixed_size(c, w):  # the batch size written in: no micro-batch fits
    return layer(c.reshape(BATCH, 8, WIDTH // 8).reshape(BATCH, WIDTH), w)


@pytest.mark.parametrize("body, mixes", [
    (batch_norm, "mixes the batch's examples (reduce_sum"),
    (position, "mixes the batch's examples (add"),
    (dropout, "draws random bits (random_bits"), (row_norm, None), (weight_bias, None),
    (inner_loop, None), (layer, None)])
def test_a_layer_that_mixes_the_batchs_examples_is_not_a_stack(body, mixes):
    """A layer that computes an example's row from other rows, from its place in the batch,
    or draws random bits is named by its op at the user's line; a plain scan of it is not
    a stack, a layer that treats its examples apart is one."""
    w, x = args()
    one = lambda c, wl: body(c, wl)[0]  # noqa: E731
    found = mixes_examples(one, x, w[0])
    if mixes is None:
        assert found is None
    else:
        # (the op at the user's line where the trace has it: jax.random's draws are
        # inside its own jitted functions)
        assert mixes in found and (__file__ in found or body is dropout), found
    with scans_as_layers():
        text = str(jax.make_jaxpr(lambda w, x: jax.lax.scan(body, x, w)[0])(w, x))
    assert ("shardc_layers_" in text) == (mixes is None), body.__name__


@pytest.mark.parametrize("body, write", [
    (batch_norm, "scan"), (batch_norm, "layers"), (dropout, "scan"), (batch_size, "scan"),
    (fixed_size, "layers"), (layer, "scan"), (layer, "layers")])
def test_a_stack_whose_layer_mixes_examples_never_runs_as_a_pipeline(body, write, caplog):
    """A layer that mixes examples, draws random bits, reads the batch size as a number
    (traced again at a micro-batch's size it would compute otherwise) or writes it (it
    would not trace), written as a plain scan or with shardc.pipeline.layers: a pipeline
    asked for fails with a warning saying why; left to the planner over a slow stage axis
    (where the same stack of a layer that treats its examples apart pipelines), the stack
    runs as its scan, equal to jax.jit's, with a note in the log, not a warning."""
    w, x = args()
    mixing = body is not layer

    def loss(w, x):  # the scan looked up when it runs, as user code writes it
        stack = jax.lax.scan if write == "scan" else shardc.pipeline.layers
        return jnp.mean(stack(body, x, w)[0] ** 2)

    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, value

    m = jax.make_mesh((2, 4), ("stage", "data"))
    if mixing:
        with caplog.at_level(logging.INFO, logger="shardc"), \
                pytest.raises(NoStackError, match="treats the batch's examples"):
            shardc.auto_shard(step, mesh=m, pipeline=Pipeline("stage", 2, 4)).plan(w, x)
        warned = [r for r in caplog.records if "not run as a pipeline" in r.getMessage()]
        assert warned and warned[0].levelno == logging.WARNING, caplog.text
        caplog.clear()
    # the stage axis at 10 MB/s, devices of 1 GFLOP/s: a pipeline pays (priced 2.86 ms
    # against 3.31 unpipelined)
    slow = dataclasses.replace(Cluster.ethernet_nodes("stage", "data"), device_flops=1e9,
                               axis_bandwidth={"stage": 1e7, "data": 4.5e11})
    with caplog.at_level(logging.INFO, logger="shardc"):
        run = shardc.auto_shard(step, mesh=m, cluster=slow)
        got = run(w, x)
    assert (run.plan(w, x).pipeline is None) == mixing
    if mixing:  # and the choice it shows says so (it priced the refused stack's pipelines)
        choice = run.pipeline_choice(w, x)
        assert choice.pipeline is None and "can run as a pipeline" in choice.reason
    noted = [r for r in caplog.records if "not run as a pipeline" in r.getMessage()]
    assert bool(noted) == mixing and all(r.levelno == logging.INFO for r in noted), caplog.text
    assert_close(got, jax.jit(step)(w, x), rtol=2e-5, atol=2e-6)


def test_a_check_that_cannot_run_refuses_the_pipeline_and_fails_nothing(monkeypatch):
    """Where the examples check itself fails, the stack is not run as a pipeline, and the
    program runs as jax.jit's: the check never breaks a trace of shardc.pipeline.layers."""
    import shardc.ir.trace

    def broken(*_, **__):
        raise RuntimeError("no graph today")

    monkeypatch.setattr(shardc.ir.trace, "graph_from_jaxpr", broken)
    w, x = args()
    found = mixes_examples(lambda c, wl: layer(c, wl)[0], x, w[0])
    assert "could not run" in found and "no graph today" in found

    def step(w, x):
        return jnp.mean(shardc.pipeline.layers(layer, x, w)[0] ** 2)

    np.testing.assert_allclose(np.asarray(jax.jit(step)(w, x)),
                               np.asarray(jax.jit(loss)(w, x)), rtol=1e-6)
    m = jax.make_mesh((2, 4), ("stage", "data"))
    with pytest.raises(NoStackError):
        shardc.auto_shard(step, mesh=m, pipeline=Pipeline("stage", 2, 4)).plan(w, x)


def test_a_flax_scan_drawing_dropout_masks_draws_what_jax_jit_draws():
    """Flax's ``make_rng`` counts in Python state each time the scan's body is traced: a
    scan is traced once, as ``jax.lax.scan`` traces it, so its masks are jax.jit's (they
    were not when the routing traced the body to inspect it), and a layer that draws is
    not a stack (a pipeline would trace it again per micro-batch)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dropout(0.1, deterministic=False)(x)
            return x + jnp.tanh(nn.Dense(WIDTH)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(Block, variable_axes={"params": 0},
                             split_rngs={"params": True, "dropout": True}, length=LAYERS)
            return blocks()(x, None)[0]

    net, x = Net(), args()[1]
    p = net.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)

    def forward(p, x, key):
        return net.apply(p, x, rngs={"dropout": key})

    call = (p, x, jax.random.key(9))
    slow = dataclasses.replace(Cluster.ethernet_nodes("stage", "data"), device_flops=1e9,
                               axis_bandwidth={"stage": 1e7, "data": 4.5e11})
    run = shardc.auto_shard(forward, mesh=jax.make_mesh((2, 4), ("stage", "data")),
                            cluster=slow)
    np.testing.assert_array_equal(np.asarray(run(*call)), np.asarray(jax.jit(forward)(*call)))
    assert run.plan(*call).pipeline is None


def test_a_pipeline_asked_for_under_a_budget_none_fits_runs_priced_with_a_warning(caplog):
    """Where no pipelined plan fits the budget, a pipeline asked for runs as a priced
    pipeline (not the unpipelined plan with the pipeline attached unpriced, as it did), the
    leanest that compiled kept with the reason in its record and a warning in the log."""
    k = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k[0], (LAYERS, 128, 128)) / 128
    x = jax.random.normal(k[1], (64, 128))

    def step(w, x):
        value, g = jax.value_and_grad(
            lambda w: jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2))(w)
        return w - 0.1 * g, value

    slow = dataclasses.replace(Cluster.ethernet_nodes("stage", "data"), device_flops=1e9,
                               axis_bandwidth={"stage": 1e7, "data": 4.5e11})
    pipe = Pipeline("stage", 2, 4)
    with caplog.at_level(logging.INFO, logger="shardc"):
        run = shardc.auto_shard(step, mesh=jax.make_mesh((2, 4), ("stage", "data")),
                                cluster=slow, memory_budget=258_056, pipeline=pipe)
        plan = run.plan(w, x)
    assert plan.pipeline == pipe and "kept_asked" in plan.solver["pipeline"], plan.solver
    assert "not priced" not in plan.explain(max_rows=1)
    # the pipeline's own price: its step and its peak, over the budget
    assert plan.solver["pipeline"]["step_s"] > 0 and plan.predicted.peak_memory > 258_056
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and
              "the pipeline asked for runs" in r.getMessage()]
    assert warned and "over the budget" in warned[0].getMessage()
    assert_close(run(w, x), jax.jit(step)(w, x), rtol=2e-5, atol=2e-6)


def test_a_routed_scan_is_named_by_the_users_line():
    """Every scan of a traced function passes through shardc's routing: its ops are named
    by the user's line that called ``jax.lax.scan``, not by shardc's own file."""
    w, x = args()

    def step(w, x):
        return jnp.mean(jax.lax.scan(batch_norm, x, w)[0] ** 2)  # a scan, not a stack

    plan = shardc.auto_shard(step, mesh=jax.make_mesh((2, 4), ("stage", "data"))).plan(w, x)
    named = {o.source for o in plan.ops if o.prim in ("scan_enter", "scan_exit")}
    assert named and all(s.startswith(__file__ + ":") for s in named), named
