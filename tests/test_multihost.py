"""Multi-host: 2 processes x 4 CPU devices under jax.distributed (gloo collectives) run the
tiny GPT's step under auto_shard on one (2, 4) mesh of all 8 devices, with the same plan
and losses as one process with 8 devices; processes that plan differently stop with
PlanMismatchError instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import AxisType

import shardc
from models import gpt
from shardc.multihost import plan_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
STEPS = 3
TIMEOUT = 150  # seconds per job: a hung job fails the test instead of the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(*extra: list[str], processes: int = 2) -> list[tuple[int, dict | None, str]]:
    """Launch ``processes`` workers on a fresh port; (exit code, JSON report, stderr tail)
    per process. ``extra[i]`` are process i's extra arguments."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(processes), str(port),
                               str(STEPS), *(extra[i] if i < len(extra) else [])],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(processes)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            reports = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            out.append((p.returncode, reports[-1] if reports else None, stderr[-3000:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_two_processes_match_one():
    results = run_job()
    for code, report, err in results:
        assert code == 0 and report is not None, err
    r0, r1 = (report for _, report, _ in results)
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


def test_processes_with_different_plans_stop():
    results = run_job([], ["--skew"])
    for code, report, err in results:
        assert code == 3 and report is not None, (code, err)
        assert "made different plans" in report["error"]
        assert "process 0" in report["error"] and "process 1" in report["error"]
