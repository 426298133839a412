"""The zoo's latency-bound (``small``) and gradient-accumulation (``accum``) cells."""

import jax
import numpy as np
import pytest
from helpers import assert_close

import shardc
from shardc.bench import harness
from shardc.bench.zoo import PRESETS, ZOO
from shardc.models import accum, mlp

NEW = ("small", "accum")


@pytest.fixture(autouse=True)
def _one_timing_run(monkeypatch):
    """A shardc cell compiles its saved plan and jax.jit's once each, not the bench's
    TIMING_RUNS times: the tests read the timings' presence, not their minimum."""
    monkeypatch.setattr(harness, "TIMING_RUNS", 1)


@pytest.mark.parametrize("name", NEW)
def test_tiny_step_under_auto_shard_equals_jit(name):
    zm = ZOO[name]
    mod = zm.load()
    step, (state, batch) = mod.make_train_step(zm.config("tiny"))
    want = jax.jit(step)(state, batch)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    got = shardc.auto_shard(step, mesh=mesh, time_limit=5.0)(state, batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
    assert_close(got, want, rtol=2e-5, atol=2e-6)


def _dots(step, state, batch) -> int:
    jaxpr = jax.make_jaxpr(step)(state, batch).jaxpr
    return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)


def test_accumulation_is_unrolled_into_k_gradient_computations():
    """An L-layer MLP's value-and-grad has 3L - 1 matmuls (L forward, L weight gradients,
    L - 1 input gradients); the accumulating step has K times as many, at top level."""
    cfg = accum.AccumConfig.tiny()
    step, (state, batch) = accum.make_train_step(cfg)
    k, per_grad = cfg.micro_batches, 3 * cfg.n_layers - 1
    assert k > 1
    one, _ = mlp.make_train_step(cfg)  # the same network, one gradient over the whole batch
    assert _dots(one, state, batch) == per_grad
    assert _dots(step, state, batch) == k * per_grad


def test_accumulation_averages_to_the_whole_batch_gradient():
    """Micro-batches partition the batch and are equal-sized, so the mean of their mean
    losses and gradients is the whole batch's: one accumulated step is one plain step."""
    cfg = accum.AccumConfig.tiny()
    step, (state, batch) = accum.make_train_step(cfg)
    plain, _ = mlp.make_train_step(cfg)
    # the micro-batches' sums reassociate the gradient: the parameters after Adam to the
    # tolerance its update allows
    assert_close(jax.jit(step)(state, batch), jax.jit(plain)(state, batch), rtol=1e-4,
                 atol=1e-6, lr=cfg.learning_rate)
    rows = np.concatenate([np.asarray(accum.micro_batch(batch, i, 4)["x"]) for i in range(4)])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, np.asarray(batch["x"])))


def test_accum_config_rejects_an_uneven_split():
    with pytest.raises(ValueError, match="micro_batches"):
        accum.AccumConfig(batch=10, micro_batches=4)


@pytest.mark.parametrize("name", NEW)
def test_cells_run_and_match(name):
    zm, preset = ZOO[name], PRESETS["node-8"]
    for method in ("shardc", "data-parallel"):
        cell = harness.run_cell(zm, preset, method, "tiny", check=True, time_limit=5.0)
        assert cell.error is None, cell.error
        assert cell.matched is True
        assert cell.compiled_s > 0 and set(cell.priced) == set(harness.PRICINGS)
