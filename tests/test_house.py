"""The house's rules for functions and records: no function over 80 lines in shardc/, and the
option records built by keyword. Static checks of the source tree."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def _long_functions(folder: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` of every function or method in ``folder`` longer than
    ``limit`` lines, decorators left out."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    where = path.relative_to(folder.parent)
                    out.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_80_lines():
    long = _long_functions(ROOT / "shardc", MAX_FUNCTION_LINES)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                      f"steps): {long}")


def test_a_long_function_is_found(tmp_path):
    """The check above can fail: a function of 81 lines is named."""
    body = "\n".join(f"    x{k} = {k}" for k in range(80))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert _long_functions(tmp_path / "pkg", MAX_FUNCTION_LINES) == \
        ["pkg/m.py:5 long (81 lines)"]


@pytest.mark.parametrize("record", ["shardc.step.options.Options",
                                    "shardc.pipeline.choose.ChoiceOptions",
                                    "shardc.pipeline.choose.Choice",
                                    "shardc.pipeline.cost.PipelinePrice",
                                    "shardc.plan.record.Plan"])
def test_option_records_are_keyword_only(record):
    module, _, name = record.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    assert not positional, f"{record} fields that may be passed by position: {positional}"


def test_one_default_time_limit():
    from shardc.pipeline.choose import ChoiceOptions
    from shardc.solve.ilp import DEFAULT_TIME_LIMIT
    from shardc.solve.search import SolveOptions
    from shardc.step.options import Options

    assert Options().time_limit == ChoiceOptions().time_limit == \
        SolveOptions().time_limit == DEFAULT_TIME_LIMIT
