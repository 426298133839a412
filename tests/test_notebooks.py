"""The notebooks run top to bottom (simulated CPU devices) and are committed without
outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    # the kernel starts in the repository root, so it imports this checkout's shardc
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        failed = next((i for i in code if any(o.output_type == "error"
                                              for o in nb.cells[i].outputs)), None)
        where = "?" if failed is None else \
            f"{failed} (code cell {code.index(failed) + 1} of {len(code)})"
        first = "" if failed is None else nb.cells[failed].source.splitlines()[0]
        pytest.fail(f"{path.name}: cell {where} failed, starting {first!r}:\n{exc}",
                    pytrace=False)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs if o.output_type == "stream")
    for want in EXPECT.get(path.stem, []):
        assert want in text, f"{path.name}: {want!r} not in its output"
