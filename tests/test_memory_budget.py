"""A budget holds on the compiled program (issue 55): a plan made under a budget is
compiled, planned again where it compiles over it, and where none compiles within it the
error names the fix. And the memory model itself: the values it counts no buffer for, and
the predicted peak against what XLA allocates (the Llama's and an experts' budget:
test_memory_experts.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MIB,
    PODS,
    assert_close,
    first_call_compiles,
    stack_make,
    stack_stacked,
    stack_train_step,
)
from helpers import PEAK_SLACK as SLACK
from jax.sharding import AxisType

import shardc
from shardc.models import llama


def test_fused_values_hold_no_buffer():
    # Adam's chains: the bias-corrected moments and the update are computed inside the
    # fusion that writes the new parameter; the gradient and the new moments are stored
    from shardc.ir.trace import trace
    from shardc.solve.lifetimes import fused_values

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        m = 0.9 * g
        return w - 0.1 * (m / 0.5) / (jnp.sqrt(m * m) + 1e-8), m

    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    graph = trace(step, w, w).graph
    fused = fused_values(graph)
    kept = {v.id for v in graph.outputs}
    assert fused and not fused & kept
    for op in graph.ops:
        if op.name == "dot_general":
            assert all(v.id not in fused for v in op.outputs)


def test_the_gradients_all_reduces_are_one_buffer_from_the_last_gradient_on():
    # XLA:CPU combines a data-parallel step's gradient all-reduces into one tuple
    # all-reduce: it waits for the last gradient, and every reduced gradient lives from
    # there to its reader (a reader before it waits: a micro-batch's gradient summed with
    # the next); a copy another member is computed from cannot wait: it runs alone.
    # ``joins``: (the copy's value's bit, the bits of the tail values computed from it)
    from shardc.solve.memory import combined

    copies = [[10, 12, 100.0, 5, (1, 0)], [11, 11, 100.0, 8, (2, 0)],
              [6, 9, 50.0, 2, (4, 0)], [3, 4, 10.0, 1, None]]
    assert combined(copies) == [(9, 12, 100.0), (9, 11, 100.0), (9, 9, 50.0), (3, 4, 10.0)]
    copies = [[10, 12, 100.0, 5, (1, 0)], [11, 11, 100.0, 8, (2, 0)],
              [6, 9, 50.0, 2, (4, 2)], [3, 4, 10.0, 1, None]]  # the second is made from it
    assert combined(copies) == [(9, 12, 100.0), (9, 11, 100.0), (6, 9, 50.0), (3, 4, 10.0)]


def test_a_budget_between_the_lean_and_the_free_plan_beats_every_generic_layout_that_fits():
    # the budgeted search uses the budget it is given: on a scanned Llama (abstract 2x4)
    # whose free plan holds 57 MiB, 29 MiB plans faster than FSDP and ZeRO-1 (28.0 and 28.3
    # MiB, the generic layouts that fit; FSDP held 23.0 MiB, and 24 was the budget, before
    # a layer's weight slices settled in the scan were priced per iteration: its completion
    # now gathers them otherwise). The memory cut once charged every plan the copies one
    # plan held at the peak point, and the search settled on its lean start (5.2 ms,
    # against FSDP's 2.0)
    cfg = llama.LlamaConfig(vocab=512, seq_len=16, d_model=256, n_heads=4, n_kv_heads=2,
                            d_ff=512, n_layers=4, batch=8, scan_layers=True)
    mesh = jax.sharding.AbstractMesh((2, 4), ("node", "gpu"))
    budget = 29 * 2**20
    step = shardc.auto_shard(llama.build_step(cfg), mesh=mesh,
                             cluster=shardc.Cluster.multi_node(), memory_budget=budget)
    args = llama.abstract_args(cfg)
    plan = step.plan(*args)
    assert plan.predicted.peak_memory <= budget
    fitting = [b for b in step.margins(*args).baselines if b.predicted.peak_memory <= budget]
    assert fitting  # FSDP
    for b in fitting:
        assert plan.predicted.step_time <= b.predicted.step_time, b.name


def test_a_budget_too_small_names_the_peak_a_plan_reaches():
    """Under a budget it cannot meet the search stops at its lean start (an MLP stack with
    Adam-free SGD on 8 devices: 8.0 MiB), while under one it can it finds leaner plans
    (5.2 MiB under 6): the error names the peak of the plan made at the budget found, where
    planning at that peak succeeds too, and that budget plans. On an AbstractMesh: the
    search's own budgets (on devices the 6 MiB plan compiles to 6.3 MiB, and the compiled
    check raises for it: test_a_budget_binds_the_compiled_program_or_names_the_fix)."""
    state, batch = stack_make()
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("stage", "data", "model"))

    def planned(budget):
        return shardc.auto_shard(stack_train_step(stack_stacked), mesh=mesh,
                                 cluster=PODS, memory_budget=budget,
                                 pipeline=False).plan(state, batch)

    leaner = planned(6 * MIB).predicted.peak_memory
    with pytest.raises(shardc.MemoryBudgetError) as info:
        planned(5 * MIB)
    needed = info.value.needed
    assert needed <= 1.01 * leaner, (needed, leaner)
    assert planned(needed).predicted.peak_memory <= needed


def _decode_loop(layers=2, batch=8, context=128, heads=4, head_dim=32, vocab=256, steps=16):
    """A greedy decode loop carrying a KV cache [layers, 2, batch, context, heads, dim]
    through a scan, updated in place each step; its parameters and first tokens."""
    width = heads * head_dim
    key = jax.random.PRNGKey(0)
    params = {"emb": jax.random.normal(key, (vocab, width)) * 0.02,
              "qkv": [jax.random.normal(jax.random.fold_in(key, i), (width, 3 * width)) * 0.02
                      for i in range(layers)]}

    def decode(params, tokens):
        cache = jnp.zeros((layers, 2, batch, context, heads, head_dim))

        def body(carry, t):
            cache, tok = carry
            x = params["emb"][tok]
            for i, w in enumerate(params["qkv"]):
                q, k, v = (a.reshape(batch, heads, head_dim)
                           for a in jnp.split(x @ w, 3, axis=-1))
                cache = cache.at[i, 0, :, t].set(k).at[i, 1, :, t].set(v)
                s = jnp.einsum("bhd,bthd->bht", q, cache[i, 0])
                s = jnp.where(jnp.arange(context) <= t, s, -1e9)
                x = x + jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1),
                                   cache[i, 1]).reshape(batch, width)
            tok = jnp.argmax(x @ params["emb"].T, -1)
            return (cache, tok), tok

        return jax.lax.scan(body, (cache, tokens), jnp.arange(steps))[1]

    return decode, params, jnp.zeros((batch,), jnp.int32)


def _compiled_peak(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def test_a_decode_loops_cache_is_predicted_as_xla_holds_it():
    """The KV cache is updated in place (XLA's scatter over its operand's buffer) and the
    loop reads its parameters in place (no copy for the loop): predicted within 15% of the
    compiled peak (was 1.9x over, counting each cache update and the parameters twice).
    Tokens equal jax.jit's."""
    decode, params, tokens = _decode_loop()
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(decode, mesh=mesh)
    plan = step.plan(params, tokens)
    compiled = _compiled_peak(step.lower(params, tokens).compile())
    assert abs(plan.predicted.peak_memory / compiled - 1) < 0.15, (plan.predicted, compiled)
    np.testing.assert_array_equal(np.asarray(step(params, tokens)),
                                  np.asarray(jax.jit(decode)(params, tokens)))


def test_a_budget_binds_the_decode_loops_compiled_program():
    """Under 0.8x the free plan's compiled peak, the decode loop's fastest plan predicted
    within the budget compiles over it (its weights gathered before the loop, held through
    it, where the model gathers them in it): planned again under the budget lowered by the
    overshoot, the step compiles within the budget, its first call runs the compile the
    check made, and its tokens equal jax.jit's."""
    decode, params, tokens = _decode_loop()
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    free = shardc.auto_shard(decode, mesh=mesh)
    free.plan(params, tokens)
    budget = 0.8 * _compiled_peak(free.lower(params, tokens).compile())
    step = shardc.auto_shard(decode, mesh=mesh, memory_budget=budget)
    plan = step.plan(params, tokens)
    rounds = plan.solver["budget_rounds"]
    print("budget", budget, "rounds", rounds)
    assert rounds[0]["predicted"] <= budget < rounds[0]["compiled"], \
        ("the budget no longer binds the compiled program, so the rounds go untested: pick "
         "a budget the memory model still misses", rounds)
    assert all(r["compiled"] > budget for r in rounds[:-1])
    assert [r["budget"] for r in rounds] == sorted((r["budget"] for r in rounds), reverse=True)
    assert rounds[-1]["compiled"] == plan.solver["compiled_peak"] <= budget
    assert _compiled_peak(step.lower(params, tokens).compile()) <= budget
    assert "compiled peak" in plan.explain()
    compiled, out = first_call_compiles(step, params, tokens)
    assert "jit(positional)" not in compiled, compiled  # the check's compile runs
    assert_close(out, jax.jit(decode)(params, tokens))


def test_a_budget_binds_the_compiled_program_or_names_the_fix():
    """The MLP stack's plans under 6 MiB on 8 devices predict 5.2 MiB and compile to 6.3
    (its stacked gradients leave the backward loop beside the new weights): no plan
    compiles within it, and the error names the compiled peak and a budget raised by what
    the prediction missed, under which the step compiles within that budget."""
    state, batch = stack_make()
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))

    def step(budget):
        return shardc.auto_shard(stack_train_step(stack_stacked), mesh=mesh,
                                 cluster=PODS, memory_budget=budget, pipeline=False)

    try:
        plan = step(6 * MIB).plan(state, batch)
    except shardc.MemoryBudgetError as exc:
        print(exc)
        assert exc.predicted is not None and exc.predicted <= 6 * MIB < exc.found
        assert exc.found <= exc.needed and "compiled to" in str(exc) and \
            f"memory_budget={exc.needed}" in str(exc)
        plan = step(exc.needed).plan(state, batch)
        assert plan.solver["compiled_peak"] <= exc.needed
    else:  # the memory model learnt what it missed: the plan compiles within the budget
        assert plan.solver["compiled_peak"] <= 6 * MIB


ROWS, WIDTH, USERS, BATCH = 262144, 64, 4096, 256


def _lookup_step(params, batch):
    """A two-tower lookup model's SGD step: both towers' rows gathered, a dense layer
    each, a logistic loss on their dot, and every parameter updated."""

    def loss(p):
        u = jnp.tanh(p["users"][batch["user"]] @ p["wu"])
        i = jnp.tanh(p["items"][batch["item"]] @ p["wi"])
        logit = jnp.sum(u * i, -1)
        return jnp.mean(jnp.logaddexp(0.0, logit) - batch["label"] * logit)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value


@pytest.mark.parametrize("budget", [None, 20 * 2**20], ids=["free", "20MiB"])
def test_a_large_embeddings_step_is_predicted_as_xla_holds_it(budget):
    """A 262144-row table (64 MiB) on 8 devices, replicated by the fastest plan, split
    under 20 MiB: predicted within 15% of the compiled peak. The new table is written
    over its gradient (a scatter-add into zeros, updated in place): counted as a third
    table, the fastest plan was predicted at 1.5x its compiled peak, and no plan fitted
    under 24.4 MiB."""
    f32, i32 = jnp.float32, jnp.int32
    params = {"items": jax.ShapeDtypeStruct((ROWS, WIDTH), f32),
              "users": jax.ShapeDtypeStruct((USERS, WIDTH), f32),
              "wi": jax.ShapeDtypeStruct((WIDTH, WIDTH), f32),
              "wu": jax.ShapeDtypeStruct((WIDTH, WIDTH), f32)}
    batch = {"user": jax.ShapeDtypeStruct((BATCH,), i32),
             "item": jax.ShapeDtypeStruct((BATCH,), i32),
             "label": jax.ShapeDtypeStruct((BATCH,), f32)}
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    step = shardc.auto_shard(_lookup_step, mesh=mesh, memory_budget=budget)
    plan = step.plan(params, batch)
    compiled = _compiled_peak(step.lower(params, batch).compile())
    print(budget, plan.predicted.peak_memory, compiled, plan.inputs[0])
    assert abs(plan.predicted.peak_memory / compiled - 1) <= SLACK - 1, \
        (plan.predicted.peak_memory, compiled)
    if budget is not None:
        assert compiled <= budget and plan.inputs[0].shard_fraction(plan.axis_sizes) < 1
