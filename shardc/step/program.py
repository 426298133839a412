"""A user's program named on the command line: ``path/to/file.py:make`` or
``pkg.module:make``, where ``make()`` returns ``(fn, args)``: the function to plan and a
tuple of its positional arguments (arrays or ``jax.ShapeDtypeStruct``s, in pytrees).

A file is imported as ``python path/to/file.py`` would run it (its folder first on
``sys.path``, so its own imports resolve); a module as ``python -m`` would find it (the
working directory first). What is wrong with the name (no such file or module, no such
attribute, ``make`` returning something else) raises :class:`ProgramError` with one line
naming the fix; an exception raised by the user's own code propagates as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardc.errors import ProgramError as ProgramError

__all__ = ["Program", "ProgramError", "load_program"]


@dataclass(frozen=True)
class Program:
    """A loaded program: ``fn(*args)`` is what gets planned."""

    spec: str  # as named: "file.py:make"
    fn: Callable
    args: tuple


def _split(spec: str) -> tuple[str, str]:
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise ProgramError(f"{spec!r} does not name a program; write path/to/file.py:make or "
                           "pkg.module:make, where make() returns (fn, args)")
    return where, attr


def _import_file(path: str):
    if not os.path.isfile(path):
        raise ProgramError(f"{path}: no such file")
    name = "_shardc_program_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProgramError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_module(name: str):
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # the module named (or its package) is missing; a missing import inside it is the
        # program's own error and propagates
        if exc.name is not None and name.startswith(exc.name):
            raise ProgramError(f"no module named {name!r} (from the working directory "
                               f"{os.getcwd()}); for a file, write path/to/file.py:make"
                               ) from exc
        raise


def load_program(spec: str) -> Program:
    """Import what ``spec`` names and call its ``make()``."""
    where, attr = _split(spec)
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    module = _import_file(where) if is_file else _import_module(where)
    make = getattr(module, attr, None)
    if make is None:
        raise ProgramError(f"{where} has no {attr!r}; define {attr}() returning (fn, args)")
    if not callable(make):
        raise ProgramError(f"{where}:{attr} is a {type(make).__name__}, not a function; "
                           f"define {attr}() returning (fn, args)")
    made = make()
    if not (isinstance(made, tuple | list) and len(made) == 2):
        raise ProgramError(f"{spec}: {attr}() returned {_what(made)}; return (fn, args), "
                           "args a tuple of the positional arguments")
    fn, args = made
    if not callable(fn):
        raise ProgramError(f"{spec}: {attr}() returned {_what(fn)} as fn; return (fn, args) "
                           "with fn the function to plan")
    if not isinstance(args, tuple | list):
        raise ProgramError(f"{spec}: {attr}() returned {_what(args)} as args; return a tuple "
                           "of fn's positional arguments (arrays or jax.ShapeDtypeStructs), "
                           "e.g. (fn, (params, batch))")
    import jax

    bad = [jax.tree_util.keystr(path) for path, x in
           jax.tree_util.tree_flatten_with_path(tuple(args))[0]
           if not (hasattr(x, "shape") and hasattr(x, "dtype")
                   or isinstance(x, bool | int | float | complex))]
    if bad:
        raise ProgramError(f"{spec}: args{bad[0]} is not an array (and {len(bad) - 1} more); "
                           "give arrays or jax.ShapeDtypeStructs (bind other values into fn "
                           "with functools.partial)")
    return Program(spec, fn, tuple(args))


def _what(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"
