"""Loops planned as straight code: a scan's body (forward and transposed) gets per-op
strategies priced by its trip count, and what XLA compiles is priced the same way."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LOOP_BATCH as BATCH
from helpers import LOOP_LAYERS as LAYERS
from helpers import LOOP_WIDTH as WIDTH
from helpers import LOOP_X as X
from helpers import assert_close
from helpers import loop_params as _params
from helpers import loss_scanned as _loss_scanned
from helpers import sgd_step as _step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc
from shardc.inspect import price
from shardc.inspect.loops import loop_extra_flops, multiplicity
from shardc.inspect.schedule import replay_flops
from shardc.ir.graph import check_graph
from shardc.ir.sbp import B, NdSbp
from shardc.ir.trace import trace

MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("node", "gpu")),
          "4x2": ((4, 2), ("node", "gpu"))}
RNG = np.random.default_rng(0)


def mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _loss_unrolled(params, x):
    h = x
    for k in range(LAYERS):
        h = jnp.tanh(h @ params["w"][k] + params["b"][k])
    return jnp.mean(h ** 2)


def test_a_scan_body_is_inlined_once_and_weighted_by_its_trip_count():
    step, state = _step(_loss_scanned)
    graph = trace(step, state, X).graph
    check_graph(graph)
    dots = [op for op in graph.ops if op.name == "dot_general"]
    assert {op.weight for op in dots} == {LAYERS}  # forward and transposed bodies
    assert len(dots) == 3  # h @ w forward; its two gradients in the backward body
    enters = [op for op in graph.ops if op.name == "scan_enter"]
    assert {op.params["kind"] for op in enters} >= {"carry", "xs"}
    assert "dot_general" in str(graph) and f"x{LAYERS}" in str(graph)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_scanned_train_step_matches_the_unsharded_run(mesh_name):
    step, state = _step(_loss_scanned)
    s = shardc.auto_shard(step, mesh=mesh(mesh_name), time_limit=3.0)
    got, want = s(state, X), jax.jit(step)(state, X)
    assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_backward_scan_is_not_replicated():
    """On devices slow enough that this small model's compute outweighs NCCL's latency
    (on H100s it is cheapest replicated)."""
    step, state = _step(_loss_scanned)
    slow = shardc.Cluster(device_flops=1e12)
    plan = shardc.auto_shard(step, mesh=mesh("8"), time_limit=3.0, cluster=slow).plan(state, X)
    dots = [o for o in plan.ops if o.prim == "dot_general"]
    assert len(dots) == 3 and all(not o.outs[0].is_replicated for o in dots)


def test_scanned_and_unrolled_steps_plan_and_compile_alike():
    """Predicted and compiled step within 5% of the same layers unrolled, at a size where
    the layers' compute decides (abstract arguments: planned and compiled, not run). The
    scanned program's per-layer gradients are all-reduced once after the loop, as the
    unrolled ones are combined into one (once per iteration, each of the 16 paid
    ring/Simple's 56 µs latency under NCCL's model); its backward body computes the first
    layer's input gradient too."""
    layers, width, batch = 16, 2048, 32768
    f32 = jnp.float32
    x = jax.ShapeDtypeStruct((batch, width), f32)

    def scanned(params, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)

    def unrolled(params, x):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    def step(loss):
        return lambda params, x: jax.tree.map(
            lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))

    args = {"scan": (jax.ShapeDtypeStruct((layers, width, width), f32), x),
            "unrolled": ([jax.ShapeDtypeStruct((width, width), f32)] * layers, x)}
    m = mesh("2x4")
    got = {}
    for name, loss in (("scan", scanned), ("unrolled", unrolled)):
        s = shardc.auto_shard(step(loss), mesh=m, time_limit=3.0)
        plan = s.plan(*args[name])
        cost = price(s.lower(*args[name]).compile(), s.mesh_for(plan), plan.cluster)
        got[name] = (plan.predicted.step_time, cost.time + plan.predicted.feed_time)
    for k in range(2):
        assert got["scan"][k] == pytest.approx(got["unrolled"][k], rel=0.05), got


def test_compiled_compute_counts_loop_bodies_by_trip_count():
    """cost_analysis counts a while body once; the priced FLOPs of a scanned and an
    unrolled matmul chain agree."""
    w = jnp.ones((10, 256, 256)) / 256
    x = jnp.ones((256, 256))

    def scanned(w, x):
        return jax.lax.scan(lambda h, wk: (h @ wk, None), x, w)[0]

    def unrolled(w, x):
        for k in range(10):
            x = x @ w[k]
        return x

    one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    a = jax.jit(scanned).lower(w, x).compile()
    b = jax.jit(unrolled).lower(w, x).compile()
    assert a.cost_analysis()["flops"] < 0.2 * b.cost_analysis()["flops"]  # counted once
    assert loop_extra_flops(a.as_text()) > 0
    cluster = shardc.Cluster()
    fa, fb = price(a, one, cluster).flops, price(b, one, cluster).flops
    assert fa == pytest.approx(fb, rel=0.02)
    assert max(multiplicity(a.as_text()).values()) == 10


def test_a_conditional_in_a_loop_counts_its_costliest_branch_every_trip():
    """A loop whose body takes a matmul or a cheap branch by the step (a 1F1B pipeline's
    ticks): priced as the costliest branch on every trip, as the unconditional loop (it
    was counted once, as cost_analysis counts the body), in the serial pricing and the
    overlap replay alike; the branch's computation runs as often as the loop."""
    x = jnp.ones((128, 128)) / 128

    def body(cond):
        def step(c, i):
            if cond:
                return jax.lax.cond(i % 2 == 0, lambda: jnp.tanh(c @ x), lambda: c * 2.0), None
            return jnp.tanh(c @ x), None
        return step

    one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    got = {}
    for cond in (True, False):
        compiled = jax.jit(lambda c, cond=cond: jax.lax.scan(body(cond), c, jnp.arange(6))[0]
                           ).lower(x).compile()
        cost = price(compiled, one, shardc.Cluster())
        got[cond] = (cost.flops, replay_flops(compiled.as_text(), []))
        if cond:
            runs = multiplicity(compiled.as_text())
            assert sorted(runs.values())[-2:] == [6, 6], runs
    assert got[True][0] == pytest.approx(got[False][0], rel=0.01), got
    assert got[True][1] == pytest.approx(got[False][1], rel=0.01), got


def test_gradient_accumulation_reduces_once():
    """Four micro-batches accumulated in a loop compile to no more than data parallelism's
    step and within 5% of the same accumulation unrolled: the carry stays a partial sum
    through the loop (each device's summand held apart) and is reduced once after it."""
    micro = 4
    params = _params()
    xs = jnp.asarray(RNG.normal(size=(micro, BATCH, WIDTH)), jnp.float32)

    def grads(params, x):
        return jax.grad(_loss_unrolled)(params, x)

    def accumulate_loop(params, xs):
        def body(acc, x):
            return jax.tree.map(jnp.add, acc, grads(params, x)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.scan(body, zeros, xs)[0]

    def accumulate_fori(params, xs):  # a fori_loop with static bounds is a scan
        def body(k, acc):
            return jax.tree.map(jnp.add, acc, grads(params, xs[k]))

        return jax.lax.fori_loop(0, micro, body, jax.tree.map(jnp.zeros_like, params))

    def accumulate_unrolled(params, xs):
        acc = jax.tree.map(jnp.zeros_like, params)
        for k in range(micro):
            acc = jax.tree.map(jnp.add, acc, grads(params, xs[k]))
        return acc

    m = mesh("2x4")
    cluster = shardc.Cluster()
    priced = {}
    expect = accumulate_unrolled(params, xs)
    for name, fn in (("loop", accumulate_loop), ("fori", accumulate_fori),
                     ("unrolled", accumulate_unrolled)):
        s = shardc.auto_shard(fn, mesh=m, time_limit=3.0)
        priced[name] = price(s.lower(params, xs).compile(), m, cluster)
        assert_close(s(params, xs), expect, rtol=1e-4, atol=1e-5)
    plan = shardc.auto_shard(accumulate_loop, mesh=m, time_limit=3.0).plan(params, xs)
    carries = [o for o in plan.ops if o.prim == "scan_enter" and o.outs[0].has_partial]
    assert len(carries) == 2, "both gradient accumulators stay partial through the loop"
    for loop in (priced["loop"], priced["fori"]):
        assert loop.runs and max(loop.runs) == 1, "no collective runs every iteration"
    rep = jax.tree.map(lambda _: NamedSharding(m, Ps()), params)
    dp = jax.jit(accumulate_loop, in_shardings=(rep, NamedSharding(m, Ps(None, ("node", "gpu")))))
    priced["data-parallel"] = price(dp.lower(params, xs).compile(), m, cluster)
    times = {k: v.time for k, v in priced.items()}
    for name in ("loop", "fori"):
        assert times[name] <= times["data-parallel"] * 1.001, times
        assert times[name] <= times["unrolled"] * 1.05, times


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_flax_scanned_layers_match_the_unsharded_run(kind, mesh_name):
    from flax import linen as nn
    from flax import nnx

    if kind == "nnx":
        class Block(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(32, 32, rngs=rngs)

            def __call__(self, x):
                return jnp.tanh(self.lin(x))

        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return Block(nnx.Rngs(key))

        stack = make(jax.random.split(jax.random.key(0), 3))
        graphdef, params = nnx.split(stack)

        def forward(params, x):
            blocks = nnx.merge(graphdef, params)

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block, h):
                return block(h)

            return run(blocks, x)
    else:
        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return jnp.tanh(nn.Dense(32)(h)), None

        model = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)()
        params = model.init(jax.random.key(0), jnp.ones((16, 32)), None)

        def forward(params, x):
            return model.apply(params, x, None)[0]

    x = jnp.asarray(RNG.normal(size=(16, 32)), jnp.float32)

    def step(params, x):
        return jax.grad(lambda p: jnp.sum(forward(p, x) ** 2))(params)

    got = shardc.auto_shard(step, mesh=mesh(mesh_name), time_limit=2.0)(params, x)
    assert_close(got, jax.jit(step)(params, x), rtol=1e-4, atol=1e-5)


def _decoder(layers, width):
    """A scanned residual stack with a norm scale per layer (small, latency-bound
    gradients) and a weight per layer."""
    params = {"w": jnp.asarray(RNG.normal(size=(layers, width, width)) / width ** 0.5,
                               jnp.float32),
              "g": jnp.asarray(1 + 0.1 * RNG.normal(size=(layers, width)), jnp.float32)}

    def loss(p, x):
        def layer(h, q):
            n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * q["g"]
            return h + jnp.tanh(n @ q["w"]), None

        return jnp.mean(jax.lax.scan(layer, x, p)[0] ** 2)

    def step(p, x):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p, x))

    return step, params


def test_per_layer_gradients_are_reduced_once_after_the_loop():
    """A batch-split backward scan's per-layer gradients leave the body partial and are
    all-reduced once after the loop (one collective for all layers), not once per layer:
    each in-loop all-reduce pays NCCL's latency. The plan's choice is the cheaper one."""
    from helpers import SLOW_DEVICES

    from shardc.cost.comm import conversion

    layers, width = 4, 64
    step, params = _decoder(layers, width)
    x = jnp.asarray(RNG.normal(size=(512, width)), jnp.float32)
    m = mesh("8")
    s = shardc.auto_shard(step, mesh=m, time_limit=3.0, cluster=SLOW_DEVICES)
    plan = s.plan(params, x)
    ys = [o for o in plan.ops if o.prim == "scan_exit" and o.ins[0].has_partial]
    assert len(ys) == 2, "the norm scale's and the weight's gradients leave the body partial"
    sizes, names = (8,), ("x",)
    for o in ys:  # one all-reduce of the stack after the loop beats one per layer inside
        after = [r for r in plan.reshards if r.consumer == o.id]
        assert len(after) == 1 and after[0].collectives == ("all-reduce@x",)
        layer = re.search(r"\[([\d,]*)\]", o.types).group(1)  # the body's value
        nbytes = 4 * math.prod(int(d) for d in layer.split(","))
        inside = layers * conversion(o.ins[0], NdSbp((B,)), sizes, names,
                                     SLOW_DEVICES).time(nbytes)
        assert after[0].time < inside
    compiled = s.lower(params, x).compile()
    cost = price(compiled, m, SLOW_DEVICES)
    assert cost.collectives and max(cost.runs) == 1, "no collective runs every iteration"
    assert max(multiplicity(compiled.as_text()).values()) == layers  # the loop is there
    got, want = s(params, x), jax.jit(step)(params, x)
    assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_memory_budget_keeps_the_gradient_reduction_in_the_loop():
    """Reduced after the loop, a per-layer gradient is held unreduced, the whole stack on
    every device, through the loop (the memory model counts it); under a budget that does
    not hold it, the plan reduces the weights' gradient inside the loop instead."""
    from helpers import SLOW_DEVICES

    layers, width = 8, 512
    step, params = _decoder(layers, width)
    x = jnp.asarray(RNG.normal(size=(1024, width)), jnp.float32)
    m = mesh("8")

    def planned(**budget):
        s = shardc.auto_shard(step, mesh=m, time_limit=3.0, cluster=SLOW_DEVICES, **budget)
        plan = s.plan(params, x)
        grads = {f"f32[{width}]->f32[{layers},{width}]",
                 f"f32[{width},{width}]->f32[{layers},{width},{width}]"}
        return s, plan, [o for o in plan.ops if o.prim == "scan_exit" and o.types in grads]

    s, free, ys = planned()
    assert len(ys) == 2 and all(o.ins[0].has_partial for o in ys)
    stack = 4 * layers * width * (width + 1)  # the weights' and the scales' gradients
    assert free.predicted.peak_memory > stack
    # of the compiled peak: a budget holds on the compiled program, and the plan reducing
    # in the loop compiles to 3.5 MiB over its prediction (no plan the search finds
    # compiles within 0.6 of the free plan's predicted peak)
    budget = 0.6 * price(s.lower(params, x).compile(), m, SLOW_DEVICES).peak_memory
    s, plan, ys = planned(memory_budget=budget)
    assert plan.predicted.peak_memory <= budget
    # the weights' gradient stack does not fit: reduced in the loop (the scales' small one
    # may stay partial where the budget holds it)
    weights = [o for o in ys if o.types == f"f32[{width},{width}]->f32[{layers},{width},{width}]"]
    assert len(ys) == 2 and not weights[0].ins[0].has_partial
    assert plan.predicted.step_time > free.predicted.step_time  # the budget costs time
    cost = price(s.lower(params, x).compile(), m, SLOW_DEVICES)
    assert max(cost.runs) == layers, "the gradients are reduced every iteration"
    got, want = s(params, x), jax.jit(step)(params, x)
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gradients_made_inside_a_checkpointed_layer_are_reduced_once_after_the_loop():
    """The Llama's layer is a ``jax.checkpoint`` region inside the scan body: its weight
    gradients, kept partial and stacked by the plan, are held stacked inside that region
    too (it runs inlined), so XLA reduces them once after the loop as planned, not also
    inside it (before: 2 all-reduces compiled where 1 was planned, 24.3 MB for 14.0 MB; on
    the realistic Llama 4 for 3, twice the bytes)."""
    from shardc.bench.zoo import PRESETS
    from shardc.models import llama

    # the size only has to make the plan keep the weight gradients data-parallel partial
    # (at d 128 it plans no collective at all): at d 256, vocab 1024 (2.0 M parameters, not
    # the realistic preset's 88 M) the lowering without the fix compiles the same double
    # reduction
    cfg = llama.LlamaConfig(vocab=1024, seq_len=128, d_model=256, n_heads=4, n_kv_heads=2,
                            d_ff=704, n_layers=2, batch=16)
    fn, (state, batch) = llama.make_train_step(cfg)
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(fn, mesh=mesh, cluster=PRESETS["node-8"].cluster,
                             mesh_search=False)
    plan = step.plan(state, batch)
    # what the size is chosen for: the layers' weight gradients leave the scan partial
    assert any(o.prim == "scan_exit" and o.ins[0].has_partial for o in plan.ops)
    rows = {r.kind: r for r in plan.verify(step.lower(state, batch).compile(), mesh).rows}
    assert rows["all-reduce"].planned_count == rows["all-reduce"].compiled_count
    assert rows["all-reduce"].planned_bytes == rows["all-reduce"].compiled_bytes
    got, want = step(state, batch), jax.jit(fn)(state, batch)
    assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_layers_slice_settled_once_is_converted_every_iteration():
    """A scan's per-iteration inputs (a layer's slice of the stacked weights, the carry as an
    iteration reads it) exist inside the body only: their one shared conversion (the settle)
    runs every iteration, and the cost graph and the plan's prediction charge it so. A
    value made before the loop and read inside is settled once."""
    from shardc.ir.flow import settle_runs
    from shardc.ir.trace import SCAN_ENTER
    from shardc.solve.problem import build

    def fwd(ws, x, b):
        def body(c, w):  # the slice w read twice: one settled layout for both reads
            return jnp.tanh(c @ w) + c @ w.T + b, None
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    ws, x, b = jnp.ones((6, 16, 16)), jnp.ones((8, 16)), jnp.ones((16,))
    graph = trace(fwd, ws, x, b).graph
    enters = {op.params["kind"]: op for op in graph.ops if op.prim is SCAN_ENTER}
    runs, settled = graph.runs(), settle_runs(graph)
    for kind in ("xs", "carry"):
        vid = enters[kind].outputs[0].id
        assert runs[vid] == 1 and settled[vid] == 6, kind
    assert settled.get(enters["const"].outputs[0].id, 1) == 1
    # the settle edge of the slice costs six conversions, as the lowering runs them
    cg = build(graph, (8,), ("x",), shardc.Cluster())
    w = enters["xs"].outputs[0]
    node = cg.settle[w.id]
    edge = next(e for e in cg.edges if e.v == node and e.value.id == w.id)
    one = cg.reshard_matrix(cg.out_sbps(*cg.producer[w.id]), cg.choices[node], w.nbytes)
    np.testing.assert_allclose(edge.cost, 6 * one)
