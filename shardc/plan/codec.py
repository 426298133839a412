"""The JSON form of a plan: what :meth:`shardc.plan.record.Plan.from_json` reads a plan file
with, and the error it raises on a file it cannot read.

A version 2 plan (what :meth:`~shardc.plan.record.Plan.to_json` writes) keeps every layout
once, in a table its values, ops and reshards index, and its ops and reshards as columns
(:class:`ColumnReader`); a version 1 plan writes each layout in place, and its ops and reshards
as objects (:class:`InPlaceReader`). Both readers build the plan's rows with the classes they are
given (:class:`~shardc.plan.record.OpPlan`, :class:`~shardc.plan.record.Reshard`), so this
module does not import the record it reads. What goes wrong reading one field becomes a
:class:`PlanFormatError` naming it (:func:`reading_field`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

from shardc.errors import PlanFormatError as PlanFormatError
from shardc.ir.sbp import NdSbp
from shardc.pipeline.schedule import Pipeline

__all__ = ["FIELDS", "FIELDS_V2", "ColumnReader", "InPlaceReader", "layout_reader", "parsed",
           "PlanFormatError", "program_fields", "reading_field"]

#: a row of a plan's ops or reshards, as the reader is given its class
Row = TypeVar("Row")


class InPlaceReader:
    """Reads version 1 plans: every layout written in place, ops and reshards as objects."""

    def __init__(self, nd: Callable[[Any], NdSbp]):
        self.nd = nd

    def layouts(self, xs) -> tuple[NdSbp, ...]:
        return tuple(map(self.nd, xs))

    def by_id(self, d: dict) -> dict[int, NdSbp]:
        return {int(k): self.nd(v) for k, v in d.items()}

    def ops(self, rows, op_plan: Callable[..., Row]) -> tuple[Row, ...]:
        out = []
        for i, o in enumerate(rows):
            with reading_field(f"ops[{i}]"):
                out.append(op_plan(**{**o, "ins": self.layouts(o["ins"]),
                                      "outs": self.layouts(o["outs"]),
                                      "reads": tuple(o.get("reads", ())),
                                      "writes": tuple(o.get("writes", ())),
                                      "source": str(o.get("source", "")),
                                      "where": tuple(int(i) for i in o.get("where", ()))}))
        return tuple(out)

    def reshards(self, rows, reshard: Callable[..., Row]) -> tuple[Row, ...]:
        out = []
        for i, r in enumerate(rows):
            with reading_field(f"reshards[{i}]"):
                out.append(reshard(**{**r, "src": self.nd(r["src"]), "dst": self.nd(r["dst"]),
                                      "collectives": tuple(r["collectives"]),
                                      "collective_bytes": tuple(r["collective_bytes"])}))
        return tuple(out)


class ColumnReader:
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
            raise PlanFormatError(f"layout index {k!r}")
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
            raise PlanFormatError(f"expected columns by name, got {type(d).__name__}")
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanFormatError(f"no column {missing[0]!r}")
        n = len(d[required[0]])
        bad = [k for k, col in d.items() if len(col) != n]
        if bad:
            raise PlanFormatError(f"columns of unequal lengths ({required[0]} {n} rows, {bad[0]} "
                                  f"{len(d[bad[0]])})")
        return n

    def ops(self, d, op_plan: Callable[..., Row]) -> tuple[Row, ...]:
        with reading_field("ops"):
            n = self._rows(d, ("id", "prim", "types", "ins", "outs", "compute_time",
                               "comm_time"))
            s, lay, none, c = self.strings, self.layouts, [()] * n, d
            return tuple(
                op_plan(int(i), s[p], s[t], lay(ins), lay(outs), float(ct), float(mt),
                        tuple(r), tuple(w), s[src] if src is not None else "", tuple(wh))
                for i, p, t, ins, outs, ct, mt, r, w, src, wh in zip(
                    c["id"], c["prim"], c["types"], c["ins"], c["outs"], c["compute_time"],
                    c["comm_time"], c.get("reads", none), c.get("writes", none),
                    c.get("source", [None] * n), c.get("where", none), strict=True))

    def reshards(self, d, reshard: Callable[..., Row]) -> tuple[Row, ...]:
        with reading_field("reshards"):
            self._rows(d, ("value", "consumer", "src", "dst", "time", "wire_bytes",
                           "collectives", "collective_bytes"))
            combined = d.get("combined", [[]] * len(d["value"]))
            return tuple(
                reshard(int(v), None if k is None else int(k), self.at(a), self.at(b),
                        float(t), float(w), tuple(map(str, cs)), tuple(map(float, bs)),
                        tuple(map(int, g)))
                for v, k, a, b, t, w, cs, bs, g in zip(
                    d["value"], d["consumer"], d["src"], d["dst"], d["time"], d["wire_bytes"],
                    d["collectives"], d["collective_bytes"], combined, strict=True))


FIELDS = ("mesh_axes", "cluster", "inputs", "outputs", "input_ranks", "output_ranks",
           "values", "ops", "reshards", "predicted", "solver", "fingerprint")
FIELDS_V2 = ("layouts", "strings")  # the tables a version 2 plan's fields index


@contextlib.contextmanager
def reading_field(name: str):
    """Turn what goes wrong reading field ``name`` into a :class:`PlanFormatError`."""
    try:
        yield
    except PlanFormatError as exc:  # a reader's own refusal: named by the field
        raise PlanFormatError(f"field {name}: {exc.what}") from exc
    except KeyError as exc:
        raise PlanFormatError(f"field {name} has no {exc.args[0]!r}") from exc
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise PlanFormatError(f"field {name} is malformed: {exc}") from exc


def parsed(text: str) -> tuple[dict, int]:
    """A saved plan's JSON object and format version, its fields all present."""
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
    return d, version


def layout_reader(d: dict, version: int, n_axes: int):
    """How a saved plan's layouts are read: from its tables (version 2) or in place (1).

    Each layout is checked against the mesh's ``n_axes``.
    """

    def nd(x) -> NdSbp:
        out = NdSbp.from_json(x)
        if len(out) != n_axes:
            raise PlanFormatError(f"{x} has {len(out)} mesh axes, the plan's mesh {n_axes}")
        return out

    if version == 2:
        with reading_field("layouts"):
            table = [nd(x) for x in d["layouts"]]
        with reading_field("strings"):
            strings = [str(s) for s in d["strings"]]
        return ColumnReader(table, strings)
    return InPlaceReader(nd)


def program_fields(d: dict, n_in: int, n_out: int) -> dict:
    """The fields that describe a saved plan's program.

    Names, types, remat, pipeline and offloading, checked against its ``n_in`` inputs and
    ``n_out`` outputs.
    """
    # what a plan saved before these fields existed lacks is left empty
    described = {}
    for key, per in (("input_ids", n_in), ("input_types", n_in), ("output_types", n_out),
                     ("input_names", n_in), ("output_names", n_out)):
        with reading_field(key):
            got = tuple(d.get(key, ()))
            if got and len(got) != per:
                raise PlanFormatError(f"{len(got)} entries for {per} leaves")
            described[key] = tuple(int(x) for x in got) if key == "input_ids" else \
                tuple(str(x) for x in got)
    with reading_field("remat"):  # a plan saved before remat was a choice recomputes nothing
        described["remat"] = tuple(int(k) for k in d.get("remat", ()))
        described["segments"] = int(d.get("segments", 0))
        if any(not 0 <= k < described["segments"] for k in described["remat"]):
            raise PlanFormatError(f"segments {list(described['remat'])} of "
                             f"{described['segments']}")
    with reading_field("pipeline"):  # a plan saved before pipelines runs none
        pipe = d.get("pipeline")
        described["pipeline"] = Pipeline.from_json(pipe) if pipe is not None else None
    with reading_field("offloaded"):  # a plan saved before offloading keeps all on device
        off = d.get("offloaded") or {}
        described["offloaded"] = tuple(int(k) for k in off.get("inputs", ()))
        described["offloaded_outputs"] = tuple(int(k) for k in off.get("outputs", ()))
        if any(not 0 <= k < n_in for k in described["offloaded"]) or any(
                not 0 <= k < n_out for k in described["offloaded_outputs"]):
            raise PlanFormatError("an offloaded leaf index out of range")
    return described
