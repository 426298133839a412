"""Multi-host: 2 processes x 4 CPU devices under jax.distributed (gloo collectives) run the
tiny GPT's step under auto_shard on one (2, 4) mesh of all 8 devices, with the same plan
and losses as one process with 8 devices; processes that plan differently run process 0's
plan, and processes planning different programs stop with PlanMismatchError instead of
hanging."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import launch
from jax.sharding import AxisType

import shardc
from shardc.models import gpt
from shardc.runtime.multihost import plan_digest

STEPS = 3


def run_job(*extra: list[str]) -> list:
    """The two workers, ``extra[i]`` process i's extra arguments."""
    return launch("multihost_worker.py",
                  [[str(i), "2", "{port}", str(STEPS), *(extra[i] if i < len(extra) else [])]
                   for i in range(2)])


@pytest.mark.slow
def test_two_processes_match_one():
    results = run_job()
    for r in results:
        assert r.code == 0 and r.last is not None, r.stderr
    r0, r1 = (r.last for r in results)
    # one plan in both processes, and it is the plan one process makes for 8 devices
    assert r0["digest"] == r1["digest"] and r0["fingerprint"] == r1["fingerprint"]
    step_fn, (state, batch) = gpt.make_train_step(gpt.GPTConfig.tiny())
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=shardc.Cluster(device_flops=1e10))
    plan = step.plan(state, batch)
    assert r0["digest"] == plan_digest(plan) and r0["fingerprint"] == plan.fingerprint
    # the plan splits the batch across the processes: each fed only its own rows
    assert "node" in r0["batch_specs"]["tokens"]
    assert r0["local_shapes"]["tokens"][0] == batch["tokens"].shape[0] // 2
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(r0["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(r1["losses"], losses, rtol=1e-5)


@pytest.mark.slow
def test_processes_with_different_plans_run_process_0s():
    """Process 1 prices another cluster, so it plans differently: both run process 0's plan
    (one warning on each), and their losses agree."""
    r0, r1 = run_job([], ["--skew"])
    for r in (r0, r1):
        assert r.code == 0 and r.last is not None, (r.code, r.stderr)
        assert "every process runs process 0's" in r.stderr
    assert r0.last["digest"] == r1.last["digest"]
    np.testing.assert_allclose(r0.last["losses"], r1.last["losses"], rtol=1e-6)


@pytest.mark.slow
def test_processes_planning_different_programs_stop():
    for r in run_job([], ["--other"]):
        assert r.code == 3 and r.last is not None, (r.code, r.stderr)
        assert "planned different programs" in r.last["error"]
        assert "process 0" in r.last["error"] and "process 1" in r.last["error"]
