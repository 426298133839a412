"""The lines of ``plan.explain()`` that say where a plan puts what it places besides its
layouts: state kept in host memory (offload), and how each attention is split."""

from __future__ import annotations

import textwrap

from shardc.cost.units import fmt_time

__all__ = ["attention_lines", "offloaded_line"]


def offloaded_line(plan) -> str:
    """The line naming the state the plan keeps in host memory."""
    names = [plan.input_names[k] if plan.input_names else f"input {k}" for k in plan.offloaded]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return textwrap.fill(
        f"offload: {len(names)} state leaves live in host memory (pinned_host) between steps, "
        f"moved to the devices when read and back once updated "
        f"({fmt_time(plan.predicted.host_time)} per step): {shown}. "
        "Forbid it with auto_shard(..., offload=False).",
        width=100, subsequent_indent="  ", break_on_hyphens=False)


def attention_lines(forms: list[dict]) -> str:
    """The lines saying how the plan splits each attention (by the user's line), per mesh
    axis: over the batch, the heads, or the sequence (context parallelism) and in which
    form (:mod:`shardc.plan.attention`)."""
    by_line: dict[str, dict[str, dict[str, int]]] = {}
    for f in forms:
        line = by_line.setdefault(_short(f["source"]) or "attention", {})
        for axis, form in f["axes"].items():
            line.setdefault(axis, {}).setdefault(form, 0)
            line[axis][form] += 1
    rows = []
    for source, axes in by_line.items():
        parts = [f"{axis}: " + " | ".join(f"{form} (x{n})" if n > 1 else form
                                          for form, n in forms_.items())
                 for axis, forms_ in axes.items()]
        rows.append(f"  {source}: " + "; ".join(parts))
    whys = dict.fromkeys(f"    {axis}: {why}" for f in forms
                         for axis, why in f.get("why", {}).items())
    rows += list(whys)[:4]
    sequence = any("sequence" in form for f in forms for form in f["axes"].values())
    note = (" - the sequence is split (context parallelism); auto_shard(..., "
            "context_parallel=False) forbids it") if sequence else ""
    return "\n".join([f"attention, per mesh axis{note}:", *rows])


def _short(source: str) -> str:
    """``path/to/file.py:12`` as ``file.py:12``."""
    return source.rsplit("/", 1)[-1]
