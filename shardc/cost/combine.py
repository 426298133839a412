"""Which resharding collectives XLA will combine into one.

XLA's combiners merge collectives that do not depend on each other into one tuple collective
(a data-parallel step's gradient all-reduces compile to a single ``all-reduce`` of a tuple).
Values in the step's *tail*, from which every path to the outputs runs through elementwise
and layout ops only (gradients on their way into the optimizer update), are independent of
each other in that sense: their collectives share one latency. The cost model charges each of
them ``α / K`` for ``K`` tail values, so a plan that reduces all of them pays about one ``α``,
as the compiled program does.

These shares are the search's estimate; the plan's predicted figures and counts run
XLA's combiner itself on the chosen collectives (:mod:`shardc.cost.combiner`), which also
joins collectives outside the tail that do not depend on each other (a loss's all-reduce
and the backward pass's). Only the kinds in :data:`COMBINED_KINDS` share: XLA:CPU (jax
0.10) runs the all-reduce combiner but no all-gather combiner (five independent all-gathers
of sharded parameters compile to five ``all-gather`` ops), and its reduce-scatters are
all-reduces followed by a slice, so they combine as all-reduces do (:class:`Combiner`: the
backends' combiners).

References:
  XLA ``all_reduce_combiner.cc`` / ``all_gather_combiner.cc`` (combine independent
  collectives up to a byte threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir.flow import head_values, late_op, late_values
from shardc.ir.graph import Graph
from shardc.ir.prims import facts

__all__ = ["alpha_scales", "COMBINED_KINDS", "Combiner", "combiner_for", "COMBINERS", "XLA_CPU",
           "XLA_GPU"]

#: collective kinds whose independent instances XLA merges into one (see the module doc)
COMBINED_KINDS = frozenset({"all-reduce", "reduce-scatter"})


def alpha_scales(graph: Graph, combiner: Combiner | None = None) -> dict[int, float]:
    """value id -> the share of a collective's latency it pays.

    Tail values share one latency among the ``K`` places a collective enters the tail: the
    tail values made by non-tail ops (a data-parallel step's gradients and loss). A scan
    body's tail (the per-layer gradients of a scanned model, on their way out as ys)
    combines within an iteration only: its values share among the entries made as often
    as they are (``Op.weight``, standing for the loop they are in). Where the backend
    combines all-gathers (``combiner``: XLA:GPU), head values (:func:`shardc.ir.flow.
    head_values`: the parameters an FSDP step gathers) share one latency among the ``K`` of
    them the step's other ops read, the same way. A combiner with a byte limit runs ``K``
    entries of ``B`` bytes as ``max(1, B / limit)`` collectives (at most ``K``): each pays
    that many shares."""
    combiner = combiner or XLA_CPU
    runs = graph.runs()
    tail = late_values(graph)
    entries: dict[int, list[float]] = {}
    for op in graph.ops:
        if not late_op(op):
            for v in op.outputs:
                if v.id in tail:
                    entries.setdefault(op.weight, []).append(v.nbytes)
    out: dict[int, float] = {}
    if "all-gather" in combiner.kinds:
        head = head_values(graph)
        read: dict[int, list[float]] = {}
        seen: set[int] = set()
        for op in graph.ops:
            if facts(op.name).tail and all(v.id in head for v in op.outputs):
                continue  # a head op itself
            for v in op.inputs:
                if v.id in head and v.id not in seen:
                    seen.add(v.id)
                    read.setdefault(runs.get(v.id, 1), []).append(v.nbytes)
        shares = {w: _share(sizes, combiner) for w, sizes in read.items()}
        out.update((vid, shares.get(runs.get(vid, 1), 1.0)) for vid in head)
    shares = {w: _share(sizes, combiner) for w, sizes in entries.items()}
    out.update((vid, shares.get(runs.get(vid, 1), 1.0)) for vid in tail)
    return out


def _share(sizes, combiner: Combiner) -> float:
    """One value's share of a latency among entries of ``sizes`` bytes (:func:`alpha_scales`):
    ``K`` entries of ``B`` bytes in all run as ``max(1, B / limit)`` collectives."""
    if not sizes:
        return 1.0
    return min(1.0, max(1.0, sum(sizes) / combiner.threshold_bytes) / len(sizes))


@dataclass(frozen=True, slots=True)
class Combiner:
    """A backend's collective combiners: which kinds join (``families``: kind -> the
    combiner that takes it; kinds of one family combine with each other), and each combined
    collective's limits in result bytes and operands.

    Backend-specific: :data:`XLA_CPU` is what the bench compiles on (jax 0.10 XLA:CPU:
    an all-reduce combiner only; a reduce-scatter is an all-reduce and a slice there, so it
    combines with all-reduces of its group), :data:`XLA_GPU` XLA:GPU's defaults (all-reduce,
    all-gather, reduce-scatter and collective-permute combiners, each to 30 MiB; permutes
    of the same source-target pairs join: two rings' sends round one axis; no conversion
    the search prices runs a permute, so only the plan's rings meet that family).
    ``scatter_as_all_reduce``: the backend runs a reduce-scatter as an all-reduce of the
    whole buffer and a slice (XLA:CPU), so the whole buffer is held while it runs.
    ``reassociates``: the kinds whose two like reductions feeding one add the backend
    rewrites into one reduction of the sum
    (``add(reduce-scatter(x), reduce-scatter(y))`` -> ``reduce-scatter(add(x, y))``, each
    operand's collective read by the add alone): XLA:GPU's; a Llama's backward loop on
    (4, 2) H100s sums the gate and up projections' input gradients, each reduce-scattered
    over the second axis, and compiles to one reduce-scatter per layer, not two.

    References:
      XLA ``cpu_compiler.cc`` (``AllReduceCombiner`` with ``kCombineBytes`` = int64 max,
      ``kCombineCount`` = 256); XLA:GPU ``xla_gpu_all_reduce_combine_threshold_bytes`` and
      its all-gather / reduce-scatter / collective-permute twins (30 MiB;
      ``collective_permute_combiner.cc``, ``collective_permute_key.cc``: the key is the
      source-target pairs). Reduce-scatters of different scatter
      dimensions combine there (a ViT's gradients scattered over dims 0, 1 and 2 compile to
      one reduce-scatter, each transposed to scatter its leading dim), and all-gathers of
      different element types (XLA ``all_gather_combiner.cc``: its key holds no type).
      XLA ``gpu_compiler.cc``: its collective optimizations run ``AllReduceReassociate``
      and ``ReduceScatterReassociate`` (``all_reduce_reassociate.h``: an all-reduce read by
      one user only).
    """

    backend: str
    families: tuple[tuple[str, str], ...]
    threshold_bytes: float
    threshold_count: int
    scatter_as_all_reduce: bool = False
    reassociates: frozenset[str] = frozenset()

    def family(self, kind: str) -> str | None:
        return dict(self.families).get(kind)

    @property
    def kinds(self) -> frozenset[str]:
        """The collective kinds this backend combines (their latencies shared in the
        search's objective, :func:`alpha_scales`)."""
        return frozenset(k for k, _ in self.families)


XLA_CPU = Combiner("cpu", (("all-reduce", "all-reduce"), ("reduce-scatter", "all-reduce")),
                   float(2**63 - 1), 256, scatter_as_all_reduce=True)
XLA_GPU = Combiner("gpu", (("all-reduce", "all-reduce"), ("all-gather", "all-gather"),
                           ("reduce-scatter", "reduce-scatter"),
                           ("collective-permute", "collective-permute")), 30 * 2**20, 256,
                   reassociates=frozenset({"all-reduce", "reduce-scatter"}))
COMBINERS = {"cpu": XLA_CPU, "gpu": XLA_GPU, "cuda": XLA_GPU, "rocm": XLA_GPU}


def combiner_for(platform: str | None) -> Combiner:
    """The combiner of the backend ``platform`` compiles for (XLA:CPU's when unknown)."""
    return COMBINERS.get(platform or "cpu", XLA_CPU)
