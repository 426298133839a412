"""Remat as a choice: recompute a forward segment's activations in the backward pass instead
of keeping them.

A train step traced by ``make_jaxpr`` holds its forward pass (equations named ``jvp(...)``
in their name stack) and its backward pass (``transpose(jvp(...))``) flat in one jaxpr; the
forward values the backward reads (the residuals) live from the forward to the backward,
and on a long model they are most of the step's peak memory. :func:`segments` cuts the
forward pass where a single activation crosses (the residual stream between sublayers) and
lists each segment's own residuals: the values it makes that the backward reads and no later
forward equation does. :func:`rematerialize` rewrites the jaxpr so the chosen segments'
residuals are recomputed: their equations are copied into a ``checkpoint`` call (the
primitive ``jax.checkpoint`` binds, ``differentiated`` as in a differentiated program)
placed just before the backward's first read, and the backward reads its results. The
copy reads its activation inputs through a select on the cotangent that first read needs
(:func:`_gate`), so XLA can neither merge it with the forward (common subexpressions) nor
run it before the backward gets there: ``jax.checkpoint``'s optimization barrier does the
first, but XLA's CPU pipeline drops barriers before it schedules, and its scheduler then
hoists the copy into the forward, where it saves nothing. The planner sees the recomputed
equations as ops of their own: their time is priced by the cost model, and the kept
activations' shorter lives by the memory model.

Scope: the top-level jaxpr's forward and backward. A scanned stack of layers (its residuals
are the forward scan's stacked outputs) and layers the user already wrapped in
``jax.checkpoint`` (their residuals are their inputs) are not segments. The user's own
checkpoints get the same gate (:func:`gate_checkpoints`): without it XLA's CPU scheduler
runs their recomputation in the forward too, and they save nothing.

References:
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (segment checkpoints);
  Jain et al. 2020, "Checkmate" (recompute priced against memory).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jax
from jax._src import ad_checkpoint
from jax.extend import core as jcore

__all__ = ["GATE", "Segment", "gate_checkpoints", "is_gate", "levels", "order", "prefixes",
           "rematerialize", "segments"]

GATE = "shardc_remat_gate"
"""The name scope of :func:`_gate`'s equations: the lowering runs a gate's select in its
gated operand's own layout (:func:`is_gate`)."""

REMAT = ad_checkpoint.remat_p
"""The primitive ``jax.checkpoint`` binds (``remat2`` in JAX 0.10; a call the trace inlines
for planning and the lowering keeps)."""


@dataclass(frozen=True)
class Segment:
    """A forward segment whose residuals can be recomputed. ``eqns``: indices of the
    top-level equations recomputed (those its residuals depend on within the segment);
    ``kept``: the residuals' bytes (whole arrays) held from the forward to the backward
    when it is not recomputed; ``flops``: the recomputation's work (whole arrays; dots
    ``2mnk``, other equations one per output element), to order segments by bytes saved
    per FLOP."""

    index: int
    eqns: tuple[int, ...]
    residuals: tuple[int, ...]  # positions of the residual vars among eqns' outvars (see _res)
    kept: int
    flops: float

    @property
    def price(self) -> float:
        """Recompute FLOPs per byte saved (lower is a better trade)."""
        return self.flops / max(self.kept, 1)


def _stack(eqn) -> str:
    return str(eqn.source_info.name_stack)


def _forward(eqn) -> bool:
    s = _stack(eqn)
    return "jvp(" in s and "transpose(" not in s


def _backward(eqn) -> bool:
    return "transpose(" in _stack(eqn)


def _nbytes(v) -> int:
    aval = v.aval
    return math.prod(getattr(aval, "shape", ())) * getattr(getattr(aval, "dtype", None),
                                                            "itemsize", 0)


def _flops(eqn) -> float:
    out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if eqn.primitive.name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
        return 2.0 * out * k
    return float(out)


def _vars(atoms: Iterable) -> list:
    return [a for a in atoms if isinstance(a, jcore.Var)]


def _res(jaxpr, seg: Segment) -> list:
    """The residual vars of ``seg``: ``residuals`` indexes the flat outvars of its eqns."""
    outs = [v for i in seg.eqns for v in jaxpr.eqns[i].outvars]
    return [outs[k] for k in seg.residuals]


def segments(closed) -> tuple[Segment, ...]:
    """The forward segments of ``closed`` (a ClosedJaxpr) whose residuals can be recomputed,
    in forward order; empty when it has no backward pass at the top level. Only segments
    whose recomputation can lower the peak are kept (:func:`_pays`): not the loss, whose
    residuals the backward reads at once, nor one recomputed before the backward has freed
    as much as it recomputes."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    fwd = [i for i, e in enumerate(eqns) if _forward(e)]
    if not fwd or not any(_backward(e) for e in eqns):
        return ()
    made: dict = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            made[v] = i
    uses: dict = {}
    for i, e in enumerate(eqns):
        for v in _vars(e.invars):
            uses.setdefault(v, []).append(i)
    outs = set(_vars(jaxpr.outvars))
    is_fwd = set(fwd)
    # values that come from constants alone (a mask, an iota): XLA folds them; not activations
    folded: set = set()
    for i in fwd:
        if all(v in folded for v in _vars(eqns[i].invars)) and not eqns[i].effects:
            folded.update(eqns[i].outvars)
    # cut after forward equation k where at most one activation crosses to a later one
    cuts, live = [], set()
    last_fwd_use = {v: max((u for u in uses.get(v, ()) if u in is_fwd), default=-1)
                    for i in fwd for v in eqns[i].outvars}
    for i in fwd:
        live.update(v for v in eqns[i].outvars
                    if last_fwd_use[v] > i and v not in folded and getattr(v.aval, "ndim", 0))
        live = {v for v in live if last_fwd_use[v] > i}
        if len(live) <= 1:
            cuts.append(i)
    runs, start = [], 0
    for c in cuts:  # fwd ascends: each run is the slice up to its cut
        end = bisect.bisect_right(fwd, c, lo=start)
        if end > start:
            runs.append(fwd[start:end])
        start = end
    out = []
    for run in runs:
        mine = set(run)
        res = [v for i in run for v in eqns[i].outvars
               if v not in outs and v not in folded
               and any(_backward(eqns[u]) for u in uses.get(v, ()))
               and all(u in mine or _backward(eqns[u]) for u in uses.get(v, ()))]
        if not res:
            continue
        need, todo = set(), list(res)
        while todo:  # the run's equations the residuals depend on
            i = made.get(todo.pop())
            if i is None or i in need or i not in mine:
                continue
            need.add(i)
            todo.extend(_vars(eqns[i].invars))
        if any(eqns[i].effects for i in need):
            continue
        idx = tuple(sorted(need))
        flat = [v for i in idx for v in eqns[i].outvars]
        pos = {v: k for k, v in enumerate(flat)}
        out.append(Segment(len(out), idx, tuple(pos[v] for v in res),
                           sum(_nbytes(v) for v in res), sum(_flops(eqns[i]) for i in idx)))
    if not out:
        return ()
    first_bwd = {s.index: min(u for v in _res(jaxpr, s) for u in uses[v] if _backward(eqns[u]))
                 for s in out}
    # a residual's bytes are free once the backward has read it for the last time; a user's
    # checkpoint in the backward (its recomputation) holds what its body makes while it runs
    freed = sorted([(max(uses[v]), _nbytes(v)) for s in out for v in _res(jaxpr, s)] +
                   [(i, sum(_nbytes(v) for b in e.params["jaxpr"].eqns for v in b.outvars))
                    for i, e in enumerate(eqns) if e.primitive is REMAT and _backward(e)])
    upto = list(itertools.accumulate((b for _, b in freed), initial=0))  # bytes freed
    kept = [s for s in out if _pays(s, first_bwd[s.index], freed, upto)]
    return tuple(Segment(k, s.eqns, s.residuals, s.kept, s.flops) for k, s in enumerate(kept))


def _pays(seg: Segment, first: int, freed: list[tuple[int, int]], upto: list[int]) -> bool:
    """Recomputing ``seg`` can lower the step's peak: by the backward's first read of its
    residuals (``first``, where the recomputation runs), at least as many bytes as it
    recomputes were freed since the backward began (``freed``: (program point, bytes),
    sorted: other segments' residuals after their last read, a user's checkpoint's
    recomputation after it ran). A train step peaks where the backward begins, every
    residual still held, or where a user's checkpoint recomputes; a recomputation that runs
    before anything is freed only adds its own values and its gate's copies to that peak.
    This leaves out the segment whose backward runs first (the loss: nothing is free yet)
    and the next when the loss frees less than it recomputes (a log-softmax over the
    logits: recomputed, a toy language model's step compiled 8 MiB more on one device).
    ``upto[k]``: the bytes of ``freed``'s first ``k`` entries."""
    free = upto[bisect.bisect_left(freed, (first, -1))]
    return 0 < seg.kept <= free


def order(segs: Sequence[Segment]) -> list[int]:
    """Segment indices, best trade first (fewest recompute FLOPs per byte saved); ties in
    forward order."""
    return sorted(range(len(segs)), key=lambda k: (segs[k].price, k))


def levels(segs: Sequence[Segment]) -> list[tuple[int, ...]]:
    """The remat choices worth planning, most recomputed first: every segment, then the
    half with the best trade (:func:`order`); none when there are no segments."""
    if not segs:
        return []
    best = order(segs)
    out = [tuple(range(len(segs)))]
    half = tuple(sorted(best[:(len(best) + 1) // 2]))
    if half != out[0]:
        out.append(half)
    return out


def prefixes(segs: Sequence[Segment]) -> list[tuple[int, ...]]:
    """The greedy's remat choices, least recomputed first: none, the segment with the best
    trade (:func:`order`), the best two, and so on to every segment (each sorted). The
    time-memory frontier (:mod:`shardc.tradeoff.frontier`) picks among them by budget."""
    best = order(segs)
    return [tuple(sorted(best[:k])) for k in range(len(segs) + 1)]


def rematerialize(closed, segs: Sequence[Segment], chosen: Iterable[int]):
    """``closed`` with the residuals of segments ``chosen`` (indices into ``segs``, which
    :func:`segments` made for it) recomputed in the backward pass (module docstring)."""
    chosen = sorted(set(chosen))
    if not chosen:
        return closed
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    uses: dict = {}
    for i, e in enumerate(eqns):
        for v in _vars(e.invars):
            uses.setdefault(v, []).append(i)
    by_backward = {v for e in eqns if _backward(e) for v in e.outvars}
    rename: dict = {}  # residual var -> the recomputed var the backward reads
    before: dict[int, list] = {}  # equation index -> remat equations placed before it
    for k in chosen:
        seg = segs[k]
        res = _res(jaxpr, seg)
        first = min(u for v in res for u in uses[v] if _backward(eqns[u]))
        made = {v for i in seg.eqns for v in eqns[i].outvars}
        ext = list(dict.fromkeys(v for i in seg.eqns for v in _vars(eqns[i].invars)
                                 if v not in made))
        # the cotangent the first backward read also needs: the recomputation waits for it
        wait = [v for v in dict.fromkeys(_vars(eqns[first].invars))
                if v in by_backward and v not in ext]
        source = eqns[seg.eqns[-1]].source_info
        body, new = _body(eqns, seg, res, ext, wait)
        rename.update(zip(res, new))
        eqn = jcore.new_jaxpr_eqn(  # the gate already keeps XLA from merging the copies
            ext + wait, new, REMAT,
            {"jaxpr": body, "prevent_cse": False, "differentiated": True, "policy": None},
            jcore.no_effects, source)
        before.setdefault(first, []).append(eqn)
    out = []
    for i, e in enumerate(eqns):
        out.extend(before.get(i, ()))
        if _backward(e) and any(v in rename for v in _vars(e.invars)):
            e = e.replace(invars=[rename.get(v, v) if isinstance(v, jcore.Var) else v
                                  for v in e.invars])
        out.append(e)
    new = jaxpr.replace(eqns=out)
    return jcore.ClosedJaxpr(new, closed.consts)


def gate_checkpoints(closed):
    """``closed`` with each top-level ``checkpoint`` of its backward pass (the call
    ``jax.checkpoint`` leaves where the user's remat'd layer is recomputed) reading its
    saved inputs through :func:`_gate` on the cotangents it also reads, so its
    recomputation runs where the backward needs it, as on a backend that keeps
    ``jax.checkpoint``'s barrier. The values are unchanged, bit for bit."""
    eqns = closed.jaxpr.eqns
    by_backward = {v for e in eqns if _backward(e) for v in e.outvars}
    out, changed = [], False
    for e in eqns:
        if e.primitive is REMAT and _backward(e):
            wait = [k for k, v in enumerate(e.invars)
                    if isinstance(v, jcore.Var) and v in by_backward]
            if wait and len(wait) < len(e.invars):
                e = e.replace(params={**e.params, "jaxpr": _gated_body(e.params["jaxpr"], wait)})
                changed = True
        out.append(e)
    if not changed:
        return closed
    return jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=out), closed.consts)


def _gated_body(body, wait: list[int]):
    """The checkpoint body ``body`` (an open jaxpr) with its inputs other than ``wait``
    (positions of the cotangents) read through :func:`_gate` on those."""
    ins = body.invars
    args = [k for k in range(len(ins)) if k not in set(wait)]
    g = jax.make_jaxpr(_gate)([jax.ShapeDtypeStruct(ins[k].aval.shape, ins[k].aval.dtype)
                              for k in args],
                             [jax.ShapeDtypeStruct(ins[k].aval.shape, ins[k].aval.dtype)
                              for k in wait])
    assert not g.consts, "the gate closes over no constants"
    fresh = dict(zip(args + wait, g.jaxpr.invars))
    env = {ins[k]: g.jaxpr.outvars[j] for j, k in enumerate(args)}
    env.update({ins[k]: fresh[k] for k in wait})
    sub = [e.replace(invars=[env.get(v, v) if isinstance(v, jcore.Var) else v
                             for v in e.invars]) for e in body.eqns]
    outs = [env.get(v, v) if isinstance(v, jcore.Var) else v for v in body.outvars]
    return body.replace(invars=[fresh[k] for k in range(len(ins))],
                        eqns=list(g.jaxpr.eqns) + sub, outvars=outs)


def _tautology(w):
    """True everywhere, but not to XLA: ``w == w`` is false where ``w`` is NaN and ``w != w``
    true exactly there, and XLA's simplifier does not fold their ``or``."""
    return (w == w) | (w != w)


def is_gate(eqn) -> bool:
    """``eqn`` is the select of a recomputation's gate (:func:`_gate`): its third operand is
    the gated value. The lowering converts the select's result, not that operand, to the
    plan's layout: a collective on the operand would depend on the forward alone, and
    XLA's scheduler hoists it there, holding a converted copy of every gated activation
    through the backward."""
    return eqn.primitive.name == "select_n" and GATE in str(eqn.source_info.name_stack)


def _gate(args: list, wait: list) -> list:
    """``args`` made to depend on ``wait`` without changing a bit: each argument of the
    shape and dtype of a waited value ``w`` is read through ``select(w == w | w != w, arg,
    w)`` (elementwise: no communication where both are laid out alike); with no such pair,
    the largest argument waits on one element of the first waited value. An optimization
    barrier would say the same, but XLA's CPU pipeline removes barriers before it schedules,
    and a data dependence holds on every backend."""
    if not wait:
        return list(args)
    with jax.named_scope(GATE):
        return _gated(args, wait)


def _gated(args: list, wait: list) -> list:
    like = {(tuple(w.shape), w.dtype): w for w in wait}
    out = [jax.lax.select(_tautology(like[(tuple(a.shape), a.dtype)]), a,
                          like[(tuple(a.shape), a.dtype)])
           if (tuple(a.shape), a.dtype) in like else a for a in args]
    if all(o is a for o, a in zip(out, args)) and args:
        k = max(range(len(args)), key=lambda i: args[i].size)
        w = min(wait, key=lambda v: v.size)
        # a reduction of the whole value: on a split value each device reduces its own
        # part and one scalar is combined, where slicing one element out of it gathers it
        # whole first (a GPT's batch-split logits cotangent: 2 GiB more per device on 2x4)
        whole = jax.lax.reduce_max(w, tuple(range(w.ndim)))
        a = args[k]
        out[k] = jax.lax.select(jax.lax.broadcast(_tautology(whole), a.shape),
                                a, jax.lax.full_like(a, 0))
    return out


def _body(eqns, seg: Segment, res: list, args: list, wait: list):
    """The recomputation as an open jaxpr over fresh copies of ``args`` and ``wait`` (the
    values it waits for, :func:`_gate`), and fresh outer vars for its results."""
    gated = jax.make_jaxpr(_gate)([jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                  for v in args],
                                 [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                  for v in wait])
    g = gated.jaxpr
    assert not gated.consts, "the gate closes over no constants"
    env = dict(zip(args, g.outvars))
    body_eqns = list(g.eqns)
    for i in seg.eqns:
        e = eqns[i]
        for v in e.outvars:
            env[v] = jcore.Var(v.aval)
        body_eqns.append(e.replace(
            invars=[env[v] if isinstance(v, jcore.Var) else v for v in e.invars],
            outvars=[env[v] for v in e.outvars]))
    outs = [env[v] for v in res]
    body = jcore.Jaxpr([], list(g.invars), outs, body_eqns, debug_info=g.debug_info._replace(
        func_src_info="shardc remat", result_paths=tuple(f"r{k}" for k in range(len(outs)))))
    return body, [jcore.Var(v.aval) for v in res]
