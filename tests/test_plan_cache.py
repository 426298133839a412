"""Deterministic plans and the on-disk plan cache: the same program, mesh and cluster give
the same plan whatever the machine's load, and a second process with the same cache_dir
loads it instead of solving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import shardc
from shardc.solve import search
from shardc.step.cache import CACHE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType

    def make():
        rng = np.random.default_rng(0)
        params = [{"w": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32),
                   "b": jnp.zeros((256,), jnp.float32)} for _ in range(3)]
        opt = optax.adam(1e-3)

        def loss(params, x):
            for p in params:
                x = jnp.tanh(x @ p["w"] + p["b"])
            return jnp.mean(x ** 2)

        def step(state, x):
            value, g = jax.value_and_grad(loss)(state["params"], x)
            u, o = opt.update(g, state["opt"], state["params"])
            return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

        state = {"params": params, "opt": opt.init(params)}
        x = jnp.asarray(rng.normal(size=(512, 256)), jnp.float32)
        mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
        return step, (state, x), mesh
""")


def _make():
    scope: dict = {}
    exec(PROGRAM, scope)  # noqa: S102 - the same source the subprocess runs
    return scope["make"]()


def _strategies(plan) -> list:
    return [plan.fingerprint, [nd.to_json() for nd in plan.inputs],
            [(o.id, [nd.to_json() for nd in o.ins], [nd.to_json() for nd in o.outs])
             for o in plan.ops]]


def test_plans_are_identical_under_load():
    """One plan made on an idle machine, one while two busy processes take both cores: the
    solver's stages run to their ends (the time limit is only a guard), so nothing in the
    plan depends on the load."""
    step, args, mesh = _make()
    quiet = shardc.auto_shard(step, mesh=mesh).plan(*args)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = shardc.auto_shard(step, mesh=mesh).plan(*args)
    finally:
        for h in hogs:
            h.kill()
    assert quiet.solver["status"] in ("optimal", "refined")  # the ILP ran, to its end
    assert loaded.solver["status"] == quiet.solver["status"]
    assert _strategies(loaded) == _strategies(quiet)
    assert loaded.predicted == quiet.predicted


def _second_process(cache: str, env_var: bool) -> dict:
    """Plan the same program in a fresh process whose solver raises if called."""
    kwargs = "" if env_var else f", cache_dir={cache!r}"
    code = PROGRAM + textwrap.dedent(f"""
        import json, shardc
        from shardc.solve import search

        def refuse(*a, **k):
            raise AssertionError("the solver ran")

        search.solve = refuse
        step, args, mesh = make()
        s = shardc.auto_shard(step, mesh=mesh, time_limit=1.0{kwargs})
        plan = s.plan(*args)
        out = s(*args)
        print(json.dumps({{"plan": plan.to_json(), "loss": float(out[1])}}))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}  # the suite's XLA flags: 8 devices, fast compiles
    env.pop(CACHE_ENV, None)
    if env_var:
        env[CACHE_ENV] = cache
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_cached_plan(tmp_path):
    step, args, mesh = _make()
    cache = str(tmp_path / "plans")
    s = shardc.auto_shard(step, mesh=mesh, time_limit=1.0, cache_dir=cache)
    plan = s.plan(*args)
    assert len(os.listdir(cache)) == 1 and "cached" not in plan.solver
    for env_var in (False, True):
        got = _second_process(cache, env_var)
        other = shardc.Plan.from_json(got["plan"])
        assert _strategies(other) == _strategies(plan)
        assert other.solver["cached"].startswith(cache)
        np.testing.assert_allclose(got["loss"], float(jax.jit(step)(*args)[1]), rtol=1e-5)


def test_a_damaged_or_foreign_cache_file_is_planned_again(tmp_path, monkeypatch, caplog):
    step, args, mesh = _make()
    cache = tmp_path / "plans"
    shardc.auto_shard(step, mesh=mesh, time_limit=1.0, cache_dir=str(cache)).plan(*args)
    (path,) = cache.iterdir()
    calls = []
    real = search.solve
    monkeypatch.setattr(search, "solve", lambda *a, **k: calls.append(1) or real(*a, **k))
    path.write_text(path.read_text()[:100])  # truncated
    with caplog.at_level("WARNING", logger="shardc"):
        plan = shardc.auto_shard(step, mesh=mesh, time_limit=1.0,
                                 cache_dir=str(cache)).plan(*args)
    assert calls and "damaged cached plan" in caplog.text
    assert shardc.Plan.from_json(path.read_text()).fingerprint == plan.fingerprint
    # another program's plan under this key (a hand-copied file): refused, planned again
    foreign = shardc.auto_shard(lambda x: jnp.sin(x) * 2.0, mesh=mesh, time_limit=1.0)
    path.write_text(foreign.plan(args[1]).to_json())
    calls.clear()
    with caplog.at_level("WARNING", logger="shardc"):
        shardc.auto_shard(step, mesh=mesh, time_limit=1.0, cache_dir=str(cache)).plan(*args)
    assert calls and "made for another program" in caplog.text


def test_the_key_covers_the_options_and_the_mesh(tmp_path):
    step, args, mesh = _make()
    cache = tmp_path / "plans"
    # pipeline=False (never) against the default (the planner's choice): a plan made under
    # one was loaded under the other, and a pipeline asked for was stamped on a plan made
    # without it
    for kwargs in ({}, {"memory_budget": 1 << 30}, {"time_limit": 0.5},
                   {"cluster": shardc.Cluster.multi_node("node", "gpu")}, {"pipeline": False}):
        shardc.auto_shard(step, mesh=mesh, cache_dir=str(cache),
                          **{"time_limit": 1.0, **kwargs}).plan(*args)
    flat = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    shardc.auto_shard(step, mesh=flat, time_limit=1.0, cache_dir=str(cache)).plan(*args)
    assert len(list(cache.iterdir())) == 6


def test_the_key_covers_the_meshs_platform(tmp_path):
    """The backend shapes a plan (its collective combiners, its memory model): a mesh of
    GPUs with the same axes as a mesh of CPUs keys apart; an abstract mesh keys as neither."""
    import types

    from shardc.solve.fixed import NOTHING_FIXED
    from shardc.step.cache import PlanCache
    from shardc.step.options import Options

    store, opts = PlanCache(tmp_path), Options()
    cpu = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    gpu = types.SimpleNamespace(
        axis_sizes=cpu.axis_sizes, axis_names=cpu.axis_names,
        devices=np.array([types.SimpleNamespace(platform="gpu")] * 8).reshape(2, 4))
    keys = {store.key("program", [], mesh, opts, {}, [], NOTHING_FIXED)
            for mesh in (cpu, gpu, cpu.abstract_mesh)}
    assert len(keys) == 3


def test_every_option_but_where_the_cache_is_changes_the_key(tmp_path):
    """The key holds the whole options record: each field changed alone keys apart (the
    cluster, seeds and layouts asked for are keyed as the solver gets them; the cache's
    directory is not keyed)."""
    import dataclasses

    from shardc.pipeline import Pipeline
    from shardc.solve.fixed import NOTHING_FIXED
    from shardc.step.cache import PlanCache
    from shardc.step.options import Options

    changed = {"cluster": shardc.Cluster.multi_node("node", "gpu"), "memory_budget": 1e9,
               "time_limit": 1.0, "mesh_search": True, "keep_input_shardings": False,
               "while_trips": 3, "pipeline": Pipeline("node", 2, 2), "rank_compiled": 2,
               "offload": False, "context_parallel": False}
    apart = {"seeds", "in_shardings", "cache_dir"}
    assert set(changed) | apart == {f.name for f in dataclasses.fields(Options)}
    store = PlanCache(tmp_path)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)

    def key(opts):
        return store.key("program", [], mesh, opts, {}, [], NOTHING_FIXED)

    base = key(Options())
    assert key(Options(cache_dir=str(tmp_path))) == base
    for name, value in changed.items():
        assert key(Options(**{name: value})) != base, name


def test_python_scalar_arguments_are_cached_too(tmp_path):
    """A weak-typed Python scalar among the arguments (a learning rate) keys like jax.jit."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    x = jnp.ones((64, 32), jnp.float32)
    cache = tmp_path / "plans"
    for _ in range(2):
        s = shardc.auto_shard(lambda x, lr: jnp.tanh(x) * lr, mesh=mesh, time_limit=0.5,
                              cache_dir=str(cache))
        np.testing.assert_allclose(np.asarray(s(x, 0.5)), np.tanh(np.ones((64, 32))) * 0.5,
                                   rtol=1e-6)
    assert len(list(cache.iterdir())) == 1
