"""``cond`` and ``while`` planned inside: a platform-dependent ``cond`` (``jnp.diagonal``) is
resolved at trace time to its platform's branch; a ``cond``'s branches are planned op by op
between ``cond_enter`` / ``cond_exit`` ops; a ``while`` loop's predicate and body like a
scan's body, weighted by its trip count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SLOW_DEVICES, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc
from shardc.inspect.hlo import price
from shardc.ir.graph import GraphError, check_graph
from shardc.ir.trace import trace
from shardc.ir.trips import DEFAULT_WHILE_TRIPS
from shardc.solve.search import MemoryBudgetError

RNG = np.random.default_rng(0)


def mesh8():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _close(got, want, rtol=1e-4, atol=1e-5):
    assert_close(got, want, rtol=rtol, atol=atol)


# ---- platform_index ------------------------------------------------------------------------

BATCH, DIM = 4096, 512


def _contrastive_step(diagonal: bool):
    """A contrastive (CLIP-style) loss's SGD step; the matched pairs' logits read with
    ``jnp.diagonal`` or, equivalently, masked with an identity matrix."""
    def loss(p, x, y):
        logits = (x @ p["a"]) @ (y @ p["b"]).T
        d = jnp.diagonal(logits) if diagonal else jnp.sum(logits * jnp.eye(BATCH), 1)
        return jnp.mean(jax.nn.logsumexp(logits, 1) - d)

    def step(p, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, p, g), value

    return step


def _contrastive_args():
    f32 = jnp.float32
    p = {k: jnp.asarray(RNG.normal(size=(DIM, DIM)) / DIM ** 0.5, f32) for k in "ab"}
    return (p, jnp.asarray(RNG.normal(size=(BATCH, DIM)), f32),
            jnp.asarray(RNG.normal(size=(BATCH, DIM)), f32))


def test_a_platform_dependent_cond_is_traced_as_its_platform_branch():
    x = jnp.ones((8, 8))
    graph = trace(jnp.diagonal, x).graph
    check_graph(graph)
    names = [op.name for op in graph.ops]
    assert "cond" not in names and "platform_index" not in names
    assert "gather" in names  # the default branch, inlined


def test_diagonal_keeps_the_matmul_split():
    """``jnp.diagonal`` lowers to a ``platform_index`` and a ``cond``: planned as one opaque
    op it made the logits' matmul run replicated (3x the FLOPs per device of the same loss
    without it); resolved, the two losses compile alike."""
    args = _contrastive_args()
    flops = {}
    for diagonal in (False, True):
        s = shardc.auto_shard(_contrastive_step(diagonal), mesh=mesh8(), time_limit=3.0,
                              cluster=SLOW_DEVICES)
        flops[diagonal] = s.lower(*args).compile().cost_analysis()["flops"]
        if diagonal:
            _close(s(*args), jax.jit(_contrastive_step(True))(*args))
    assert flops[True] <= 1.2 * flops[False], flops


# ---- cond planned inside -------------------------------------------------------------------

WIDTH, ROWS = 1024, 1024


def _mlp_params():
    return {f"w{k}": jnp.asarray(RNG.normal(size=(WIDTH, WIDTH)) / WIDTH ** 0.5, jnp.float32)
            for k in range(3)}


def _mlp_loss(p, x):
    h = x
    for k in range(3):
        h = jnp.tanh(h @ p[f"w{k}"])
    return jnp.mean(h ** 2)


X = jnp.asarray(RNG.normal(size=(ROWS, WIDTH)), jnp.float32)


def _optimizer_step(opt):
    def step(params, state, x):
        g = jax.grad(_mlp_loss)(params, x)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state

    return step


def _skip_step(params, state, x):
    """Loss scaling's "skip the step on inf": the update under a ``cond`` whose index is
    the gradients' global norm being finite."""
    opt = optax.adam(1e-3)
    g = jax.grad(lambda p: 1024.0 * _mlp_loss(p, x))(params)
    ok = jnp.isfinite(optax.tree.norm(g))

    def apply(params, state, g):
        u, state = opt.update(jax.tree.map(lambda v: v / 1024.0, g), state, params)
        return optax.apply_updates(params, u), state

    return jax.lax.cond(ok, apply, lambda p, s, g: (p, s), params, state, g)


def _state_specs(s, params, state, x):
    return [sh.spec for sh in jax.tree.leaves(s.input_shardings(params, state, x)[0][1])]


def test_cond_branches_are_inlined_and_joined():
    def f(w, x, i):
        return jax.lax.cond(i > 0, lambda h: jnp.tanh(h @ w), lambda h: h * 2.0, x @ w)

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    graph = trace(f, w, x, 1).graph
    check_graph(graph)
    names = [op.name for op in graph.ops]
    assert "cond" not in names and names.count("cond_exit") == 1
    enters = [op for op in graph.ops if op.name == "cond_enter"]
    assert sorted(op.params["branch"] for op in enters) == [0, 1, 1]  # branch 0 skips w
    dots = [op for op in graph.ops if op.name == "dot_general"]
    assert [op.weight for op in dots] == [1, 1]  # the costlier branch prices the cond
    assert {op.weight for op in graph.ops if op.name == "mul"} == {0}


def _scan_with_cond(w, x):
    def body(h, k):
        h = jax.lax.cond(k % 2 == 0, lambda h: jnp.tanh(h @ w), lambda h: h * 0.5 + 1.0, h)
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(body, x, jnp.arange(4))
    return jnp.sum(h ** 2) + jnp.sum(ys)


def _switch(w, x, i):
    return jax.lax.switch(i, [lambda h: h @ w, jnp.sin, lambda h: jnp.zeros_like(h) + 2.0], x)


def _while_with_cond(w, x):
    def body(c):
        i, h = c
        return i + 1, jax.lax.cond(i < 2, lambda h: jnp.tanh(h @ w), lambda h: h + 1.0, h)

    return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1]


@pytest.mark.parametrize("fn,extra", [
    (_scan_with_cond, ()), (jax.grad(_scan_with_cond), ()), (_switch, (0,)), (_switch, (2,)),
    (_while_with_cond, ()),
], ids=["scan", "scan-grad", "switch-0", "switch-2", "while"])
def test_nested_control_flow_matches_jit(fn, extra):
    """Conds inside a scan body (and its transpose), a three-way switch, a cond inside a
    while body: planned on a (2, 4) mesh, the values jax.jit gives."""
    w = jnp.asarray(RNG.normal(size=(32, 32)) / 6, jnp.float32)
    x = jnp.asarray(RNG.normal(size=(16, 32)), jnp.float32)
    m = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    got = shardc.auto_shard(fn, mesh=m, time_limit=1.0)(w, x, *extra)
    _close(got, jax.jit(fn)(w, x, *extra), rtol=1e-5, atol=1e-5)


def _sharded_share(s, params, state) -> float:
    """The share of the optimizer state's matrices the plan gives sharded."""
    specs = _state_specs(s, params, state, X)
    big = [spec for spec, v in zip(specs, jax.tree.leaves(state)) if v.ndim == 2]
    return sum(any(a is not None for a in spec) for spec in big) / len(big)


@pytest.mark.parametrize("kind", ["multisteps", "skip"])
def test_an_update_under_cond_keeps_its_state_sharded(kind):
    """The optimizer's moments (and MultiSteps' accumulated gradients) are sharded as in
    the plain step (planned as one opaque op, the cond held them all replicated); three
    steps equal jax.jit's (the skip step's second is skipped: its batch is not finite).
    The skip step's check costs an all-reduce of one partial norm per leaf, which at this
    size makes the replicated update as fast (76 us against 78 predicted): planned within
    the plain step's memory, its state is sharded."""
    params = _mlp_params()
    adam = optax.adam(1e-3)
    plain = shardc.auto_shard(_optimizer_step(adam), mesh=mesh8(), time_limit=3.0,
                              cluster=SLOW_DEVICES)
    want_share = _sharded_share(plain, params, adam.init(params))
    assert want_share > 0.5
    budget = None
    if kind == "multisteps":
        opt = optax.MultiSteps(adam, every_k_schedule=2)
        step, state = _optimizer_step(opt), opt.init(params)
    else:
        step, state = _skip_step, adam.init(params)
        budget = 1.1 * plain.plan(params, state, X).predicted.peak_memory
    s = shardc.auto_shard(step, mesh=mesh8(), time_limit=3.0, memory_budget=budget,
                          cluster=SLOW_DEVICES)
    assert _sharded_share(s, params, state) >= want_share
    ref = jax.jit(step)
    got = want = (params, state)
    for k in range(3):
        x = X.at[0, 0].set(jnp.inf) if kind == "skip" and k == 1 else X
        got, want = s(*got, x), ref(*want, x)
        # to rounding: Adam's m / sqrt(v) turns a sharded sum's rounding of a tiny gradient
        # into up to 1e-5 of an update of 1e-3
        _close(got, want, rtol=1e-4, atol=2e-5)


def _leanest(step, *args) -> float:
    with pytest.raises(MemoryBudgetError) as err:
        shardc.auto_shard(step, mesh=mesh8(), time_limit=3.0, memory_budget=2 ** 20,
                          cluster=SLOW_DEVICES, offload=False).plan(*args)
    return err.value.needed


def test_multisteps_plans_under_the_plain_steps_budget():
    """MultiSteps' update under a ``cond`` plans at the plain step's leanest budget plus
    its accumulated gradients (read and written: two copies, sharded), all on the devices
    (offload, which would lower the plain step's leanest budget, forbidden); planned as one
    opaque op, the cond held its whole state replicated (113 MB predicted against 34)."""
    params = _mlp_params()
    plain, multi = optax.adam(1e-3), optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    base = _leanest(_optimizer_step(plain), params, plain.init(params), X)
    extra = 2 * sum(v.nbytes for v in jax.tree.leaves(params)) / 8
    budget = 1.05 * (base + extra)
    s = shardc.auto_shard(_optimizer_step(multi), mesh=mesh8(), time_limit=3.0,
                          memory_budget=budget, cluster=SLOW_DEVICES, offload=False)
    plan = s.plan(params, multi.init(params), X)
    assert plan.predicted.peak_memory <= budget


def test_check_graph_verifies_the_cond_edges():
    def f(x, i):
        return jax.lax.cond(i > 0, jnp.sin, jnp.cos, x)

    graph = trace(f, jnp.ones((4,)), 1).graph
    exit_op = next(op for op in graph.ops if op.name == "cond_exit")
    exit_op.inputs = exit_op.inputs[:1]  # no branch values
    with pytest.raises(GraphError, match="one value per branch"):
        check_graph(graph)
    exit_op.inputs = [graph.inputs[0], graph.inputs[0]]  # a float vector as the index
    with pytest.raises(GraphError, match="not a scalar integer"):
        check_graph(graph)


def test_explain_reports_the_compute_inside_control_flow():
    """A cond is reported by what runs inside it, its costlier branch: here the matmul
    that is half of the step's compute (not the 0.0% of one opaque op)."""
    def f(w, x, i):
        h = x @ w
        return jax.lax.cond(i > 0, lambda h: jnp.tanh(h @ w), lambda h: h * 2.0, h)

    w, x = jnp.ones((512, 512)), jnp.ones((1024, 512))
    text = shardc.auto_shard(f, mesh=mesh8(), time_limit=3.0).plan(w, x, 1).explain()
    line = next(ln for ln in text.splitlines() if ln.startswith("control flow"))
    share = float(line.split("ops, ")[1].split("%")[0])
    assert "cond at" in line and share == pytest.approx(50.0, abs=5.0), line


# ---- while planned inside ------------------------------------------------------------------

VOCAB, EMBED, STEPS, PROMPTS = 512, 256, 8, 64


def _decoder_params():
    shapes = {"emb": (VOCAB, EMBED), "q": (EMBED, EMBED), "k": (EMBED, EMBED),
              "v": (EMBED, EMBED), "o": (EMBED, EMBED), "out": (EMBED, VOCAB)}
    return {k: jnp.asarray(RNG.normal(size=s) / s[0] ** 0.5, jnp.float32)
            for k, s in shapes.items()}


def _decode_step(p, i, tok, kc, vc, toks):
    """One greedy token of a one-layer decoder with a KV cache."""
    h = p["emb"][tok]
    q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
    kc = jax.lax.dynamic_update_slice(kc, k[:, None], (0, i, 0))
    vc = jax.lax.dynamic_update_slice(vc, v[:, None], (0, i, 0))
    s = jnp.einsum("bd,btd->bt", q, kc) / kc.shape[-1] ** 0.5
    s = jnp.where(jnp.arange(STEPS)[None] <= i, s, -1e30)
    o = jnp.einsum("bt,btd->bd", jax.nn.softmax(s, -1), vc)
    tok = jnp.argmax((h + o @ p["o"]) @ p["out"], -1).astype(jnp.int32)
    return tok, kc, vc, toks.at[:, i].set(tok)


def _decode_start(tok, embed=EMBED):
    cache = jnp.zeros((tok.shape[0], STEPS, embed), jnp.float32)
    return tok, cache, cache, jnp.zeros((tok.shape[0], STEPS), jnp.int32)


def decode_fori(p, tok):
    return jax.lax.fori_loop(0, STEPS, lambda i, c: _decode_step(p, i, *c),
                             _decode_start(tok))[3]


def decode_while(p, tok):
    def body(c):
        i, *rest = c
        return (i + 1, *_decode_step(p, i, *rest))

    return jax.lax.while_loop(lambda c: c[0] < STEPS, body, (0, *_decode_start(tok)))[4]


def test_a_while_loop_is_inlined_by_its_trip_count():
    def counted(x):
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.sin(c[1])),
                                  (0, x))[1]

    def traced_bound(x, n):  # a fori_loop with a traced bound is a while loop
        return jax.lax.fori_loop(0, n, lambda i, h: jnp.sin(h), x)

    x = jnp.ones((8, 4))
    graph = trace(counted, x).graph
    check_graph(graph)
    assert "while" not in [op.name for op in graph.ops]
    assert {op.weight for op in graph.ops if op.name == "sin"} == {5}
    graph = trace(traced_bound, x, 3).graph
    assert {op.weight for op in graph.ops if op.name == "sin"} == {DEFAULT_WHILE_TRIPS}
    graph = trace(traced_bound, x, 3, while_trips=40).graph
    assert {op.weight for op in graph.ops if op.name == "sin"} == {40}
    # auto_shard's while_trips reaches the trace, and the plan's compute follows it
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    compute = {n: shardc.auto_shard(traced_bound, mesh=mesh, while_trips=n)
               .plan(x, jnp.int32(3)).predicted.compute_time for n in (4, 40)}
    assert compute[40] > 5 * compute[4]
    with pytest.raises(ValueError, match="while_trips is the iterations"):
        shardc.auto_shard(traced_bound, mesh=mesh, while_trips=0)


@pytest.mark.parametrize("decode", [decode_fori, decode_while], ids=["fori", "while"])
def test_greedy_decode_costs_no_more_than_data_parallelism(decode):
    """A greedy KV-cache decode, planned: its compiled program does no more FLOPs and
    communication than the data-parallel jax.jit of it (prompts split, weights
    replicated), and decodes the same tokens. Planned as one opaque op, the while loop
    all-gathered its carries."""
    params = _decoder_params()
    prompt = jnp.asarray(RNG.integers(0, VOCAB, size=(PROMPTS,)), jnp.int32)
    m, cluster = mesh8(), shardc.Cluster()
    s = shardc.auto_shard(decode, mesh=m, time_limit=3.0)
    np.testing.assert_array_equal(np.asarray(s(params, prompt)),
                                  np.asarray(jax.jit(decode)(params, prompt)))
    whole, split = NamedSharding(m, Ps()), NamedSharding(m, Ps("x"))
    dp = jax.jit(decode, in_shardings=(jax.tree.map(lambda _: whole, params), split))
    mine = price(s.lower(params, prompt).compile(), m, cluster)
    theirs = price(dp.lower(params, prompt).compile(), m, cluster)
    assert mine.flops <= 1.02 * theirs.flops, (mine.flops, theirs.flops)
    assert mine.comm_time <= theirs.comm_time + 1e-9, (mine.counts, theirs.counts)


@pytest.mark.parametrize("loop", ["fori", "while"])
def test_a_decode_loop_large_enough_for_tensor_parallelism_is_no_slower_than_dp(loop):
    """A decode function returns no new state, so its first argument (the parameters)
    stays on the devices between calls, as a train step's state does; only the prompts are
    fed each call. Priced as fed every call, replicated weights cost eight times the feed of
    split ones, and a larger decoder planned 3.4x data parallelism's FLOPs to save it."""
    vocab, embed, prompts = 4096, 512, 32

    def decode(p, tok):
        start = _decode_start(tok, embed)
        if loop == "fori":
            return jax.lax.fori_loop(0, STEPS, lambda i, c: _decode_step(p, i, *c), start)[3]

        def body(c):
            i, *rest = c
            return (i + 1, *_decode_step(p, i, *rest))

        return jax.lax.while_loop(lambda c: c[0] < STEPS, body, (0, *start))[4]

    f32 = jnp.float32
    shapes = {"emb": (vocab, embed), "q": (embed, embed), "k": (embed, embed),
              "v": (embed, embed), "o": (embed, embed), "out": (embed, vocab)}
    params = {k: jax.ShapeDtypeStruct(s, f32) for k, s in shapes.items()}
    prompt = jax.ShapeDtypeStruct((prompts,), jnp.int32)
    m, cluster = mesh8(), shardc.Cluster()
    s = shardc.auto_shard(decode, mesh=m, time_limit=3.0)
    plan = s.plan(params, prompt)
    assert plan.predicted.feed_time == pytest.approx(prompts * 4 / cluster.host_bandwidth,
                                                     rel=1.0)  # the prompts at most
    whole, split = NamedSharding(m, Ps()), NamedSharding(m, Ps("x"))
    dp = jax.jit(decode, in_shardings=(jax.tree.map(lambda _: whole, params), split))
    mine = price(s.lower(params, prompt).compile(), m, cluster)
    theirs = price(dp.lower(params, prompt).compile(), m, cluster)
    assert mine.time <= theirs.time * 1.001, (mine.time, theirs.time, mine.counts)
