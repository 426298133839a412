"""Predicted vs compiled: does XLA emit the collectives the plan chose?

Collectives are compared per kind (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute): count (each op once, a loop body's once), wire bytes per device and
time on the plan's cluster (inside a loop body, times its trips). The planned count counts
the collectives the plan expects XLA to combine into one tuple collective once
(``Reshard.combined``, made by running the backend's combiner on the plan:
:mod:`shardc.cost.combiner`). Counts are a backend's: XLA:CPU has an all-reduce combiner
only, XLA:GPU combines all-gathers and reduce-scatters too, each to a byte limit. A kind
only in the HLO is *unplanned*, only in the plan is *missing*.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from jax.sharding import Mesh

from shardc.errors import OptionsError
from shardc.util.tables import Table

__all__ = ["KindRow", "KINDS", "Verification", "planned", "verify"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class KindRow:
    kind: str
    planned_count: int
    planned_bytes: float
    compiled_count: int
    compiled_bytes: float
    compiled_time: float

    @property
    def status(self) -> str:
        if self.planned_count and self.compiled_count:
            return "matched"
        return "unplanned" if self.compiled_count else "missing"


@dataclass(frozen=True)
class Verification:
    rows: tuple[KindRow, ...]
    predicted_comm_time: float
    compiled_comm_time: float
    predicted_bytes: float
    compiled_bytes: float

    @property
    def time_error(self) -> float:
        """(predicted - compiled) / compiled communication time; 0 when both are 0."""
        if not self.compiled_comm_time:
            return 0.0 if not self.predicted_comm_time else float("inf")
        return (self.predicted_comm_time - self.compiled_comm_time) / self.compiled_comm_time

    @property
    def counts_match(self) -> bool:
        """Every kind's planned count (combined collectives once) is the compiled count."""
        return all(r.planned_count == r.compiled_count for r in self.rows)

    @property
    def unplanned(self) -> list[KindRow]:
        return [r for r in self.rows if r.status == "unplanned"]

    @property
    def missing(self) -> list[KindRow]:
        return [r for r in self.rows if r.status == "missing"]

    def table(self) -> Table:
        """The comparison as a :class:`shardc.util.tables.Table` (one row per kind)."""
        return Table(
            "predicted vs compiled collectives (wire bytes per device):",
            ("kind", "planned", "MiB", "compiled", "MiB", "status"),
            tuple((r.kind, str(r.planned_count), f"{r.planned_bytes / 2**20:.2f}",
                   str(r.compiled_count), f"{r.compiled_bytes / 2**20:.2f}", r.status)
                  for r in self.rows), align="<>>>><", indent=2,
            caption=f"comm time: predicted {self.predicted_comm_time * 1e6:.1f} us, compiled "
                    f"{self.compiled_comm_time * 1e6:.1f} us ({self.time_error * 100:+.1f}%)")

    def report(self) -> str:
        return "\n".join(self.table().text())


def planned(plan) -> tuple[dict[str, int], dict[str, float]]:
    """The collectives ``plan`` expects in its compiled program: ``(count, wire bytes per
    device)`` by kind, the members of one combined collective (``Reshard.combined``)
    counted once."""
    count: dict[str, int] = defaultdict(int)
    nbytes: dict[str, float] = defaultdict(float)
    groups: dict[str, set[int]] = defaultdict(set)
    for r in plan.reshards:
        joins = r.combined or (-1,) * len(r.collectives)
        for name, b, g in zip(r.collectives, r.collective_bytes, joins, strict=True):
            kind = name.split("@")[0]
            if kind in KINDS:
                if g < 0:
                    count[kind] += 1
                else:
                    groups[kind].add(g)
                nbytes[kind] += b
    for kind, ids in groups.items():
        count[kind] += len(ids)
    return count, nbytes


def verify(plan, compiled, mesh: Mesh | None = None) -> Verification:
    from shardc.inspect.hlo import price

    if mesh is None:
        raise OptionsError("verify needs the mesh the program was compiled for: "
                           "plan.verify(compiled, mesh)")
    cost = price(compiled, mesh, plan.cluster)
    planned_n, planned_b = planned(plan)
    comp_n: dict[str, int] = defaultdict(int)
    comp_b: dict[str, float] = defaultdict(float)
    comp_t: dict[str, float] = defaultdict(float)
    for c, t, n in zip(cost.collectives, cost.times, cost.runs, strict=True):
        comp_n[c.kind] += 1
        comp_b[c.kind] += c.wire_bytes * n
        comp_t[c.kind] += t
    rows = tuple(KindRow(k, planned_n[k], planned_b[k], comp_n[k], comp_b[k], comp_t[k])
                 for k in KINDS if planned_n[k] or comp_n[k])
    return Verification(rows, plan.predicted.comm_time, cost.comm_time,
                        plan.predicted.comm_bytes, cost.wire_bytes)
