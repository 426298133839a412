"""Execute every notebook in this folder top to bottom and save it with its outputs.

    python notebooks/refresh.py            # all of them
    python notebooks/refresh.py frontier   # one, by name

The notebooks are committed executed, so a reader on a code host sees their tables and
plots; ``tests/test_notebooks.py`` runs each again from a clean copy and fails on an error,
and checks that the committed one holds the outputs a run prints. Run this after a change
that moves what they show, and commit the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 300
"""Per cell; the slowest cell (the frontier's sweep) takes about a minute on 2 cores."""


def execute(path: Path) -> nbformat.NotebookNode:
    """``path`` run top to bottom in a fresh kernel started in the repository root (so it
    imports this checkout's shardc); raises ``nbclient.exceptions.CellExecutionError``."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE.parent)}}).execute()
    return nb


def main(names: list[str]) -> None:
    paths = sorted(HERE.glob("*.ipynb"))
    if names:
        known = {p.stem: p for p in paths}
        unknown = [n for n in names if n not in known]
        if unknown:
            sys.exit(f"refresh: no notebook {unknown[0]!r}; choose from {sorted(known)}")
        paths = [known[n] for n in names]
    for path in paths:
        print(f"executing {path.name} ...", flush=True)
        nbformat.write(execute(path), path)


if __name__ == "__main__":
    main(sys.argv[1:])
