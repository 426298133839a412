"""``shardc bench --calls``'s first-call part (shardc/bench/first_call.py), on a small step:
each side runs in a fresh process, the jit side with the shardings the shardc side's plan
chose, and each reports its time and memory."""

import json

import pytest

from shardc.bench import first_call


@pytest.mark.slow
def test_each_side_runs_its_first_call_in_a_process_of_its_own(tmp_path):
    specs = str(tmp_path / "specs.json")
    mine = first_call.run_one("shardc", 20, specs)
    saved = json.loads((tmp_path / "specs.json").read_text())
    assert len(saved["in"]) == 20 + 1 and len(saved["out"]) == 20 + 1  # params, x; loss
    jit = first_call.run_one("jit", 20, specs)
    for side in (mine, jit):
        assert side.seconds > 0 and side.peak_rss >= side.rss_after > 0
    assert 0 < mine.plan_seconds < mine.seconds and jit.plan_seconds == 0
    for side in (mine, jit):  # JAX's own phases, heard from its duration events
        assert set(side.phases) == {"trace", "lower", "compile"}
        assert 0 < side.phases["trace"] and 0 < side.phases["compile"] < side.seconds
    rows = first_call.markdown([mine, jit], 20, 1)
    assert f"{mine.seconds / jit.seconds:.2f}x" in "\n".join(rows)
