"""Resuming after a fault: a 2-process job that checkpoints every step is SIGKILLed in the
middle of a step, relaunched, SIGKILLed in the middle of a save, and relaunched on one
host with half the devices (re-planned for them); it resumes each time from the last
complete checkpoint, and its losses and final parameters are the uninterrupted run's (each
step has its own batch, so a step lost or taken twice would show)."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest
from helpers import assert_close, launch

from shardc.models import mlp

STEPS = 6
WORKER = "resume_worker.py"


def _reference():
    """Losses and final state of the same steps unsharded, never interrupted."""
    import resume_worker

    cfg = mlp.MLPConfig.tiny()
    step_fn, (state, _) = mlp.make_train_step(cfg)
    step = jax.jit(step_fn)
    losses = []
    for i in range(1, STEPS + 1):
        state, loss = step(state, resume_worker.batch_for(cfg, i))
        losses.append(float(loss))
    return losses, state


def _complete(ckpt) -> list[int]:
    return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())


def _steps(ended) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in ended.events if "step" in e}


@pytest.mark.slow
def test_killed_job_resumes_from_the_last_complete_checkpoint(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "final")

    def job(processes: int, *kill: str):
        return launch(WORKER, [[str(i), str(processes), "{port}", "4", ckpt, str(STEPS), out,
                                *kill] for i in range(processes)])

    # Saves are asynchronous and one may be in flight when the job dies (Orbax starts a
    # save once the previous one is committed): after a kill during step k the newest
    # complete checkpoint is k-1 or k-2, and the relaunched job resumes from it.
    logged: dict[int, float] = {}  # each step's loss from the last run that took it
    first = job(2, "--kill-at", "3:step")  # killed once step 3 is dispatched
    assert [r.code for r in first] == [-signal.SIGKILL] * 2, first[0].stderr
    assert [r.events[0]["resumed_from"] for r in first] == [0, 0]
    assert sorted(_steps(first[0])) == [1, 2]
    done = _complete(ckpt)
    assert done in ([1], [1, 2]), done
    logged |= _steps(first[0])

    # relaunched: resumes after the newest complete checkpoint; killed while checkpoint 5
    # is being written
    second = job(2, "--kill-at", "5:save")
    assert [r.code for r in second] == [-signal.SIGKILL] * 2, second[0].stderr
    assert [r.events[0]["resumed_from"] for r in second] == [done[-1]] * 2
    assert sorted(_steps(second[0])) == list(range(done[-1] + 1, 6))
    logged |= _steps(second[0])
    # the interrupted save left only Orbax's temporary directory, never a step 5
    done = _complete(ckpt)
    assert done in ([3], [3, 4]), done  # max_to_keep=2
    assert any(d.startswith("5.") and "tmp" in d for d in os.listdir(ckpt)), os.listdir(ckpt)

    # back on one host with 4 devices: planned for them, resumes after the newest one
    (third,) = job(1)
    assert third.code == 0, third.stderr
    assert third.events[0] == {"process": 0, "resumed_from": done[-1], "devices": 4}
    assert sorted(_steps(third)) == list(range(done[-1] + 1, STEPS + 1))
    assert third.last["done"] == STEPS
    logged |= _steps(third)

    ref_losses, ref_state = _reference()
    assert sorted(logged) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[i] for i in range(1, STEPS + 1)], ref_losses, rtol=1e-5)
    final = np.load(out + ".npz")
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(ref_state["params"])]
    assert sorted(final.files) == sorted(paths)
    # the parameters after STEPS Adam steps, to the tolerance their own updates allow
    # (shardc.bench.numerics reads the reference's second moments): the state as the
    # reference's with the job's final parameters
    got = {**ref_state, "params": jax.tree.unflatten(jax.tree.structure(ref_state["params"]),
                                                     [final[p] for p in paths])}
    assert_close(got, ref_state, rtol=1e-5, atol=1e-6,
                 lr=STEPS * mlp.MLPConfig.tiny().learning_rate, what="final parameters")
