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
from collections.abc import Callable
from typing import Any, TypeVar

from shardc.errors import PlanFormatError as PlanFormatError
from shardc.ir.sbp import NdSbp

__all__ = ["FIELDS", "FIELDS_V2", "ColumnReader", "InPlaceReader", "PlanFormatError",
           "reading_field"]

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
