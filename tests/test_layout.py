"""The house's layout (docs/architecture.md): the top level, module sizes, the direction of
imports, and the packages pyproject.toml installs. Static checks of the source tree."""

from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the design card's top level, plus the docs and CI folders and git's own file
TOP_LEVEL = {"pyproject.toml", "shardc", "tests", "models", "notebooks", "README.md", "docs",
             ".ci", ".gitignore"}
MAX_LINES = 500


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the layout is checked on the repository")
    return [f for f in out.splitlines() if (ROOT / f).exists()]


def _modules() -> dict[str, Path]:
    """``shardc.x.y`` -> its file, for shardc/ and the zoo in models/ (``shardc.models``)."""
    out = {}
    for folder, package in ((ROOT / "shardc", "shardc"), (ROOT / "models", "shardc.models")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the shardc modules it imports anywhere in its text: at the top, under
    ``TYPE_CHECKING`` and inside functions (a circle through a lazy import is still one)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                found.update(c for c in [base] + [f"{base}.{a.name}" for a in node.names]
                             if c in modules)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
        found.discard(name)
        # importing a package's module imports the package (its __init__) too; a package's
        # own __init__ importing its modules is no circle through them
        edges[name] = {m for m in found if not (m != name and name.startswith(m + "."))}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_top_level_is_the_design_cards():
    top = {f.split("/")[0] for f in _tracked()}
    assert top <= TOP_LEVEL, f"unexpected at the top level: {sorted(top - TOP_LEVEL)}"
    assert {"pyproject.toml", "shardc", "tests", "models", "notebooks", "README.md"} <= top


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_import_circle():
    circles = _circles(_imports(_modules()))
    assert not circles, ("import circles (move the shared piece down, docs/architecture.md): "
                         f"{circles}")


def test_a_circle_is_found_where_there_is_one():
    """The check above can fail: a lazy import back is a circle."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("lower, upper", [
    ("shardc.lower", "shardc.solve"),  # lowering reads a finished plan and the IR
    ("shardc.report", "shardc.step"),  # reports read plans, never the calling surface
    ("shardc.ir", "shardc.rules"), ("shardc.ir", "shardc.cost"), ("shardc.ir", "shardc.solve"),
    ("shardc.cost", "shardc.solve"), ("shardc.solve", "shardc.report"),
    ("shardc.solve", "shardc.step"), ("shardc.plan", "shardc.step"),
])
def test_imports_follow_the_flow(lower, upper):
    against = sorted((m, u) for m, deps in _imports(_modules()).items()
                     if m == lower or m.startswith(lower + ".")
                     for u in deps if u == upper or u.startswith(upper + "."))
    assert not against, f"{lower} must not import {upper}: {against}"


def test_pyproject_installs_every_package_and_only_shardc():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert listed == packages, (f"pyproject.toml [tool.setuptools] packages: missing "
                                f"{sorted(packages - listed)}, stale {sorted(listed - packages)}")
    assert all(p == "shardc" or p.startswith("shardc.") for p in listed)
    assert config["package-dir"] == {"shardc.models": "models"}


def test_nothing_refers_outside_the_repository():
    hits = [f for f in _tracked()
            if f.endswith((".md", ".py", ".toml", ".ipynb")) and f != "tests/test_layout.py"
            and "shared/" in (ROOT / f).read_text()]
    assert not hits, f"files naming a path outside the repository (shared/): {hits}"
    # nor a working folder of the machine a result was made on
    made = [f for f in _tracked() if f.endswith(".md") and "/work/" in (ROOT / f).read_text()]
    assert not made, f"documents naming a path outside the repository (/work/): {made}"
