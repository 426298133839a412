"""A plan as a standalone Python module that runs it with plain ``jax.jit``: no shardc at
run time; and (``rules_module``) as partition rules keyed by parameter path.

The module pins what ``jax.jit`` can pin from outside a function, a ``NamedSharding`` per
flat argument and result leaf, and by default the plan's constraints inside it: the
exported ``constrained(fn, mesh)`` traces ``fn`` to its jaxpr and binds the equations
again, pinning the inputs and outputs :func:`constraints` lists by each equation's place
(``OpPlan.where``), as :mod:`shardc.lower.emit` does. It inlines inner ``jit`` calls only;
what sits inside loops, remat and custom-derivative calls is left to XLA's propagation,
and the module's docstring says so. On the tested MLP step it compiles to shardc's
collectives one for one; pinning the ends only, to those plus a 4-byte all-reduce.
"""

from __future__ import annotations

import inspect
import re

from shardc.errors import PlanError
from shardc.ir.sbp import to_partition_spec
from shardc.lower.emit import conversion_steps
from shardc.report.explain import mesh_label, spec_text
from shardc.report.export_code import MODULE
from shardc.report.keys import _key as names_key

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


_RANKS = re.compile(r"\w+\[([\d,]*)\]")


def _ranks(types: str) -> tuple[list[int], list[int]]:
    """Ranks of an op's inputs and outputs from its ``types`` (``f32[8,16],f32[]->...``)."""
    ins, _, outs = types.partition("->")
    rank = lambda t: [len(m.group(1).split(",")) if m.group(1) else 0  # noqa: E731
                      for m in _RANKS.finditer(t)]
    return rank(ins), rank(outs)


def constraints(plan) -> tuple[dict, dict]:
    """What shardc's lowering pins, where plain code can say it: per op (by its equation's
    place, ``OpPlan.where``) its primitive, the layouts each input is pinned to in turn
    (the planned conversion's steps) and those of each output (its layout, then its
    settling); per argument leaf, its settling. As text of PartitionSpecs. Left out as the
    lowering leaves them: partial layouts (no spelling on Auto axes), values computed from
    constants alone, and the scan's own enter / exit ops (the scan is bound whole)."""
    names = plan.axis_names
    free: set[int] = set()
    for o in plan.ops:
        if all(v == -1 or v in free for v in o.reads):
            free.update(o.writes)

    def steps(src, dst, rank) -> tuple[str, ...]:
        if dst is None:
            return ()
        return tuple(spec_text(to_partition_spec(nd, rank, names))
                     for nd in conversion_steps(plan, src, dst) if not nd.has_partial)

    per_op = {}
    for o in plan.ops:
        if not o.where or o.prim in ("scan_enter", "scan_exit", "cond_enter", "cond_exit") or \
                (o.writes and all(v in free for v in o.writes)):
            continue
        rin, rout = _ranks(o.types)
        ins = {k: st for k, vid in enumerate(o.reads) if vid != -1 and vid not in free
               and (st := steps(plan.read_as(vid), o.ins[k], rin[k]))}
        outs = tuple(((spec_text(to_partition_spec(nd, r, names)),) if not nd.has_partial
                      else ()) + steps(plan.values.get(vid), plan.settled.get(vid), r)
                     for vid, nd, r in zip(o.writes, o.outs, rout))
        per_op[o.where] = (o.prim, ins, outs)
    args = {k: st for k, vid in enumerate(plan.input_ids)
            if (st := steps(plan.inputs[k], plan.settled.get(vid), plan.input_ranks[k]))}
    return per_op, args


def _table(per_op: dict, args: dict) -> str:
    rows = ["CONSTRAINTS = {"]
    for where, (prim, ins, outs) in per_op.items():
        conv = "{" + ", ".join(f"{k}: ({', '.join(st)},)" for k, st in ins.items()) + "}"
        made = "(" + "".join(f"({', '.join(st)},)," if st else "()," for st in outs) + ")"
        rows.append(f"    {where!r}: ({prim!r}, {conv}, {made}),")
    rows.append("}")
    rows.append("ARGUMENTS = {" + ", ".join(f"{k}: ({', '.join(st)},)"
                                            for k, st in args.items()) + "}")
    return "\n".join(rows)


def _stacks_code(plan) -> str:
    """The exported ``_stacks(mesh)``: the layer stacks run as the plan's pipeline
    (:mod:`shardc.pipeline.lowering`: a pipelined program's stacks are
    ``shardc.pipeline.layers``, so it has shardc), or None for a plan without one."""
    if plan.pipeline is None:
        return 'def _stacks(mesh):\n    """None: the plan runs no pipeline."""\n    return None\n'
    axes = plan.solver.get("pipeline", {}).get("batch_axes")
    axes = None if axes is None else tuple(axes)
    return f'''def _stacks(mesh):
    """The layer stacks (shardc.pipeline.layers) run as the plan's pipeline, each
    micro-batch split over the mesh axes it was priced with."""
    from shardc.pipeline import Pipeline
    from shardc.pipeline.lowering import Stacks

    return Stacks(Pipeline.from_json(PIPELINE), mesh, {{}}, {axes!r})
'''


def python_module(plan, source: str = "") -> str:
    """The text of a Python module that runs ``plan`` with ``jax.jit`` (see the module
    docstring of the result for its API). ``source`` names where the plan came from. A
    plan that recomputes activations (``plan.remat``) runs a rewritten program plain code
    does not hold: refused, with the way out."""
    if plan.remat:
        raise PlanError(
            f"this plan recomputes {len(plan.remat)} of {plan.segments} forward segments in "
            "the backward pass, a rewrite of the program that exported code cannot carry; "
            "run it with shardc (step.use_plan(plan, *args)), or export a plan that keeps "
            "its activations (one of the frontier's without remat, or one planned with a "
            "larger memory_budget). The partition rules (rules_module) export either way")
    n_in, n_out = len(plan.inputs), len(plan.outputs)
    names_in = [plan.input_name(k) for k in range(n_in)]
    names_out = [plan.output_name(j) for j in range(n_out)]
    origin = f" from {source}" if source else ""
    per_op, args = constraints(plan)
    placed = "" if per_op or not plan.ops else \
        "\nThis plan was saved without its ops' places: no constraint inside is placed.\n"
    return MODULE.format(
        origin=origin, mesh=mesh_label(plan.mesh_axes), fingerprint=plan.fingerprint,
        step_ms=plan.predicted.step_time * 1e3, placed=placed,
        mesh_axes=tuple(plan.mesh_axes),
        pipeline=plan.pipeline.to_json() if plan.pipeline is not None else None,
        inputs=_leaves(names_in, plan.input_types, plan.input_specs()),
        outputs=_leaves(names_out, plan.output_types, plan.output_specs()),
        constraints=_table(per_op, args), stacks=_stacks_code(plan))


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
    expression over each leaf's path (as :mod:`shardc.step.names` writes it) mapped to its
    PartitionSpec, layer indices folded; results laid out otherwise than an argument, and
    anything the rules cannot say, are listed in its docstring."""
    if not plan.input_names:
        raise PlanError("the plan has no names for its arguments (saved before names were "
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

#: the pipeline the program's layer stacks (shardc.pipeline.layers) run as; None: none
PIPELINE = {plan.pipeline.to_json() if plan.pipeline is not None else None!r}

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
