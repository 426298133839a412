"""The fault campaign, short: a 2-process training job (shardc.bench.fault_worker) killed
mid-step, mid-restore and mid-save, its newest checkpoint truncated, one host lost and given
back, its disk full during a save; it finishes every time, applies every step once with its
own batch, loses at most one checkpoint interval per fault, and its losses are the
uninterrupted run's. And docs/faults.md's training loop, run as written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from shardc.bench import faults
from shardc.bench.fault_worker import NO_SPACE, batch_for
from shardc.models import mlp

STEPS, EVERY = 35, 5
#: one fault of each kind; the truncated checkpoint 25 is the last one the job saves on one
#: host, so the job that finds it damaged is the one the host returns to
SCHEDULE = [faults.Fault("kill-step", 7, 0), faults.Fault("kill-restore", 0, 1),
            faults.Fault("kill-save", 10, 1), faults.Fault("host-lost", 17, 1),
            faults.Fault("truncated", 25), faults.Fault("enospc", 30)]


def _reference() -> dict[int, float]:
    """The same steps unsharded, never interrupted."""
    cfg = mlp.MLPConfig.tiny()
    step = jax.jit(mlp.build_step(cfg))
    state, out = mlp.init_state(cfg), {}
    for i in range(1, STEPS + 1):
        state, loss = step(state, batch_for(cfg, i))
        out[i] = float(loss)
    return out


@pytest.mark.slow
def test_a_job_survives_one_fault_of_each_kind(tmp_path):
    result = faults.campaign(tmp_path, [faults.Fault(f.kind, f.at, f.victim)
                                        for f in SCHEDULE], STEPS, EVERY, return_after=1,
                             reference=False, say=lambda line: None)
    fired = result["faults"]
    assert [f.kind for f in fired] == [f.kind for f in SCHEDULE] and not result["unfired"]
    assert all(f.resumed_from >= 0 for f in fired)  # resumed after every fault
    assert [f.lost for f in fired] == [2, 0, 5, 2, 5, 5], [(f.kind, f.lost) for f in fired]
    runs = [(x["processes"], x["codes"]) for x in result["launches"]]
    assert [p for p, _ in runs] == [2, 2, 2, 2, 1, 2, 2], runs  # lost at 17, back at 25
    assert all(c == 0 for c in runs[-1][1]) and any(c == NO_SPACE for c in runs[-2][1])
    assert result["launches"][1]["mid_restore"]  # killed before either process restored
    host = result["launches"][4]["events"]
    assert any(e["event"] == "planned" and e["devices"] == 4 for e in host)
    # recovery is timed by phase, and a mesh seen before is planned from the cache
    for f in fired:
        assert {"start", "plan", "restore", "compile", "total"} <= set(f.recovery), f
    sources = [f.recovery["plan_source"] for f in fired]
    assert sources.count("solved") == 1 and fired[3].recovery["plan_source"] == "solved"

    seen = faults.checks(result, _reference())  # raises on a step missing or repeated
    # steps 16..20 were last run on the one host (its run from checkpoint 15 saved 20 and
    # a damaged 25), 21..35 on two again
    assert seen["first_replanned_step"] == 16 and seen["after_replan"] == 20
    np.testing.assert_allclose([v[0] for v in seen["losses"].values()],
                               [v[1] for v in seen["losses"].values()], rtol=1e-5)


def _example() -> dict:
    """docs/faults.md's training loop, run as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "faults.md").read_text()
    namespace: dict = {}
    exec(compile(text.split("```python\n")[1].split("```")[0], "docs/faults.md", "exec"),
         namespace)
    return namespace


def test_the_docs_loop_resumes_past_a_damaged_checkpoint(tmp_path, caplog):
    train = _example()["train"]
    plans = tmp_path / "plans"
    first = train(tmp_path / "a", plans, 12, every=5)  # checkpoints 5, 10, 12
    seal = json.loads((tmp_path / "a" / "12" / "shardc-seal.json").read_text())
    (tmp_path / "a" / "12" / max(seal, key=seal.get)).write_bytes(b"")  # truncated
    with caplog.at_level(logging.WARNING, logger="shardc"):
        second = train(tmp_path / "a", plans, 20, every=5)
    assert any("checkpoint 12 in" in r.getMessage() and "restoring checkpoint 10" in
               r.getMessage() for r in caplog.records), caplog.text
    whole = train(tmp_path / "b", plans, 20, every=5)
    assert sorted(first) == list(range(1, 13)) and sorted(second) == list(range(11, 21))
    assert {**first, **second} == whole  # bit-equal: the same plan on the same devices


def test_events_are_read_past_gloos_lines_and_a_line_cut_by_a_kill():
    text = ('[Gloo] Rank 0 is connected\n{"event": "ready", "t": 1}[Gloo] Rank \n'
            '[Gloo] x {"event": "step", "step": 3}\n{"event": "step", "st')
    assert faults._events(text) == [{"event": "ready", "t": 1}, {"event": "step", "step": 3}]
