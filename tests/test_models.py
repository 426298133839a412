"""Smoke tests for the model zoo: tiny configs train, keep their state shape,
``abstract_args`` describes ``example_args`` exactly, every parameter has logical axis
names, and the activation annotations are inert outside ``axis_rules``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params
from jax.sharding import Mesh

from shardc.bench.zoo import ZOO
from shardc.models import gpt, mlp, moe, vit, wrn
from shardc.models.logical import axis_rules

N_STEPS = 3

CASES: dict[str, tuple[Any, Any]] = {
    "mlp": (mlp, mlp.MLPConfig.tiny()),
    "gpt": (gpt, gpt.GPTConfig.tiny()),
    "moe": (moe, moe.MoEConfig.tiny()),
    "wrn": (wrn, wrn.WRNConfig.tiny()),
    "vit": (vit, vit.ViTConfig.tiny()),
}

REALISTIC: dict[str, Any] = {
    "gpt": gpt.GPTConfig.gpt2_small(),
    "moe": moe.MoEConfig.realistic(),
    "wrn": wrn.WRNConfig.realistic(),
    "vit": vit.ViTConfig.realistic(),
}

RULES = {  # every logical name on some mesh axis, to exercise all constrain calls
    "batch": "data", "heads": "model", "mlp": "model", "vocab": "model", "expert": "model",
    "conv_out": "model", "classes": "model", "patch": "model", "embed": "model",
}

VOCABULARY = {"batch", "seq", "embed", "mlp", "heads", "vocab", "expert", "conv_in",
              "conv_out", "classes", "patch", None}


@functools.cache
def _example(name: str) -> tuple[Any, tuple[Any, Any]]:
    """``make_train_step`` of the tiny config, built once per test session."""
    module, config = CASES[name]
    return module.make_train_step(config)


def _signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    """Tree structure plus (shape, dtype) of every leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]


@pytest.mark.parametrize("name", list(CASES))
def test_train_step_runs_and_learns(name: str) -> None:
    train_step, (state, batch) = _example(name)
    step: Callable[..., Any] = jax.jit(train_step)
    losses = []
    for _ in range(N_STEPS):
        new_state, loss = step(state, batch)
        assert loss.shape == () and loss.dtype == jnp.float32
        assert _signature(new_state) == _signature(state)
        state = new_state
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", list(CASES))
def test_abstract_args_match_example_args(name: str) -> None:
    module, config = CASES[name]
    _, example = _example(name)
    abstract = module.abstract_args(config)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert _signature(abstract) == _signature(example)


@pytest.mark.parametrize("name", list(CASES))
def test_example_args_are_deterministic(name: str) -> None:
    module, config = CASES[name]
    _, first = _example(name)
    _, second = module.make_train_step(config)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_gpt2_small_abstract_args_allocate_nothing() -> None:
    state, batch = gpt.abstract_args(gpt.GPTConfig.gpt2_small())
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    assert 124_000_000 < n_params < 125_000_000
    assert batch["tokens"].shape == (8, 1024) and batch["tokens"].dtype == jnp.int32


@pytest.mark.parametrize(
    ("name", "lo", "hi"),
    [("moe", 360e6, 370e6), ("wrn", 36.4e6, 36.6e6), ("vit", 86.5e6, 86.6e6)],
)
def test_realistic_presets_have_their_size(name: str, lo: float, hi: float) -> None:
    state, _ = CASES[name][0].abstract_args(REALISTIC[name])
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    assert lo < n_params < hi, n_params


def _str_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


@pytest.mark.parametrize("name", list(CASES))
def test_param_axes_name_every_dim(name: str) -> None:
    module, config = CASES[name]
    configs = [config] + ([REALISTIC[name]] if name in REALISTIC else [])
    for cfg in configs:
        state, _ = module.abstract_args(cfg)

        def check(path: tuple[Any, ...], leaf: Any) -> None:
            keys = _str_keys(path)[1:]  # drop "params" / "opt": slots shadow their param
            if not leaf.shape:
                return
            names = module.param_axes(keys, tuple(leaf.shape))
            assert isinstance(names, tuple) and len(names) == len(leaf.shape), (keys, names)
            assert set(names) <= VOCABULARY, (keys, names)

        jax.tree_util.tree_map_with_path(check, state)
    with pytest.raises(KeyError):
        module.param_axes(("no", "such", "param"), (8,))


@pytest.mark.parametrize("name", list(CASES))
def test_one_config_class_per_module(name: str) -> None:
    """``shardc.bench.zoo`` finds a model's config as the one ``*Config`` class."""
    module, config = CASES[name]
    found = [v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)]
    assert found == [type(config)]


def _primitives(jaxpr: Jaxpr) -> Iterator[str]:
    """Primitive names of every equation, sub-jaxprs (jit, custom_vjp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jaxprs_in_params(eqn.params):
            yield from _primitives(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)


def _traced(name: str) -> list[str]:
    module, config = CASES[name]
    closed = jax.make_jaxpr(module.build_step(config))(*module.abstract_args(config))
    return list(_primitives(closed.jaxpr))


@pytest.mark.parametrize("name", list(CASES))
def test_logical_constraints_only_inside_axis_rules(name: str) -> None:
    assert "sharding_constraint" not in _traced(name)
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    with axis_rules(mesh, RULES):
        inside = _traced(name)
    assert inside.count("sharding_constraint") >= 2


def test_moe_primitives_are_simple() -> None:
    prims, dense = _traced("moe"), _traced("gpt")
    assert {"argmax", "cumsum", "dot_general"} <= set(prims)
    assert not set(prims) & {"top_k", "sort", "scatter"}, prims
    for name in ("gather", "scatter-add"):  # the token embedding's only, as in GPT
        assert prims.count(name) == dense.count(name)


def test_top2_gating_respects_capacity_and_matches_top_k() -> None:
    logits = 3.0 * np.random.default_rng(0).standard_normal((4, 32, 8), np.float32)
    gating = jax.jit(moe.top2_gating, static_argnums=1)
    combine, dispatch, aux = map(np.asarray, gating(logits, 6))
    assert combine.shape == dispatch.shape == (4, 32, 8, 6)
    assert dispatch.sum(axis=1).max() == 1.0  # at most one token per expert slot
    assert dispatch.sum(axis=(1, 3)).max() == 6  # at most `capacity` tokens per expert
    assert combine.sum(axis=(2, 3)).max() <= 1.0 + 1e-6
    assert (dispatch.sum(axis=(2, 3)) <= 2).all()
    assert math.isfinite(float(aux)) and float(aux) > 0
    combine = np.asarray(gating(logits, 64)[0])  # no token dropped: the plain top-2 mixture
    gates = np.exp(logits - logits.max(-1, keepdims=True))
    gates /= gates.sum(-1, keepdims=True)
    idx = np.argsort(-gates, axis=-1)[..., :2]
    top = np.take_along_axis(gates, idx, axis=-1)
    want = np.zeros_like(gates)
    np.put_along_axis(want, idx, top / top.sum(-1, keepdims=True), axis=-1)
    np.testing.assert_allclose(combine.sum(-1), want, atol=1e-6)


@pytest.mark.parametrize("name", list(ZOO))
def test_every_primitive_of_the_zoo_has_a_rule(name):
    """The zoo and the bench plan with no 'no sharding rule' warning: every primitive of
    each model's train step, tiny and bench sized, has a rule."""
    from shardc.ir.trace import trace
    from shardc.rules.registry import has_rule

    zm = ZOO[name]
    mod = zm.load()
    for which in ("tiny", "bench"):
        cfg = zm.config(which)
        graph = trace(mod.build_step(cfg), *mod.abstract_args(cfg)).graph
        assert sorted({op.name for op in graph.ops if not has_rule(op.name)}) == []
