"""Layouts the user fixed: ``with_sharding_constraint``, ``jax.sharding.reshard`` and
``shard_map`` regions (semi-automatic planning).

A layout the user wrote is a constraint the plan keeps, not a hint it may override
(PaddlePaddle's semi-automatic mode; XLA's preserve-shardings): the op gets exactly that
placement, and the solver plans everything around it, pricing the conversions into and out
of it like any other edge.

* ``sharding_constraint`` (``with_sharding_constraint``) and ``reshard``: the value's layout
  is the spec's, in and out. Dims the spec marks ``UNCONSTRAINED`` are free: every layout
  splitting them over mesh axes the spec leaves unused (or none) is offered. The lowering
  emits the plan's own constraint in its place.
* ``shard_map``: a manual region is one op; its operands are placed by ``in_specs``, its
  results by ``out_specs``, mesh axes outside the region's manual axes broadcast. Its FLOPs
  per device are its body's (the body is typed with the per-device shapes). The lowering
  re-binds it with its own params.

When the mesh being planned cannot name the spec's axes (the 1-D problems solved only to seed
the real one), the registry plans these ops by their rules instead: a constraint is an
identity (every split passes through), a ``shard_map`` region runs replicated there.

References:
  PaddlePaddle semi-automatic parallelism (``shard_tensor`` / ``reshard`` annotations kept
  by the planner); XLA auto-sharding ``preserve_shardings`` option.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jax.extend import core as jcore
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from shardc.ir.flops import op_flops
from shardc.ir.graph import Op
from shardc.ir.sbp import B, NdSbp, Split, from_partition_spec
from shardc.rules.control import body_graph
from shardc.rules.registry import LayoutError, Signature, register, register_fixed
from shardc.util.axes import axis_tuple

__all__ = ["constraint_layouts", "identity_rule", "on_mesh", "shard_map_flops",
           "shard_map_layouts"]


def _layout(spec: PartitionSpec, ndim: int, axis_names: Sequence[str], what: str) -> NdSbp:
    try:
        return from_partition_spec(spec, ndim, tuple(axis_names))
    except ValueError as exc:
        raise LayoutError(f"{what} {spec} cannot be placed on the mesh {list(axis_names)}: "
                          f"{exc}") from exc


def constraint_layouts(spec: PartitionSpec, ndim: int, axis_names: Sequence[str],
                       what: str = "sharding constraint") -> list[NdSbp]:
    """Every layout ``spec`` allows: itself, with its ``UNCONSTRAINED`` dims split over any
    mesh axes the spec leaves unused."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    free = [d for d, e in enumerate(entries) if e is PartitionSpec.UNCONSTRAINED]
    base = _layout(PartitionSpec(*(None if d in free else e for d, e in enumerate(entries))),
                   ndim, axis_names, what)
    named = {n for e in entries if e not in (None, PartitionSpec.UNCONSTRAINED)
             for n in axis_tuple(e)}
    open_axes = [k for k, n in enumerate(axis_names) if n not in named]
    if not free or not open_axes:
        return [base]
    out = []
    for combo in itertools.product([B] + [Split(d) for d in free], repeat=len(open_axes)):
        sbps = list(base.sbps)
        for k, s in zip(open_axes, combo):
            sbps[k] = s
        out.append(NdSbp(tuple(sbps)))
    return out


def _constraint(op: Op, axis_names: Sequence[str]):
    sharding = op.params["sharding"] if op.name == "sharding_constraint" else \
        op.params["dst_sharding"]
    layouts = constraint_layouts(sharding.spec, op.inputs[0].ndim, axis_names,
                                 f"{op.name} of {op.inputs[0].type_str()}")
    return [((nd,), (nd,)) for nd in layouts]


def _no_flops(op: Op) -> float:
    return 0.0


register_fixed("sharding_constraint", "reshard", flops=_no_flops)(_constraint)


@register("sharding_constraint", "reshard")
def identity_rule(op: Op) -> list[Signature]:
    """Where the fixed layout cannot be named: the constraint moves no data itself."""
    return [Signature((Split(d),), (Split(d),)) for d in range(op.inputs[0].ndim)]


def shard_map_flops(op: Op) -> float:
    body = body_graph(jcore.ClosedJaxpr(op.params["jaxpr"], ()))
    return float(sum(op_flops(o) for o in body.ops))


@register_fixed("shard_map", flops=shard_map_flops)
def shard_map_layouts(op: Op, axis_names: Sequence[str]):
    mesh = op.params["mesh"]
    if tuple(mesh.axis_names) != tuple(axis_names):
        raise LayoutError(f"a shard_map region runs on mesh axes {list(mesh.axis_names)}, "
                          f"but the plan is for {list(axis_names)}; give auto_shard the "
                          "region's mesh")
    ins = tuple(_layout(s, v.ndim, axis_names, "shard_map in_spec")
                for s, v in zip(op.params["in_specs"], op.inputs))
    outs = tuple(_layout(s, v.ndim, axis_names, "shard_map out_spec")
                 for s, v in zip(op.params["out_specs"], op.outputs))
    return [(ins, outs)]


def on_mesh(ops: Sequence[Op], mesh) -> None:
    """Read the user's constraints written on another mesh of ``mesh``'s devices (other
    axis names, or the same devices in fewer, larger axes) in ``mesh``'s axis names, as
    ``jax.jit`` accepts them: each such op's sharding param is replaced by the same layout
    on ``mesh``. A mesh placing the devices in an order ``mesh``'s axes cannot name is
    refused, naming the fix."""
    own = tuple(mesh.axis_names)
    for op in ops:
        key = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}.get(op.name)
        sh = op.params.get(key) if key else None
        other = getattr(sh, "mesh", None)
        if other is None or tuple(other.axis_names) == own or isinstance(other, AbstractMesh):
            continue  # an abstract mesh (a set_mesh context's type) names no devices
        groups = _axis_groups(other, mesh)
        if groups is None:
            raise LayoutError(
                f"{op.name} of {op.inputs[0].type_str()} is on mesh "
                f"{dict(zip(other.axis_names, other.axis_sizes))}, whose devices the plan's "
                f"mesh {dict(zip(own, mesh.axis_sizes))} does not lay out alike; write it "
                f"with auto_shard's mesh (NamedSharding(mesh, P(...)) naming {list(own)})")
        spec = PartitionSpec(*(_rename(e, groups) for e in sh.spec))
        op.params = {**op.params, key: NamedSharding(mesh, spec)}


def _axis_groups(other, mesh) -> dict[str, tuple[str, ...]] | None:
    """Each axis of ``other`` as the run of ``mesh`` axes it spans (same devices, same
    order, an axis of ``other`` the product of consecutive axes of ``mesh``); None if
    the two meshes do not lay the devices out so."""
    ids = [d.id for d in other.devices.flat]
    if ids != [d.id for d in mesh.devices.flat]:
        return None
    sizes = list(zip(mesh.axis_names, mesh.axis_sizes))
    groups, k = {}, 0
    for name, size in zip(other.axis_names, other.axis_sizes):
        run, prod = [], 1
        while prod < size and k < len(sizes):
            run.append(sizes[k][0])
            prod *= sizes[k][1]
            k += 1
        if prod != size:
            return None
        groups[name] = tuple(run)
    return groups


def _rename(entry, groups: dict[str, tuple[str, ...]]):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return entry
    names = tuple(n for e in axis_tuple(entry) for n in groups[e])
    return names[0] if len(names) == 1 else (names or None)
