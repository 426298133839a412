"""A placement plan: every value's NdSbp, every op's strategy, and what it should cost.

The predicted figures are recomputed from the final choices (not read off the solver), so
they hold for plans loaded from JSON too, and they count what the solver's pairwise
objective cannot: a value converted the same way for several consumers pays once (XLA CSEs
the collectives), so a plan's predicted step may be below its solver objective.
``explain()`` prints the per-op table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from shardc.cost.cluster import Cluster
from shardc.cost.collectives import seconds
from shardc.cost.combine import alpha_scales, combiner_for
from shardc.cost.combiner import Pending, Use, combine_groups
from shardc.cost.comm import conversion
from shardc.ir.flow import carry_exit, loop_tests, loop_ties, read_runs, reads
from shardc.ir.graph import Graph
from shardc.ir.sbp import B, NdSbp, Partial, to_partition_spec
from shardc.pipeline.schedule import Pipeline
from shardc.solve.costgraph import CostGraph
from shardc.solve.memory import memory_profile
from shardc.solve.problem import feed_time
from shardc.solve.reduced_ys import unreduced_ys, ys_exits, ys_shares


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
    #: members, :func:`_combine`), -1 where it runs on its own; () in older plans
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
        """:meth:`explain` as a :class:`shardc.report.tables.Report`: ``str()`` is the text, a rich
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
        missing = [k for k in _FIELDS + (_FIELDS_V2 if version == 2 else ()) if k not in d]
        if missing:
            raise PlanFormatError(f"missing field(s) {missing}")
        with _field("mesh_axes"):
            mesh_axes = tuple((str(n), int(s)) for n, s in d["mesh_axes"])
        n_axes = len(mesh_axes)

        def nd(x) -> NdSbp:
            out = NdSbp.from_json(x)
            if len(out) != n_axes:
                raise ValueError(f"{x} has {len(out)} mesh axes, the plan's mesh {n_axes}")
            return out

        if version == 2:
            with _field("layouts"):
                table = [nd(x) for x in d["layouts"]]
            with _field("strings"):
                strings = [str(s) for s in d["strings"]]
            read = _Columns(table, strings)
        else:
            read = _InPlace(nd)
        with _field("cluster"):
            cluster = Cluster.from_json(d["cluster"])
        with _field("inputs"):
            inputs = read.layouts(d["inputs"])
        with _field("outputs"):
            outputs = read.layouts(d["outputs"])
        with _field("values"):
            values = read.by_id(d["values"])
        with _field("settled"):
            settled = read.by_id(d["settled"]) if "settled" in d else {}
        ops = read.ops(d["ops"])
        reshards = read.reshards(d["reshards"])
        with _field("predicted"):
            predicted = Predicted(**d["predicted"])
        with _field("input_ranks / output_ranks"):
            input_ranks = tuple(int(r) for r in d["input_ranks"])
            output_ranks = tuple(int(r) for r in d["output_ranks"])
            if len(input_ranks) != len(inputs) or len(output_ranks) != len(outputs):
                raise ValueError("one rank per input and per output")
        # what a plan saved before these fields existed lacks is left empty
        described = {}
        for key, per in (("input_ids", inputs), ("input_types", inputs),
                         ("output_types", outputs), ("input_names", inputs),
                         ("output_names", outputs)):
            with _field(key):
                got = tuple(d.get(key, ()))
                if got and len(got) != len(per):
                    raise ValueError(f"{len(got)} entries for {len(per)} leaves")
                described[key] = tuple(int(x) for x in got) if key == "input_ids" else \
                    tuple(str(x) for x in got)
        with _field("remat"):  # a plan saved before remat was a choice recomputes nothing
            described["remat"] = tuple(int(k) for k in d.get("remat", ()))
            described["segments"] = int(d.get("segments", 0))
            if any(not 0 <= k < described["segments"] for k in described["remat"]):
                raise ValueError(f"segments {list(described['remat'])} of "
                                 f"{described['segments']}")
        with _field("pipeline"):  # a plan saved before pipelines runs none
            pipe = d.get("pipeline")
            described["pipeline"] = Pipeline.from_json(pipe) if pipe is not None else None
        return cls(mesh_axes=mesh_axes, cluster=cluster, inputs=inputs, outputs=outputs,
                   values=values, settled=settled, ops=ops, reshards=reshards,
                   predicted=predicted, solver=dict(d["solver"]),
                   fingerprint=str(d["fingerprint"]), input_ranks=input_ranks,
                   output_ranks=output_ranks, **described)


class _InPlace:
    """Reads version 1 plans: every layout written in place, ops and reshards as objects."""

    def __init__(self, nd: Callable[[Any], NdSbp]):
        self.nd = nd

    def layouts(self, xs) -> tuple[NdSbp, ...]:
        return tuple(map(self.nd, xs))

    def by_id(self, d: dict) -> dict[int, NdSbp]:
        return {int(k): self.nd(v) for k, v in d.items()}

    def ops(self, rows) -> tuple[OpPlan, ...]:
        out = []
        for i, o in enumerate(rows):
            with _field(f"ops[{i}]"):
                out.append(OpPlan(**{**o, "ins": self.layouts(o["ins"]),
                                     "outs": self.layouts(o["outs"]),
                                     "reads": tuple(o.get("reads", ())),
                                     "writes": tuple(o.get("writes", ())),
                                     "source": str(o.get("source", "")),
                                     "where": tuple(int(i) for i in o.get("where", ()))}))
        return tuple(out)

    def reshards(self, rows) -> tuple[Reshard, ...]:
        out = []
        for i, r in enumerate(rows):
            with _field(f"reshards[{i}]"):
                out.append(Reshard(**{**r, "src": self.nd(r["src"]), "dst": self.nd(r["dst"]),
                                      "collectives": tuple(r["collectives"]),
                                      "collective_bytes": tuple(r["collective_bytes"])}))
        return tuple(out)


class _Columns:
    """Reads version 2 plans: layouts and strings by index into the file's tables, ops and
    reshards as columns (one list per field, all of one length)."""

    def __init__(self, table: list[NdSbp], strings: list[str]):
        self.table = table
        self.strings = strings
        #: an op's input / output layouts as written (a list of indices) -> the layouts:
        #: thousands of ops share a few hundred such lists, each resolved once
        self.tuples: dict[tuple, tuple[NdSbp, ...]] = {}

    def at(self, k) -> NdSbp:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"layout index {k!r}")
        return self.table[k]

    def layouts(self, xs) -> tuple[NdSbp, ...]:
        key = tuple(xs)
        got = self.tuples.get(key)
        if got is None:
            got = self.tuples[key] = tuple(map(self.at, key))
        return got

    def by_id(self, d: dict) -> dict[int, NdSbp]:
        return dict(zip(map(int, d["ids"]), map(self.at, d["layouts"]), strict=True))

    @staticmethod
    def _rows(d: dict, required: tuple[str, ...]) -> int:
        """The number of rows of the table ``d`` (its columns by name), checking that it
        has the ``required`` columns and that all have as many rows."""
        if not isinstance(d, dict):
            raise TypeError(f"expected columns by name, got {type(d).__name__}")
        missing = [k for k in required if k not in d]
        if missing:
            raise KeyError(missing[0])
        n = len(d[required[0]])
        bad = [k for k, col in d.items() if len(col) != n]
        if bad:
            raise ValueError(f"columns of unequal lengths ({required[0]} {n} rows, {bad[0]} "
                             f"{len(d[bad[0]])})")
        return n

    def ops(self, d) -> tuple[OpPlan, ...]:
        with _field("ops"):
            n = self._rows(d, ("id", "prim", "types", "ins", "outs", "compute_time",
                               "comm_time"))
            s, lay, none, c = self.strings, self.layouts, [()] * n, d
            return tuple(
                OpPlan(int(i), s[p], s[t], lay(ins), lay(outs), float(ct), float(mt),
                       tuple(r), tuple(w), s[src] if src is not None else "", tuple(wh))
                for i, p, t, ins, outs, ct, mt, r, w, src, wh in zip(
                    c["id"], c["prim"], c["types"], c["ins"], c["outs"], c["compute_time"],
                    c["comm_time"], c.get("reads", none), c.get("writes", none),
                    c.get("source", [None] * n), c.get("where", none), strict=True))

    def reshards(self, d) -> tuple[Reshard, ...]:
        with _field("reshards"):
            self._rows(d, ("value", "consumer", "src", "dst", "time", "wire_bytes",
                           "collectives", "collective_bytes"))
            combined = d.get("combined", [[]] * len(d["value"]))
            return tuple(
                Reshard(int(v), None if k is None else int(k), self.at(a), self.at(b),
                        float(t), float(w), tuple(map(str, cs)), tuple(map(float, bs)),
                        tuple(map(int, g)))
                for v, k, a, b, t, w, cs, bs, g in zip(
                    d["value"], d["consumer"], d["src"], d["dst"], d["time"], d["wire_bytes"],
                    d["collectives"], d["collective_bytes"], combined, strict=True))


class PlanFormatError(ValueError):
    """A plan file that cannot be read; the message names the field."""

    def __init__(self, what: str):
        super().__init__(f"cannot read the plan: {what}. Plan again and save it with "
                         "plan.to_json()")


_FIELDS = ("mesh_axes", "cluster", "inputs", "outputs", "input_ranks", "output_ranks",
           "values", "ops", "reshards", "predicted", "solver", "fingerprint")
_FIELDS_V2 = ("layouts", "strings")  # the tables a version 2 plan's fields index


@contextlib.contextmanager
def _field(name: str):
    """Turn what goes wrong reading field ``name`` into a :class:`PlanFormatError`."""
    try:
        yield
    except KeyError as exc:
        raise PlanFormatError(f"field {name} has no {exc.args[0]!r}") from exc
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise PlanFormatError(f"field {name} is malformed: {exc}") from exc


def _combine(reshards: list, ops: list, comm: float, combined: dict, model: str
             ) -> tuple[list, list, float]:
    """Price each group of collectives XLA combines into one tuple collective
    (:func:`shardc.cost.combiner.combine_groups`; one of a kind per combined set, keyed
    ``(kind, group, runs, set)``) as that one collective: NCCL picks its algorithm and
    protocol for the whole buffer, and it pays one latency. Each member's reshard (and its
    reader's comm time) gets its part of the group's time in proportion to its bytes, in
    place of the share it was charged (a collective left alone: its full time)."""
    delta: dict[int, float] = {}
    for (kind, group, times, _), members in combined.items():
        whole = sum(b for _, b, _ in members)
        if not whole:
            continue
        t = seconds(kind, group, whole, model) * times
        for index, nbytes, charged in members:
            delta[index] = delta.get(index, 0.0) + t * nbytes / whole - charged
    if not delta:
        return reshards, ops, comm
    by_op: dict[int, float] = {}
    out = list(reshards)
    for index, d in delta.items():
        r = out[index]
        out[index] = dataclasses.replace(r, time=r.time + d)
        if r.consumer is not None and r.consumer >= 0:
            by_op[r.consumer] = by_op.get(r.consumer, 0.0) + d
    ops = [dataclasses.replace(o, comm_time=o.comm_time + by_op[o.id]) if o.id in by_op else o
           for o in ops]
    return out, ops, comm + sum(delta.values())


def _joined(graph: Graph, uses: list, via: dict, pending: list, combiner, reshards: list
            ) -> dict[tuple, list[tuple[int, float, float]]]:
    """Run XLA's combiner on the plan's collectives (:func:`shardc.cost.combiner.
    combine_groups`): mark each reshard's collectives with the combined collective they join
    (``Reshard.combined``, in place) and return the members of each, keyed ``(kind, group,
    runs, set)``, as :func:`_combine` prices them (a collective left alone is a set of one)."""
    sets = combine_groups(graph, uses, via, [p for p, _ in pending], combiner)
    combined: dict[tuple, list[tuple[int, float, float]]] = {}
    joins = {k: list(r.combined) for k, r in enumerate(reshards)}
    for n, ((p, (kind, group, times, charged, buffer)), g) in enumerate(
            zip(pending, sets, strict=True)):
        key = (kind, group, times, g if g >= 0 else -1 - n)
        combined.setdefault(key, []).append((p.reshard, buffer, charged))
        if g >= 0:
            joins[p.reshard][p.position] = list(combined).index(key)
    for k, j in joins.items():
        if tuple(j) != reshards[k].combined:
            reshards[k] = dataclasses.replace(reshards[k], combined=tuple(j))
    return combined


def assemble(graph: Graph, cg: CostGraph, choice: Sequence[int], ties: Sequence[tuple[int, int]],
             solver: dict, remat: tuple[int, ...] = (), segments: int = 0,
             platform: str | None = None) -> Plan:
    """Build the Plan from per-node choices of a cost graph ``cg`` (solve.costgraph.CostGraph)
    of ``graph``, a program that recomputes its segments ``remat`` of ``segments``, compiled
    for ``platform`` (whose combiners join collectives: :func:`shardc.cost.combiner.
    combiner_for`; XLA:CPU's when None)."""
    sizes, names, cluster = cg.axis_sizes, cg.axis_names, cg.cluster
    rate = cluster.device_flops * cluster.utilization
    values: dict[int, NdSbp] = {}
    scale = alpha_scales(graph)
    n_in = len(graph.inputs)
    for k, v in enumerate(graph.inputs):
        values[v.id] = cg.choices[k][choice[k]]
    ops, reshards = [], []
    comm = wire = compute = 0.0

    done: dict[tuple, int] = {}  # (value, src, dst) -> its reshard
    folded = graph.constants()  # read partial, one is made so (as in the cost graph)
    combiner = combiner_for(platform)
    uses: list[Use] = []  # per reshard, where it sits (for XLA's combiner)
    via: dict[tuple[int, int], int] = {}  # (consumer, value) -> the reshard it reads
    #: the collectives a combiner may join, with (kind, group, runs, seconds charged)
    pending: list[tuple[Pending, tuple]] = []

    def record(value, consumer, src, dst, times: int = 1, reduced: bool = False) -> float:
        """Price converting ``value`` from ``src`` to ``dst`` for ``consumer``, ``times``
        per call (every iteration of a loop body). A constant read partial is free, as in
        the cost graph. The same conversion of the same value for another consumer is
        free: XLA's CSE merges the identical collectives (a parameter stored sharded and
        gathered for the forward and the backward dot compiles to one all-gather).
        ``reduced``: the consumer's results are all reduced where made (settled), so one
        it reads made partial here is read apart (:class:`shardc.cost.combiner.Use`)."""
        nonlocal comm, wire
        conv = conversion(src, dst, sizes, names, cluster)
        if not conv.collectives or value.id in folded and dst.has_partial:
            return 0.0
        if (value.id, src, dst) in done:
            via.setdefault((consumer, value.id), done[(value.id, src, dst)])
            return 0.0
        done[(value.id, src, dst)] = via[(consumer, value.id)] = len(reshards)
        uses.append(Use(value.id, consumer, reduced and any(
            isinstance(d, Partial) and s != d for s, d in zip(src.sbps, dst.sbps))))
        share = scale.get(value.id, 1.0)
        t = conv.time(value.nbytes, share) * times
        for k, c in enumerate(conv.collectives):
            family = combiner.family(c.kind)
            if c.group is not None and family is not None:
                op = next((s.reduction for a in c.axes
                           if isinstance(s := src.sbps[a], Partial)), "sum")
                key = (family, c.axes, op, value.type_str().split("[")[0], times)
                # the combiners' limit is on result bytes: a reduce-scatter's is its
                # buffer over the group, where it runs as one (not as an all-reduce);
                # NCCL prices the buffer
                buffer = c.buffer_factor * value.nbytes
                result = buffer / (c.group.ranks if c.kind == "reduce-scatter" and
                                   not combiner.scatter_as_all_reduce else 1)
                pending.append((Pending(len(reshards), k, key, result),
                                (c.kind, c.group, times,
                                 c.seconds(value.nbytes, cluster.collective_model, share)
                                 * times, buffer)))
        comm += t
        wire += conv.wire_bytes(value.nbytes) * times
        reshards.append(Reshard(value.id, consumer, src, dst, t,
                                conv.wire_bytes(value.nbytes) * times,
                                tuple(f"{c.kind}@{'+'.join(names[a] for a in c.axes)}"
                                      for c in conv.collectives),
                                tuple(c.bytes_factor * value.nbytes * times
                                      for c in conv.collectives),
                                (-1,) * len(conv.collectives)))
        return t

    settled = {vid: cg.choices[w][choice[w]] for vid, w in cg.settle.items()}
    runs = graph.runs()
    reduced_ys = ys_exits(graph)
    scale.update(ys_shares(graph, reduced_ys))  # the after-loop all-reduces, combined

    def settle(v) -> None:
        if v.id in settled:
            record(v, None, values[v.id], settled[v.id], runs.get(v.id, 1))

    def read(v) -> NdSbp:
        return settled.get(v.id, values[v.id])

    for v in graph.inputs:
        settle(v)
    for j, op in enumerate(graph.ops):
        strat = cg.choices[n_in + j][choice[n_in + j]]
        op_comm = 0.0
        reduced = bool(op.outputs) and all(v.id in settled for v in op.outputs)
        for k, v in reads(op):
            if not v.is_const:
                op_comm += record(v, op.id, values[v.id] if carry_exit(op) else read(v),
                                  strat.ins[k], read_runs(runs, v, op), reduced)
        if op.id in reduced_ys and (held := unreduced_ys(strat)) is not None:
            op_comm += record(op.outputs[0], op.id, held, strat.outs[0])  # after the loop
        for v, nd in zip(op.outputs, strat.outs):
            values[v.id] = nd
            settle(v)
        types = (",".join(v.type_str() for v in op.inputs) + "->" +
                 ",".join(v.type_str() for v in op.outputs))
        ops.append(OpPlan(op.id, op.name, types, strat.ins, strat.outs,
                          strat.flops / rate * op.weight, op_comm,
                          tuple(-1 if v.is_const else v.id for v in op.inputs),
                          tuple(v.id for v in op.outputs), op.source, op.where))
        compute += strat.flops / rate * op.weight
    for enter, v in loop_ties(graph):  # a scan's carry back to its carried layout
        record(v, enter.id, read(v), values[enter.outputs[0].id], runs.get(v.id, 1))
    for v in loop_tests(graph):  # a while's predicate, read replicated every iteration
        record(v, None, read(v), NdSbp((B,) * len(sizes)), runs.get(v.id, 1))
    tied = dict(ties)
    outputs = []
    for j, v in enumerate(graph.outputs):
        if v.is_const:
            src = NdSbp((B,) * len(sizes))
        elif j in tied and graph.inputs[tied[j]].id == v.id:
            src = values[v.id]  # the state passed through unchanged
        else:
            src = read(v)
        if j in cg.fixed.outputs:
            dst = cg.fixed.outputs[j]
        else:
            dst = values[graph.inputs[tied[j]].id] if j in tied else unreduced(src)
        if not v.is_const:
            record(v, -1 - j, src, dst)
        outputs.append(dst)
    combined = _joined(graph, uses, via, pending, combiner, reshards)
    reshards, ops, comm = _combine(reshards, ops, comm, combined, cluster.collective_model)
    peak = float(np.max(memory_profile(cg, choice)))  # the profile budgets are held to
    carried = set(tied.values()) | cg.resident
    feed = sum(feed_time(v, values[v.id], sizes, cluster, k in carried)
               for k, v in enumerate(graph.inputs))
    return Plan(tuple(zip(names, sizes)), cluster,
                tuple(values[v.id] for v in graph.inputs), tuple(outputs), values, tuple(ops),
                tuple(reshards), Predicted(comm, compute, wire, peak, feed), dict(solver),
                fingerprint(graph), tuple(v.ndim for v in graph.inputs),
                tuple(v.ndim for v in graph.outputs), settled,
                tuple(v.id for v in graph.inputs), tuple(v.type_str() for v in graph.inputs),
                tuple(v.type_str() for v in graph.outputs), remat=tuple(remat),
                segments=segments)
