"""Attention split over the sequence (context parallelism): found in the program, its form
named per mesh axis, and each form's compiled step equal to ``jax.jit``'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardc
from shardc.inspect.hlo import collectives
from shardc.ir.trace import trace
from shardc.models import llama
from shardc.plan.attention import find_attention, sequence_dims

T, D, HEADS, KV, DH = 128, 64, 8, 2, 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:8])


def _attention(params, x, pin=None):
    heads, kv = params["q"].shape[1] // DH, params["k"].shape[1] // DH
    """Causal grouped-query attention (keys and values repeated to the query heads);
    ``pin(name, value)`` may constrain the projections (``made``), the queries, keys,
    values and scores."""
    pin = pin or (lambda name, v: v)
    b, t, _ = x.shape
    q = pin("q", pin("made", x @ params["q"]).reshape(b, t, heads, DH))
    k = pin("made", x @ params["k"]).reshape(b, t, kv, DH)
    v = pin("made", x @ params["v"]).reshape(b, t, kv, DH)
    k = pin("k", jnp.repeat(k, heads // kv, axis=2))
    v = pin("v", jnp.repeat(v, heads // kv, axis=2))
    scores = pin("scores", jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(DH))
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, heads * DH)
    return out @ params["o"]


def _args(heads=HEADS, kv=KV):
    ks = jax.random.split(jax.random.key(0), 5)
    params = {"q": jax.random.normal(ks[0], (D, heads * DH)) / 8,
              "k": jax.random.normal(ks[1], (D, kv * DH)) / 8,
              "v": jax.random.normal(ks[2], (D, kv * DH)) / 8,
              "o": jax.random.normal(ks[3], (heads * DH, D)) / 8}
    return params, jax.random.normal(ks[4], (1, T, D))


def _grad_step(pin=None):
    def step(params, x):
        return jax.value_and_grad(lambda p: jnp.sum(_attention(p, x, pin) ** 2))(params)
    return step


def _pins(mesh, layouts):
    def pin(name, v):
        spec = layouts.get(name)
        return v if spec is None else jax.lax.with_sharding_constraint(
            v, NamedSharding(mesh, spec))
    return pin


def _forms(plan) -> set[str]:
    return {form for f in plan.solver.get("attention", ()) for form in f["axes"].values()}


def _equal(step, fn, args):
    want, got = jax.jit(fn)(*args), step(*args)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want[1]))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(want[1]), jax.tree.leaves(got[1])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale)


def test_attention_is_found_as_users_write_it_and_as_jax_writes_it():
    params, x = _args()
    assert len(find_attention(trace(lambda p, x: _attention(p, x), params, x).graph)) == 1

    def library(params, x):
        b, t, _ = x.shape
        q = (x @ params["q"]).reshape(b, t, HEADS, DH)
        k = (x @ params["k"]).reshape(b, t, KV, DH)
        v = (x @ params["v"]).reshape(b, t, KV, DH)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    assert len(find_attention(trace(library, params, x).graph)) == 1
    mlp = trace(lambda p, x: jax.nn.log_softmax(x @ p["q"]) @ p["o"], params, x).graph
    assert find_attention(mlp) == []  # a softmax between two matmuls without heads


#: a cluster overlapping communication whose block products outlast a ring's sends
SLOW = shardc.Cluster(device_flops=2e9, overlap=True)
ALONG = {"q": P(None, "d"), "k": P(None, "d"), "v": P(None, "d"), "scores": P(None, None, "d")}


@pytest.mark.parametrize("form, layouts, collective, cluster", [
    ("sequence, K/V all-gathered", {"q": P(None, "d"), "k": P(), "v": P(),
                                    "scores": P(None, None, "d")}, "all-gather", None),
    ("sequence, all-to-all to heads", {"q": P(None, None, "d"), "k": P(None, None, "d"),
                                       "v": P(None, None, "d"), "scores": P(None, "d"),
                                       "made": P(None, "d")},
     "all-to-all", None),
    ("sequence, K/V ring", ALONG, "collective-permute", SLOW),
], ids=["all-gather", "all-to-all", "ring"])
def test_each_sequence_form_runs_as_jax_jit(mesh, form, layouts, collective, cluster):
    params, x = _args()
    x_spec = NamedSharding(mesh, P(None, "d"))  # the layer's input split along the sequence
    fn = _grad_step(_pins(mesh, layouts))
    step = shardc.auto_shard(fn, mesh=mesh, in_shardings=(None, P(None, "d")),
                             cluster=cluster)
    args = (params, jax.device_put(x, x_spec))
    plan = step.plan(*args)
    assert form in _forms(plan), plan.solver.get("attention")
    assert "attention, per mesh axis - the sequence is split" in plan.explain()
    assert collective in step.lower(*args).compile().as_text()
    _equal(step, fn, args)


def test_the_planner_rings_the_keys_where_the_sends_hide_and_gathers_them_where_not(mesh):
    params, x = _args()
    fn = _grad_step(_pins(mesh, ALONG))  # the queries and keys along the sequence
    args = (params, jax.device_put(x, NamedSharding(mesh, P(None, "d"))))
    chosen = {}
    for name, cluster in (("slow", SLOW), ("fast", shardc.Cluster.nvlink_node("d")),
                          ("serial", shardc.Cluster(device_flops=2e9))):
        step = shardc.auto_shard(fn, mesh=mesh, in_shardings=(None, P(None, "d")),
                                 cluster=cluster)
        plan = step.plan(*args)
        chosen[name] = _forms(plan)
        why = plan.solver["attention"][0]["why"]["d"]
        assert why.startswith("ring: 7 sends of") and "all-gather of the keys" in why
        assert why in plan.explain()
        if name == "slow":  # the op table marks the ring
            assert "S(1),S(1)->S(2) ring" in plan.explain()
    assert chosen == {"slow": {"sequence, K/V ring"},  # the sends hide behind the products
                      "fast": {"sequence, K/V all-gathered"},  # they outlast them
                      "serial": {"sequence, K/V all-gathered"}}  # nothing hides


def test_the_planner_splits_the_sequence_where_memory_binds(mesh):
    params, x = _args(heads=2, kv=1)  # fewer heads than devices: splitting them is not enough
    fn = _grad_step()
    free = shardc.auto_shard(fn, mesh=mesh).plan(params, x)
    step = shardc.auto_shard(fn, mesh=mesh, memory_budget=free.predicted.peak_memory / 4)
    plan = step.plan(params, x)
    assert any(f.startswith("sequence") for f in _forms(plan)), plan.solver.get("attention")
    _equal(step, fn, (params, x))


def test_context_parallel_false_keeps_every_attentions_sequence_whole(mesh):
    params, x = _args(heads=2, kv=1)
    fn = _grad_step()
    free = shardc.auto_shard(fn, mesh=mesh).plan(params, x)
    budget = free.predicted.peak_memory / 1.2
    split = shardc.auto_shard(fn, mesh=mesh, memory_budget=budget).plan(params, x)
    assert any(f.startswith("sequence") for f in _forms(split)), split.solver.get("attention")
    step = shardc.auto_shard(fn, mesh=mesh, context_parallel=False)
    plan = step.plan(params, x)
    assert _forms(plan) and not any(f.startswith("sequence") for f in _forms(plan))
    assert plan.predicted.step_time >= free.predicted.step_time  # a smaller search space
    # neither the attention's products, its softmax (and gradient) nor the projections
    # feeding it split a sequence
    graph = trace(fn, params, x).graph  # traced as the step traces it: the same op ids
    planned = {o.id: o for o in plan.ops}
    by_id = {op.id: op for op in graph.ops}
    for op_id, (ins, outs) in sequence_dims(graph).items():
        assert planned[op_id].prim == by_id[op_id].name  # the same program, the same ids
        for nds, dims in ((planned[op_id].ins, ins), (planned[op_id].outs, outs)):
            for nd, whole in zip(nds, dims):
                assert not any(getattr(s, "dim", None) in whole for s in nd.sbps), nd
    _equal(step, fn, (params, x))


def test_a_budget_only_a_sequence_split_meets_names_context_parallel_in_its_error(mesh):
    params, x = _args(heads=2, kv=1)  # fewer heads than devices
    fn = _grad_step()
    budget = shardc.auto_shard(fn, mesh=mesh).plan(params, x).predicted.peak_memory / 4
    with pytest.raises(shardc.MemoryBudgetError, match="context_parallel=True") as info:
        shardc.auto_shard(fn, mesh=mesh, memory_budget=budget,
                          context_parallel=False).plan(params, x)
    # the budget it names plans, and compiles within it
    plan = shardc.auto_shard(fn, mesh=mesh, memory_budget=info.value.needed,
                             context_parallel=False).plan(params, x)
    assert plan.solver["compiled_peak"] <= info.value.needed


def test_the_sequence_is_followed_back_to_the_projections_through_rotary_embeddings():
    cfg = llama.LlamaConfig(seq_len=64, batch=1, n_layers=1)
    fn, (state, batch) = llama.make_train_step(cfg)
    graph = trace(fn, state, batch).graph
    dims = sequence_dims(graph)
    scores = [a.scores for a in find_attention(graph)]
    assert scores and all(dims[s][0] == (frozenset({1}), frozenset({1})) for s in scores)
    by_id = {op.id: op for op in graph.ops}
    made = [i for i, (_, outs) in dims.items()  # the q, k, v projections: [batch, seq, -]
            if by_id[i].name == "dot_general" and by_id[i].outputs[0].ndim == 3]
    assert len(made) == 3 * len(scores), dims
    assert all(dims[i][1] == (frozenset({1}),) for i in made)
    assert all(by_id[i].outputs[0].shape[1] == cfg.seq_len for i in made)


def test_a_decoder_at_batch_one_splits_its_sequence_over_every_device(mesh):
    cfg = llama.LlamaConfig(seq_len=256, batch=1, n_layers=2)
    fn, (state, batch) = llama.make_train_step(cfg)
    free = shardc.auto_shard(fn, mesh=mesh).plan(state, batch)
    step = shardc.auto_shard(fn, mesh=mesh, memory_budget=free.predicted.peak_memory / 3)
    plan = step.plan(state, batch)
    assert plan.predicted.peak_memory <= free.predicted.peak_memory / 3
    tokens = [k for k, n in enumerate(plan.input_names) if n.endswith("tokens")]
    assert [str(plan.inputs[k]) for k in tokens] == ["(S(1))"]  # along the sequence
    assert any(f.startswith("sequence") for f in _forms(plan)), plan.solver.get("attention")
    want, got = jax.jit(fn)(state, batch), step(state, batch)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-5)


def test_a_decoder_at_batch_one_rings_its_keys_round_every_device(mesh):
    cfg = llama.LlamaConfig(seq_len=256, batch=1, n_layers=2)
    fn, (state, batch) = llama.make_train_step(cfg)
    step = shardc.auto_shard(fn, mesh=mesh, cluster=SLOW)
    plan = step.plan(state, batch)
    assert _forms(plan) == {"sequence, K/V ring"}, plan.solver.get("attention")
    compiled = step.lower(state, batch).compile()
    rows = {r.kind: r for r in plan.verify(compiled, mesh).rows}
    permutes = rows["collective-permute"]  # 7 sends per ring, shared where XLA merges them
    assert permutes.planned_count == permutes.compiled_count > 0
    assert permutes.planned_bytes == permutes.compiled_bytes
    # the keys and values pass round as their 2 heads, repeated for the 4 query heads on
    # each device (before, the repeated blocks passed: 917504 bytes against 573440)
    heads = {s[s.index("[") + 1:s.index("]")].split(",")[2] for c in collectives(compiled, mesh)
             if c.kind == "collective-permute" for s in c.shapes}
    assert str(cfg.n_kv_heads) in heads, heads
    # explain() names the blocks the ring passes: 32 tokens x 2 kv heads x 16 x 4 bytes
    assert "7 sends of 4.00 KiB" in plan.explain(), plan.explain()
    # the parameters after an AdamW step: bounded by the update's sensitivity to its
    # gradient, which the ring sums in another order
    assert_close(step(state, batch), jax.jit(fn)(state, batch), rtol=1e-4, atol=1e-5,
                 lr=cfg.learning_rate)
