"""Read the collectives XLA actually compiled, and price the compiled program.

:func:`collectives` walks every computation of an optimized HLO module (the text of
``jax.jit(f).lower(...).compile().as_text()``) and returns one :class:`HloCollective` per
collective instruction: its kind, per-device result size, replica groups, and the mesh axes
those groups run over. :func:`price` turns them into seconds on a
:class:`~shardc.cost.cluster.Cluster` with the planner's own collective model
(:meth:`~shardc.cost.cluster.Cluster.collective_seconds`, over the links each group
actually crosses: :func:`shardc.inspect.groups.group_spans`), and adds compute time from
XLA's ``cost_analysis`` (where a backend gives none, the FLOPs of
:func:`shardc.inspect.schedule.replay_flops`: :func:`program_flops`) and peak memory from
``memory_analysis``.

Replica groups
--------------
XLA prints the device groups of a collective in three spellings; all three name *logical*
device ids, i.e. positions in the program's device assignment. For a program jitted on a
``jax.sharding.Mesh`` that assignment is ``mesh.devices.flat``, so id ``i`` sits at mesh
coordinate ``np.unravel_index(i, mesh.devices.shape)`` (on the default CPU mesh id ``i`` is
also ``device.id == i``; on a permuted mesh it is not, and the position is what counts).

1. Explicit lists, ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (``{}`` = one group of every
   device). On jax 0.10.2 CPU this is what ``shard_map`` collectives (``psum``,
   ``psum_scatter``, ``all_to_all``) print.
2. Iota lists, ``replica_groups=[2,4]<=[4,2]T(1,0)``: ``iota(prod(dims))`` reshaped to
   ``dims``, transposed by ``T(perm)`` (omitted when there is none), reshaped to
   ``[num_groups, group_size]``. Not printed by this build by default, parsed anyway.
3. Mesh axes, ``replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2],
   device_ids=([2,4]T(1,0)) {'axis_1'}``: a synthetic mesh (its own axis names, unrelated
   to the JAX mesh's) whose device assignment is ``device_ids`` (an iota
   ``[reshape_dims]T(perm)``, a comma list of ids, or absent = ``iota``); each group holds
   the devices that differ only along the braced axes, in the braced order. A braced axis
   may be a sub-axis ``'a':(pre)size``. This is what GSPMD/Shardy partitioning of
   ``NamedSharding`` programs prints on this build.

``collective-permute`` has ``source_target_pairs={{0,1},{1,2},...}`` instead; its groups
are the connected components of those pairs (a shift along one mesh axis gives that axis's
lines).

XLA:CPU's rewrites of a collective (a reduce-scatter run as an all-reduce and a slice,
16-bit floats moved as ``f32``) are read back as the collective a backend without them runs
(:mod:`shardc.inspect.cpuforms`).

Async forms ``<kind>-start`` count as their kind, ``-done`` (and ``-update``) never count;
a generic ``async-start`` is not a collective itself, the op in the async computation it
wraps is, so each collective counts once. A collective in a while body counts once per text
occurrence; its :attr:`HloCollective.computation` names the body, and :func:`price` weights
its time and bytes by how often that runs (:func:`shardc.inspect.loops.multiplicity`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import Mesh

from shardc.cost import comm
from shardc.cost.cluster import Cluster
from shardc.errors import OptionsTypeError
from shardc.inspect.collective import HloCollective
from shardc.inspect.cpuforms import narrowed, split_scatters
from shardc.inspect.groups import group_axes, group_spans, instruction_groups
from shardc.inspect.hlotext import (
    Computation,
    Instruction,
    parse_module,
    result_shapes,
    shape_bytes,
)
from shardc.inspect.loops import loop_extra_flops, multiplicity
from shardc.inspect.schedule import replay_flops, schedule

__all__ = ["collective_seconds", "collectives", "compiled_flops", "compiled_peak_memory",
           "CompiledCost", "KINDS", "price", "price_all", "program_flops"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# ---- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledCost:
    """A compiled program priced on a cluster.

    ``times`` are the seconds of ``collectives``, index by index, each times ``runs``
    (how often its computation runs per call: the trip counts of the loops around it);
    ``comm_time`` is their sum (no overlap). ``flops`` are per device from
    ``compiled.cost_analysis()`` with loop bodies by trip count (:func:`program_flops`);
    ``peak_memory`` is ``temp + argument + output - alias`` bytes from
    ``compiled.memory_analysis()`` (generated code and host-side sizes excluded), None when
    the backend gives no memory analysis. ``overlapped_time`` is ``time`` with each
    collective run beside the compute that does not wait for it
    (:func:`shardc.inspect.schedule.schedule`; the same collectives and compute, so
    ``max(comm_time, compute_time) <= overlapped_time <= time``); None where not priced.
    """

    comm_time: float
    compute_time: float
    wire_bytes: float
    flops: float
    peak_memory: float | None
    collectives: tuple[HloCollective, ...]
    counts: dict[str, int] = field(default_factory=dict)
    times: tuple[float, ...] = ()
    runs: tuple[int, ...] = ()
    overlapped_time: float | None = None
    #: the arguments and results in host memory moved over the host link, each way
    #: (:func:`host_memory_bytes` at ``Cluster.host_bandwidth``); in ``time`` and
    #: ``overlapped_time`` in full
    host_time: float = 0.0

    @property
    def time(self) -> float:
        return self.comm_time + self.compute_time + self.host_time


# ---- collectives -----------------------------------------------------------------------------


def _hlo_text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    as_text = getattr(compiled_or_text, "as_text", None)
    if as_text is None:
        raise OptionsTypeError("collectives() needs HLO text or a jax Compiled (with .as_text()), "
                               f"got {type(compiled_or_text).__name__}")
    text = as_text()
    if not isinstance(text, str):
        raise OptionsTypeError(f"{type(compiled_or_text).__name__}.as_text() returned "
                               f"{type(text).__name__}, not HLO text")
    return text


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _collectives_of(comps: Mapping[str, Computation], comp: Computation,
                    instr: Instruction, kind: str, mesh: Mesh) -> list[HloCollective]:
    """One collective, or two where a tuple all-reduce combines all-reduces with CPU
    reduce-scatters (what a backend with both combiners would run as two collectives)."""
    groups = instruction_groups(instr, mesh.devices.size)
    size = max((len(g) for g in groups), default=1)
    axes = group_axes(groups, mesh)
    shapes = result_shapes(instr.opcode, instr.shape)

    def make(kind: str, shapes, from_ar: bool = False) -> HloCollective:
        return HloCollective(kind, instr.name, sum(shape_bytes(s) for s in shapes),
                             tuple(shapes), size, groups, axes, from_ar, comp.name)

    if instr.opcode != "all-reduce" or size == 1:  # an async all-reduce (XLA:GPU's) runs whole
        return [make(kind, narrowed(comps, comp, instr, shapes))]
    reduced, scattered = split_scatters(comps, comp, instr, shapes, size)
    out = [make("all-reduce", reduced)] if reduced else []
    if scattered:
        out.append(make("reduce-scatter", scattered, from_ar=True))
    return out


def collectives(compiled_or_hlo_text: Any, mesh: Mesh) -> list[HloCollective]:
    """Every collective of an optimized HLO module, in text order, over all computations
    (entry, while bodies, fusions, async computations); see the module docstring."""
    comps = parse_module(_hlo_text(compiled_or_hlo_text))
    found = []
    for comp in comps.values():
        for instr in comp.instructions.values():
            kind = _kind(instr.opcode)
            if kind is not None:
                found += _collectives_of(comps, comp, instr, kind, mesh)
    return found


# ---- pricing ---------------------------------------------------------------------------------


def collective_seconds(c: HloCollective, mesh: Mesh, cluster: Cluster) -> float:
    """Seconds of one run of ``c`` under ``cluster``'s collective model, over the mesh axes
    its groups cross (a group of 2 of a node's 8 GPUs crosses NVLink only) on NCCL's buffer
    for it (:func:`shardc.cost.comm.collective_buffer`)."""
    spans = group_spans(c.groups, mesh) if c.groups else tuple(
        (a, dict(mesh.shape)[a]) for a in c.axes or ())
    if not spans and c.group_size > 1:  # no groups printed: every device
        spans = tuple(mesh.shape.items())
    return cluster.collective_seconds(
        c.kind, spans, comm.collective_buffer(c.kind, c.group_size, c.result_bytes))


def compiled_flops(compiled: Any) -> float:
    """Per-device FLOPs from ``compiled.cost_analysis()`` (a dict, or a list of dicts that
    are summed; 0.0 when the backend reports none), with the later iterations of loops it
    counts once added (:func:`shardc.inspect.loops.loop_extra_flops`)."""
    return (_analysed_flops(compiled) or 0.0) + loop_extra_flops(compiled.as_text())


def program_flops(compiled: Any, text: str, found: Sequence[HloCollective]) -> float:
    """Per-device FLOPs of ``compiled`` (``text`` its HLO, ``found`` its collectives):
    :func:`compiled_flops`, or where the backend reports no ``cost_analysis`` (XLA:GPU's
    ahead-of-time compile for devices this machine lacks) the FLOPs the overlap replay
    weighs (:func:`shardc.inspect.schedule.replay_flops`: dots and convolutions from their
    shapes, library matmuls from their dimension numbers, elementwise ops one per element,
    loop bodies by trip count)."""
    analysed = _analysed_flops(compiled)
    if analysed is None:
        return replay_flops(text, found)
    return analysed + loop_extra_flops(text)


def _analysed_flops(compiled: Any) -> float | None:
    analysis = compiled.cost_analysis()
    if analysis is None:
        return None
    if isinstance(analysis, Mapping):
        entries: Sequence[Mapping] = [analysis]
    elif isinstance(analysis, list | tuple):
        entries = analysis
    else:
        raise OptionsTypeError(f"cost_analysis() returned {type(analysis).__name__}, "
                               "expected a dict or a list of dicts")
    return float(sum(e.get("flops", 0.0) for e in entries if e))


def compiled_peak_memory(compiled: Any) -> float | None:
    """``temp + argument + output - alias`` bytes per device from
    ``compiled.memory_analysis()``, less the arguments and results in host memory (where
    the backend counts them with the device's: XLA:CPU, whose "device" is the host);
    None when unavailable."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    host = 0.0
    if not (stats.host_argument_size_in_bytes or stats.host_output_size_in_bytes):
        host = host_memory_bytes(_hlo_text(compiled))
    return float(stats.temp_size_in_bytes + stats.argument_size_in_bytes
                 + stats.output_size_in_bytes - stats.alias_size_in_bytes) - host


#: an array shape of the entry computation's layout in host memory (memory space 5)
_HOST_ARRAY = re.compile(r"([a-z]+[0-9]*\[[0-9,]*\])\{[0-9,]*:S\(5\)\}")


def host_memory_bytes(text: str) -> float:
    """Bytes per device of the entry computation's arguments and results placed in host
    memory (``S(5)`` in its ``entry_computation_layout``: ``pinned_host`` shardings)."""
    head = text.split("\n", 1)[0]
    start = head.find("entry_computation_layout={")
    if start < 0:
        return 0.0
    depth, end = 0, len(head)
    for i in range(start + len("entry_computation_layout="), len(head)):
        depth += {"{": 1, "}": -1}.get(head[i], 0)
        if depth == 0:
            end = i
            break
    return float(sum(shape_bytes(s) for s in _HOST_ARRAY.findall(head[start:end])))


def price(compiled: Any, mesh: Mesh, cluster: Cluster) -> CompiledCost:
    """Price a ``jax`` Compiled on ``cluster``: each collective with
    :func:`collective_seconds`, times the runs of the loop bodies around it;
    compute as ``flops / (device_flops * utilization)``, loop bodies by trip count; and
    the same with communication overlapped (:func:`shardc.inspect.schedule.schedule`)."""
    return price_all(compiled, mesh, [cluster])[0]


def price_all(compiled: Any, mesh: Mesh, clusters: Sequence[Cluster]) -> list[CompiledCost]:
    """:func:`price` on each of ``clusters`` (the same devices under other collective
    models, say): the program is printed, parsed and analysed once."""
    text = _hlo_text(compiled)  # printed once, parsed once (parse_module keeps the last few)
    found = tuple(collectives(text, mesh))
    every = multiplicity(text)
    runs = tuple(every.get(c.computation, 1) for c in found)
    flops = program_flops(compiled, text, found)
    peak = compiled_peak_memory(compiled)
    host = host_memory_bytes(text)
    out = []
    for cluster in clusters:
        seconds = tuple(collective_seconds(c, mesh, cluster) for c in found)
        times = tuple(t * n for t, n in zip(seconds, runs))
        compute_time = flops / (cluster.device_flops * cluster.utilization)
        out.append(CompiledCost(
            comm_time=sum(times),
            compute_time=compute_time,
            wire_bytes=sum(c.wire_bytes * n for c, n in zip(found, runs)),
            flops=flops,
            peak_memory=peak,
            collectives=found,
            counts=dict(Counter(c.kind for c in found)),
            times=times,
            runs=runs,
            overlapped_time=schedule(text, found, seconds, compute_time).time
            + host / cluster.host_bandwidth,
            host_time=host / cluster.host_bandwidth,
        ))
    return out
