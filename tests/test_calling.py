"""auto_shard's calling surface against ``jax.jit``'s: the fast path of a steady-state call
(JAX's own dispatch, falling back to the full path on a miss), the ambient mesh the
function is traced under, and errors in the user's words."""

from __future__ import annotations

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Ps

import shardc
from shardc.step.auto_shard import AutoSharded

AUTO = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("node", "gpu"))  # jax.make_mesh's default: Explicit axes
X = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
W = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)


def shard(fn, mesh=AUTO, **kw):
    return shardc.auto_shard(fn, mesh=mesh, time_limit=2.0, **kw)


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
    assert_close(a, b, rtol=1e-5, atol=1e-5)


def mlp(params, x):
    return jnp.tanh(x @ params["w"]) @ params["v"]


PARAMS = {"w": W, "v": W.T}


# ---- the fast path -------------------------------------------------------------------------

def _no_full_path(monkeypatch):
    def refuse(self, *args):
        raise AssertionError("the full path ran")
    monkeypatch.setattr(AutoSharded, "_call", refuse)


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_a_steady_state_call_does_not_take_the_full_path(monkeypatch, mesh):
    step = shard(mlp, mesh=mesh)
    out = step(PARAMS, X)
    (params, x), _ = step.input_shardings(PARAMS, X)
    placed = (jax.device_put(PARAMS, params), jax.device_put(X, x))
    step(*placed)
    _no_full_path(monkeypatch)
    close(step(*placed), jax.jit(mlp)(PARAMS, X))
    close(out, jax.jit(mlp)(PARAMS, X))


def test_calls_the_fast_path_was_not_made_for_fall_back_to_jax_jits_values(monkeypatch):
    step = shard(mlp)
    (params, x), _ = step.input_shardings(PARAMS, X)
    placed = jax.device_put(PARAMS, params)
    step(placed, jax.device_put(X, x))
    calls = []
    full = AutoSharded._call
    monkeypatch.setattr(AutoSharded, "_call",
                        lambda self, *a: calls.append(1) or full(self, *a))
    bigger = jnp.concatenate([X, X])  # another shape: planned anew
    close(step(placed, bigger), jax.jit(mlp)(PARAMS, bigger))
    assert len(calls) == 1
    elsewhere = jax.device_put(X, NamedSharding(AUTO, Ps(None, "gpu")))  # another placement
    close(step(placed, elsewhere), jax.jit(mlp)(PARAMS, X))
    assert len(calls) == 2
    close(step(placed, X.astype(jnp.bfloat16)), jax.jit(mlp)(PARAMS, X.astype(jnp.bfloat16)))
    assert len(calls) == 3
    more = {**PARAMS, "u": W}  # another pytree, as many arguments
    close(step(more, X), jax.jit(mlp)(more, X))
    assert len(calls) == 4
    close(step(placed, X + 1), jax.jit(mlp)(PARAMS, X + 1))  # the first's: planned already


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_a_training_loop_with_numpy_batches_takes_the_full_path_once_per_signature(
        monkeypatch, mesh):
    def train(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, jnp.mean(x)

    step = shard(train, mesh=mesh)
    calls = []
    full = AutoSharded._call
    monkeypatch.setattr(AutoSharded, "_call",
                        lambda self, *a: calls.append(1) or full(self, *a))
    w = wj = W * 0.1
    for i in range(5):
        x = np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32)
        (w, loss), (wj, lossj) = step(w, x), jax.jit(train)(wj, x)
        close((w, loss), (wj, lossj))
    # the first call only: on an Explicit mesh too, plain arguments' results are untyped
    # (as jax.jit's), so the state fed back is a placement, not a new signature
    assert len(calls) == 1


def test_the_fast_path_keeps_statics_kwargs_and_donation():
    def f(x, n, *, scale):
        return x * n * scale

    step = shard(f, static_argnums=1, donate_argnames="scale")
    for n in (2, 3, 2):
        s = jnp.full((16, 8), 0.5)
        close(step(X, n, scale=s), X * n * 0.5)


# ---- traced as jax.jit traces --------------------------------------------------------------

class Partitioned(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_partitioning(nn.initializers.ones, ("data", None)), (8, 8))
        return x @ w


def test_the_function_sees_the_ambient_mesh_jax_jit_gives_it():
    model = Partitioned()
    params = model.init(jax.random.key(0), X)

    def apply(p, x):
        return model.apply(p, x)

    close(shard(apply, mesh=EXPLICIT)(params, X), jax.jit(apply)(params, X))


def test_a_constraint_on_the_same_devices_under_other_axis_names_is_accepted():
    other = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    flat = jax.make_mesh((8,), ("all",), axis_types=(AxisType.Auto,))

    def f(x):
        y = jax.lax.with_sharding_constraint(x * 2, NamedSharding(other, Ps("b")))
        return jax.lax.with_sharding_constraint(y + 1, NamedSharding(flat, Ps("all")))

    step = shard(f)
    close(step(X), jax.jit(f)(X))
    outs = [str(o.outs[0]) for o in step.plan(X).ops if o.prim == "sharding_constraint"]
    assert outs == ["(B, S(0))", "(S(0), S(0))"]


# ---- errors in the user's words ------------------------------------------------------------

def branchy(x, flag):
    if flag.sum() > 0:
        return x
    return -x


def test_a_tracer_error_names_the_function_and_the_argument_path():
    with pytest.raises(jax.errors.TracerBoolConversionError) as want:
        jax.jit(branchy)(X, X)
    with pytest.raises(jax.errors.TracerBoolConversionError,
                       match=r"tracing the function branchy at .*test_calling\.py:\d+ for jit"
                             r"(.|\n)*argument flag") as got:
        shard(branchy)(X, X)
    assert "shardc/step/calling.py" not in str(got.value) and "leaves[" not in str(got.value)
    line = str(want.value).split("tracing the function ")[1].split(" for ")[0]
    assert line in str(got.value)


def test_a_string_argument_names_its_path_and_the_static_fix():
    def f(x, name):
        return x

    with pytest.raises(TypeError, match="path name"):
        jax.jit(f)(X, "run1")
    step = shard(f)
    with pytest.raises(TypeError, match=r"'run1'(.|\n)*at path name(.|\n)*static_argnames"):
        step(X, "run1")
    step(X, X)  # and where the fast path was made for an array there
    with pytest.raises(TypeError, match=r"'run1'(.|\n)*at path name(.|\n)*static_argnames"):
        step(X, "run1")


def test_an_unregistered_dataclass_argument_is_named_not_printed():
    @dataclasses.dataclass
    class Batch:
        a: jax.Array
        b: jax.Array

    batch = Batch(jnp.ones((100, 100)), jnp.ones((100, 100)))
    with pytest.raises(TypeError, match="path batch"):
        jax.jit(lambda batch: batch.a)(batch)
    with pytest.raises(TypeError, match=r"Batch(.|\n)*at path batch") as got:
        shard(lambda batch: batch.a)(batch)
    assert len(str(got.value)) < 800


def test_an_axis_named_twice_in_in_shardings_is_jax_jits_error():
    with pytest.raises(Exception, match="duplicate entries for `gpu`") as want:
        jax.jit(lambda x, y: x + y, in_shardings=(Ps("gpu", "gpu"), None))
    with pytest.raises(type(want.value), match="duplicate entries for `gpu`"):
        shard(lambda x, y: x + y, in_shardings=(Ps("gpu", "gpu"), None))


def test_static_argnums_past_the_arguments_is_refused_as_jax_jit_refuses_it():
    with pytest.raises(ValueError, match=r"static_argnums=\(5,\), but only accepts 2"):
        jax.jit(lambda x, y: x + y, static_argnums=5)
    with pytest.raises(ValueError, match=r"static_argnums=\(5,\), but only accepts 2"):
        shard(lambda x, y: x + y, static_argnums=5)
    shard(lambda *xs: xs[0], static_argnums=5)  # any position is fine with *args, as for jit


def test_use_plan_for_other_shapes_names_the_argument_and_both_shapes():
    plan = shard(mlp).plan(PARAMS, X)
    with pytest.raises(ValueError, match=r"argument x is f32\[32,8\] here, f32\[16,8\] in the "
                                         r"plan"):
        shard(mlp).use_plan(plan, PARAMS, jnp.concatenate([X, X]))


def igamma_twice(x):
    y = jax.lax.igamma(x * x + 1.0, x * x + 2.0)  # the line the warning names
    return jax.lax.igamma(y + 1.0, y + 2.0)


def test_the_no_rule_warning_points_at_the_users_line_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard(igamma_twice).plan(X)
    found = [w for w in caught if "no sharding rule" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__
    line = next(i for i, text in enumerate(open(__file__), 1) if "the line the warning" in text)
    assert found[0].lineno == line
    with warnings.catch_warnings(record=True) as caught:  # the default filters
        for _ in range(3):  # three step objects
            shard(igamma_twice).plan(X)
    assert sum("no sharding rule" in str(w.message) for w in caught) == 1


def test_grad_and_an_outer_jit_through_a_step_on_its_fast_path():
    step = shard(mlp)
    step(PARAMS, X)

    def loss(params, x, f):
        return f(params, x).sum()

    close(jax.grad(loss)(PARAMS, X, step), jax.grad(loss)(PARAMS, X, mlp))
    close(jax.jit(lambda p, x: step(p, x) * 2)(PARAMS, X), jax.jit(mlp)(PARAMS, X) * 2)
    close(step(PARAMS, X), jax.jit(mlp)(PARAMS, X))


def test_the_calls_bench_table_marks_each_row_against_the_target():
    from shardc.bench.calls import CallCase, markdown

    text = markdown([CallCase(20, 100.0, 150.0), CallCase(1000, 1000.0, 1200.0)],
                    "shardc bench --calls")
    rows = [line for line in text.splitlines() if line.startswith("| 20") or
            line.startswith("| 1000")]
    assert rows == ["| 20 | 100 us | 150 us | 1.50x | 160 us | yes |",
                    "| 1000 | 1000 us | 1200 us | 1.20x | 1150 us | no |"]


#: a donated argument passed again, in a process of its own: on several CPU devices JAX's
#: dispatch of a deleted buffer ends the process (SIGSEGV), so a crash fails the test
#: instead of the suite; ``which`` picks shardc's step or single-device jax.jit's
_DONATED_AGAIN = """
import sys, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
import shardc
mesh = jax.make_mesh((8,), ("data",))
f = lambda state, x: {"w": state["w"] * 2.0 + x, "b": state["b"] + 1.0}
if sys.argv[1] == "jit":
    step, put = jax.jit(f, donate_argnums=0), jax.device_put
else:
    step = shardc.auto_shard(f, mesh=mesh, donate_argnums=0, time_limit=2.0)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("data")))
state = {"w": put(jnp.ones((64, 32))), "b": put(jnp.ones((64,)))}
x = put(jnp.ones((64, 32)))
state2 = step(state, x)
again = [step(state2, x)]  # the result is fine to pass (and donate) again
try:
    step(state, x)
except Exception as exc:
    print("RAISED", type(exc).__name__, isinstance(exc, ValueError), exc)
"""


def _donated_again(which: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DONATED_AGAIN, which], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{which}: exit {done.returncode}\n{done.stderr[-2000:]}"
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert raised, f"{which}: calling again with the donated state raised nothing"
    return raised[0]


def test_a_donated_argument_passed_again_raises_jax_jits_error():
    want = _donated_again("jit")  # single-device jax.jit's refusal
    got = _donated_again("shardc")
    assert "Buffer has been deleted or donated" in want
    assert got.startswith("RAISED DonatedArgumentError True Buffer has been deleted or donated")
    assert "args[0]['b']" in got and "donate_argnums" in got  # the leaf and the fix
