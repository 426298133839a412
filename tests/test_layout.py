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


def _import_sites(modules: dict[str, Path]) -> dict[str, set[tuple[str, bool]]]:
    """Module -> the shardc modules it imports anywhere in its text, each with whether the
    import sits inside a function (a lazy import) or at module level (the top, or under
    ``TYPE_CHECKING``)."""
    edges: dict[str, set[tuple[str, bool]]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        inside = {id(n) for f in ast.walk(tree)
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        found = set()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                names = [c for c in [base] + [f"{base}.{a.name}" for a in node.names]
                         if c in modules]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name in modules]
            # importing a package's module imports the package (its __init__) too; a
            # package's own __init__ importing its modules is no circle through them
            found.update((m, id(node) in inside) for m in names
                         if m != name and not name.startswith(m + "."))
        edges[name] = found
    return edges


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the shardc modules it imports anywhere in its text: at the top, under
    ``TYPE_CHECKING`` and inside functions (a circle through a lazy import is still one)."""
    return {name: {m for m, _ in sites} for name, sites in _import_sites(modules).items()}


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


#: Every shardc package (the zoo, ``models``, included) and top-level module, with the shardc
#: packages it may import (docs/architecture.md, "The layers"). An entry is a package
#: (``cost``: any of its modules) or one module (``pipeline.schedule``: that module only).
#: Each package is listed below the ones that may import it as a whole; every package may
#: also import BASE. ``__init__`` is ``shardc/__init__.py``, the public API.
MAY_IMPORT: dict[str, set[str]] = {
    "version": set(),
    "ir": set(),
    "rules": {"ir"},
    "cost": {"ir"},
    "solve": {"ir", "rules", "cost"},  # never a report or the calling surface
    "inspect": {"ir", "cost"},  # the compiled program read back
    # the Plan record names its pipeline (pipeline.schedule's Pipeline record)
    "plan": {"ir", "rules", "cost", "solve", "pipeline.schedule"},
    # lowering reads a finished plan and the IR (never the solver); a layer stack's
    # lowering is pipeline.lowering's
    "lower": {"ir", "rules", "cost", "pipeline.lowering"},
    # pipelines plan their stages with the solver and price them on the devices' views
    "pipeline": {"ir", "rules", "cost", "solve", "plan", "tradeoff.views"},
    "report": {"ir", "rules", "cost", "lower"},  # reports read plans, never `step`
    "tradeoff": {"ir", "rules", "cost", "solve", "plan", "report"},
    "runtime": {"ir", "cost", "plan"},
    "step": {"version", "ir", "rules", "cost", "solve", "inspect", "plan", "lower",
             "pipeline", "report", "tradeoff", "runtime"},
    "models": {"pipeline"},  # the zoo: user code, on the public pipeline helpers
    "bench": {"ir", "rules", "cost", "solve", "inspect", "plan", "lower", "pipeline",
              "report", "tradeoff", "runtime", "step", "models"},
    "cli": {"version", "ir", "rules", "cost", "solve", "inspect", "plan", "lower",
            "pipeline", "report", "tradeoff", "runtime", "step", "models", "bench"},
    "__init__": {"version", "ir", "rules", "cost", "solve", "inspect", "plan", "lower",
                 "pipeline", "report", "tradeoff", "runtime", "step"},
}
#: leaf modules every package may import; they import nothing of shardc but each other
BASE = {"util", "errors"}
#: imports allowed only inside a function, upward: the Plan's convenience methods
#: (``plan.explain()``, ``plan.plot()``, ``plan.verify()``) call the reports and the
#: verification that read plans
INSIDE_FUNCTIONS_ONLY: dict[str, set[str]] = {
    "plan": {"report.explain", "report.plot", "inspect.verify"},
}


def _unit(module: str) -> str:
    """The MAY_IMPORT key a module belongs to: ``shardc.plan.record`` -> ``plan``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _covered(module: str, entries: set[str]) -> bool:
    name = module.split(".", 1)[1] if "." in module else ""
    return any(name == e or name.startswith(e + ".") for e in entries)


def _against_the_allow_list(sites: dict[str, set[tuple[str, bool]]]) -> list[str]:
    """Every import of another unit that MAY_IMPORT (and BASE, INSIDE_FUNCTIONS_ONLY for
    imports inside functions) does not allow."""
    out = []
    for module, found in sorted(sites.items()):
        unit = _unit(module)
        allowed = MAY_IMPORT.get(unit, set()) | BASE
        if unit in BASE:
            allowed = set(BASE)
        for target, lazy in sorted(found):
            if _unit(target) == unit or _covered(target, allowed):
                continue
            if lazy and _covered(target, INSIDE_FUNCTIONS_ONLY.get(unit, set())):
                continue
            where = "inside a function" if lazy else "at module level"
            out.append(f"{module} imports {target} {where}")
    return out


def test_every_package_has_an_allow_list():
    units = {_unit(m) for m in _modules()}
    listed = set(MAY_IMPORT) | BASE
    assert units - listed == set(), (f"packages without an entry in MAY_IMPORT (say which "
                                     f"shardc packages they may import): {units - listed}")
    stale = set(MAY_IMPORT) - units
    assert not stale, f"MAY_IMPORT lists packages that are gone: {stale}"
    named = {e.split(".")[0] for entries in [*MAY_IMPORT.values(),
                                             *INSIDE_FUNCTIONS_ONLY.values()] for e in entries}
    assert named <= units | BASE, f"allow-lists naming no package: {named - units - BASE}"


def test_whole_package_allowances_are_layers():
    """A package allowed whole is below the one allowed it: those edges have no circle
    (single modules allowed, like ``pipeline.schedule``, are the named exceptions)."""
    edges = {u: {e for e in entries if "." not in e} for u, entries in MAY_IMPORT.items()}
    assert _circles(edges) == []


def test_imports_follow_the_allow_list():
    against = _against_the_allow_list(_import_sites(_modules()))
    assert not against, ("imports against tests/test_layout.py's MAY_IMPORT (move the "
                         "shared piece down, docs/architecture.md):\n" + "\n".join(against))


def test_the_allow_list_check_can_fail():
    """An upward import is caught, at module level where only a lazy one is allowed, and
    a leaf module may not import a layer."""
    assert _against_the_allow_list({"shardc.ir.graph": {("shardc.solve.search", False)}})
    assert _against_the_allow_list({"shardc.plan.overlap": {("shardc.inspect.schedule",
                                                              False)}})
    assert _against_the_allow_list({"shardc.plan.record": {("shardc.inspect.verify",
                                                             False)}})
    assert not _against_the_allow_list({"shardc.plan.record": {("shardc.inspect.verify",
                                                                 True)}})
    assert _against_the_allow_list({"shardc.util.tables": {("shardc.ir.sbp", False)}})
    assert not _against_the_allow_list({"shardc.solve.ilp": {("shardc.util.tables", False),
                                                              ("shardc.solve.fold", False)}})
    assert _against_the_allow_list({"shardc.lower.emit": {("shardc.pipeline.choose",
                                                            False)}})


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
