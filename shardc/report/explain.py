"""Human-readable plan reports in the user's words: totals, the PartitionSpec of every
argument and result leaf by its name (``state.params.blocks[0..11].attn.q.kernel``), the
per-op table with repeated layers folded into one row group, and the costliest reshards."""

from __future__ import annotations

import bisect
import os
import re
import textwrap
from collections import Counter
from collections.abc import Iterable

from shardc.cost.units import fmt_bytes, fmt_time
from shardc.ir.trace import PACKAGE_DIR
from shardc.report.placements import attention_lines, offloaded_line
from shardc.util.tables import Report, Table

__all__ = ["argument_table", "explain_plan", "explain_report", "fold_repeats", "merge_names",
           "mesh_label", "op_table", "spec_text"]


def _ranked(plan) -> float:
    """The step ``plan`` was chosen by, as its seeds are priced: overlapped (with the feed)
    where its cluster overlaps (``solver["overlapped_s"]``), else its predicted step."""
    step = plan.predicted.step_time
    return plan.solver.get("overlapped_s", step) if plan.cluster.overlap else step


def _coverage(ops) -> list[str]:
    """A line naming the primitives that ran replicated for lack of a rule, with their
    share of the step's compute (nothing when every primitive has one)."""
    from shardc.rules.registry import has_rule

    missing = Counter()
    spent: Counter = Counter()
    for o in ops:
        if not has_rule(o.prim):
            missing[o.prim] += 1
            spent[o.prim] += o.compute_time
    if not missing:
        return []
    total = sum(o.compute_time for o in ops) or 1.0
    return ["ran replicated, no sharding rule: " + ", ".join(
        f"{p} ({n} op{'s' * (n > 1)}, {100 * spent[p] / total:.1f}% of compute)"
        for p, n in sorted(missing.items()))]


#: the edge ops framing a body the planner sees inline, by what the body is
_FRAMES = {"scan_enter": "loop", "scan_exit": "loop", "cond_enter": "cond",
           "cond_exit": "cond"}


def _control_flow(ops) -> list[str]:
    """A line naming each loop (``scan``, ``while``) and cond by its source line (a loop
    shardc's own code runs, as a layer stack's scan in an inner ``jit`` whose traceback
    holds no line of the user's, by the first line of the user's inside it), with the share
    of the step's compute that runs inside it: its body's ops, by their trip count (a cond:
    its costlier branch, the one its cost counts)."""
    frames: dict[tuple, tuple[str, str]] = {}
    for o in ops:
        kind = _FRAMES.get(o.prim)
        if kind is not None and o.where:
            frames.setdefault(o.where, (kind, o.source))
    if not frames:
        return []
    total = sum(o.compute_time for o in ops) or 1.0
    parts = []
    for where, (kind, source) in frames.items():
        inside = [o for o in ops if len(o.where) > len(where) and o.where[:len(where)] == where]
        if source.startswith(PACKAGE_DIR):
            source = next((o.source for o in inside if o.source and
                           not o.source.startswith(PACKAGE_DIR)), source)
        spent = sum(o.compute_time for o in inside)
        parts.append(f"{kind} at {source or where} ({len(inside)} ops, "
                     f"{100 * spent / total:.1f}% of compute)")
    return ["control flow, the compute run inside: " + "; ".join(parts)]


def spec_text(spec) -> str:
    """A PartitionSpec as a user writes it: ``P(None, 'gpu')``, ``P(('node', 'gpu'))``."""
    return "P(" + ", ".join(repr(e) for e in tuple(spec)) + ")"


_INDEX = re.compile(r"\[(\d+)\]")


def _shape(name: str) -> str:
    """``name`` with every integer index made a wildcard: the layers of one stack agree."""
    return _INDEX.sub("[#]", name)


def _indices(values: list[int]) -> str:
    vals = sorted(set(values))
    if len(vals) == 1:
        return str(vals[0])
    if len(vals) > 2 and vals[-1] - vals[0] == len(vals) - 1:
        return f"{vals[0]}..{vals[-1]}"
    return ",".join(map(str, vals))


def merge_names(names: list[str]) -> str:
    """Names that differ in integer indices only, as one: ``blocks[0..11].attn.q.kernel``."""
    parts = _INDEX.split(names[0])  # text, index, text, index, ..., text
    per = [_INDEX.split(n)[1::2] for n in names]
    for slot in range(len(parts) // 2):
        parts[2 * slot + 1] = _indices([int(p[slot]) for p in per])
    return "".join(p if i % 2 == 0 else f"[{p}]" for i, p in enumerate(parts))


_ROOT = re.compile(r"(out(?:\[\d+\])?|[^.\[]+)(.*)")


def _rows(names, types, specs) -> list[tuple[str, str, str, int]]:
    """(name, type, spec, count) rows, leaves that differ only in integer indices and agree
    in type and spec merged into one."""
    groups: dict[tuple, list[str]] = {}
    for k, name in enumerate(names):
        groups.setdefault((_shape(name), types[k] if types else "", spec_text(specs[k])),
                          []).append(name)
    return [(merge_names(members), typ, spec, len(members))
            for (_, typ, spec), members in groups.items()]


def _subtrees(names, types, specs) -> dict[str, set]:
    """Per root (an argument, ``out`` or ``out[i]``), its leaves as (path below the root,
    type, spec)."""
    out: dict[str, set] = {}
    for k, name in enumerate(names):
        root, rest = _ROOT.match(name).groups()
        out.setdefault(root, set()).add((rest, types[k] if types else "",
                                         spec_text(specs[k])))
    return out


def argument_table(plan) -> list[Table]:
    """The PartitionSpec of every argument and result leaf, by the user's name; leaves that
    differ only in a layer index and agree in type and spec are one row (``x12``); a result
    laid out leaf for leaf as an argument (the new state of a train step) is one line."""
    names_in = [plan.input_name(k) for k in range(len(plan.inputs))]
    names_out = [plan.output_name(j) for j in range(len(plan.outputs))]
    specs_in, specs_out = plan.input_specs(), plan.output_specs()
    args = _subtrees(names_in, plan.input_types, specs_in)
    same = {}
    for root, leaves in _subtrees(names_out, plan.output_types, specs_out).items():
        twin = next((a for a, theirs in args.items() if theirs == leaves), None)
        if twin is not None:
            same[root] = twin
    kept = [j for j, n in enumerate(names_out) if _ROOT.match(n).group(1) not in same]
    tables = []
    for title, count, rows in (
            ("arguments", len(names_in), _rows(names_in, plan.input_types, specs_in)),
            ("results", len(names_out),
             _rows([names_out[j] for j in kept],
                   [plan.output_types[j] for j in kept] if plan.output_types else (),
                   [specs_out[j] for j in kept]))):
        notes = [f"{root}: as {twin}, leaf for leaf" for root, twin in same.items()] \
            if title == "results" else []
        tables.append(Table(
            f"{title} ({count} leaves, in jax.tree.leaves order; PartitionSpec on the "
            "plan's mesh):", ("leaf", "type", "PartitionSpec", "count"),
            (*notes, *((name, typ, spec, f"x{n}" if n > 1 else "")
                       for name, typ, spec, n in rows)),
            widths=(64,), header=False, indent=2))
    return tables


def fold_repeats(sigs: list, least: int = 4) -> list[tuple[int, int, int]]:
    """``(start, period, count)`` runs covering ``sigs`` in order: a run repeats the
    ``period`` items from ``start`` ``count`` times in a row (count 1: no repeat). A repeat
    is taken where it saves at least ``least`` rows; at each start the longest one."""
    n = len(sigs)
    where: dict = {}
    for j, s in enumerate(sigs):
        where.setdefault(s, []).append(j)
    out, i = [], 0
    while i < n:
        best_p, best_k = 1, 1
        for j in where[sigs[i]][bisect.bisect_right(where[sigs[i]], i):]:
            p = j - i
            if i + 2 * p > n:
                break
            if (n - i) // p * p <= best_p * best_k:
                continue
            head = min(p, 8)
            if sigs[i:i + head] != sigs[j:j + head] or sigs[i:j] != sigs[j:j + p]:
                continue
            k = 2
            while i + (k + 1) * p <= n and sigs[i + k * p:i + (k + 1) * p] == sigs[i:j]:
                k += 1
            if p * (k - 1) >= least and p * k > best_p * best_k:
                best_p, best_k = p, k
        out.append((i, best_p, best_k))
        i += best_p * best_k
    return out


class _Names:
    """How explain names a value: an argument leaf by the user's name, an op's result by
    its op, a result leaf by its name."""

    def __init__(self, plan):
        self.plan = plan
        self.inputs = {vid: k for k, vid in enumerate(plan.input_ids)}
        self.made_by = {vid: o for o in plan.ops for vid in o.writes}

    def input(self, vid: int) -> str | None:
        k = self.inputs.get(vid)
        return None if k is None else self.plan.input_name(k)

    def value(self, vid: int) -> str:
        name = self.input(vid)
        if name is not None:
            return name
        op = self.made_by.get(vid)
        return f"op {op.id} {op.prim}" if op is not None else f"v{vid}"

    def consumer(self, consumer: int | None) -> str:
        if consumer is None:
            return "its uses"
        if consumer >= 0:
            return f"op {consumer}"
        return self.plan.output_name(-1 - consumer)


def _where(sources: list[str]) -> str:
    """The source line of a row (``file.py:12``); a folded row whose members came from
    different lines names the first and how many others."""
    shown = [os.path.basename(x) for x in sources if x]
    if not shown:
        return ""
    others = len(set(shown)) - 1
    return shown[0] + (f" (+{others})" if others else "")


def op_table(plan, names: _Names, max_rows: int | None) -> Table:
    """The per-op table in program order; a run of ops repeated in a row with the same
    strategies (the layers of a stack) is shown once with its count, costs summed."""
    ops = list(plan.ops)
    reads = [[n for n in map(names.input, o.reads) if n is not None] for o in ops]
    interned: dict = {}
    sigs = [interned.setdefault((o.prim, o.strategy, o.types, tuple(map(_shape, r))),
                                len(interned)) for o, r in zip(ops, reads)]
    rows = []  # (run index, op, compute, comm, reads text, source)
    runs = fold_repeats(sigs)
    for g, (start, period, count) in enumerate(runs):
        for r in range(period):
            members = [start + m * period + r for m in range(count)]
            names_read = [merge_names([reads[i][a] for i in members])
                          for a in range(len(reads[start + r]))]
            rows.append((g, ops[start + r], sum(ops[i].compute_time for i in members),
                         sum(ops[i].comm_time for i in members), ", ".join(names_read),
                         _where([ops[i].source for i in members])))
    shown = rows
    folded = sum(1 for _, _, count in runs if count > 1)
    runs_shown = f"{folded} repeated run{'s' if folded != 1 else ''} shown once"
    what = f"{len(ops)} ops" + (f" in {len(rows)} rows ({runs_shown})" if folded else "")
    if max_rows is not None and len(rows) > max_rows:
        keep = set(sorted(range(len(rows)), key=lambda i: -(rows[i][2] + rows[i][3]))
                   [:max_rows])
        shown = [row for i, row in enumerate(rows) if i in keep]
        title = f"{what}; the {max_rows} costliest rows, in program order:"
    else:
        title = f"{what}:"
    body: list = []
    last = None
    # a ring's sends are recorded as a reshard of the value passed round, to its own layout
    rings = {r.consumer for r in plan.reshards if r.src == r.dst}
    for g, o, compute, comm, read, source in shown:
        start, period, count = runs[g]
        if count > 1 and g != last:
            body.append(f"-- x{count}: ops {plan.ops[start].id}-"
                        f"{plan.ops[start + period * count - 1].id}, {period} per repeat; "
                        f"shown once, compute and comm summed over the {count}")
        last = g
        body.append((str(o.id), o.prim, o.strategy + (" ring" if o.id in rings else ""),
                     fmt_time(compute), fmt_time(comm), source, o.types, read))
    return Table(title, ("op", "primitive", "strategy (per mesh axis)", "compute", "comm",
                         "source", "types", "reads"), tuple(body), align="><<>><<<",
                 widths=(0, 0, 44, 0, 0, 0, 40, 0))


def _pipeline(plan) -> str:
    """The plan's pipeline: the stages (their layers and devices), the schedule, the
    micro-batches, and as priced, the bubble's share of the step and the sends."""
    p = plan.pipeline
    others = [f"{n}={k}" for n, k in plan.mesh_axes if n != p.axis]
    virtual = f", {p.virtual} virtual stages per device" if p.virtual > 1 else ""
    head = (f"pipeline: {p.stages} stages over mesh axis {p.axis!r} (stage s on the devices "
            f"at {p.axis}=s{', each ' + ' x '.join(others) if others else ''}), "
            f"{p.schedule} schedule{virtual}, {p.microbatches} micro-batches")
    if p.schedule == "1f1b":
        head += " (each micro-batch's backward as soon as its loss is known, on the last stage)"
    priced = plan.solver.get("pipeline")
    if not priced:
        return head + f"; bubble {p.bubble:.0%} of the pipelined part (not priced)"
    step = priced["step_s"]
    loss = f" and 1 all-reduce of the loss's gradient ({fmt_bytes(priced['loss_bytes'])}) " \
        f"over {'+'.join(priced['loss_axes'])}" if priced.get("loss_bytes") else ""
    split = priced.get("batch_axes")
    split = "over " + " x ".join(split) if split else "over no axis" if split is not None \
        else "as they split the stack's carry"
    tensor = priced.get("tensor_axes")
    if tensor:
        split += " and splits its layers' weights over " + " x ".join(tensor) + \
            " (tensor parallelism inside the stage)"
    ranked = "; compiled, overlapped: " + ", ".join(
        f"{r['schedule'] or 'unpipelined'} "
        + (fmt_time(r["compiled_s"]) if r.get("compiled_s") is not None else "failed")
        for r in priced["compiled_ranking"]) if priced.get("compiled_ranking") else ""
    return textwrap.fill(
        head + f"; {p.describe(priced['layers'])}; bubble {fmt_time(priced['bubble_s'])}, "
        f"{priced['bubble_s'] / step:.0%} of the step; "
        f"{_counted(priced['permutes'], 'collective-permute')} of "
        f"{fmt_bytes(priced['permute_bytes'])} and "
        f"{_counted(priced['reduces'], 'all-reduce')} of {fmt_bytes(priced['reduce_bytes'])} over "
        f"{p.axis!r}{loss} per step; unpipelined step {fmt_time(priced['unpipelined_s'])} "
        f"(the tables below lay out the unpipelined program; each stage splits a "
        f"micro-batch {split}){ranked}",
        width=100, subsequent_indent="  ", break_on_hyphens=False)


def _counted(n: int, what: str) -> str:
    """``3 all-reduces``, ``1 all-reduce``."""
    return f"{n} {what}" + ("" if n == 1 else "s")


def _overlapped(plan) -> str:
    """The step the plan was chosen by under ``Cluster(overlap=True)``: its communication run
    beside its compute (estimated), and where it was ranked on compiled programs, its
    compiled program priced so."""
    kept = [r for r in plan.solver.get("compiled_ranking", ()) if r.get("kept")]
    compiled = f", its compiled HLO priced {fmt_time(kept[0]['compiled_s'])}" \
        if kept and "compiled_s" in kept[0] else ""
    return (f"with communication overlapped (Cluster(overlap=True), what the plan was chosen "
            f"by): {fmt_time(plan.solver['overlapped_s'])} estimated{compiled}")


def _budget_check(plan) -> str:
    """The memory budget's check against the compiled program
    (:func:`shardc.step.solving.compiled_within`): the kept plan's compiled peak, and the
    plans made before it that compiled over the budget."""
    rounds, peak = plan.solver["budget_rounds"], plan.solver.get("compiled_peak")
    line = f"memory budget {fmt_bytes(rounds[0]['budget'])}: " + (
        f"compiled peak {fmt_bytes(peak)} per device (memory_analysis())" if peak is not None
        else "not checked (the program did not compile, or the backend reports no memory)")
    if len(rounds) > 1:
        line += f"; planned under {fmt_bytes(rounds[-1]['budget'])}, as " + ", ".join(
            f"the plan under {fmt_bytes(r['budget'])} (predicted {fmt_bytes(r['predicted'])})"
            f" compiled to {fmt_bytes(r['compiled'])}" for r in rounds[:-1])
    return line


def explain_report(plan, max_rows: int | None = 60, top: int = 10, margins=None,
                   verification=None) -> Report:
    """The plan as a :class:`Report`: totals, the argument and result tables, the per-op
    table, the costliest reshards; with ``margins`` (:class:`shardc.tradeoff.baselines.Margins`) the
    generic layouts priced beside it, with ``verification`` predicted vs compiled."""
    blocks = _summary(plan) + _search_notes(plan)
    if margins is not None:
        blocks.append(margins.table())
    blocks += _coverage(plan.ops)
    blocks += _control_flow(plan.ops)
    blocks += argument_table(plan)
    names = _Names(plan)
    blocks.append(op_table(plan, names, max_rows))
    kinds = Counter(c for r in plan.reshards for c in r.collectives)
    blocks.append(textwrap.fill(
        "collectives planned: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
                                   or "none"), width=100, subsequent_indent="  ",
        break_on_hyphens=False))
    if plan.reshards:
        blocks.append(Table(
            f"top {min(top, len(plan.reshards))} resharding edges:",
            ("value", "read by", "from", "to", "collectives", "time", "wire bytes"),
            tuple((*_edge(plan, names, r), "+".join(r.collectives), fmt_time(r.time),
                   fmt_bytes(r.wire_bytes))
                  for r in sorted(plan.reshards, key=lambda r: -r.time)[:top]),
            align="<<<<<>>", indent=2))
    if verification is not None:
        blocks.append(verification.table())
    return Report(tuple(blocks))


def _summary(plan) -> list:
    """The report's head: the solver, the predicted step and peak, and what the plan does
    beyond layouts (offloading, a budget's check, overlap, remat, a pipeline)."""
    p = plan.predicted
    mesh = mesh_label(plan.mesh_axes)
    blocks: list = [
        f"shardc plan on mesh ({mesh}); solver: {plan.solver.get('status', '?')}"
        + (f" ({plan.solver['stages']})" if plan.solver.get("stages") else "")
        + f" in {plan.solver.get('plan_s', 0.0):.2f} s",
        f"predicted step: {fmt_time(p.step_time)} = compute {fmt_time(p.compute_time)} + "
        f"comm {fmt_time(p.comm_time)} ({fmt_bytes(p.comm_bytes)} on the wire per device) + "
        f"input feed {fmt_time(p.feed_time)}"
        + (f" + host memory {fmt_time(p.host_time)}" if p.host_time else "")
        + f"; peak memory {fmt_bytes(p.peak_memory)} per device",
    ]
    if plan.offloaded:
        blocks.append(offloaded_line(plan))
    if plan.solver.get("attention"):
        blocks.append(attention_lines(plan.solver["attention"]))
    if "budget_rounds" in plan.solver:
        blocks.append(textwrap.fill(_budget_check(plan), width=100, subsequent_indent="  ",
                                    break_on_hyphens=False))
    if plan.cluster.overlap and "overlapped_s" in plan.solver:
        blocks.append(_overlapped(plan))
    if plan.remat:
        blocks.append(f"remat: recomputes the activations of {len(plan.remat)} of "
                      f"{plan.segments} forward segments in the backward pass (segments "
                      f"{', '.join(map(str, plan.remat))}) instead of keeping them")
    if plan.pipeline is not None:
        blocks.append(_pipeline(plan))
    return blocks


def _search_notes(plan) -> list:
    """What the planner weighed beside the plan: pipelines passed over, the meshes and
    compiled programs it ranked, the seeds' predictions."""
    blocks = []
    rejected = plan.solver.get("pipeline", {}).get("rejected") or \
        plan.solver.get("pipeline_rejected")
    if rejected:
        blocks.append(textwrap.fill(
            "pipelines checked against their compiled programs and passed over: "
            + "; ".join(rejected), width=100, subsequent_indent="  ",
            break_on_hyphens=False))
    kept = plan.solver.get("pipeline", {}).get("kept_asked")
    if kept:
        blocks.append(textwrap.fill(
            "WARNING: the pipeline asked for runs although its compiled program fails the "
            "check the planner holds its own choices to: " + kept, width=100,
            subsequent_indent="  ", break_on_hyphens=False))
    tried = plan.solver.get("mesh_search")
    if tried:
        blocks.append("mesh search (predicted step per view of the devices): " + "; ".join(
            f"{t['mesh']} " + (fmt_time(t["predicted_s"]) if t["predicted_s"] is not None
                               else "over the memory budget") for t in tried))
    ranked = plan.solver.get("compiled_ranking")
    if ranked:
        blocks.append("ranked on their compiled programs (estimated, gradients reduced late / "
                      "chained -> the compiled HLO priced, overlapped): "
                      + "; ".join(f"{r['mesh']}" + (f" ({r['seed']})" if r["seed"] else "")
                                  + f" {fmt_time(r['estimated_s'])} / "
                                  + f"{fmt_time(r['chained_s'])} -> "
                                  + (fmt_time(r["compiled_s"]) if "compiled_s" in r
                                     else "did not compile")
                                  + (" (kept)" if r.get("kept") else "") for r in ranked))
    seeds = plan.solver.get("seeds")
    if seeds:
        blocks.append("seeds (hand-written plans, predicted" + (
            ", overlapped" if plan.cluster.overlap else "") + "): " + ", ".join(
            f"{name} {fmt_time(t)}" for name, t in sorted(seeds.items(), key=lambda kv: kv[1]))
            + f"; this plan {fmt_time(_ranked(plan))}")
    return blocks


def _edge(plan, names, r) -> tuple[str, str, str, str]:
    """A resharding edge's value, reader and layouts; a pipeline's own collectives (its
    sends, sums and relayouts, :mod:`shardc.pipeline.runs`: the carry's layout on both
    sides) as the pipeline's."""
    if plan.pipeline is not None and r.consumer is None and r.src == r.dst:
        return "pipeline", "its stages", "-", "-"
    return names.value(r.value), names.consumer(r.consumer), str(r.src), str(r.dst)


def explain_plan(plan, max_rows: int | None = 60, top: int = 10, margins=None) -> str:
    """:func:`explain_report` as plain text."""
    return str(explain_report(plan, max_rows, top, margins))


def mesh_label(axes: Iterable[tuple[str, int]]) -> str:
    """``(("node", 2), ("gpu", 8))`` -> ``"node=2 x gpu=8"``: how plans, reports and the
    bench name a mesh."""
    return " x ".join(f"{n}={s}" for n, s in axes)
