"""The user's names for a program's flat argument and result leaves.

A leaf is named by its path in the call: the parameter's name, then the pytree keys, with
string dict keys and attributes as ``.key`` (``state.params.blocks[3].attn.q.kernel``;
optax's Adam slots read ``state.opt[0].mu.params...``), sequence indices and other keys in
brackets. Results are named ``out`` (one array) or ``out[1]``, ``out[0].params.w`` (a
pytree). The flat order is ``jax.tree.leaves``'s: positional arguments, then keyword ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax

from shardc.report.keys import key_path
from shardc.step.calling import Call

__all__ = ["input_names", "output_names"]


def _parameter_names(fn: Callable, call: Call) -> list[str]:
    """The name of each dynamic positional argument: its parameter's name in ``fn``'s
    signature, else ``args[i]`` (a ``*args`` tail, a function without a signature)."""
    static = {i for i, _ in call.statics[0]}  # positions, already non-negative
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f"args[{i}]"
            for i in range(call.n_args) if i not in static]


def input_names(fn: Callable, call: Call) -> list[str]:
    """The user's name of each dynamic leaf of ``call`` (see the module docstring)."""
    positional = _parameter_names(fn, call)
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(call.unflatten(call.leaves))[0]:
        where, rest = path[0].idx, path[1:]
        if where == 0:  # positional: rest[0] is the argument's index
            out.append(key_path(positional[rest[0].idx], rest[1:]))
        else:  # keyword: rest[0] is its name
            out.append(key_path(str(rest[0].key), rest[1:]))
    return out


def output_names(out_tree) -> list[str]:
    """The name of each result leaf of a function whose results have treedef ``out_tree``."""
    tree = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
    return [key_path("out", path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
