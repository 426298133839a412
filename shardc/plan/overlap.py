"""A plan's predicted step with its communication overlapped with its compute.

:class:`shardc.plan.record.Predicted` adds every conversion's time to the compute time.
:func:`plan_overlap` replays the plan the way :mod:`shardc.inspect.schedule` replays a
compiled program, from the plan alone (to re-rank candidate plans without compiling
them):

- **compute**: the plan's ops one after another, each its predicted compute time (loop
  bodies already weighted by their trip counts), in the order XLA's scheduler gives them
  (:func:`_in_order`), not program order. The scheduler lists the program bottom-up, so an
  op runs as late as its uses allow: what reads the state alone (a weight's reshape) first,
  then the rest by its longest path to the step's end, longest first. A weight gradient,
  which only the update reads, then comes after the rest of the backward pass, and so
  does its reduction, while FSDP's weight all-gathers run from the start. XLA:GPU starts a
  data-parallel plan's combined gradient all-reduces earlier, back to back from about the
  middle of the backward pass, so the estimate hides less of them than the compiled step
  does (the design notes, "Where the overlap estimate misses", give the figures).
- **communication**: one stream; each conversion (:class:`shardc.plan.record.Reshard`, all its
  collectives one block) can start when the op producing its value ends (a program input
  at 0; a conversion from another conversion's result, as a value's settling followed by
  its reader's own conversion, when that one ends). Conversions XLA combines into one
  collective (``Reshard.combined``) are one block, startable once every member is.
  Whenever the stream is free it runs the startable block needed first
  (:func:`shardc.inspect.schedule.next_collective`).
- an op starts when the stream is free and every conversion it reads has ended: the one
  made for it (``consumer``), and any conversion of a value it reads whose target layout
  is the layout it reads that value in (a conversion shared by several readers is recorded
  for the first one only, its other readers wait for it too).

Measured against the compiled programs (GPT-2 small, XLA:GPU for H100s, each priced by
:mod:`shardc.inspect.schedule`): on node-8 the four candidates the search keeps on the
8-GPU mesh rank in the compiled order, each predicted 0.6-0.9 ms (12-22%) above its
compiled step; in program order the replay ranked the solver's plan first (4.11 ms) where
it compiles to 5.13 ms, behind FSDP's 4.56 and the Megatron seed's 4.19. On 2 nodes x 8
the plan it ranks first (the FSDP seed with a vocabulary-split table; 6.55 ms) compiles to
5.40 ms, against the fastest expert's 6.06.

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

from collections.abc import Sequence

from shardc.inspect.schedule import Overlap, next_collective
from shardc.ir.prims import facts
from shardc.plan.record import OpPlan, Plan

__all__ = ["plan_overlap", "ranking_time"]


def _waiters(plan: Plan, ops: Sequence[OpPlan]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(position in ``ops`` -> the conversions that op waits for, conversion -> the
    conversion whose result it converts further: a first step, from the layout its value is
    produced in)."""
    pos = {op.id: i for i, op in enumerate(ops)}
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
    for i, op in enumerate(ops):
        mine = waits.setdefault(i, [])
        for v, layout in zip(op.reads, op.ins):
            mine += [k for k in by_value.get(v, ()) if plan.reshards[k].dst == layout and
                     k not in mine]
    return waits, after


def _in_order(plan: Plan, blocks: list[list[int]]) -> list[OpPlan]:
    """The plan's ops in the order XLA's scheduler runs them (:mod:`shardc.plan.overlap`
    docstring): first what reads the state as held (an input the step's tail reads,
    :func:`shardc.ir.flow.tail_values`, as the optimizer update reads the parameters,
    and what is computed from such inputs alone: a weight's reshape), which nothing else
    holds back; then the rest as late as its longest path to the step's end allows, longest
    first, ties in program order. A collective combined from several conversions
    (``blocks``) waits for each member's value and holds back each member's reader, so the
    producer of one member runs before the readers of all (XLA combines the token ids'
    gather for the embedding with the one for its gradient, and computes both first)."""
    ops = plan.ops
    pos = {op.id: i for i, op in enumerate(ops)}
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.reads:
            readers.setdefault(v, []).append(i)
    tail_value: set[int] = set()
    is_tail = [False] * len(ops)
    for i in reversed(range(len(ops))):
        tail_value.update(v for v in ops[i].writes
                          if all(is_tail[u] for u in readers.get(v, ())))
        is_tail[i] = facts(ops[i].prim).tail and all(v in tail_value for v in ops[i].writes)
    users = [[u for v in op.writes for u in readers.get(v, ())] for op in ops]
    producer = {v: i for i, op in enumerate(ops) for v in op.writes}
    for members in (m for m in blocks if len(m) > 1):
        held = {pos[plan.reshards[k].consumer] for k in members
                if plan.reshards[k].consumer in pos}
        held.update(u for k in members if plan.reshards[k].consumer is None
                    for u in readers.get(plan.reshards[k].value, ())
                    if (plan.reshards[k].value, plan.reshards[k].dst) in
                    zip(ops[u].reads, ops[u].ins))
        for k in members:
            p = producer.get(plan.reshards[k].value)
            if p is not None:
                users[p] += [u for u in held if u != p]
    height = _heights(users)
    state = {v for v in plan.input_ids if any(is_tail[u] for u in readers.get(v, ()))}
    of_batch = {v for v in plan.input_ids if v not in state}
    settled = {(r.value, r.dst) for r in plan.reshards if r.consumer is None}
    converts = {r.consumer for r in plan.reshards}
    first = set()
    for op in ops:
        # a state-only op reading a converted value (a gathered weight's transpose) runs
        # where its uses put it, as XLA places it; one reading the state as held, first
        if any(v in of_batch for v in op.reads) or op.id in converts or \
                any((v, nd) in settled for v, nd in zip(op.reads, op.ins)):
            of_batch.update(op.writes)
        else:
            first.add(op.id)
    rest = sorted((i for i, op in enumerate(ops) if op.id not in first),
                  key=lambda i: (-height[i], i))
    return [op for op in ops if op.id in first] + [ops[i] for i in rest]


def _heights(users: list[list[int]]) -> list[int]:
    """Per op, the ops on its longest path to the step's end, itself included (``users``:
    per op, those that run after it). An edge closing a cycle (a combined collective whose
    member is computed from another's reader, which XLA does not combine) is left out."""
    height = [0] * len(users)
    mark = [0] * len(users)  # 0: not seen, 1: on the path being walked, 2: done
    for root in reversed(range(len(users))):
        if mark[root]:
            continue
        mark[root] = 1
        path = [(root, iter(users[root]))]
        while path:
            i, todo = path[-1]
            for u in todo:
                if not mark[u]:
                    mark[u] = 1
                    path.append((u, iter(users[u])))
                    break
            else:
                path.pop()
                mark[i] = 2
                height[i] = 1 + max((height[u] for u in users[i] if mark[u] == 2), default=0)
    return height


def _blocks(plan: Plan) -> list[list[int]]:
    """The conversions that run as one block: those whose collectives XLA combines into one
    tuple collective (``Reshard.combined``, transitively), each other conversion alone."""
    parent = list(range(len(plan.reshards)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    first: dict[int, int] = {}  # combined collective -> a conversion in it
    for k, r in enumerate(plan.reshards):
        for c in r.combined:
            if c >= 0:
                parent[find(k)] = find(first.setdefault(c, k))
    out: dict[int, list[int]] = {}
    for k in range(len(plan.reshards)):
        out.setdefault(find(k), []).append(k)
    return list(out.values())


def plan_overlap(plan: Plan) -> Overlap:
    """``plan``'s predicted step (less the feed) with each conversion run beside the ops
    that do not wait for it (module docstring). Conversions XLA combines into one collective
    (:func:`_blocks`) run as one: it starts once every member can, and every member's
    reader waits for all of it."""
    blocks = _blocks(plan)
    ops = _in_order(plan, blocks)
    waits, after = _waiters(plan, ops)
    deadline = {k: len(ops) for k in range(len(plan.reshards))}
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
    block_of = {k: b for b, members in enumerate(blocks) for k in members}
    waiting = [len(members) for members in blocks]  # members not yet startable
    start = [0.0] * len(blocks)
    ready: dict[int, tuple[float, float]] = {}  # startable block -> (start, deadline)
    done: dict[int, float] = {}  # conversion -> when it ends
    compute = comm = 0.0

    def startable(ks, t: float) -> None:
        for k in ks:
            b = block_of[k]
            waiting[b] -= 1
            start[b] = max(start[b], t)
            if not waiting[b]:
                ready[b] = (start[b], min(deadline[j] for j in blocks[b]))

    def run(until: list[int] | None) -> None:
        nonlocal comm
        while ready and (until is None or any(k not in done for k in until)):
            b = next_collective(ready, comm)
            comm = max(comm, ready.pop(b)[0]) + sum(plan.reshards[k].time for k in blocks[b])
            done.update((k, comm) for k in blocks[b])
            for k in blocks[b]:
                startable(then.get(k, ()), comm)

    made = {v for op in ops for v in op.writes}
    for v in [v for v in of_value if v not in made]:  # inputs (and constants): at 0
        startable(of_value.pop(v), 0.0)
    for i, op in enumerate(ops):
        need = waits.get(i, [])
        run(need)
        compute = max([compute, *(done.get(k, 0.0) for k in need)]) + op.compute_time
        for v in op.writes:
            startable(of_value.pop(v, ()), compute)
    run(None)
    # a conversion never startable (assemble() makes none; a combined block waiting on a
    # member no op produces) runs after the rest
    stranded = sum(r.time for k, r in enumerate(plan.reshards) if k not in done)
    return Overlap(max(compute, comm) + stranded, plan.predicted.compute_time,
                   plan.predicted.comm_time)


def ranking_time(plan: Plan) -> float:
    """The seconds the search ranks ``plan`` by: its overlapped step plus the feed where its
    cluster asks for overlap (``Cluster(overlap=True)``), else its predicted step."""
    if plan.cluster.overlap:
        return plan_overlap(plan).time + plan.predicted.feed_time
    return plan.predicted.step_time
