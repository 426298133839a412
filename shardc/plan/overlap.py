"""A plan's predicted step with its communication overlapped with its compute.

:class:`shardc.plan.record.Predicted` adds every conversion's time to the compute time.
:func:`plan_overlap` replays the plan the way :mod:`shardc.inspect.schedule` replays a
compiled program, from the plan alone (to re-rank candidate plans without compiling
them):

- **compute**: the plan's ops one after another, each its predicted compute time (loop
  bodies already weighted by their trip counts), in the order XLA's scheduler gives them
  (:func:`_in_order`), not program order. The scheduler lists the program bottom-up, so an
  op runs as late as its uses allow: what reads the state alone (a weight's reshape) first,
  then the rest by its longest path to the step's end, longest first; FSDP's weight
  all-gathers then run from the start, and a weight gradient, which only the update
  reads, after the rest of the backward pass, its reduction with it.
- **chained** (``chained=True``, the second of the two estimates the compiled ranking
  takes candidates from, :mod:`shardc.step.ranking`): as XLA:GPU orders a step's gradient
  reductions. Ops that only make gradients run as soon as their operands exist
  (:func:`_gradients_early`), a layer's weight gradient before the next layer's
  activation gradient; XLA:GPU keeps one collective in flight and places about
  :data:`KERNELS_UNDER_COLLECTIVE` kernels (dots, convolutions) under each, so the
  conversions only the step's tail waits for (the gradient reductions the update reads,
  settlings, outputs') are issued one after another, the chain ending at the step's last
  kernel: the ``j``-th of ``n`` no earlier than the ``5 (n - j)``-th kernel from the end
  (:func:`_issued`). GPT-2's data-parallel step on one node issues its 13 gradient
  all-reduces so, from half-way through the backward pass; the wide ResNet's its 5.
- **communication**: one stream; each conversion (:class:`shardc.plan.record.Reshard`, all its
  collectives one block) can start when the op producing its value ends (a program input
  at 0; a conversion from another conversion's result, as a value's settling followed by
  its reader's own conversion, when that one ends). Conversions XLA combines into one
  collective (``Reshard.combined``) are one block, startable once every member is.
  Whenever the stream is free it runs the startable block needed first
  (:func:`shardc.cost.streams.next_collective`).
- an op starts when the stream is free and every conversion it reads has ended: the one
  made for it (``consumer``), and any conversion of a value it reads whose target layout
  is the layout it reads that value in (a conversion shared by several readers is recorded
  for the first one only, its other readers wait for it too).

Measured against the compiled programs (XLA:GPU for H100s, each priced by
:mod:`shardc.inspect.schedule`; the overlap search's seeds on the bench's node-8): GPT-2's
data-parallel, FSDP, ZeRO-1 and Megatron plans are estimated at 6.186, 5.677, 5.677 and
5.634 ms and compile to 5.152, 5.252, 5.270 and 4.933; chained, at 5.605, 5.213, 5.213 and
4.889. The wide ResNet's data-parallel, HSDP-2, ZeRO-1-within-4 and ZeRO-1 plans compile to
2.250, 2.585, 2.703 and 2.795 ms; the first is estimated at 2.668 (ranked last of these),
chained 2.193, 2.325, 2.602 and 2.609 (ranked as compiled). Neither estimate ranks every
program as compiled: on two nodes the chained one puts first plans whose combined
reduce-scatter XLA:GPU issues first and whose other gradients it computes after it, at the
step's end (the wide ResNet's HSDP-2 within the node: 2.754 ms chained, 3.327 compiled).

Conversions for the program's outputs are awaited by the end of the step. The result's
``time`` excludes the host feed (``Predicted.feed_time``), which runs before the step;
``compute`` and ``comm`` are the plan's predicted figures, so
``max(comm, compute) <= time <= comm + compute``.

Not modelled, as in the compiled replay: limits on how far ahead a conversion may run, and
loop iterations (a loop body's ops are one op each here, weighted by trip count, so a
conversion inside a body overlaps the whole loop's other ops).

References:
  XLA ``latency_hiding_scheduler.cc`` (collectives overlapped with independent compute);
  XLA ``gpu_latency_hiding_scheduler.cc`` (``GpuLatencyEstimator``: five library kernels
    under a collective), ``gpu_hlo_schedule.cc`` (one all-reduce in flight);
  NCCL user guide, "CUDA stream semantics" (a stream's operations run in issue order).
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Sequence

from shardc.cost.streams import Overlap, next_collective
from shardc.ir.prims import facts
from shardc.plan.record import OpPlan, Plan

__all__ = ["KERNELS_UNDER_COLLECTIVE", "chained_time", "host_exposed", "plan_overlap",
           "ranking_time"]

#: kernels XLA:GPU's latency-hiding scheduler places under each asynchronous collective: it
#: prices a collective's start-to-done at 5000 units and a GEMM or convolution library call
#: (or a loop fusion) at 1000, "so the LHS will try to schedule approximately 5 of these in
#: between each start/end pair" (XLA ``gpu_latency_hiding_scheduler.cc``,
#: ``GpuLatencyEstimator``), and keeps one collective in flight (``gpu_hlo_schedule.cc``:
#: ``all_reduce_overlap_limit = 1``, one asynchronous stream)
KERNELS_UNDER_COLLECTIVE = 5


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


def _in_order(plan: Plan, blocks: list[list[int]], chained: bool,
              tail: tuple[dict[int, list[int]], list[bool]]) -> list[OpPlan]:
    """The plan's ops in the order XLA's scheduler runs them (:mod:`shardc.plan.overlap`
    docstring): first what reads the state as held (an input the step's tail reads,
    :func:`shardc.ir.flow.tail_values`, as the optimizer update reads the parameters,
    and what is computed from such inputs alone: a weight's reshape), which nothing else
    holds back; then the rest as late as its longest path to the step's end allows, longest
    first, ties in program order; ``chained``, ops that only make gradients as soon as they
    can (:func:`_gradients_early`). A collective combined from several conversions
    (``blocks``) waits for each member's value and holds back each member's reader, so the
    producer of one member runs before the readers of all (XLA combines the token ids'
    gather for the embedding with the one for its gradient, and computes both first)."""
    ops = plan.ops
    pos = {op.id: i for i, op in enumerate(ops)}
    readers, is_tail = tail
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
    order = [i for i, op in enumerate(ops) if op.id in first] + rest
    if not chained:
        return [ops[i] for i in order]
    tail_ids = {op.id for op, t in zip(ops, is_tail) if t}
    late = {plan.reshards[k].value for k in _tail_read(plan, tail_ids)}
    return _gradients_early(ops, order, readers, users, is_tail, late)


def _tail(ops: Sequence[OpPlan]) -> tuple[dict[int, list[int]], list[bool]]:
    """(value -> the positions in ``ops`` of its readers, per op whether it belongs to the
    step's tail: an op doing no cross-element work whose results only such ops read, as the
    optimizer update and what follows it)."""
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
    return readers, is_tail


def _tail_read(plan: Plan, tail_ids: set[int]) -> list[int]:
    """The conversions only the step's tail (the ops ``tail_ids``) waits for: a value's
    settling, an output's conversion, a tail op's (the gradient reductions the optimizer
    update reads)."""
    return [k for k, r in enumerate(plan.reshards)
            if r.consumer is None or r.consumer < 0 or r.consumer in tail_ids]


def _gradients_early(ops: Sequence[OpPlan], order: list[int], readers: dict[int, list[int]],
                     users: list[list[int]], is_tail: Sequence[bool], late: set[int]
                     ) -> list[OpPlan]:
    """``order`` (positions in ``ops``) with each op that only makes gradients run as soon
    as its operands exist: an op whose results only tail ops read and one of which is
    converted for the tail (``late``: a weight gradient's reshape before its reduction),
    or whose results only such ops read (the weight gradient's dot, the backward pass
    that leads to it). Of the ops ready to run, such ops go first, the one nearest the
    step's end first (a layer's weight gradient before the next layer's activation
    gradient); then the rest in ``order``. XLA:GPU computes a layer's weight gradients
    where their reduction is issued, during the backward pass (GPT-2's data-parallel step:
    its 13 gradient all-reduces start from half-way through the backward pass). ``users``
    (per op, the ops that run after it) adds to the dataflow the edges of combined
    collectives; those against ``order`` are left out, as :func:`_heights` leaves them."""
    rank = {i: r for r, i in enumerate(order)}
    early = [False] * len(ops)
    for i in reversed(order):
        read = [u for v in ops[i].writes for u in readers.get(v, ())]
        if any(v in late for v in ops[i].writes):
            early[i] = all(is_tail[u] or early[u] for u in read)
        else:
            early[i] = bool(read) and all(early[u] for u in read)
    after = [[u for u in set(us) if rank[u] > rank[i]] for i, us in enumerate(users)]
    waiting = [0] * len(ops)
    for us in after:
        for u in us:
            waiting[u] += 1

    def key(i: int) -> tuple[int, int]:
        return (0, -rank[i]) if early[i] else (1, rank[i])

    ready = [key(i) for i in order if not waiting[i]]
    heapq.heapify(ready)
    by_key = {key(i): i for i in order}
    out = []
    while ready:
        i = by_key[heapq.heappop(ready)]
        out.append(ops[i])
        for u in after[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, key(u))
    return out


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


def _issued(plan: Plan, ops: Sequence[OpPlan], blocks: list[list[int]], is_tail: list[bool]
            ) -> dict[int, list[int]]:
    """Per position in ``ops`` (the order they run in; ``is_tail``: per op of ``plan.ops``
    whether it is in the step's tail, :func:`_tail`), the blocks of conversions XLA:GPU
    issues no earlier than that op: its gradient chain (module docstring). The blocks only
    the step's tail waits for, each made by the plan's ops and moving bytes, in the order
    their values are made, are issued one after another, the chain ending at the step's
    last kernel (a dot or a convolution, :attr:`shardc.ir.prims.Prim.kernel`) with
    :data:`KERNELS_UNDER_COLLECTIVE` kernels under each; a block whose share of the chain
    would start before the first kernel is issued when its values are made."""
    tail_read = set(_tail_read(plan, {op.id for op, t in zip(plan.ops, is_tail) if t}))
    made = {v: i for i, op in enumerate(ops) for v in op.writes}
    chain = [b for b, members in enumerate(blocks)
             if all(k in tail_read and plan.reshards[k].value in made for k in members)
             and any(not c.startswith("local@")
                     for k in members for c in plan.reshards[k].collectives)]
    chain.sort(key=lambda b: (max(made[plan.reshards[k].value] for k in blocks[b]), b))
    kernels = [i for i, op in enumerate(ops) if facts(op.prim).kernel]
    issued: dict[int, list[int]] = {}
    for j, b in enumerate(chain):
        under = KERNELS_UNDER_COLLECTIVE * (len(chain) - j)
        if under <= len(kernels):
            issued.setdefault(kernels[-under], []).append(b)
    return issued


#: (id of a plan, chained) -> (a weak reference to that plan, its estimate): a plan is a
#: frozen record, so its estimate is computed once; the search and the compiled ranking
#: ask for each candidate's two to four times (GPT-2 on one node under overlap: 190
#: estimates of 94 plans, 85 ms each on XLA:GPU's mesh). An entry goes with its plan.
_ESTIMATES: dict[tuple[int, bool], tuple[weakref.ref, Overlap]] = {}


def plan_overlap(plan: Plan, chained: bool = False) -> Overlap:
    """``plan``'s predicted step (less the feed) with each conversion run beside the ops
    that do not wait for it (module docstring); ``chained``, its gradients made and reduced
    as XLA:GPU chains them. Conversions XLA combines into one collective (:func:`_blocks`)
    run as one: it starts once every member can, and every member's reader waits for all
    of it. Computed once per plan (:data:`_ESTIMATES`)."""
    key = (id(plan), chained)
    kept = _ESTIMATES.get(key)
    if kept is not None and kept[0]() is plan:
        return kept[1]
    out = _replay(plan, chained)
    _ESTIMATES[key] = (weakref.ref(plan, lambda _, key=key: _ESTIMATES.pop(key, None)), out)
    return out


def _replay(plan: Plan, chained: bool) -> Overlap:
    """:func:`plan_overlap`, computed."""
    blocks = _blocks(plan)
    tail = _tail(plan.ops)  # (readers, per op of plan.ops whether in the step's tail)
    ops = _in_order(plan, blocks, chained, tail)
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
    issued = _issued(plan, ops, blocks, tail[1]) if chained else {}  # the gradient chain's places
    for b in (b for bs in issued.values() for b in bs):
        waiting[b] += 1
    start = [0.0] * len(blocks)
    ready: dict[int, tuple[float, float]] = {}  # startable block -> (start, deadline)
    done: dict[int, float] = {}  # conversion -> when it ends
    compute = comm = 0.0

    def startable(ks, t: float) -> None:
        for k in ks:
            release(block_of[k], t)

    def release(b: int, t: float) -> None:
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
        began = max([compute, *(done.get(k, 0.0) for k in need)])
        compute = began + op.compute_time
        for b in issued.get(i, ()):
            release(b, began)
        for v in op.writes:
            startable(of_value.pop(v, ()), compute)
    run(None)
    # a conversion never startable (assemble() makes none; a combined block waiting on a
    # member no op produces) runs after the rest
    stranded = sum(r.time for k, r in enumerate(plan.reshards) if k not in done)
    return Overlap(max(compute, comm) + stranded, plan.predicted.compute_time,
                   plan.predicted.comm_time)


def ranking_time(plan: Plan) -> float:
    """The seconds the search ranks ``plan`` by where its cluster asks for overlap
    (``Cluster(overlap=True)``): the mean of its two overlapped estimates, the gradient
    reductions after the backward pass (:func:`plan_overlap`) and chained during it
    (``chained=True``), plus the feed; else its predicted step.

    XLA:GPU's schedule lies between the two: it chains a data-parallel step's all-reduces
    through the backward pass, but issues a combined reduce-scatter first and computes
    the other gradients after it, at the step's end. On the bench's cells, compiled by
    XLA:GPU, the mean picks faster programs than either estimate alone, on average and in
    the worst cell (docs/design-notes.md, "Overlap in the objective"). Offloaded state's
    transfers count as far as they run beside no compute (:func:`host_exposed`)."""
    if plan.cluster.overlap:
        return (plan_overlap(plan).time + plan_overlap(plan, chained=True).time) / 2 \
            + plan.predicted.feed_time + host_exposed(plan)
    return plan.predicted.step_time


def host_exposed(plan: Plan) -> float:
    """The seconds of ``plan``'s host-memory transfers (``Predicted.host_time``: offloaded
    state in, its new state out, half each) that no compute hides: the way in runs on the
    host link beside the ops before the first that reads offloaded state (XLA's host
    offloading issues the copies asynchronously, its scheduler hoists their starts); the
    way out follows the update at the step's end, beside nothing."""
    if not plan.offloaded:
        return plan.predicted.host_time
    moved = {plan.input_ids[k] for k in plan.offloaded} if plan.input_ids else set()
    before = 0.0
    for op in plan.ops:
        if moved.intersection(op.reads):
            break
        before += op.compute_time
    return plan.predicted.host_time / 2 + max(0.0, plan.predicted.host_time / 2 - before)


def chained_time(plan: Plan) -> float:
    """``plan``'s overlapped step with its gradients reduced as XLA:GPU chains them
    (:func:`plan_overlap`, ``chained``), plus the feed: the compiled ranking's second
    estimate (:func:`shardc.step.ranking.compiled_best`)."""
    return plan_overlap(plan, chained=True).time + plan.predicted.feed_time \
        + host_exposed(plan)
