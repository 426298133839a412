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
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Partial, to_partition_spec
from shardc.pipeline.schedule import Pipeline
from shardc.plan.codec import (
    FIELDS,
    FIELDS_V2,
    ColumnReader,
    InPlaceReader,
    PlanFormatError,
    reading_field,
)

__all__ = ["OpPlan", "Plan", "Predicted", "Reshard", "fingerprint", "unreduced"]


@dataclass(frozen=True)
class Predicted:
    comm_time: float  # seconds per step
    compute_time: float
    comm_bytes: float  # wire bytes per device per step
    peak_memory: float  # bytes per device
    feed_time: float = 0.0  # host -> device transfer of the inputs not carried between steps

    @property
    def step_time(self) -> float:
        return self.comm_time + self.compute_time + self.feed_time


@dataclass(frozen=True)
class OpPlan:
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
        axes = range(len(self.outs[0]) if self.outs else 0)
        return " | ".join(",".join(str(nd.sbps[a]) for nd in self.ins) + "->" +
                          ",".join(str(nd.sbps[a]) for nd in self.outs) for a in axes)


@dataclass(frozen=True)
class Reshard:
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
    """A digest of the program a plan is for: the inputs' types, and per op its primitive,
    params, which values it reads (numbered in definition order; constants by type, and
    by value when scalar) and its outputs' types."""
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
    return NdSbp(tuple(B if isinstance(s, Partial) else s for s in nd.sbps))


@dataclass(frozen=True)
class Plan:
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

    def read_as(self, value_id: int) -> NdSbp | None:
        """The layout the uses of a value read it from: settled, else as produced."""
        return self.settled.get(value_id, self.values.get(value_id))

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.mesh_axes)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.mesh_axes)

    def named(self, input_names, output_names) -> Plan:
        """This plan with the user's names of its input and output leaves (one each)."""
        input_names, output_names = tuple(input_names), tuple(output_names)
        if len(input_names) != len(self.inputs) or len(output_names) != len(self.outputs):
            raise ValueError(f"named: {len(input_names)} input / {len(output_names)} output "
                             f"names for a plan of {len(self.inputs)} inputs and "
                             f"{len(self.outputs)} outputs")
        if (input_names, output_names) == (self.input_names, self.output_names):
            return self  # a plan reused for another call of the same names stays one object
        return dataclasses.replace(self, input_names=input_names, output_names=output_names)

    def input_name(self, k: int) -> str:
        return self.input_names[k] if self.input_names else f"input {k}"

    def output_name(self, j: int) -> str:
        return self.output_names[j] if self.output_names else f"output {j}"

    def input_specs(self) -> list[PartitionSpec]:
        return [to_partition_spec(nd, r, self.axis_names)
                for nd, r in zip(self.inputs, self.input_ranks)]

    def output_specs(self) -> list[PartitionSpec]:
        return [to_partition_spec(nd, r, self.axis_names)
                for nd, r in zip(self.outputs, self.output_ranks)]

    def explain(self, max_rows: int | None = 60, top: int = 10, compiled=None,
                mesh=None, margins=None) -> str:
        """The plan in the user's names: the PartitionSpec of every argument and result leaf,
        the per-op table (repeated layers folded, each row's source line), the costliest
        reshards; with ``margins`` (``step.margins(*args)``) the predicted step of generic
        data-parallel / FSDP / Megatron / DP x TP layouts beside this plan's; with
        ``compiled`` (and its ``mesh``), predicted vs compiled collectives too."""
        return str(self.report(max_rows, top, compiled, mesh, margins))

    def report(self, max_rows: int | None = 60, top: int = 10, compiled=None, mesh=None,
               margins=None):
        """:meth:`explain` as a :class:`shardc.util.tables.Report`: ``str()`` is the text, a rich
        console renders it as tables, a notebook as HTML."""
        from shardc.report.explain import explain_report

        check = self.verify(compiled, mesh) if compiled is not None else None
        return explain_report(self, max_rows, top, margins, check)

    def plot(self, path: str | None = None):
        """The per-op layout per mesh axis and the compute / communication split
        (:func:`shardc.report.plot.plot_plan`, matplotlib); saved to ``path`` if given. Returns
        the ``matplotlib.figure.Figure``."""
        from shardc.report.plot import plot_plan

        return plot_plan(self, path)

    def _repr_html_(self) -> str:
        return self.report(max_rows=30)._repr_html_()

    def verify(self, compiled, mesh=None):
        """Predicted vs compiled collectives of ``compiled`` (a ``jax.stages.Compiled``)."""
        from shardc.inspect.verify import verify

        return verify(self, compiled, mesh)

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON (version 2): every layout written once, in a table the values,
        ops and reshards index, and the ops and reshards as columns. A large program's plan
        holds a few dozen distinct layouts and a few hundred distinct type strings over
        thousands of ops, so this is a third of the size of writing each in place, and
        reading it (:meth:`from_json`, on every ``use_plan`` of a saved plan) builds each
        layout once instead of parsing it per use."""
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
        }
        d["layouts"] = [nd.to_json() for nd in layouts]
        d["strings"] = list(strings)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan saved with :meth:`to_json`, in this version's format or version 1's
        (each layout written in place); a damaged file raises :class:`PlanFormatError`
        naming the field that is missing or wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"not valid JSON ({exc.msg} at line {exc.lineno}, column "
                                  f"{exc.colno}); was the file truncated or edited?") from exc
        if not isinstance(d, dict):
            raise PlanFormatError(f"expected a JSON object, got {type(d).__name__}")
        version = d.get("version")
        if version not in (1, 2):
            raise PlanFormatError(f"unknown plan version {version!r}; expected 1 or 2")
        missing = [k for k in FIELDS + (FIELDS_V2 if version == 2 else ()) if k not in d]
        if missing:
            raise PlanFormatError(f"missing field(s) {missing}")
        with reading_field("mesh_axes"):
            mesh_axes = tuple((str(n), int(s)) for n, s in d["mesh_axes"])
        n_axes = len(mesh_axes)

        def nd(x) -> NdSbp:
            out = NdSbp.from_json(x)
            if len(out) != n_axes:
                raise ValueError(f"{x} has {len(out)} mesh axes, the plan's mesh {n_axes}")
            return out

        if version == 2:
            with reading_field("layouts"):
                table = [nd(x) for x in d["layouts"]]
            with reading_field("strings"):
                strings = [str(s) for s in d["strings"]]
            read = ColumnReader(table, strings)
        else:
            read = InPlaceReader(nd)
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
                raise ValueError("one rank per input and per output")
        # what a plan saved before these fields existed lacks is left empty
        described = {}
        for key, per in (("input_ids", inputs), ("input_types", inputs),
                         ("output_types", outputs), ("input_names", inputs),
                         ("output_names", outputs)):
            with reading_field(key):
                got = tuple(d.get(key, ()))
                if got and len(got) != len(per):
                    raise ValueError(f"{len(got)} entries for {len(per)} leaves")
                described[key] = tuple(int(x) for x in got) if key == "input_ids" else \
                    tuple(str(x) for x in got)
        with reading_field("remat"):  # a plan saved before remat was a choice recomputes nothing
            described["remat"] = tuple(int(k) for k in d.get("remat", ()))
            described["segments"] = int(d.get("segments", 0))
            if any(not 0 <= k < described["segments"] for k in described["remat"]):
                raise ValueError(f"segments {list(described['remat'])} of "
                                 f"{described['segments']}")
        with reading_field("pipeline"):  # a plan saved before pipelines runs none
            pipe = d.get("pipeline")
            described["pipeline"] = Pipeline.from_json(pipe) if pipe is not None else None
        return cls(mesh_axes=mesh_axes, cluster=cluster, inputs=inputs, outputs=outputs,
                   values=values, settled=settled, ops=ops, reshards=reshards,
                   predicted=predicted, solver=dict(d["solver"]),
                   fingerprint=str(d["fingerprint"]), input_ranks=input_ranks,
                   output_ranks=output_ranks, **described)


