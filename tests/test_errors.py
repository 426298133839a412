"""The declared error hierarchy (shardc/errors.py): every exception class shardc defines is
a ShardcError exported from shardc.errors and shardc, every ``raise`` in shardc/ raises one
or a builtin allowed below, and the messages that suggest a fix name it."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import shardc
import shardc.errors
from shardc.errors import MeshAxisError, OptionsError, ShardcError, ShardcWarning, closest

SOURCE = Path(shardc.__file__).resolve().parent

#: builtins shardc may raise, each for a reason that is not a user's mistake it could name;
#: a module list limits one to those modules
ALLOWED = {
    "AssertionError": (None, "a broken internal invariant: a bug in shardc, not the user's"),
    "ImportError": (None, "an optional dependency is missing; the message names the pip extra"),
    "argparse.ArgumentTypeError": (None, "how an argparse type function refuses a "
                                         "command-line value (argparse prints the usage)"),
    "OSError": ({"shardc.bench.fault_worker"}, "the disk-full fault the fault bench injects"),
}
#: exception classes that never reach the user, each with where it is caught
INTERNAL = {"shardc.step.calling.Miss": "the fast path's signal to take the full path, "
                                        "caught in shardc.step.auto_shard"}


def _modules() -> list[str]:
    """Every shardc module but the ``__main__`` scripts (importing one runs it)."""
    return ["shardc", *(m.name for m in pkgutil.walk_packages(shardc.__path__, "shardc.")
                        if not m.name.endswith("__main__"))]


def _defined_exceptions() -> dict[str, type]:
    """``module.Class`` -> every Exception subclass defined in a shardc module (warnings
    apart), each module imported."""
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and \
                    obj.__module__ == name and not issubclass(obj, Warning):
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_shardc_defines_is_a_shardc_error_and_exported():
    found = _defined_exceptions()
    assert len(found) >= 20, sorted(found)  # the walk reached the whole package
    for where, cls in found.items():
        if where in INTERNAL:
            assert cls.__name__ not in shardc.__all__, f"{where} is internal, yet exported"
            continue
        assert issubclass(cls, ShardcError), f"{where} is not a shardc.ShardcError"
        assert cls.__module__ == "shardc.errors", f"define {where} in shardc/errors.py"
        assert getattr(shardc.errors, cls.__name__) is cls
        assert getattr(shardc, cls.__name__) is cls, f"shardc does not export {cls.__name__}"
        assert cls.__name__ in shardc.__all__ and cls.__name__ in shardc.errors.__all__
        # each keeps a builtin base, so except ValueError / TypeError code still catches it
        assert cls is ShardcError or any(b.__module__ == "builtins" and b is not Exception
                                         for b in cls.__mro__[1:-2])


def test_every_warning_shardc_defines_is_a_shardc_warning_and_exported():
    warned = [obj for name in _modules() for obj in vars(importlib.import_module(name)).values()
              if inspect.isclass(obj) and issubclass(obj, Warning)
              and obj.__module__.startswith("shardc")]
    assert warned
    for cls in warned:
        assert issubclass(cls, ShardcWarning) and getattr(shardc, cls.__name__) is cls


def test_the_old_import_places_still_work():
    from shardc.plan.codec import PlanFormatError
    from shardc.rules.registry import LayoutError, NoRuleWarning
    from shardc.runtime.multihost import PlanMismatchError
    from shardc.solve.search import MemoryBudgetError
    from shardc.step.options import NeedsDevicesError

    for cls in (PlanFormatError, LayoutError, PlanMismatchError, MemoryBudgetError,
                NeedsDevicesError):
        assert issubclass(cls, ShardcError) and getattr(shardc, cls.__name__) is cls
    assert issubclass(NoRuleWarning, ShardcWarning)


def test_errors_imports_nothing_from_shardc():
    """Every layer raises these, so the module sits below them all."""
    tree = ast.parse((SOURCE / "errors.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m == "shardc" or m.startswith("shardc.")]


def _raises() -> list[tuple[str, int, str]]:
    """``(module, line, name)`` of every ``raise Name(...)`` / ``raise Name`` in shardc/
    whose name is a module-level one (a class): a local exception object re-raised is not
    counted."""
    out = []
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name | ast.Attribute):
                out.append((module, node.lineno, ast.unparse(target)))
    return out


def _resolve(module: str, name: str):
    """What ``name`` means in ``module`` (its globals, then builtins); None for a local."""
    head, *rest = name.split(".")
    scope = vars(importlib.import_module(module))
    obj = scope[head] if head in scope else getattr(builtins, head, None)
    for attr in rest:
        obj = getattr(obj, attr, None)
    return obj


def _verdict(module: str, name: str) -> bool | None:
    """Whether ``raise name(...)`` in ``module`` is allowed: a ShardcError, an internal
    signal, or a builtin ALLOWED there; None where ``name`` is no exception class of the
    module (a local exception object raised again)."""
    cls = _resolve(module, name)
    if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
        return None
    if issubclass(cls, ShardcError) or f"{cls.__module__}.{cls.__qualname__}" in INTERNAL:
        return True
    modules, _ = ALLOWED.get(name, (set(), ""))
    return modules is None or module in modules


def test_every_raise_is_a_shardc_error_or_an_allowed_builtin():
    used, bad, checked = set(), [], 0
    for module, line, name in _raises():
        verdict = _verdict(module, name)
        checked += verdict is not None
        if verdict is False:
            bad.append(f"{module}:{line} raises {name}")
        elif verdict and name in ALLOWED:
            used.add(name)
    assert checked >= 150, checked  # the walk read the package's raises
    assert not bad, ("raise a shardc.errors class (a ShardcError that keeps the builtin "
                     "base) for what the user can fix, or AssertionError for a shardc bug: "
                     + "; ".join(bad))
    assert used == set(ALLOWED), f"allowances no raise uses any more: {set(ALLOWED) - used}"


def test_the_raise_check_can_fail():
    """A bare ValueError, or a builtin allowed elsewhere only, is refused."""
    assert _verdict("shardc.step.options", "ValueError") is False
    assert _verdict("shardc.step.options", "OptionsError") is True
    assert _verdict("shardc.bench.faults", "OSError") is False  # allowed in fault_worker only
    assert _verdict("shardc.bench.fault_worker", "OSError") is True
    assert _verdict("shardc.cli.common", "argparse.ArgumentTypeError") is True
    assert _verdict("shardc.step.calling", "Miss") is True  # internal, caught in shardc
    assert _verdict("shardc.step.options", "exc") is None  # a local: not counted


def test_closest_names_the_likely_axis():
    assert closest("dta", ["data", "model"]) == " (did you mean 'data'?)"
    assert closest("modle", ("data", "model")) == " (did you mean 'model'?)"
    assert closest("zzz", ["data", "model"]) == ""


@pytest.fixture(scope="module")
def one_axis():
    return jax.make_mesh((len(jax.devices()),), ("data",))


def _step(mesh, cluster):
    return shardc.auto_shard(lambda x: jnp.tanh(x).sum(), mesh=mesh, cluster=cluster)


def test_a_mistyped_cluster_axis_names_the_closest(one_axis):
    with pytest.raises(MeshAxisError, match=r"'dta' \(did you mean 'data'\?\)"):
        _step(one_axis, shardc.Cluster(axis_bandwidth={"dta": 1e9}))
    with pytest.raises(ValueError, match=r"'dat' \(did you mean 'data'\?\)"):  # still one
        _step(one_axis, shardc.Cluster.nvlink_node(("dat",)))


def test_multi_node_on_a_one_axis_mesh_points_at_nvlink_node(one_axis):
    with pytest.raises(ShardcError, match=r"Cluster\.nvlink_node\(\('data',\)\)") as got:
        _step(one_axis, shardc.Cluster.multi_node())
    assert "did you mean" not in str(got.value)  # no axis is close: the preset is the fix


def test_multi_node_on_a_two_axis_mesh_names_its_axes():
    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("dp", "tp"))
    with pytest.raises(MeshAxisError,
                       match=r"Cluster\.multi_node\(node_axis='dp', gpu_axis='tp'\)"):
        _step(mesh, shardc.Cluster.multi_node())


def test_a_mistyped_spec_axis_names_the_closest(one_axis):
    with pytest.raises(MeshAxisError, match=r"'dtaa'.*did you mean 'data'"):
        shardc.auto_shard(lambda x: x * 2, mesh=one_axis, in_shardings=(jax.P("dtaa"),))


def test_bad_options_are_shardc_errors_that_stay_value_errors(one_axis):
    with pytest.raises(OptionsError, match="time_limit") as got:
        shardc.auto_shard(lambda x: x, mesh=one_axis, time_limit=-1)
    assert isinstance(got.value, ValueError)
    with pytest.raises(shardc.OptionsTypeError, match="needs a jax.sharding.Mesh") as got:
        shardc.auto_shard(lambda x: x, mesh="data")
    assert isinstance(got.value, TypeError)
