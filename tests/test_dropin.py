"""auto_shard as a drop-in for jax.jit: each row of the drop-in issue's table, written as a
user writes it, compared with ``jax.jit(fn)`` (values, gradients, dtypes, output sharding
types, recomputation in the compiled HLO)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SLOW_DEVICES, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc
from shardc.plan.codec import PlanFormatError

AUTO = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("node", "gpu"))  # jax.make_mesh's default: Explicit axes
W = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
DATA = Path(__file__).parent / "data"


def shard(fn, **kw):
    """auto_shard on slow devices (tests/helpers.py): these small steps shard there."""
    kw.setdefault("cluster", SLOW_DEVICES)
    return shardc.auto_shard(fn, mesh=kw.pop("mesh", AUTO), time_limit=kw.pop("time_limit", 2.0),
                             **kw)


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
    f32 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)
    assert_close(f32(a), f32(b), rtol=tol, atol=tol)


# ---- custom derivative rules survive -----------------------------------------------------

@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


@jax.custom_vjp
def straight_through_round(x):
    return jnp.round(x)


straight_through_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


@jax.custom_jvp
def scaled_sin(x):
    return jnp.sin(x)


@scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return scaled_sin(x), 100.0 * t


@pytest.mark.parametrize("rule, plain", [(clip_gradient, lambda x: x),
                                         (straight_through_round, jnp.round),
                                         (scaled_sin, jnp.sin)])
def test_grad_of_auto_shard_keeps_custom_derivative_rules(rule, plain):
    def f(w, x):
        return jnp.sum(rule(x @ w) ** 2)

    got = jax.grad(shard(f))(W, X)
    close(got, jax.grad(jax.jit(f))(W, X))
    inlined = jax.grad(lambda w, x: jnp.sum(plain(x @ w) ** 2))(W, X)  # the rule dropped
    assert float(jnp.max(jnp.abs(got - inlined))) > 1e-2


def test_grad_inside_the_step_keeps_custom_vjp():
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(clip_gradient(x @ w) ** 2))(w)
        return w - g, g

    close(shard(step)(W, X), jax.jit(step)(W, X))
    # the clipped gradient is tiny; the inlined identity would give ~|2 x@w x|, far larger
    assert float(jnp.max(jnp.abs(shard(step)(W, X)[1]))) <= 16 * 0.01 + 1e-6


# ---- remat keeps its recomputation -------------------------------------------------------

def _count(text: str, op: str) -> int:
    return len(re.findall(rf"= \S+ {op}\(", text))


def _remat_step(w, x):
    layer = jax.checkpoint(lambda h, w: jnp.tanh(h @ w),
                           policy=jax.checkpoint_policies.nothing_saveable)

    def loss(w):
        h = x
        for _ in range(4):
            h = layer(h, w)
        return jnp.sum(h)

    return jax.grad(loss)(w)


def test_remat_recomputation_is_kept_in_the_compiled_program():
    got = shard(_remat_step).lower(W, X).compile().as_text()
    want = jax.jit(_remat_step).lower(W, X).compile().as_text()
    assert _count(want, "tanh") > 4  # remat recomputes the forward tanh in the backward
    assert _count(got, "tanh") == _count(want, "tanh")
    close(shard(_remat_step)(W, X), jax.jit(_remat_step)(W, X))


def test_remat_step_temp_memory_matches_jit_with_the_same_shardings():
    """A train step with per-layer jax.checkpoint (residual MLP blocks, Adam): shardc's
    program needs (within 5%) the temporary memory of jax.jit given the same input and
    output shardings. The batch is pinned split so both compile the data-parallel program."""
    import optax

    rng = np.random.default_rng(2)
    params = [{"w1": jnp.asarray(rng.normal(size=(128, 512)) / 11, jnp.float32),
               "w2": jnp.asarray(rng.normal(size=(512, 128)) / 23, jnp.float32)}
              for _ in range(3)]
    opt = optax.adam(1e-3)
    state = {"params": params, "opt": opt.init(params)}
    x = jnp.asarray(rng.normal(size=(2048, 128)), jnp.float32)

    def step(state, x):
        block = jax.checkpoint(lambda h, p: h + jax.nn.gelu(h @ p["w1"]) @ p["w2"])

        def loss(params):
            h = x
            for p in params:
                h = block(h, p)
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

    s = shard(step, in_shardings=(Ps(), Ps(("node", "gpu"))))
    plan = s.plan(state, x)
    mesh = s.mesh_for(plan)
    ins = tuple(jax.tree.unflatten(jax.tree.structure(a), [NamedSharding(mesh, p) for p in ps])
                for a, ps in ((state, plan.input_specs()[:-1]), (x, plan.input_specs()[-1:])))
    outs = jax.tree.unflatten(jax.tree.structure((state, 0.0)),
                              [NamedSharding(mesh, p) for p in plan.output_specs()])
    got = s.lower(state, x).compile()
    want = jax.jit(step, in_shardings=ins, out_shardings=outs).lower(state, x).compile()
    assert _count(got.as_text(), "tanh") == _count(want.as_text(), "tanh")  # gelu's, recomputed
    ratio = got.memory_analysis().temp_size_in_bytes / want.memory_analysis().temp_size_in_bytes
    assert ratio <= 1.05, ratio


# ---- transformations of an auto_shard function -------------------------------------------

def test_vmap_jit_and_grad_of_auto_shard_match_jax_jit():
    def f(w, x):
        return jnp.tanh(x @ w)

    s = shard(f)
    xs = jnp.stack([X, 2 * X])
    close(jax.vmap(s, in_axes=(None, 0))(W, xs), jax.vmap(f, in_axes=(None, 0))(W, xs))
    close(jax.jit(lambda w, x: s(w, x) * 2)(W, X), jax.jit(lambda w, x: f(w, x) * 2)(W, X))
    close(jax.grad(lambda w: jnp.sum(s(w, X)))(W), jax.grad(lambda w: jnp.sum(f(w, X)))(W))


# ---- calling convention ------------------------------------------------------------------

def test_keyword_arguments_and_defaults():
    def f(w, x, scale=1.0):
        return (x @ w) * scale

    s = shard(f)
    close(s(W, X, scale=2.0), jax.jit(f)(W, X, scale=2.0))
    close(s(w=W, x=X), jax.jit(f)(w=W, x=X))
    close(s(W, x=X), jax.jit(f)(W, x=X))


def test_static_arguments_by_negative_index_and_by_name():
    def f(x, act):
        return act(x)

    by_index = shard(f, static_argnums=-1)
    close(by_index(X, jax.nn.relu), jax.nn.relu(X))
    close(by_index(X, jnp.tanh), jnp.tanh(X))
    by_name = shard(f, static_argnames="act")
    close(by_name(X, act=jax.nn.relu), jax.nn.relu(X))
    close(by_name(X, jax.nn.relu), jax.nn.relu(X))  # inferred from the signature, like jit
    with pytest.raises(TypeError, match="hashable"):
        shard(lambda x, n: x * len(n), static_argnums=1)(X, [1, 2])


def test_donated_arguments_by_index_and_name():
    def f(w, x):
        return w + 1.0, x @ w

    for kw in ({"donate_argnums": 0}, {"donate_argnames": "w"}):
        got = shard(f, **kw)(jnp.array(W), X)
        close(got, jax.jit(f)(W, X))
    with pytest.raises(ValueError, match="both static and donated"):
        shard(f, static_argnums=0, donate_argnums=0)


def test_python_scalars_are_weakly_typed_as_under_jit():
    def f(x, c):
        return x.astype(jnp.bfloat16) * c

    got = shard(f)(X, 2.0)
    want = jax.jit(f)(X, 2.0)
    assert got.dtype == want.dtype == jnp.bfloat16
    close(got, want)


# ---- placed inputs -----------------------------------------------------------------------

def test_placed_inputs_are_moved_once_with_one_log_line(caplog):
    s = shard(lambda w, x: x @ w)
    placed = [jax.device_put(X, NamedSharding(AUTO, Ps(None, "gpu"))),
              jax.device_put(X, jax.devices()[3]),
              jax.device_put(X, NamedSharding(EXPLICIT, Ps("node")))]
    with caplog.at_level(logging.WARNING, logger="shardc"):
        for x in placed:
            close(s(W, x), X @ W)
        s(W, placed[0])
    moved = [r for r in caplog.records if "is placed as" in r.message]
    assert len(moved) == 1 and "args[1]" in moved[0].message  # the same argument: once


def test_kept_input_shardings_fix_the_plan():
    x = jax.device_put(X, NamedSharding(AUTO, Ps(None, "gpu")))
    s = shard(lambda w, x: jnp.tanh(x @ w), keep_input_shardings=True)
    assert s.plan(W, x).input_specs()[1] == Ps(None, "gpu")
    close(s(W, x), jnp.tanh(X @ W))
    fixed = shard(lambda w, x: jnp.tanh(x @ w), in_shardings=(Ps("gpu"), None))
    assert fixed.plan(W, X).input_specs()[0] == Ps("gpu")


def test_shape_dtype_struct_shardings_count_like_placed_arguments(caplog):
    sds = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(AUTO, Ps(None, "gpu")))
    kept = shard(lambda w, x: jnp.tanh(x @ w), keep_input_shardings=True)
    assert kept.plan(W, sds).input_specs()[1] == Ps(None, "gpu")
    with caplog.at_level(logging.WARNING, logger="shardc"):
        lowered = shard(lambda w, x: jnp.tanh(x @ w)).lower(W, sds)
    plan_spec = lowered.compile().input_shardings[0][1].spec
    if plan_spec != Ps(None, "gpu"):
        assert any("is placed as" in r.message for r in caplog.records)


# ---- Explicit meshes ---------------------------------------------------------------------

def test_explicit_mesh_outputs_are_typed_on_the_users_mesh():
    def f(x):
        return jnp.tanh(x) * 2.0

    xe = jax.device_put(X, NamedSharding(EXPLICIT, Ps("node")))
    got, want = shard(f, mesh=EXPLICIT)(xe), jax.jit(f)(xe)
    assert jax.typeof(got).sharding == jax.typeof(want).sharding  # as jax.jit types it
    close(got + xe, want + xe)  # combines with the user's own arrays
    replicated = jax.device_put(X, NamedSharding(EXPLICIT, Ps()))
    with jax.set_mesh(EXPLICIT):
        inside = shard(f, mesh=EXPLICIT)(X)  # a plain argument: the plan picks the layout
        close(inside + replicated, f(X) + X)
    assert jax.typeof(inside).sharding.mesh.axis_types == EXPLICIT.axis_types


def test_explicit_mesh_keeps_placed_arguments_by_default():
    """On an Explicit mesh a placement is the argument's type: the plan keeps it unless the
    user says keep_input_shardings=False."""
    xe = jax.device_put(X, NamedSharding(EXPLICIT, Ps(None, "gpu")))
    kept = shard(lambda x: jnp.tanh(x) * 2.0, mesh=EXPLICIT).plan(xe)
    assert str(kept.inputs[0]) == "(B, S(1))"
    free = shard(lambda x: jnp.tanh(x) * 2.0, mesh=EXPLICIT, keep_input_shardings=False)
    assert free.keep is False


def test_explicit_mesh_results_fed_back_reuse_the_plan():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    s = shard(step, mesh=EXPLICIT)
    w1 = s(W, X)  # plain arguments: planned freely, results typed on the mesh
    w2 = s(w1, X)  # w1 keeps its placement (its type); the plan already has it
    assert len({id(p) for p in s._plans.values()}) == 1
    close(w2, jax.jit(step)(jax.jit(step)(W, X), X))
    assert jax.typeof(w2).sharding == jax.typeof(w1).sharding


def test_explicit_mesh_results_of_plain_arguments_are_untyped_as_jax_jits():
    """On jax.make_mesh's default mesh, plain arguments' results are typed as jax.jit types
    them (unsharded) whatever layout the plan gave them, so the user's own code reads them
    as it reads jax.jit's: typed with the plan's layout (a weight split along the dim the
    user's own loss contracts), jax.jit of that loss refused them as ambiguous."""
    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["a"]) @ p["b"]) ** 2

    def step(p, x):
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p, x))

    params = {"a": W, "b": W.T}
    s = shard(step, mesh=EXPLICIT, in_shardings=({"a": Ps(None, "gpu"), "b": Ps("gpu")}, None))
    got, want = s(params, X), jax.jit(step)(params, X)
    assert got["b"].sharding.spec == Ps("gpu")  # placed as planned
    assert jax.typeof(got["b"]).sharding.spec == jax.typeof(want["b"]).sharding.spec
    close(jax.jit(loss)(got, X), jax.jit(loss)(want, X))  # the user's own jax.jit
    close(got["b"][3, 5], want["b"][3, 5])  # and eager indexing read them
    again = s(got, X)  # fed back: a placement, not a new signature
    assert len({id(p) for p in s._plans.values()}) == 1
    close(again, jax.jit(step)(want, X))


def test_an_untyped_result_runs_beside_a_batch_placed_on_the_explicit_mesh():
    """A result left untyped (plain arguments) fed back beside a batch placed on the
    Explicit mesh: the batch types the call, the result is given the plan's type (jax.jit
    refuses arrays on meshes of different axis types together), and the step equals
    jax.jit's."""
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    s = shard(step, mesh=EXPLICIT)
    xe = jax.device_put(X, NamedSharding(EXPLICIT, Ps("node")))
    close(s(s(W, X), xe), jax.jit(step)(jax.jit(step)(W, X), X))


def test_a_train_step_runs_inside_jax_set_mesh_of_an_explicit_mesh():
    """Traced under ``jax.set_mesh`` of an Explicit mesh, a step's jaxpr types its values on
    that mesh (the broadcasts, reductions and reshards of the scalars it lifts name it, and
    so do the bodies of its calls): the lowering runs them on Auto axes, equal to jax.jit's
    step, its results typed on the mesh as jax.jit's are."""
    import optax

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))

    def step(w, state, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jax.nn.gelu(x @ w) ** 2))(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss

    with jax.set_mesh(EXPLICIT):
        state = opt.init(W)
        got, want = shard(step, mesh=EXPLICIT)(W, state, X), jax.jit(step)(W, state, X)
    close(got, want)
    assert jax.typeof(got[0]).sharding.mesh.axis_types == EXPLICIT.axis_types


def test_a_step_typed_by_its_arguments_and_out_sharding_runs_as_jax_jits():
    """Arguments placed on an Explicit mesh type the step's values, each op's type written
    into its equation (a gradient's broadcast split as its cotangent is, a dot's
    ``out_sharding``): the lowering replays them on Auto axes, its results typed as
    jax.jit's."""
    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.matmul(jnp.tanh(x @ w), w.T, out_sharding=Ps("node")) ** 2)

        return w - 0.1 * jax.grad(loss)(w)

    with jax.set_mesh(EXPLICIT):
        we = jax.device_put(W, NamedSharding(EXPLICIT, Ps(None, "gpu")))
        xe = jax.device_put(X, NamedSharding(EXPLICIT, Ps("node")))
        got, want = shard(step, mesh=EXPLICIT)(we, xe), jax.jit(step)(we, xe)
    close(got, want)
    assert jax.typeof(got).sharding == jax.typeof(want).sharding


def test_explicit_mesh_arguments_typed_as_a_plan_left_them_still_run():
    """A plan may leave a parameter split along a dimension the user's program contracts
    (an embedding split over its width, say). Fed back, such types fail jax.jit's type rules
    (ambiguous contraction); shardc keeps them and runs, its results typed as planned."""
    both = ("node", "gpu")
    xe = jax.device_put(X, NamedSharding(EXPLICIT, Ps(None, both)))
    we = jax.device_put(W, NamedSharding(EXPLICIT, Ps(both, None)))

    def f(x, w):
        return jnp.tanh(x @ w), w * 0.5

    with pytest.raises(Exception, match="ambiguous"):
        jax.jit(f)(xe, we)
    s = shard(f, mesh=EXPLICIT)
    y, w2 = s(xe, we)
    close((y, w2), f(X, W))
    assert jax.typeof(w2).sharding.mesh.axis_types == EXPLICIT.axis_types
    close(s(xe, w2), f(X, W * 0.5))

def test_auto_mesh_step_runs_inside_an_explicit_set_mesh():
    with jax.set_mesh(EXPLICIT):
        close(shard(lambda x: jnp.tanh(x) * 2.0)(X), jnp.tanh(X) * 2.0)


# ---- the user's own constraints ----------------------------------------------------------

def test_user_sharding_constraints_are_fixed_layouts(recwarn):
    def f(x, w):
        y = jax.lax.with_sharding_constraint(x @ w, NamedSharding(AUTO, Ps(None, "gpu")))
        # a result of its own shape (one shaped like x would be tied to x's layout, and
        # ending in x's layout would cost the same as starting in the constraint's)
        return jnp.tanh(y)[:4]

    s = shard(f)
    out = s(X, W)
    assert not [w for w in recwarn if "no sharding rule" in str(w.message)]
    plan = s.plan(X, W)
    pinned = [o for o in plan.ops if o.prim == "sharding_constraint"]
    assert [str(o.outs[0]) for o in pinned] == ["(B, S(1))"]
    assert out.sharding.spec == Ps(None, "gpu")  # the constrained layout flows to the output
    close(out, jnp.tanh(X @ W)[:4])


def test_reshard_on_an_explicit_mesh_is_a_fixed_layout():
    def f(x, w):
        return jnp.tanh(jax.sharding.reshard(x @ w, Ps(None, "gpu")))

    with jax.set_mesh(EXPLICIT):
        s = shard(f, mesh=EXPLICIT)
        got, want = s(X, W), jax.jit(f)(X, W)
    close(got, want)
    assert jax.typeof(got).sharding == jax.typeof(want).sharding
    assert [str(o.outs[0]) for o in s.plan(X, W).ops if o.prim == "reshard"] == ["(B, S(1))"]


def test_unconstrained_dims_stay_free():
    def f(x):
        return jax.lax.with_sharding_constraint(
            x * 2, NamedSharding(AUTO, Ps(Ps.UNCONSTRAINED, "gpu")))

    plan = shard(f).plan(X)
    o = next(o for o in plan.ops if o.prim == "sharding_constraint")
    assert str(o.outs[0]).endswith("S(1))")  # gpu on dim 1; node is the solver's choice


def test_flax_partitioning_annotations_as_fixed_layouts_or_seeds():
    from flax import nnx

    with jax.set_mesh(AUTO):  # flax places annotated variables when they are made
        model = nnx.Linear(8, 16, rngs=nnx.Rngs(0),
                           kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                             (None, "gpu")))
    graphdef, params = nnx.split(model, nnx.Param)
    specs = nnx.get_partition_spec(params)

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    fixed = shard(forward, in_shardings=(specs, None))
    plan = fixed.plan(params, X)
    leaves = jax.tree.leaves(params)
    kernel = [k for k, v in enumerate(leaves) if v.ndim == 2][0]
    assert plan.input_specs()[kernel] == Ps(None, "gpu")
    close(fixed(params, X), forward(params, X))
    seeded = shard(forward, seeds={"flax": (specs, None)})
    assert "flax" in seeded.plan(params, X).solver["seeds"]


def test_linen_logical_constraints_and_partitioning():
    import flax.linen as nn

    rules = (("batch", "node"), ("embed", None), ("mlp", "gpu"))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
            h = nn.with_logical_constraint(h, ("batch", "mlp"))
            return nn.Dense(8)(nn.relu(h))

    model = Block()
    with jax.set_mesh(AUTO), nn.logical_axis_rules(rules):
        variables = model.init(jax.random.key(0), X)
        specs = nn.logical_to_mesh(nn.get_partition_spec(variables))
        step = shard(lambda v, x: model.apply(v, x), in_shardings=(specs, None))
        close(step(variables, X), model.apply(variables, X))
        plan = step.plan(variables, X)
    pinned = [str(o.outs[0]) for o in plan.ops if o.prim == "sharding_constraint"]
    assert "(S(0), S(1))" in pinned  # ("batch", "mlp") under the rules
    kernel = next(k for k, x in enumerate(jax.tree.leaves(variables)) if x.shape == (8, 32))
    assert plan.input_specs()[kernel] == Ps(None, "gpu")


# ---- saved plans -------------------------------------------------------------------------

def test_a_saved_plan_runs_without_the_solver(monkeypatch):
    def f(w, x):
        return jnp.tanh(x @ w) @ w.T

    text = shard(f).plan(W, X).to_json()
    import shardc.step.solving

    def no_solver(*a, **k):
        raise AssertionError("the solver ran for a saved plan")

    monkeypatch.setattr(shardc.step.solving, "plan_graph", no_solver)
    s = shard(f)
    s.use_plan(shardc.Plan.from_json(text), W, X)
    close(s(W, X), f(W, X))


def test_a_plan_for_another_program_is_refused():
    plan = shard(lambda w, x: jnp.tanh(x @ w)).plan(W, X)
    with pytest.raises(ValueError, match="different program"):
        shard(lambda w, x: jnp.sin(x @ w)).use_plan(plan, W, X)
    with pytest.raises(ValueError, match="different program"):  # same ops, other params
        shard(lambda w, x: jnp.tanh(x @ w.T)).use_plan(plan, W, X)


def _edited(text: str, **fields) -> str:
    return json.dumps({**json.loads(text), **fields})


def _edited_ops(text: str, **columns) -> str:
    d = json.loads(text)
    return _edited(text, ops={**d["ops"], **columns})


@pytest.mark.parametrize("damage, field", [
    (lambda t: t[: len(t) // 2], "not valid JSON"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "ops"}), "'ops'"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "layouts"}),
     "'layouts'"),
    (lambda t: _edited(t, inputs=[["B"]] * 2), "inputs"),  # a layout written in place
    (lambda t: _edited(t, inputs=[0, 99]), "inputs"),  # an index past the layout table
    (lambda t: _edited(t, layouts=[["B"]]), "layouts"),  # a layout of another mesh
    (lambda t: _edited(t, ops=[{"id": 0}]), "ops"),  # rows, not columns
    (lambda t: _edited_ops(t, id=[0, 1, 2]), "field ops: columns of unequal"),
])
def test_a_damaged_plan_file_names_the_field(damage, field):
    text = shard(lambda w, x: x @ w).plan(W, X).to_json()
    with pytest.raises(PlanFormatError, match=field):
        shardc.Plan.from_json(damage(text))


def test_a_plan_saved_in_the_first_format_still_runs():
    """``data/plan_v1.json``: this program's plan as shardc wrote plans before the layout
    table (version 1, every layout in place); it loads, runs, and saves in the new format
    as the same plan."""
    def f(w, x):
        return jnp.tanh(x @ w) @ w.T, x.sum(1)

    old = shardc.Plan.from_json((DATA / "plan_v1.json").read_text())
    assert old.settled and old.input_names == ("w", "x")
    assert shardc.Plan.from_json(old.to_json()) == old
    s = shard(f)
    s.use_plan(old, W, X)
    close(s(W, X), f(W, X))


def test_a_plan_saved_with_a_zeroing_charge_still_runs():
    """Plans saved while the search charged each ``B -> P`` zeroing a latency carry it in
    ``predicted.zeroing_time``; they load (the charge dropped: no collective ever ran for
    it) and run."""
    def f(w, x):
        return x @ w

    s = shard(f)
    plan = s.plan(W, X)
    d = json.loads(plan.to_json())
    d["predicted"]["zeroing_time"] = 1e-5
    old = shardc.Plan.from_json(json.dumps(d))
    assert old.predicted == plan.predicted
    s.use_plan(old, W, X)
    close(s(W, X), f(W, X))


# ---- errors that name the fix ------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    ({"axis_latency": {"gpu": -1e-6}}, "axis_latency"),
    ({"axis_bandwidth": {"gpu": 0.0}}, "axis_bandwidth"),
    ({"utilization": 0}, "utilization"),
    ({"utilization": 1.5}, "utilization"),
    ({"host_bandwidth": 0}, "host_bandwidth"),
    ({"device_memory": -1}, "device_memory"),
    ({"device_flops": float("nan")}, "device_flops"),
])
def test_cluster_rejects_figures_that_make_no_sense(kw, field):
    with pytest.raises(ValueError, match=field):
        shardc.Cluster(**kw)


def test_a_too_small_memory_budget_names_one_that_works():
    def f(w, x):
        return jnp.tanh(x @ w) @ w.T

    with pytest.raises(shardc.MemoryBudgetError, match=r"needs [\d.]+ (B|KiB)") as info:
        shard(f, memory_budget=100).plan(W, X)
    needed = info.value.needed
    plan = shard(f, memory_budget=needed).plan(W, X)
    assert plan.predicted.peak_memory <= needed


def test_one_warning_per_missing_rule_per_plan():
    def f(x):  # igamma (the regularized incomplete gamma function) has no rule
        y = jax.lax.igamma(x.T @ x + 16.0, jnp.ones((8, 8)))
        return jax.lax.igamma(y @ y.T + 1.0, jnp.ones((8, 8))).sum() + x

    with pytest.warns(UserWarning) as rec:
        shard(f).plan(X)
    assert sum("'igamma'" in str(w.message) for w in rec) == 1


def test_cli_reports_bad_arguments_in_one_line(capsys):
    from shardc.cli import main

    for argv in (["plan", "gpt", "--mesh", "2xfour"], ["plan", "gpt", "--axes", "a,a"],
                 ["demo", "--layers", "-1"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "".join(err) and err[-1].startswith("shardc")


def test_tracing_pauses_the_garbage_collector_and_restores_it():
    """Tracing runs with Python's cyclic collector paused (many short-lived objects: each
    full collection in a large process would walk them all); it is on again afterwards, and
    after a trace that raises."""
    import gc

    seen = []

    def f(x):
        seen.append(gc.isenabled())
        return jnp.tanh(x) * 2.0

    close(shard(f)(X), jnp.tanh(X) * 2.0)
    assert seen == [False] and gc.isenabled()

    def broken(x):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        shard(broken)(X)
    assert gc.isenabled()


@pytest.mark.parametrize("typed_by", ["set_mesh", "argument"])
def test_a_step_with_an_io_callback_runs_on_an_explicit_mesh_as_jax_jits(typed_by):
    """A step that reports its loss through ``io_callback``, typed by a ``jax.set_mesh``
    context or by an argument placed on the Explicit mesh: JAX lowers a program with a
    primitive that needs its devices only where every sharding names one abstract mesh, so
    the step runs on the mesh's Auto view (its results untyped) and equals jax.jit's, each
    callback heard as jax.jit's are."""
    import contextlib

    from jax.experimental import io_callback

    heard: list[float] = []

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        io_callback(lambda v: heard.append(float(v)), None, loss, ordered=True)
        return w - 0.1 * g, loss

    context = jax.set_mesh(EXPLICIT) if typed_by == "set_mesh" else contextlib.nullcontext()
    w = W if typed_by == "set_mesh" else jax.device_put(W, NamedSharding(EXPLICIT, Ps()))
    runs = {}
    with context:
        for name, fn in (("jit", jax.jit(step)), ("shardc", shardc.auto_shard(step,
                                                                              mesh=EXPLICIT))):
            state, losses = w, []
            for _ in range(3):
                state, loss = fn(state, X)
                losses.append(float(loss))
            jax.effects_barrier()
            runs[name] = (np.asarray(state), losses, list(heard))
            heard.clear()
    assert runs["shardc"][1:] == runs["jit"][1:] and len(runs["jit"][2]) == 3
    np.testing.assert_allclose(runs["shardc"][0], runs["jit"][0], rtol=1e-6, atol=1e-7)


def test_primitives_that_need_devices_are_found_inside_branches():
    from jax.experimental import io_callback

    from shardc.lower.control import _NEEDS_DEVICES, holds_named, needs_devices

    def branchy(x):
        return jax.lax.cond(x.sum() > 0, lambda y: io_callback(
            lambda v: v, jax.ShapeDtypeStruct((3,), jnp.float32), y), lambda y: y, x)

    inside = jax.make_jaxpr(branchy)(jnp.ones(3)).jaxpr
    plain = jax.make_jaxpr(jnp.sin)(1.0).jaxpr
    assert needs_devices(inside) and holds_named(inside, _NEEDS_DEVICES)
    assert not needs_devices(plain) and not holds_named(plain, _NEEDS_DEVICES)
