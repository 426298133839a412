"""Checkpoints that reshard: a state trained on one mesh, saved with Orbax, restores
straight into another mesh's plan and training goes on with the same losses."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from helpers import SLOW_DEVICES, SLOW_NODES, assert_close
from jax.sharding import AxisType

import shardc
from shardc.models import mlp
from shardc.runtime.checkpoint import Checkpoints

CFG = mlp.MLPConfig.tiny()


def _mesh(shape, names, devices):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices)


def _run(step, state, batch, n):
    losses = []
    for _ in range(n):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def test_restore_reshards_onto_four_devices(tmp_path, caplog):
    step_fn, (state0, batch) = mlp.make_train_step(CFG)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state0))
    ref_state, ref_losses = _run(jax.jit(step_fn), state0, batch, 6)

    # the memory budgets make both plans split the state (the tiny MLP is cheapest
    # replicated otherwise): 0.6 of it per device on 8 devices, 0.9 of it on 4
    mesh8 = _mesh((2, 4), ("node", "gpu"), jax.devices())
    step8 = shardc.auto_shard(step_fn, mesh=mesh8, memory_budget=state_bytes * 0.6,
                              cluster=SLOW_NODES)
    state, losses = _run(step8, state0, batch, 3)
    plan8 = step8.plan(state, batch)
    with Checkpoints(tmp_path, max_to_keep=2) as ckpt:
        ckpt.save(3, state, plan8)  # returns before the files are written
    saved = jax.tree.map(np.asarray, state)

    mesh4 = _mesh((4,), ("data",), jax.devices()[:4])
    step4 = shardc.auto_shard(step_fn, mesh=mesh4, memory_budget=state_bytes * 0.9,
                              cluster=SLOW_DEVICES)
    abstract = jax.eval_shape(lambda: state0)
    (state_sh, _), _ = step4.input_shardings(abstract, batch)
    ckpt = Checkpoints(tmp_path)
    assert ckpt.latest_step() == 3 and ckpt.plan() == plan8
    restored = ckpt.restore(abstract, state_sh)
    ckpt.close()

    split = 0
    assert jax.tree.structure(restored) == jax.tree.structure(state0)
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state_sh), strict=True):
        assert x.sharding == want, (x.sharding, want)
        assert set(x.sharding.device_set) == set(mesh4.devices.flat)
        shard_shapes = {s.data.shape for s in x.addressable_shards}
        assert shard_shapes == {want.shard_shape(x.shape)}
        split += want.shard_shape(x.shape) != x.shape
    # most of the state is split over the 4 devices: no device holds it all
    assert split >= len(jax.tree.leaves(restored)) // 2
    restored_bytes = max(sum(s.data.nbytes for x in jax.tree.leaves(restored)
                             for s in x.addressable_shards if s.device == d)
                         for d in mesh4.devices.flat)
    assert restored_bytes <= state_bytes * 3 / 4
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)

    with caplog.at_level(logging.WARNING, logger="shardc"):
        state, more = _run(step4, restored, batch, 3)
    assert not [r for r in caplog.records if "moved there" in r.getMessage()
                and "args[0]" in r.getMessage()]  # the state runs where it was restored
    np.testing.assert_allclose(losses + more, ref_losses, rtol=1e-5)
    assert_close(state, ref_state, rtol=1e-4, atol=1e-6, lr=6 * CFG.learning_rate)


def test_restore_refuses_unplaced_targets(tmp_path):
    step_fn, (state, batch) = mlp.make_train_step(CFG)
    step = shardc.auto_shard(step_fn, mesh=_mesh((8,), ("x",), jax.devices()))
    with Checkpoints(tmp_path) as ckpt:
        ckpt.save(1, state, step.plan(state, batch))
        ckpt.wait()
        with pytest.raises(ValueError, match="already exists"):
            ckpt.save(1, state, step.plan(state, batch))
        with pytest.raises(ValueError, match="needs a sharding for every array"):
            ckpt.restore(jax.eval_shape(lambda: state))
        with pytest.raises(FileNotFoundError, match="no checkpoint 7"):
            ckpt.restore(state, step=7)


@pytest.mark.parametrize("damage", ["truncated", "deleted", "unsealed"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    step_fn, (state, batch) = mlp.make_train_step(CFG)
    step = shardc.auto_shard(step_fn, mesh=_mesh((8,), ("x",), jax.devices()))
    plan = step.plan(state, batch)
    (state_sh, _), _ = step.input_shardings(state, batch)
    with Checkpoints(tmp_path) as ckpt:
        ckpt.save(1, state, plan, meta={"next_batch": 2})
        state2, _ = step(state, batch)
        ckpt.save(2, state2, plan, meta={"next_batch": 3})
    newest = tmp_path / "2"
    files = [p for p in newest.rglob("*") if p.is_file() and p.name != "shardc-seal.json"]
    victim = max(files, key=lambda p: p.stat().st_size)
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "deleted":
        victim.unlink()
    else:
        (newest / "shardc-seal.json").unlink()
    ckpt = Checkpoints(tmp_path)
    assert ckpt.damage(1) is None and ckpt.damage(2) is not None
    with caplog.at_level(logging.WARNING, logger="shardc"):
        found = ckpt.restore_newest(jax.eval_shape(lambda: state), state_sh)
    ckpt.close()
    (warning,) = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert "checkpoint 2 in" in warning and "restoring checkpoint 1" in warning, warning
    assert {"truncated": "truncated", "deleted": "missing", "unsealed": "never sealed"}[
        damage] in warning, warning
    assert found.step == 1 and found.meta == {"next_batch": 2}
    for a, b in zip(jax.tree.leaves(found.state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not newest.exists()  # dropped, so that training saves step 2 again
    assert Checkpoints(tmp_path).all_steps() == [1]


def test_no_complete_checkpoint_is_a_clear_error(tmp_path):
    step_fn, (state, batch) = mlp.make_train_step(CFG)
    step = shardc.auto_shard(step_fn, mesh=_mesh((8,), ("x",), jax.devices()))
    with Checkpoints(tmp_path) as ckpt:
        assert ckpt.restore_newest(state) is None
        ckpt.save(1, state, step.plan(state, batch))
    (tmp_path / "1" / "shardc-seal.json").write_text("{")
    with pytest.raises(RuntimeError, match="no complete checkpoint.*seal is unreadable"):
        Checkpoints(tmp_path).restore_newest(state)
