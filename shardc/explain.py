"""Human-readable plan reports: the per-op table, totals and the costliest reshards."""

from __future__ import annotations

import math
from collections import Counter

from shardc.views import mesh_label


def fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def fmt_bytes(b: float, up: bool = False) -> str:
    """``b`` bytes in the largest binary unit it fills, to 2 decimals; ``up`` rounds up (a
    budget printed this way is never below ``b``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            v = math.ceil(b / size * 100) / 100 if up else b / size
            return f"{v:.2f} {unit}"
    return f"{math.ceil(b) if up else b:.0f} B"


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


def explain_plan(plan, max_rows: int | None = 60, top: int = 10) -> str:
    p = plan.predicted
    mesh = mesh_label(plan.mesh_axes)
    lines = [
        f"shardc plan on mesh ({mesh}); solver: {plan.solver.get('status', '?')}"
        + (f" ({plan.solver['stages']})" if plan.solver.get("stages") else "")
        + f" in {plan.solver.get('plan_s', 0.0):.2f} s",
        f"predicted step: {fmt_time(p.step_time)} = compute {fmt_time(p.compute_time)} + "
        f"comm {fmt_time(p.comm_time)} ({fmt_bytes(p.comm_bytes)} on the wire per device) + "
        f"input feed {fmt_time(p.feed_time)}; "
        f"peak memory {fmt_bytes(p.peak_memory)} per device",
    ]
    tried = plan.solver.get("mesh_search")
    if tried:
        lines.append("mesh search (predicted step per view of the devices): " + "; ".join(
            f"{t['mesh']} " + (fmt_time(t["predicted_s"]) if t["predicted_s"] is not None
                               else "over the memory budget") for t in tried))
    seeds = plan.solver.get("seeds")
    if seeds:
        lines.append("seeds (hand-written plans, predicted): " + ", ".join(
            f"{name} {fmt_time(t)}" for name, t in sorted(seeds.items(), key=lambda kv: kv[1]))
            + f"; this plan {fmt_time(plan.solver.get('objective', p.step_time))}")
    ops = list(plan.ops)
    lines += _coverage(ops)
    shown = ops
    if max_rows is not None and len(ops) > max_rows:
        keep = sorted(ops, key=lambda o: -(o.compute_time + o.comm_time))[:max_rows]
        ids = {o.id for o in keep}
        shown = [o for o in ops if o.id in ids]
        lines.append(f"{len(ops)} ops; the {max_rows} costliest, in program order:")
    header = (f"{'op':>6}  {'primitive':<18} {'strategy (per mesh axis)':<44} "
              f"{'compute':>10} {'comm':>10}  types")
    lines += [header, "-" * len(header)]
    for o in shown:
        lines.append(f"{o.id:>6}  {o.prim:<18} {o.strategy:<44} {fmt_time(o.compute_time):>10} "
                     f"{fmt_time(o.comm_time):>10}  {o.types}")
    kinds = Counter(c for r in plan.reshards for c in r.collectives)
    lines.append("collectives planned: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
                                            or "none"))
    if plan.reshards:
        lines.append(f"top {min(top, len(plan.reshards))} resharding edges:")
        for r in sorted(plan.reshards, key=lambda r: -r.time)[:top]:
            if r.consumer is None:
                where = "its uses"
            else:
                where = f"op {r.consumer}" if r.consumer >= 0 else f"output {-1 - r.consumer}"
            lines.append(f"  v{r.value} -> {where}: {r.src} -> {r.dst}  "
                         f"{'+'.join(r.collectives)}  {fmt_time(r.time)}  "
                         f"{fmt_bytes(r.wire_bytes)}")
    return "\n".join(lines)
