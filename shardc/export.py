"""A plan as a standalone Python module that runs it with plain ``jax.jit``: no shardc at
run time.

The module pins what ``jax.jit`` can pin from outside a function: a ``NamedSharding`` per
flat argument leaf (``in_shardings``) and per flat result leaf (``out_shardings``), from
:meth:`Plan.input_specs` / :meth:`Plan.output_specs` on the plan's mesh. The layouts the
plan gives the values in between (shardc's lowering constrains every one of them) are left
to XLA's sharding propagation, which starts from the same pinned ends: on the programs
tried it compiles to the plan's collectives or to the plan's plus small extras (a train
step's scalar loss reduced as a partial sum: one 4-byte all-reduce). ``shardc explain
plan.json --compile`` prints what shardc's own program compiles to, to compare.
"""

from __future__ import annotations

import inspect
import re

from shardc.explain import spec_text
from shardc.names import _key as names_key
from shardc.views import mesh_label

__all__ = ["python_module", "rules_module"]

_TYPE = re.compile(r"^(\w+)\[([\d,]*)\]$")


def _shape(type_str: str) -> tuple[int, ...] | None:
    m = _TYPE.match(type_str)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(2).split(",") if d)


def _leaves(names, types, specs) -> str:
    rows = []
    for k, spec in enumerate(specs):
        shape = _shape(types[k]) if types else None
        rows.append(f"    ({names[k]!r}, {shape!r}, {spec_text(spec)}),")
    return "\n".join(rows)


def python_module(plan, source: str = "") -> str:
    """The text of a Python module that runs ``plan`` with ``jax.jit`` (see the module
    docstring of the result for its API). ``source`` names where the plan came from."""
    n_in, n_out = len(plan.inputs), len(plan.outputs)
    names_in = [plan.input_name(k) for k in range(n_in)]
    names_out = [plan.output_name(j) for j in range(n_out)]
    origin = f" from {source}" if source else ""
    return f'''"""Sharding plan{origin}, exported by shardc: run it with plain jax.jit.

Mesh {mesh_label(plan.mesh_axes)}; program fingerprint {plan.fingerprint}; predicted step
{plan.predicted.step_time * 1e3:.4f} ms on the plan's cluster. Nothing here imports shardc.

Arguments are the program's positional arguments, flattened as ``jax.tree.leaves(args)``
(dict keys sorted, as JAX flattens them): leaf k gets ``INPUTS[k]``'s PartitionSpec.
Results are flattened likewise (``OUTPUTS``). Use::

    import this_module as plan
    step = plan.jit(train_step)          # jax.jit(train_step) with the plan's shardings
    new_state, loss = step(state, batch)

or build the shardings yourself: ``in_shardings(mesh)`` / ``out_shardings(mesh)`` are flat
lists, ``jitted(fn, *args)`` is the ``jax.jit`` object for arguments shaped like ``args``.
Only the arguments' and results' layouts are pinned; XLA's sharding propagation places
the values in between, which can differ from the plan (compare with ``shardc explain
plan.json --compile``).
"""

import functools
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = {tuple(plan.mesh_axes)!r}

#: (name, shape, PartitionSpec) per leaf of the positional arguments, in jax.tree.leaves order
INPUTS = (
{_leaves(names_in, plan.input_types, plan.input_specs())}
)

#: (name, shape, PartitionSpec) per leaf of the results, in jax.tree.leaves order
OUTPUTS = (
{_leaves(names_out, plan.output_types, plan.output_specs())}
)


def make_mesh(devices=None) -> Mesh:
    """The plan's mesh (Auto axes) over ``devices``, row-major; default: the first
    devices of ``jax.devices()``."""
    shape = tuple(size for _, size in MESH_AXES)
    names = tuple(name for name, _ in MESH_AXES)
    n = math.prod(shape)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"the plan's mesh {{dict(MESH_AXES)}} needs {{n}} devices, "
                         f"{{len(devices)}} given")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(shape))


def in_shardings(mesh: Mesh) -> list:
    """A NamedSharding per argument leaf, in ``jax.tree.leaves(args)`` order."""
    return [NamedSharding(mesh, spec) for _, _, spec in INPUTS]


def out_shardings(mesh: Mesh) -> list:
    """A NamedSharding per result leaf, in ``jax.tree.leaves(results)`` order."""
    return [NamedSharding(mesh, spec) for _, _, spec in OUTPUTS]


def _check(leaves, table, what: str) -> None:
    if len(leaves) != len(table):
        raise TypeError(f"the plan has {{len(table)}} {{what}} leaves, these have "
                        f"{{len(leaves)}}: not the program the plan was made for")
    for x, (name, shape, _) in zip(leaves, table):
        have = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if shape is not None and have != shape:
            raise TypeError(f"{{what}} {{name}} has shape {{have}}, the plan's {{shape}}: "
                            "not the program the plan was made for")


def jitted(fn, *args, mesh: Mesh | None = None, **jit_kwargs):
    """``jax.jit(fn, in_shardings=..., out_shardings=...)`` for positional arguments
    shaped like ``args`` (arrays or ShapeDtypeStructs): the flat shardings unflattened
    into the pytrees of ``args`` and of ``fn``'s results."""
    mesh = make_mesh() if mesh is None else mesh
    leaves, tree = jax.tree.flatten(args)
    _check(leaves, INPUTS, "argument")
    out_leaves, out_tree = jax.tree.flatten(jax.eval_shape(fn, *args))
    _check(out_leaves, OUTPUTS, "result")
    return jax.jit(fn, in_shardings=jax.tree.unflatten(tree, in_shardings(mesh)),
                   out_shardings=jax.tree.unflatten(out_tree, out_shardings(mesh)),
                   **jit_kwargs)


def jit(fn, mesh: Mesh | None = None, **jit_kwargs):
    """``fn`` under ``jax.jit`` with the plan's shardings, called like ``fn`` (positional
    arguments); arguments are placed on the plan's layouts first. ``.lower(*args)`` and
    ``.jitted(*args)`` give the lowered program and the ``jax.jit`` object."""
    mesh = make_mesh() if mesh is None else mesh
    cache = {{}}

    def get(args):
        tree = jax.tree.structure(args)
        if tree not in cache:
            cache[tree] = jitted(fn, *args, mesh=mesh, **jit_kwargs)
        return cache[tree]

    @functools.wraps(fn)
    def call(*args):
        placed = jax.device_put(args, jax.tree.unflatten(jax.tree.structure(args),
                                                         in_shardings(mesh)))
        return get(args)(*placed)

    call.lower = lambda *args: get(args).lower(*args)
    call.jitted = lambda *args: get(args)
    return call
'''


_INDEX = re.compile(r"\[(\d+)\]")


def _pattern(name: str) -> str:
    """A regular expression matching ``name`` with every integer index any integer."""
    return r"\[\d+\]".join(re.escape(part) for part in _INDEX.split(name)[::2])


def path_rules(names, specs) -> tuple[list[tuple[str, str, int]], list[str]]:
    """``(regex, spec text, leaves)`` rules, first match wins, and what could not be folded:
    leaves whose names differ only in integer indices share one rule when they share one
    spec; where they do not (a layer planned apart from its neighbours), each such leaf
    gets an exact rule, placed first, and is named in the notes."""
    groups: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        groups.setdefault(_pattern(name), []).append(k)
    exact, folded, notes = [], [], []
    for pattern, members in groups.items():
        texts = [spec_text(specs[k]) for k in members]
        if len(set(texts)) == 1:
            folded.append((pattern, texts[0], len(members)))
            continue
        notes.append(f"{names[members[0]]} and {len(members) - 1} more like it have "
                     f"{len(set(texts))} layouts: one rule per leaf")
        exact += [(re.escape(names[k]), spec_text(specs[k]), 1) for k in members]
    return exact + folded, notes


def rules_module(plan, source: str = "") -> str:
    """The text of a Python module of partition rules for the plan's arguments: a regular
    expression over each leaf's path (as :mod:`shardc.names` writes it) mapped to its
    PartitionSpec, layer indices folded; results laid out otherwise than an argument, and
    anything the rules cannot say, are listed in its docstring."""
    if not plan.input_names:
        raise ValueError("the plan has no names for its arguments (saved before names were "
                         "recorded): plan the program again to export rules")
    names = [plan.input_name(k) for k in range(len(plan.inputs))]
    rules, notes = path_rules(names, plan.input_specs())
    by_name = dict(zip(names, map(spec_text, plan.input_specs())))
    unnamed = [plan.output_name(j) for j, spec in enumerate(plan.output_specs())
               if spec_text(spec) not in set(by_name.values()) and spec_text(spec) != "P()"]
    if unnamed:
        notes.append("results whose layout no argument has (pin them with out_shardings): "
                     + ", ".join(unnamed))
    origin = f" from {source}" if source else ""
    lines = "\n".join(f"    (r\"^{pattern}$\", {spec}),  # {n} lea{'ves' if n > 1 else 'f'}"
                      for pattern, spec, n in rules)
    noted = "\n".join(f"- {n}" for n in notes) or "- nothing: every argument leaf has a rule"
    key_source = inspect.getsource(names_key)  # the exported paths are shardc's names
    return f'''"""Partition rules{origin}, exported by shardc: MaxText / t5x-style rules keyed by
parameter path, for mesh {mesh_label(plan.mesh_axes)} (program fingerprint {plan.fingerprint}).

A leaf's path is its argument's name, then ``.key`` for string dict keys and attributes
and ``[i]`` for sequence indices and other keys (``state.params.blocks[3].attn.kernel``);
``specs(tree, root)`` names the leaves of ``tree`` so and gives each the PartitionSpec of
the first rule that matches. Integer indices are folded (a rule matches any index) wherever
every index has the same layout. The plan names paths, not logical dims (``embed``,
``mlp``): MaxText's logical_axis_rules need names the program does not carry, so each rule
is a parameter path and its whole PartitionSpec. The activations' layouts are not rules:
``shardc export --format python`` pins what plain code can.

Not expressed as folded rules:
{noted}
"""

import re

import jax
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

MESH_AXES = {tuple(plan.mesh_axes)!r}

#: (regular expression over a leaf's path, PartitionSpec); the first match wins
RULES = (
{lines}
)


def spec_for(path: str) -> P:
    """The PartitionSpec of the leaf at ``path``; KeyError when no rule matches."""
    for pattern, spec in RULES:
        if re.match(pattern, path):
            return spec
    raise KeyError(f"no rule matches {{path!r}}")


{key_source}

def specs(tree, root: str):
    """``tree`` with each leaf replaced by its PartitionSpec, the leaves named from
    ``root`` (the argument's name in the planned function, e.g. ``"state"``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: spec_for(root + "".join(map(_key, path))), tree)
'''
