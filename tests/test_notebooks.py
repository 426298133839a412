"""The notebooks run top to bottom (simulated CPU devices) from a clean copy, and are
committed executed (``notebooks/refresh.py``), with what a run prints."""

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("refresh", ROOT / "notebooks" / "refresh.py")
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)

# per notebook, strings its printed output must contain (a notebook not listed here runs
# with no check beyond running)
EXPECT = {
    "quickstart": ["arguments (6 leaves", "params.w1",
                   "max |parameter difference| after 3 steps", "predicted vs compiled collectives",
                   "INPUTS = ("],
    "cost_model": ["predicted vs compiled collectives", "MoE  step     predicted"],
    "bandwidth_sweep": ["node   3200 GB/s: predicted step", "state.params.layers[0].kernel",
                        "plans that split an argument across nodes"],
    "frontier": ["peak per device", "half the leanest peak: no plan fits", "chosen view:"],
    "bring_your_own": ["state.params.blocks[0].up", "max |state difference| exported vs shardc",
                       "input specs as planned: True"],
}


def test_there_are_notebooks():
    assert [p.stem for p in NOTEBOOKS] == sorted(EXPECT)


def _printed(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs if o.output_type == "stream")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_executed(path):
    """Every code cell ran, in order, without an error, and the outputs hold what a run
    prints (``notebooks/refresh.py`` refreshes them)."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name}: not executed top to bottom; run python notebooks/refresh.py {path.stem}"
    assert not any(o.output_type == "error" for c in code for o in c.outputs), path.name
    for want in EXPECT.get(path.stem, []):
        assert want in _printed(nb), (f"{path.name}: {want!r} not in its committed output; "
                                      f"run python notebooks/refresh.py {path.stem}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    try:
        nb = refresh.execute(path)
    except CellExecutionError as exc:  # its message holds the cell and the traceback
        pytest.fail(f"{path.name}: a cell failed:\n{exc}", pytrace=False)
    for want in EXPECT.get(path.stem, []):
        assert want in _printed(nb), f"{path.name}: {want!r} not in its output"
