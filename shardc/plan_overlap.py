"""A plan's predicted step with its communication overlapped with its compute.

:class:`shardc.plan.Predicted` adds every conversion's time to the compute time.
:func:`plan_overlap` replays the plan the way :mod:`shardc.inspect.schedule` replays a
compiled program, from the plan alone (to re-rank candidate plans without compiling
them):

- **compute**: the plan's ops in program order, one after another, each its predicted
  compute time (loop bodies already weighted by their trip counts);
- **communication**: one stream; each conversion (:class:`shardc.plan.Reshard`, all its
  collectives one block) can start when the op producing its value ends (a program input
  at 0; a conversion from another conversion's result, as a value's settling followed by
  its reader's own conversion, when that one ends). Whenever the stream is free it runs
  the startable conversion needed first (:func:`shardc.inspect.schedule.next_collective`).
- an op starts when the stream is free and every conversion it reads has ended: the one
  made for it (``consumer``), and any conversion of a value it reads whose target layout
  is the layout it reads that value in (a conversion shared by several readers is recorded
  for the first one only, its other readers wait for it too).

Conversions for the program's outputs are awaited by the end of the step. The result's
``time`` excludes the host feed (``Predicted.feed_time``), which runs before the step;
``compute`` and ``comm`` are the plan's predicted figures, so
``max(comm, compute) <= time <= comm + compute``.

Not modelled, as in the compiled replay: limits on how far ahead a conversion may run, and
loop iterations (a loop body's ops are one op each here, weighted by trip count, so a
conversion inside a body overlaps the whole loop's other ops).

References:
  XLA ``latency_hiding_scheduler.cc`` (collectives overlapped with independent compute);
  NCCL user guide, "CUDA stream semantics" (a stream's operations run in issue order).
"""

from __future__ import annotations

from shardc.inspect.schedule import Overlap, next_collective
from shardc.plan import Plan

__all__ = ["plan_overlap", "ranking_time"]


def _waiters(plan: Plan) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(op position -> the conversions it waits for, conversion -> the conversion whose
    result it converts further: a first step, from the layout its value is produced in)."""
    pos = {op.id: i for i, op in enumerate(plan.ops)}
    by_value: dict[int, list[int]] = {}
    for k, r in enumerate(plan.reshards):
        by_value.setdefault(r.value, []).append(k)
    after: dict[int, int] = {}
    for v, ks in by_value.items():
        made = plan.values.get(v)
        for k in ks:
            if plan.reshards[k].src != made:
                first = [j for j in ks if plan.reshards[j].src == made and
                         plan.reshards[j].dst == plan.reshards[k].src]
                if first:
                    after[k] = first[0]
    waits: dict[int, list[int]] = {}
    for k, r in enumerate(plan.reshards):
        if r.consumer in pos:
            waits.setdefault(pos[r.consumer], []).append(k)
    for i, op in enumerate(plan.ops):
        mine = waits.setdefault(i, [])
        for v, layout in zip(op.reads, op.ins):
            mine += [k for k in by_value.get(v, ()) if plan.reshards[k].dst == layout and
                     k not in mine]
    return waits, after


def plan_overlap(plan: Plan) -> Overlap:
    """``plan``'s predicted step (less the feed) with each conversion run beside the ops
    that do not wait for it (module docstring)."""
    waits, after = _waiters(plan)
    deadline = {k: len(plan.ops) for k in range(len(plan.reshards))}
    for i in sorted(waits, reverse=True):
        for k in waits[i]:
            deadline[k] = min(deadline[k], i)
    for k, first in after.items():  # a first step is due when the step after it is
        deadline[first] = min(deadline[first], deadline[k])
    then: dict[int, list[int]] = {}  # conversion -> those converting its result further
    for k, first in after.items():
        then.setdefault(first, []).append(k)
    of_value: dict[int, list[int]] = {}  # value -> its first steps
    for k, r in enumerate(plan.reshards):
        if k not in after:
            of_value.setdefault(r.value, []).append(k)
    ready: dict[int, tuple[float, float]] = {}  # startable conversion -> (start, deadline)
    done: dict[int, float] = {}  # conversion -> when it ends
    compute = comm = 0.0

    def produce(v: int, t: float) -> None:
        ready.update((k, (t, deadline[k])) for k in of_value.pop(v, ()))

    def run(until: list[int] | None) -> None:
        nonlocal comm
        while ready and (until is None or any(k not in done for k in until)):
            k = next_collective(ready, comm)
            comm = max(comm, ready.pop(k)[0]) + plan.reshards[k].time
            done[k] = comm
            ready.update((j, (comm, deadline[j])) for j in then.get(k, ()))

    made = {v for op in plan.ops for v in op.writes}
    for v in [v for v in of_value if v not in made]:  # inputs (and constants): at 0
        produce(v, 0.0)
    for i, op in enumerate(plan.ops):
        need = waits.get(i, [])
        run(need)
        compute = max([compute, *(done.get(k, 0.0) for k in need)]) + op.compute_time
        for v in op.writes:
            produce(v, compute)
    run(None)
    # a conversion never startable (assemble() makes none) runs after the rest
    stranded = sum(r.time for k, r in enumerate(plan.reshards) if k not in done)
    return Overlap(max(compute, comm) + stranded, plan.predicted.compute_time,
                   plan.predicted.comm_time)


def ranking_time(plan: Plan) -> float:
    """The seconds the search ranks ``plan`` by: its overlapped step plus the feed where its
    cluster asks for overlap (``Cluster(overlap=True)``), else its predicted step."""
    if plan.cluster.overlap:
        return plan_overlap(plan).time + plan.predicted.feed_time
    return plan.predicted.step_time
