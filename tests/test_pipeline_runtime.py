"""Pipelined layer stacks (shardc.pipeline.runtime / stack / lowering) on 8 CPU devices: a
2-, 4- and 8-stage step (GPipe, circular) equals the lax.scan step (loss, gradients, an SGD
update), by hand and through auto_shard; the compiled program runs the collective-permutes
the runtime states; a bad Pipeline names its fix (1F1B: tests/test_pipeline_onefb.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType

import shardc
from shardc.inspect.hlo import collectives
from shardc.inspect.loops import multiplicity
from shardc.pipeline import Pipeline, layers, pipeline_scan
from shardc.pipeline.lowering import NoStackError
from shardc.pipeline.stack import stack_named
from shardc.plan.record import Plan

D = 8


def layer(c, w):
    """A residual MLP layer that reshapes on the batch it is given (so it must be traced
    again on micro-batches), normalizes, and returns no per-layer output."""
    h = jnp.tanh(c @ w["w"] + w["b"])
    h = h.reshape(c.shape[0], 2, D // 2)
    h = h - h.mean(axis=-1, keepdims=True)
    return c + h.reshape(c.shape[0], D), None


def params(n_layers, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"layers": {"w": jax.random.normal(k[0], (n_layers, D, D)) / 3,
                       "b": jax.random.normal(k[1], (n_layers, D)) / 3},
            "head": jax.random.normal(k[2], (D, 1))}


def batch(n, seed=1):
    k = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k[0], (n, D)), jax.random.normal(k[1], (n, 1))


def train_step(stack):
    """(params, x, y) -> (params after one SGD step, loss), the stack run by ``stack``."""
    def loss(p, x, y):
        h = stack(layer, x, p["layers"])[0]
        return jnp.mean((h @ p["head"] - y) ** 2)

    def step(p, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value, g
    return step


def auto_mesh(stages):
    return jax.make_mesh((stages, 8 // stages), ("stage", "data"),
                         axis_types=(AxisType.Auto, AxisType.Auto))


def close(got, want, rtol=2e-5, atol=2e-6):
    assert_close(got, want, rtol=rtol, atol=atol)


# (stages, micro-batches, schedule, virtual, layers)
CASES = [(2, 4, "gpipe", 1, 4), (2, 2, "gpipe", 1, 4), (2, 4, "circular", 2, 4),
         (4, 4, "gpipe", 1, 8), (4, 8, "gpipe", 1, 8), (4, 4, "circular", 2, 8),
         (8, 8, "gpipe", 1, 8), (8, 2, "gpipe", 1, 8), (8, 8, "circular", 1, 8),
         (8, 8, "circular", 2, 16)]


@pytest.mark.parametrize("stages,micro,schedule,virtual,n_layers", CASES)
def test_pipeline_scan_step_equals_scan_step(stages, micro, schedule, virtual, n_layers):
    pipe = Pipeline("stage", stages, micro, schedule, virtual)
    mesh = auto_mesh(stages)
    p, (x, y) = params(n_layers), batch(16)

    def stack(fn, carry, xs):
        return pipeline_scan(fn, carry, xs, pipeline=pipe, mesh=mesh)

    close(jax.jit(train_step(stack))(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y))


def permutes(compiled, mesh):
    """(result bytes, runs per call, device pairs' axes) of each collective-permute."""
    runs = multiplicity(compiled.as_text())
    return sorted((c.result_bytes, runs[c.computation], c.axes)
                  for c in collectives(compiled, mesh) if c.kind == "collective-permute")


def loop_permutes(compiled, mesh):
    """The collective-permutes inside loops: the pipeline's (a plan's layouts around the
    stack may add one-off moves, run once)."""
    return [c for c in permutes(compiled, mesh) if c[1] > 1]


@pytest.mark.parametrize("stages,micro,schedule,virtual,n_layers,data",
                         [(4, 4, "gpipe", 1, 8, ()), (2, 4, "circular", 2, 8, ()),
                          (2, 2, "gpipe", 1, 4, ("data",))])
def test_collective_permutes_are_the_stated_ones(stages, micro, schedule, virtual, n_layers,
                                                 data):
    """One collective-permute of a micro-batch's activation (split over ``batch_axes``)
    per step, M * V + S - 1 steps, in the forward loop and again (reversed) in the
    backward loop; one all-reduce of the stack's output (the last stage's micro-batches
    to every device of the stage axis) in the forward."""
    pipe = Pipeline("stage", stages, micro, schedule, virtual)
    mesh = auto_mesh(stages)
    p, (x, y) = params(n_layers), batch(32)

    def stack(fn, carry, xs):
        return pipeline_scan(fn, carry, xs, pipeline=pipe, mesh=mesh, batch_axes=data)

    steps = micro * virtual + stages - 1
    split = 8 // stages if data else 1
    micro_bytes = 32 // micro * D * 4 // split
    forward = jax.jit(lambda p, x: stack(layer, x, p["layers"])[0]).lower(p, x).compile()
    assert permutes(forward, mesh) == [(micro_bytes, steps, ("stage",))]
    reduced = [c for c in collectives(forward, mesh) if c.kind == "all-reduce"]
    assert [(c.result_bytes, c.axes) for c in reduced] == [(32 * D * 4 // split, ("stage",))]
    step = jax.jit(train_step(stack)).lower(p, x, y).compile()
    assert permutes(step, mesh) == [(micro_bytes, steps, ("stage",))] * 2
    close(step(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y))
    # differentiated in the input too: its cotangent summed over the stages once
    both = jax.jit(jax.grad(lambda p, x: jnp.sum(stack(layer, x, p["layers"])[0] ** 2),
                            argnums=(0, 1))).lower(p, x).compile()
    runs = multiplicity(both.as_text())
    assert sorted((c.result_bytes, runs[c.computation]) for c in collectives(both, mesh)
                  if c.kind == "all-reduce" and c.axes == ("stage",)) == \
        [(32 * D * 4 // split, 1)] * 2


@pytest.mark.parametrize("stages,micro,schedule,virtual,n_layers",
                         [(2, 4, "gpipe", 1, 4), (4, 2, "gpipe", 1, 8),
                          (4, 4, "circular", 2, 8), (8, 8, "gpipe", 1, 8)])
def test_auto_shard_pipelined_step_equals_jit(stages, micro, schedule, virtual, n_layers):
    """Through auto_shard (an Explicit mesh, as jax.make_mesh makes): the plan records
    the pipeline, the step equals jax.jit of the lax.scan step, and the forward runs once
    (two collective-permutes: the forward loop's and the backward loop's, no recompute)."""
    pipe = Pipeline("stage", stages, micro, schedule, virtual)
    mesh = jax.make_mesh((stages, 8 // stages), ("stage", "data"))
    p, (x, y) = params(n_layers), batch(16)
    step = shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=pipe)
    close(step(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y))
    assert step.plan(p, x, y).pipeline == pipe
    assert len(loop_permutes(step.lower(p, x, y).compile(), mesh)) == 2


@pytest.mark.parametrize("pipe", [Pipeline("stage", 4, 4), Pipeline("stage", 2, 4, "circular", 2)])
def test_a_bfloat16_pipeline_compiles_and_equals_jit(pipe):
    """XLA:CPU aborts compiling a bfloat16 all-reduce made inside a shard_map: on CPU
    devices the pipeline's sums (the closing ones, the cotangents' over the stages and the
    batch axes) run in float32. A bfloat16 step equals jax.jit's (to bfloat16's rounding)
    through auto_shard, its micro-batches split over the data axis."""
    mesh = jax.make_mesh((pipe.stages, 8 // pipe.stages), ("stage", "data"))
    p, (x, y) = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params(8), batch(16)))
    step = shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=pipe)
    got, want = step(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y)
    assert step.plan(p, x, y).pipeline == pipe
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(got))
    close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
          jax.tree.map(lambda a: a.astype(jnp.float32), want), rtol=3e-2, atol=3e-2)


def test_layers_without_pipeline_is_the_scan():
    """shardc.pipeline.layers under jax.jit and under auto_shard without a pipeline: the
    scan's values and gradients, and no collective-permute."""
    p, (x, y) = params(4), batch(16)
    want = jax.jit(train_step(jax.lax.scan))(p, x, y)
    close(jax.jit(train_step(layers))(p, x, y), want)
    mesh = auto_mesh(2)
    step = shardc.auto_shard(train_step(layers), mesh=mesh)
    close(step(p, x, y), want)
    assert step.plan(p, x, y).pipeline is None
    assert loop_permutes(step.lower(p, x, y).compile(), mesh) == []


def test_plan_json_keeps_the_pipeline_and_use_plan_runs_it():
    pipe = Pipeline("stage", 2, 4, "circular", 2)
    mesh = auto_mesh(2)
    p, (x, y) = params(4), batch(16)
    plan = shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=pipe).plan(p, x, y)
    saved = Plan.from_json(plan.to_json())
    assert saved.pipeline == pipe
    other = shardc.auto_shard(train_step(layers), mesh=mesh)
    other.use_plan(saved, p, x, y)
    close(other(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y))
    assert len(loop_permutes(other.lower(p, x, y).compile(), mesh)) == 2


@pytest.mark.parametrize("pipe,mesh_stages,n_layers,match", [
    (Pipeline("stage", 4, 2), 2, 4, r"use stages=2"),
    (Pipeline("pipe", 2, 2), 2, 4, r"mesh has axes \('stage', 'data'\)"),
    (Pipeline("stage", 2, 2), 2, 3, r"divides 3"),
    (Pipeline("stage", 2, 2, "circular", 2), 2, 6, r"divides 6"),
    (Pipeline("stage", 2, 3), 2, 4, r"micro-batch count that divides 16"),
    (Pipeline("stage", 4, 2, "circular", 2), 4, 8, r"microbatches >= 4"),
])
def test_bad_pipeline_names_the_fix(pipe, mesh_stages, n_layers, match):
    mesh = auto_mesh(mesh_stages)
    p, (x, _) = params(n_layers), batch(16)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda p, x: pipeline_scan(layer, x, p["layers"], pipeline=pipe,
                                           mesh=mesh)).lower(p, x)


def test_auto_shard_refuses_what_it_cannot_pipeline():
    mesh = auto_mesh(2)
    p, (x, y) = params(4), batch(16)
    with pytest.raises(ValueError, match="use stages=2"):
        shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=Pipeline("stage", 4, 2))
    with pytest.raises(TypeError, match="shardc.pipeline.Pipeline"):
        shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=("stage", 2, 2))
    plain = shardc.auto_shard(train_step(jax.lax.scan), mesh=mesh,
                              pipeline=Pipeline("stage", 2, 2))
    with pytest.raises(NoStackError, match="shardc.pipeline.layers"):
        plain.plan(p, x, y)  # planned, not only when run: no plan claims a pipeline
    with pytest.raises(NoStackError, match="shardc.pipeline.layers"):
        plain(p, x, y)

    def closes_over(p, x, scale):
        return layers(lambda c, w: (jnp.tanh(c @ w["w"]) * scale, None), x, p["layers"])[0]

    closing = shardc.auto_shard(closes_over, mesh=mesh, pipeline=Pipeline("stage", 2, 2))
    with pytest.raises(ValueError, match="closes over 1 traced array"):
        closing(p, x, jnp.float32(2.0))


def test_plan_data_split_runs_inside_the_stages():
    """A plan that splits the stack's carry over ``data`` (a batch large enough for data
    parallelism) runs each micro-batch split over ``data`` inside the stages: each permute
    carries a quarter of a micro-batch, and the weight gradients are summed over ``data``
    once, after the backward loop."""
    def wide(c, w):
        return c + jnp.tanh(c @ w), None

    def grads(stack):
        return jax.grad(lambda p, x: jnp.sum(stack(wide, x, p)[0] ** 2))

    mesh = auto_mesh(2)
    width, n = 128, 2048
    p = jax.random.normal(jax.random.key(0), (4, width, width)) / width
    x = jax.random.normal(jax.random.key(1), (n, width))
    run = shardc.auto_shard(grads(layers), mesh=mesh, pipeline=Pipeline("stage", 2, 4))
    want = jax.jit(grads(jax.lax.scan))(p, x)
    # each gradient entry sums 2048 examples, in another order: to 1e-5 of the largest
    close(run(p, x), want, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    compiled = run.lower(p, x).compile()
    assert loop_permutes(compiled, mesh) == \
        [(n // 4 // 4 * width * 4, 5, ("stage",))] * 2
    runs = multiplicity(compiled.as_text())
    assert [runs[c.computation] for c in collectives(compiled, mesh)
            if c.kind == "all-reduce" and c.axes == ("data",)] == [1]


def test_exported_module_runs_the_pipeline(tmp_path):
    """The exported module of a pipelined plan runs the stacks as its pipeline."""
    import importlib.util

    from shardc.report.export import python_module

    pipe = Pipeline("stage", 2, 4)
    mesh = auto_mesh(2)
    p, (x, y) = params(4), batch(16)
    plan = shardc.auto_shard(train_step(layers), mesh=mesh, pipeline=pipe).plan(p, x, y)
    path = tmp_path / "pipelined_plan.py"
    path.write_text(python_module(plan))
    spec = importlib.util.spec_from_file_location("pipelined_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PIPELINE == pipe.to_json()
    step = module.jitted(train_step(layers), p, x, y, mesh=mesh)
    close(step(p, x, y), jax.jit(train_step(jax.lax.scan))(p, x, y))
    assert len(loop_permutes(step.lower(p, x, y).compile(), mesh)) == 2


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("circular", 2)])
def test_backward_saves_the_weights_once(capsys, schedule, virtual):
    """What the backward keeps of the stage's weights is the weights themselves, once: not
    a copy per step of the loop (the chunk a step runs is sliced before the loop for
    GPipe, recomputed in the backward for the circular schedule)."""
    pipe = Pipeline("stage", 4, 4, schedule, virtual)
    mesh = auto_mesh(4)
    p, (x, _) = params(8), batch(16)
    print_saved_residuals(
        lambda w, x: pipeline_scan(layer, x, {"w": w, "b": p["layers"]["b"]},
                                   pipeline=pipe, mesh=mesh)[0], p["layers"]["w"], x)
    shapes = [tuple(int(d) for d in line.split("[")[1].split("]")[0].split(",") if d)
              for line in capsys.readouterr().out.splitlines() if line.startswith("f32[")]
    assert sum(np.prod(s) for s in shapes if s[-2:] == (D, D)) == 8 * D * D


def test_two_stacks_inside_a_gradient_accumulation_loop():
    """Two stacks (an encoder and a decoder) in a step that accumulates gradients over a
    scan of two steps: both pipelined, each forward run once (4 permutes: 2 stacks x
    forward and backward), values and gradients those of the scans."""
    def step(stack):
        def loss(p, x):
            h = stack(layer, x, p["enc"])[0]
            return jnp.mean(stack(layer, jnp.tanh(h), p["dec"])[0] ** 2)

        def accumulate(p, xs):
            def one(g, x):
                return jax.tree.map(jnp.add, g, jax.grad(loss)(p, x)), None
            return jax.lax.scan(one, jax.tree.map(jnp.zeros_like, p), xs)[0]
        return accumulate

    mesh = auto_mesh(2)
    p = {"enc": params(4, 0)["layers"], "dec": params(4, 1)["layers"]}
    xs = jnp.stack([batch(16, 2)[0], batch(16, 3)[0]])
    run = shardc.auto_shard(step(layers), mesh=mesh, pipeline=Pipeline("stage", 2, 4))
    close(run(p, xs), jax.jit(step(jax.lax.scan))(p, xs))
    assert len(loop_permutes(run.lower(p, xs).compile(), mesh)) == 4


def test_stack_names_follow_the_layer_functions_code():
    """The same layer function traced twice files one stack; another function of the same
    jaxpr at the full batch (it may differ on micro-batches) files its own."""
    def first(c, w):
        return layer(c, w)

    def second(c, w):
        return layer(c, w)

    def names(fn):
        jaxpr = jax.make_jaxpr(lambda p, x: layers(fn, x, p)[0])(params(4)["layers"],
                                                                 batch(16)[0])
        return re.findall(r"name=(shardc_layers_\w+)", str(jaxpr))

    assert len(names(first)) == 1 and names(first) == names(first) != names(second)
    assert all(stack_named(n) is not None for n in names(first) + names(second))


def test_forward_only_step_is_pipelined():
    """Inference (no gradient in the step): the stack's custom-derivative call is kept and
    its forward runs as the pipeline (one collective-permute in a loop of M + S - 1 steps;
    the plan's layouts of x around the stack add one-off moves)."""
    def forward(p, x):
        return layers(layer, x, p)[0] @ jnp.ones((D, 1))

    mesh = auto_mesh(4)
    p, (x, _) = params(8)["layers"], batch(16)
    run = shardc.auto_shard(forward, mesh=mesh, pipeline=Pipeline("stage", 4, 4))
    close(run(p, x), jax.jit(lambda p, x: jax.lax.scan(layer, x, p)[0] @ jnp.ones((D, 1)))(p, x))
    assert [c[1:] for c in loop_permutes(run.lower(p, x).compile(), mesh)] == \
        [(7, ("stage",))]


def test_gradient_taken_outside_auto_shard_is_pipelined():
    """``jax.grad`` of an auto_shard function that takes no gradient itself: the stack's
    call runs as the pipeline whole, so the gradient differentiates the pipeline (the
    forward and the backward loop's permutes), with the scan's values."""
    def loss(p, x):
        return jnp.sum(layers(layer, x, p)[0] ** 2)

    mesh = auto_mesh(2)
    p, (x, _) = params(4)["layers"], batch(16)
    run = jax.jit(jax.grad(shardc.auto_shard(loss, mesh=mesh,
                                             pipeline=Pipeline("stage", 2, 4))))
    close(run(p, x), jax.grad(lambda p, x: jnp.sum(jax.lax.scan(layer, x, p)[0] ** 2))(p, x))
    assert [c[1:] for c in loop_permutes(run.lower(p, x).compile(), mesh)] == \
        [(5, ("stage",))] * 2
