"""A placement plan: every value's NdSbp, every op's strategy, and what it should cost.

The predicted figures are recomputed from the final choices (not read off the solver), so
they hold for plans loaded from JSON too, and they count what the solver's pairwise
objective cannot: a value converted the same way for several consumers pays once (XLA CSEs
the collectives), so a plan's predicted step may be below its solver objective.
``explain()`` prints the per-op table.

:func:`shardc.plan.assemble.assemble` builds a plan from a solved cost graph; the readers
:meth:`Plan.from_json` parses a file with, and :class:`~shardc.plan.codec.PlanFormatError`,
are :mod:`shardc.plan.codec`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from jax.sharding import PartitionSpec

from shardc.cost.cluster import Cluster
from shardc.errors import PlanError, PlanFormatError
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Partial, to_partition_spec
from shardc.pipeline.schedule import Pipeline
from shardc.plan.codec import layout_reader, parsed, program_fields, reading_field

__all__ = ["OpPlan", "Plan", "Predicted", "Reshard", "fingerprint", "unreduced"]


@dataclass(frozen=True)
class Predicted:
    """What a plan is predicted to cost per step and device.

    Attributes:
        comm_time: Seconds of communication per step.
        compute_time: Seconds of compute per step.
        comm_bytes: Wire bytes per device per step.
        peak_memory: Peak bytes per device.
        feed_time: Seconds feeding the inputs not carried between steps to the devices.
        host_time: Seconds moving offloaded state to the devices and back, serially.
    """

    comm_time: float  # seconds per step
    compute_time: float
    comm_bytes: float  # wire bytes per device per step
    peak_memory: float  # bytes per device
    feed_time: float = 0.0  # host -> device transfer of the inputs not carried between steps
    host_time: float = 0.0  # offloaded state to the devices and back (host memory), serially

    @property
    def step_time(self) -> float:
        """Seconds per step: communication, compute, feed and host memory, serially."""
        return self.comm_time + self.compute_time + self.feed_time + self.host_time


@dataclass(frozen=True)
class OpPlan:
    """One op's strategy in a plan: its inputs' and outputs' layouts and their cost.

    Attributes:
        id: The op's id in the traced program.
        prim: Its primitive's name.
        types: Its inputs' and outputs' types, ``"f32[8,16],f32[16,32]->f32[8,32]"``.
        ins: The layout each input is read in.
        outs: The layout each output is made in.
        compute_time: Seconds of its compute.
        comm_time: Seconds converting its inputs.
        reads: The value id of each input, -1 for a constant.
        writes: The value id of each output.
        source: The user's line that made it (``path:line``); "" if unknown.
        where: Its equation in the traced jaxpr, outermost call first; () if unknown.
    """

    id: int
    prim: str
    types: str  # "f32[8,16],f32[16,32]->f32[8,32]"
    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]
    compute_time: float
    comm_time: float  # resharding of this op's inputs
    reads: tuple[int, ...] = ()  # value id per input, -1 for a constant
    writes: tuple[int, ...] = ()  # value id per output
    #: the user's line that made the op (``path:line``); "" if unknown or saved without it
    source: str = ""
    #: the op's equation in the traced jaxpr: equation indices, outermost call first
    #: (``ir.graph.Op.where``); () in plans saved without it
    where: tuple[int, ...] = ()

    @property
    def strategy(self) -> str:
        """Its strategy per mesh axis, ``"S(0),B->S(0) | B,S(1)->S(1)"``."""
        axes = range(len(self.outs[0]) if self.outs else 0)
        return " | ".join(",".join(str(nd.sbps[a]) for nd in self.ins) + "->" +
                          ",".join(str(nd.sbps[a]) for nd in self.outs) for a in axes)


@dataclass(frozen=True)
class Reshard:
    """A conversion a plan runs: one value from one layout to another, and its cost.

    Attributes:
        value: The value's id.
        consumer: The reading op's id, ``-1 - j`` for result ``j``, None for the value's
            settling.
        src: The layout converted from.
        dst: The layout converted to.
        time: Seconds per step.
        wire_bytes: Wire bytes per device per step.
        collectives: Its collectives, ``"all-reduce@gpu"``.
        collective_bytes: Wire bytes per device of each collective.
        combined: Per collective, the tuple collective XLA combines it into (an index its
            members share), -1 where it runs alone; () in older plans.
    """

    value: int
    consumer: int | None  # op id, -1 - j for graph output j, None: the value's settling
    src: NdSbp
    dst: NdSbp
    time: float
    wire_bytes: float
    collectives: tuple[str, ...]  # "all-reduce@gpu"
    collective_bytes: tuple[float, ...] = ()  # wire bytes per device of each collective
    #: per collective, the tuple collective XLA combines it into (an index shared by its
    #: members, :func:`shardc.plan.assemble._combine`), -1 where it runs on its own; () in
    #: older plans
    combined: tuple[int, ...] = ()


def _stable(params: dict) -> str:
    """``params`` as text that is the same in every process: no memory addresses."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(sorted(params.items(), key=lambda kv: kv[0])))


def fingerprint(graph: Graph) -> str:
    """A digest of the program a plan is for.

    It covers the inputs' types, and per op its primitive, params, which values it reads
    (numbered in definition order; constants by type, and by value when scalar) and its
    outputs' types.

    Args:
        graph: The traced program.

    Returns:
        16 hex digits.
    """
    h = hashlib.sha1()
    number: dict[int, int] = {}

    def ref(v) -> str:
        if v.is_const:
            return f"const {v!r}:{v.type_str()}" if v.ndim == 0 else f"const {v.type_str()}"
        return f"%{number[v.id]}"

    for v in graph.inputs:
        number[v.id] = len(number)
        h.update(f"in {v.type_str()};".encode())
    for op in graph.ops:
        h.update(f"{op.name}x{op.weight}{_stable(op.params)}"
                 f"({','.join(map(ref, op.inputs))})".encode())
        for v in op.outputs:
            number[v.id] = len(number)
            h.update(f"->{v.type_str()}".encode())
    h.update(f"out ({','.join(map(ref, graph.outputs))})".encode())
    return h.hexdigest()[:16]


def unreduced(nd: NdSbp) -> NdSbp:
    """``nd`` with every partial sum reduced (broadcast)."""
    return NdSbp(tuple(B if isinstance(s, Partial) else s for s in nd.sbps))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement plan: every value's layout, every op's strategy and what it costs.

    Made by ``step.plan(*args)``; saved and read with :meth:`to_json` / :meth:`from_json`.

    Attributes:
        mesh_axes: ``(name, size)`` per mesh axis.
        cluster: The cluster the plan is priced on.
        inputs: The layout of each flat input leaf.
        outputs: The layout of each flat output leaf.
        values: Value id -> its layout as its producer makes it.
        ops: Each op's strategy.
        reshards: Each conversion the plan runs.
        predicted: The predicted step and peak memory.
        solver: The search's statistics and choices (status, timings, what it weighed).
        fingerprint: The digest of the program the plan is for (:func:`fingerprint`).
        input_ranks: The rank of each flat input leaf.
        output_ranks: The rank of each flat output leaf.
        settled: Value id -> the layout its uses read it from, where it settles.
        input_ids: The value id of each flat input leaf.
        input_types: The type of each flat input leaf, ``"f32[8,16]"``.
        output_types: The type of each flat output leaf.
        input_names: The user's name of each flat input leaf (``state.params.w``).
        output_names: The user's name of each flat output leaf (``out[1]``).
        remat: The forward segments whose activations are recomputed in the backward.
        segments: The program's forward segments.
        pipeline: The pipeline the layer stacks run as; None: none.
        offloaded: Input leaves kept in host memory between steps.
        offloaded_outputs: Output leaves (their new state) written to host memory.
    """

    mesh_axes: tuple[tuple[str, int], ...]
    cluster: Cluster
    inputs: tuple[NdSbp, ...]  # per flat input leaf
    outputs: tuple[NdSbp, ...]  # per flat output leaf
    values: dict  # value id -> NdSbp (as its producer makes it)
    ops: tuple[OpPlan, ...]
    reshards: tuple[Reshard, ...]
    predicted: Predicted
    solver: dict = field(default_factory=dict)
    fingerprint: str = ""
    input_ranks: tuple[int, ...] = ()
    output_ranks: tuple[int, ...] = ()
    settled: dict = field(default_factory=dict)  # value id -> NdSbp its uses read it from
    input_ids: tuple[int, ...] = ()  # value id per flat input leaf
    input_types: tuple[str, ...] = ()  # "f32[8,16]" per flat input leaf
    output_types: tuple[str, ...] = ()
    #: the user's name of each flat input / output leaf (``state.params.w``, ``out[1]``);
    #: empty where the plan was made without the call (names then read ``input 3``)
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    #: the program's forward segments whose activations this plan recomputes in the
    #: backward pass (indices, :mod:`shardc.ir.remat`), of ``segments`` it has
    remat: tuple[int, ...] = ()
    segments: int = 0
    #: the pipeline the program's layer stacks run as (:mod:`shardc.pipeline`); None: none
    pipeline: Pipeline | None = None
    #: input leaves kept in host memory (``pinned_host``) between steps, and the output
    #: leaves (their new state) written there: indices into inputs and outputs
    offloaded: tuple[int, ...] = ()
    offloaded_outputs: tuple[int, ...] = ()

    def read_as(self, value_id: int) -> NdSbp | None:
        """The layout the uses of a value read it from: settled, else as produced."""
        return self.settled.get(value_id, self.values.get(value_id))

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axis names."""
        return tuple(n for n, _ in self.mesh_axes)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """The mesh's axis sizes."""
        return tuple(s for _, s in self.mesh_axes)

    def named(self, input_names, output_names) -> Plan:
        """This plan with the user's names of its input and output leaves.

        Args:
            input_names: One name per flat input leaf.
            output_names: One name per flat output leaf.

        Returns:
            The plan (itself when the names are its own).

        Raises:
            ValueError: When the counts differ from the plan's leaves.
        """
        input_names, output_names = tuple(input_names), tuple(output_names)
        if len(input_names) != len(self.inputs) or len(output_names) != len(self.outputs):
            raise PlanError(f"named: {len(input_names)} input / {len(output_names)} output "
                            f"names for a plan of {len(self.inputs)} inputs and "
                            f"{len(self.outputs)} outputs")
        if (input_names, output_names) == (self.input_names, self.output_names):
            return self  # a plan reused for another call of the same names stays one object
        return dataclasses.replace(self, input_names=input_names, output_names=output_names)

    def input_name(self, k: int) -> str:
        """The name of input leaf ``k`` (``input k`` where the plan has none)."""
        return self.input_names[k] if self.input_names else f"input {k}"

    def output_name(self, j: int) -> str:
        """The name of output leaf ``j`` (``output j`` where the plan has none)."""
        return self.output_names[j] if self.output_names else f"output {j}"

    def input_specs(self) -> list[PartitionSpec]:
        """The PartitionSpec of each flat input leaf."""
        return [to_partition_spec(nd, r, self.axis_names)
                for nd, r in zip(self.inputs, self.input_ranks)]

    def output_specs(self) -> list[PartitionSpec]:
        """The PartitionSpec of each flat output leaf."""
        return [to_partition_spec(nd, r, self.axis_names)
                for nd, r in zip(self.outputs, self.output_ranks)]

    def explain(self, max_rows: int | None = 60, top: int = 10, compiled=None,
                mesh=None, margins=None) -> str:
        """The plan in the user's names, as text.

        The PartitionSpec of every argument and result leaf, the per-op table (repeated
        layers folded, each row's source line) and the costliest reshards.

        Args:
            max_rows: The most op rows shown; None: all.
            top: The costliest reshards shown.
            compiled: A ``jax.stages.Compiled`` of the plan's program: predicted vs
                compiled collectives too.
            mesh: The mesh ``compiled`` runs on.
            margins: ``step.margins(*args)``: generic data-parallel / FSDP / Megatron /
                DP x TP layouts' predicted steps beside this plan's.

        Returns:
            The report's text.
        """
        return str(self.report(max_rows, top, compiled, mesh, margins))

    def report(self, max_rows: int | None = 60, top: int = 10, compiled=None, mesh=None,
               margins=None):
        """:meth:`explain` as a Report.

        Args:
            max_rows: As for :meth:`explain`.
            top: As for :meth:`explain`.
            compiled: As for :meth:`explain`.
            mesh: As for :meth:`explain`.
            margins: As for :meth:`explain`.

        Returns:
            A :class:`shardc.util.tables.Report`: ``str()`` is the text, a rich console
            renders it as tables, a notebook as HTML.
        """
        from shardc.report.explain import explain_report

        check = self.verify(compiled, mesh) if compiled is not None else None
        return explain_report(self, max_rows, top, margins, check)

    def plot(self, path: str | None = None):
        """Draw the per-op layouts and the compute / communication split.

        Args:
            path: Where to save the figure; None: not saved.

        Returns:
            The ``matplotlib.figure.Figure`` (:func:`shardc.report.plot.plot_plan`).
        """
        from shardc.report.plot import plot_plan

        return plot_plan(self, path)

    def _repr_html_(self) -> str:
        return self.report(max_rows=30)._repr_html_()

    def verify(self, compiled, mesh=None):
        """Predicted vs compiled collectives.

        Args:
            compiled: A ``jax.stages.Compiled`` of the plan's program.
            mesh: The mesh it runs on.

        Returns:
            The comparison (:func:`shardc.inspect.verify.verify`); ``.table()`` prints it.
        """
        from shardc.inspect.verify import verify

        return verify(self, compiled, mesh)

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON (version 2).

        Every layout is written once, in a table the values, ops and reshards index, and
        the ops and reshards as columns: a large program's plan holds few distinct layouts
        and type strings over many ops, so the file is smaller than one writing each in
        place, and reading it builds each layout once.

        Returns:
            The JSON text (:meth:`from_json` reads it back).
        """
        layouts: dict[NdSbp, int] = {}
        strings: dict[str, int] = {}

        def lay(nd: NdSbp) -> int:
            return layouts.setdefault(nd, len(layouts))

        def text(s: str) -> int:
            return strings.setdefault(s, len(strings))

        ops, res = self.ops, self.reshards
        d = {
            "version": 2,
            "mesh_axes": [list(a) for a in self.mesh_axes],
            "cluster": self.cluster.to_json(),
            "inputs": [lay(nd) for nd in self.inputs],
            "outputs": [lay(nd) for nd in self.outputs],
            "input_ranks": list(self.input_ranks),
            "output_ranks": list(self.output_ranks),
            "values": {"ids": list(self.values), "layouts": list(map(lay, self.values.values()))},
            "settled": {"ids": list(self.settled),
                        "layouts": list(map(lay, self.settled.values()))},
            "ops": {"id": [o.id for o in ops], "prim": [text(o.prim) for o in ops],
                    "types": [text(o.types) for o in ops],
                    "ins": [list(map(lay, o.ins)) for o in ops],
                    "outs": [list(map(lay, o.outs)) for o in ops],
                    "compute_time": [o.compute_time for o in ops],
                    "comm_time": [o.comm_time for o in ops],
                    "reads": [list(o.reads) for o in ops],
                    "writes": [list(o.writes) for o in ops],
                    "source": [text(o.source) for o in ops],
                    "where": [list(o.where) for o in ops]},
            "reshards": {"value": [r.value for r in res], "consumer": [r.consumer for r in res],
                         "src": [lay(r.src) for r in res], "dst": [lay(r.dst) for r in res],
                         "time": [r.time for r in res],
                         "wire_bytes": [r.wire_bytes for r in res],
                         "collectives": [list(r.collectives) for r in res],
                         "collective_bytes": [list(r.collective_bytes) for r in res],
                         "combined": [list(r.combined) for r in res]},
            "predicted": asdict(self.predicted),
            "solver": self.solver,
            "fingerprint": self.fingerprint,
            "input_ids": list(self.input_ids),
            "input_types": list(self.input_types),
            "output_types": list(self.output_types),
            "input_names": list(self.input_names),
            "output_names": list(self.output_names),
            "remat": list(self.remat),
            "segments": self.segments,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
            "offloaded": {"inputs": list(self.offloaded),
                          "outputs": list(self.offloaded_outputs)},
        }
        d["layouts"] = [nd.to_json() for nd in layouts]
        d["strings"] = list(strings)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan saved with :meth:`to_json`.

        Args:
            text: The JSON, in this version's format or version 1's (each layout written
                in place).

        Returns:
            The plan.

        Raises:
            PlanFormatError: For a damaged file, naming the field missing or wrong.
        """
        d, version = parsed(text)
        with reading_field("mesh_axes"):
            mesh_axes = tuple((str(n), int(s)) for n, s in d["mesh_axes"])
        read = layout_reader(d, version, len(mesh_axes))
        with reading_field("cluster"):
            cluster = Cluster.from_json(d["cluster"])
        with reading_field("inputs"):
            inputs = read.layouts(d["inputs"])
        with reading_field("outputs"):
            outputs = read.layouts(d["outputs"])
        with reading_field("values"):
            values = read.by_id(d["values"])
        with reading_field("settled"):
            settled = read.by_id(d["settled"]) if "settled" in d else {}
        ops = read.ops(d["ops"], OpPlan)
        reshards = read.reshards(d["reshards"], Reshard)
        with reading_field("predicted"):
            # plans saved before zeroings went free (shardc.cost.comm) carry their charge
            predicted = Predicted(**{k: v for k, v in d["predicted"].items()
                                     if k != "zeroing_time"})
        with reading_field("input_ranks / output_ranks"):
            input_ranks = tuple(int(r) for r in d["input_ranks"])
            output_ranks = tuple(int(r) for r in d["output_ranks"])
            if len(input_ranks) != len(inputs) or len(output_ranks) != len(outputs):
                raise PlanFormatError("one rank per input and per output")
        described = program_fields(d, len(inputs), len(outputs))
        return cls(mesh_axes=mesh_axes, cluster=cluster, inputs=inputs, outputs=outputs,
                   values=values, settled=settled, ops=ops, reshards=reshards,
                   predicted=predicted, solver=dict(d["solver"]),
                   fingerprint=str(d["fingerprint"]), input_ranks=input_ranks,
                   output_ranks=output_ranks, **described)
