"""Benchmark results as Markdown, JSON and a PNG plot; `python -m shardc.bench.report DIR`
writes DIR's results.md and results.png again from its results.json, measuring nothing."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from shardc.bench import legend
from shardc.bench.figure import draw
from shardc.bench.harness import (
    GPU_TIMING_RUNS,
    MEMORY_MARGIN,
    PRICINGS,
    TIMING_RUNS,
    Cell,
    planned_for,
    shardc_method,
)
from shardc.errors import NotFoundError

__all__ = ["figure_panels", "ROBUST", "load", "markdown", "merge", "plot", "pricing_rows",
           "rewrite", "robust_bounds", "summary", "write"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _by_cell(cells: list[Cell]) -> dict[tuple[str, str], list[Cell]]:
    """The methods measured per (model, preset), in the cells' order."""
    groups: dict[tuple[str, str], list[Cell]] = defaultdict(list)
    for c in cells:
        groups[(c.model, c.preset)].append(c)
    return groups


def summary(cells: list[Cell]) -> list[dict]:
    """Per (model, preset): shardc / best-expert compiled step time, serial and with
    communication overlapped (the best expert of each may differ), predicted-vs-compiled
    communication error. On a memory-bound cell the best expert is the best of those whose
    compiled peak fits the device memory (a plan that does not fit does not run)."""
    groups = _by_cell(cells)
    rows = []
    for (model, preset), cs in groups.items():
        ours = next((c for c in cs if c.method == "shardc" and c.compiled_s), None)
        experts = [c for c in cs if planned_for(c.method) is None and c.compiled_s]
        fitting = [c for c in experts if c.fits is not False]
        best = min(fitting, key=lambda c: c.compiled_s, default=None)
        row = {"model": model, "preset": preset, "shardc_s": ours and ours.compiled_s,
               "shardc_mesh": ours and ours.mesh,
               "best_expert": best and best.method, "best_expert_mesh": best and best.mesh,
               "best_expert_s": best and best.compiled_s, "experts": len(experts),
               "ratio": None, "comm_error": None, "unplanned_share": None,
               "saved_plan_ratio": None, "memory_error": None,
               "budget": cs[0].budget, "shardc_peak": ours and ours.peak_memory,
               "shardc_fits": ours and ours.fits, "best_expert_peak": best and best.peak_memory,
               "not_fitting": {c.method: c.peak_memory for c in experts if c.fits is False}}
        if ours and best:
            row["ratio"] = ours.compiled_s / best.compiled_s
        row.update(_overlapped(next((c for c in cs if c.method == shardc_method("nccl", True)
                                     and c.compiled_overlap_s), ours), fitting))
        if ours and ours.predicted_peak and ours.peak_memory:
            row["memory_error"] = ours.predicted_peak / ours.peak_memory - 1.0
        row["counts_match"] = (ours.planned_counts == ours.collectives
                               if ours and ours.planned_counts else None)
        if ours and ours.saved_plan_s and ours.jit_s:
            row["saved_plan_ratio"] = ours.saved_plan_s / ours.jit_s
        if ours and ours.compiled_comm_s:
            err = ours.predicted_comm_s - ours.compiled_comm_s
            row["comm_error"] = err / ours.compiled_comm_s
            if ours.unplanned_comm_s is not None:
                row["unplanned_share"] = ours.unplanned_comm_s / ours.compiled_comm_s
        rows.append(row)
    return rows


def _overlapped(ours: Cell | None, fitting: list[Cell]) -> dict:
    """A summary row's overlapped figures: shardc's step (``ours``: its plan made for
    overlap where the results have one, else its default plan), the best fitting expert's
    (the fastest under overlap) and their ratio; None where a cell predates the column."""
    best = min((c for c in fitting if c.compiled_overlap_s), key=lambda c: c.compiled_overlap_s,
               default=None)
    mine = ours and ours.compiled_overlap_s
    return {"shardc_overlap_s": mine, "shardc_overlap_method": ours and ours.method,
            "best_overlap_expert": best and best.method,
            "best_overlap_expert_mesh": best and best.mesh,
            "best_overlap_expert_s": best and best.compiled_overlap_s,
            "overlap_ratio": mine / best.compiled_overlap_s if mine and best else None}


def _gmean_line(ratios: list[float], what: str) -> list[str]:
    if not ratios:
        return []
    gmean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return [f"\nGeometric mean shardc / best expert{what}: **{gmean:.3f}** over "
            f"{len(ratios)} cells.\n"]


def _overlap_table(rows: list[dict]) -> list[str]:
    """The summary again with each step priced with its communication overlapped."""
    rows = [r for r in rows if r["overlap_ratio"] is not None]
    if not rows:
        return []
    out = ["## With communication overlapped\n",
           "The same compiled programs with each collective run beside the compute that does "
           "not wait for it (`shardc/inspect/schedule.py`: one compute stream in program "
           "order, one communication stream; a collective starts when its operands are "
           "ready and is awaited at its first use), the feed added. *best expert* is the "
           "fastest under this pricing, which may be another than above. *plan* is shardc's "
           "plan made for this pricing (the default, `Cluster(overlap=True)`), or its "
           "default plan in results that have none.\n",
           "| model | preset | plan | shardc ms | default plan serial ms | best expert | "
           "its mesh | expert ms | shardc / expert |",
           "|---|---|---|---:|---:|---|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['preset']} | {r['shardc_overlap_method']} | "
                   f"{_ms(r['shardc_overlap_s'])} | "
                   f"{_ms(r['shardc_s'])} | {r['best_overlap_expert']} | "
                   f"{r['best_overlap_expert_mesh'] or '-'} | "
                   f"{_ms(r['best_overlap_expert_s'])} | {r['overlap_ratio']:.3f} |")
    return out + _gmean_line([r["overlap_ratio"] for r in rows], " with overlap")


def pricing_rows(cells: list[Cell]) -> list[dict]:
    """Per (model, preset) and collective model: the best fitting expert under that
    pricing, serial and overlapped, and against it shardc's plan made for that pricing and
    its default plan (made for NCCL's), each priced that way; None where a figure is
    missing (results made before the pricings)."""
    groups = _by_cell(cells)
    rows = []
    for (model, preset), cs in groups.items():
        by_method = {c.method: c for c in cs if c.priced}
        experts = [c for c in cs if planned_for(c.method) is None and c.priced
                   and c.fits is not False]
        for pricing in PRICINGS:
            row = {"model": model, "preset": preset, "pricing": pricing}
            default = by_method.get("shardc")
            for k, mode in enumerate(("serial", "overlap")):
                mine = by_method.get(shardc_method(pricing, k == 1))
                priced = [c for c in experts if c.priced.get(pricing)]
                best = min(priced, key=lambda c: c.priced[pricing][k], default=None)
                best_s = best and best.priced[pricing][k]
                row[f"{mode}_expert"] = best and best.method
                row[f"{mode}_expert_s"] = best_s
                for who, cell in (("planned", mine), ("default", default)):
                    got = cell and cell.priced.get(pricing) and cell.priced[pricing][k]
                    row[f"{mode}_{who}_s"] = got
                    row[f"{mode}_{who}_ratio"] = got / best_s if got and best_s else None
            rows.append(row)
    return rows


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pricing_table(cells: list[Cell]) -> list[str]:
    """Every cell under the three collective models, serial and overlapped."""
    rows = [r for r in pricing_rows(cells) if r["serial_expert_s"]]
    if not rows:
        return []
    out = ["## Under three pricings\n",
           "Each compiled program priced with NCCL's model (`nccl`, the presets' default), "
           "ring/Simple with every step paying its latency (`ring`, pessimistic) and one "
           "latency per collective (`alpha-beta`, optimistic; `shardc/cost/collectives.py`), "
           "serially and with communication overlapped. *planned* is shardc's plan made for "
           "that pricing (`shardc@ring`, `shardc@alpha-beta`, each also `+overlap` for the "
           "overlapped columns; for NCCL's, `shardc+serial` serially and the default plan "
           "overlapped), "
           "*default* the default plan priced that way; each against the best expert under "
           "the same pricing.\n",
           "| model | preset | pricing | best expert | ms | planned / expert | default / expert "
           "| overlapped: best expert | ms | planned / expert | default / expert |",
           "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['preset']} | {r['pricing']} | {r['serial_expert']} | "
                   f"{_ms(r['serial_expert_s'])} | {_ratio(r['serial_planned_ratio'])} | "
                   f"{_ratio(r['serial_default_ratio'])} | {r['overlap_expert'] or '-'} | "
                   f"{_ms(r['overlap_expert_s'])} | {_ratio(r['overlap_planned_ratio'])} | "
                   f"{_ratio(r['overlap_default_ratio'])} |")
    out.append("\nGeometric means over the cells, shardc / best expert:\n")
    out.append("| pricing | planned, serial | default, serial | planned, overlapped | "
               "default, overlapped |")
    out.append("|---|---:|---:|---:|---:|")
    for pricing in PRICINGS:
        mine = [r for r in rows if r["pricing"] == pricing]
        means = []
        for key in ("serial_planned_ratio", "serial_default_ratio", "overlap_planned_ratio",
                    "overlap_default_ratio"):
            xs = [r[key] for r in mine if r[key]]
            means.append(_ratio(math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None))
        out.append(f"| {pricing} | " + " | ".join(means) + " |")
    return out + [""] + _disagreements(cells)


#: how far above the best expert under another pricing shardc's default plan may be
ROBUST = 1.05


def robust_bounds(cells: list[Cell]) -> list[dict]:
    """Where shardc's default plan is more than :data:`ROBUST` x the best expert under
    another pricing (serial or overlapped): the best ratio there of any program measured in
    the cell (experts and shardc's plans for every pricing) that is no slower than the best
    expert under the default pricing (NCCL's, overlapped: what the default plan must be), and
    which program that is. A bound above :data:`ROBUST` says no measured program meets
    both: the pricings disagree. At or under it, one does, and the default plan missed it.
    Beside it, the fastest fitting program under that pricing and its step under the
    default pricing over the best expert's (the other side of a disagreement)."""
    groups = _by_cell(cells)
    priced = pricing_rows(cells)
    model, overlap = planned_for("shardc")  # the default pricing
    d = int(overlap)  # its index in Cell.priced's [serial, overlapped]
    limits = {(q["model"], q["preset"]): q[f"{('serial', 'overlap')[d]}_expert_s"]
            for q in priced if q["pricing"] == model}
    rows = []
    for r in priced:
        for k, mode in enumerate(("serial", "overlap")):
            ratio = r[f"{mode}_default_ratio"]
            if ratio is None or ratio <= ROBUST:
                continue
            cs = [c for c in groups[(r["model"], r["preset"])]
                  if c.priced.get(model) and c.priced.get(r["pricing"])]
            limit = limits[(r["model"], r["preset"])]
            if limit is None or not any(c.method == "shardc" for c in cs):
                continue  # priced another way only (results made before NCCL's)
            fitting = [c for c in cs if c.fits is not False]
            fair = [c for c in fitting if c.priced[model][d] <= limit * (1 + 1e-9)]
            if not fair:  # no fitting program priced both ways
                continue
            best = min(fair, key=lambda c: c.priced[r["pricing"]][k])
            fastest = min(fitting, key=lambda c: c.priced[r["pricing"]][k])
            rows.append({"model": r["model"], "preset": r["preset"], "pricing": r["pricing"],
                         "mode": mode, "default_ratio": ratio, "bound_method": best.method,
                         "bound": best.priced[r["pricing"]][k] / r[f"{mode}_expert_s"],
                         "fastest_method": fastest.method,
                         "fastest_nccl": fastest.priced[model][d] / limit})
    return rows


def _disagreements(cells: list[Cell]) -> list[str]:
    rows = robust_bounds(cells)
    if not rows:
        return []
    out = ["### Where the pricings disagree\n",
           f"The rows above where shardc's default plan is more than {ROBUST:.2f} x the best "
           "expert under another pricing. *bound*: the best ratio there of any program "
           "measured in the cell (every expert and each of shardc's plans) that is no "
           "slower than the best expert under NCCL's overlapped pricing (what the default plan "
           f"must be), and that program; above {ROBUST:.2f}, no measured program is both "
           "(the pricings disagree), at or under it one is, and the default plan missed "
           "it. *fastest there*: the fastest program measured under that pricing, and its "
           "step under NCCL's overlapped pricing over the best expert's there.\n",
           "| model | preset | pricing | default / expert | bound | by | fastest there | "
           "its NCCL overlapped |",
           "|---|---|---|---:|---:|---|---|---:|"]
    for r in rows:
        how = r["pricing"] + (", overlapped" if r["mode"] == "overlap" else "")
        out.append(f"| {r['model']} | {r['preset']} | {how} | {r['default_ratio']:.3f} | "
                   f"{r['bound']:.3f} | {r['bound_method']} | {r['fastest_method']} | "
                   f"{r['fastest_nccl']:.3f} |")
    return out + [""]


def markdown(cells: list[Cell], commands: list[str], header: str = "") -> str:
    made = "; then ".join(f"`{c}`" for c in commands)
    lines = [f"# shardc bench\n\n{header}Made by: {made} (later commands re-measured the "
             "cells they name)\n" if len(commands) > 1 else
             f"# shardc bench\n\n{header}Command: {made}\n",
             "Step times are the compiled program priced on the preset's cluster model: "
             "collectives read from the compiled HLO, each priced with NCCL's model over the "
             "links its groups cross (other pricings below), compute from "
             "`cost_analysis()` FLOPs (loop bodies by trip count), and the host-to-device "
             "feed of the batch under the compiled input shardings (PCIe). Lower is better. "
             "Weak scaling: the global batch is the model's per-device batch times the "
             "preset's devices. The experts are every form a practitioner writes (data "
             "parallel, FSDP, HSDP, Megatron TP, DP x TP, FSDP x TP, expert parallel and "
             "EP x DP; on several nodes also within the node, replicated across) on every "
             "logical view of the preset's devices that shardc's mesh search considers "
             "(`shardc/bench/experts.py`); *best expert* is the fastest of them, on the view "
             "named. shardc searches the logical views (`mesh_search`), each seeded with the "
             "experts written on it; *shardc mesh* is the view it "
             "chose, *unplanned comm* the share of its compiled communication time in "
             "collective kinds it did not plan; *peak* its predicted per-device peak memory "
             "against `memory_analysis()` (arguments + outputs + temporaries - aliased); "
             "*saved plan* the wall time of running a saved plan (`use_plan`, lower, "
             "compile: no solver) over tracing once plus `jax.jit` lowering and compiling "
             "the same program with the plan's shardings (" + (
                 "one run of each, the quick matrix's" if any("--quick" in c for c in commands)
                 else f"each the fastest of {TIMING_RUNS} runs") + ").\n",
             *_gpu_compiled(cells), *_figure(cells),
             *legend.markdown([c.method for c in cells]),
             "## Summary\n",
             "| model | preset | shardc ms | shardc mesh | best of N experts | its mesh | "
             "expert ms | shardc / expert | predicted vs compiled comm | collective counts "
             "equal | unplanned comm | predicted vs compiled peak | saved plan |",
             "|---|---|---:|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    ratios = []
    for r in summary(cells):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        if r["ratio"]:
            ratios.append(r["ratio"])
        err = "-" if r["comm_error"] is None else f"{r['comm_error'] * 100:+.1f}%"
        share = "-" if r["unplanned_share"] is None else f"{r['unplanned_share'] * 100:.1f}%"
        saved = "-" if r["saved_plan_ratio"] is None else f"{r['saved_plan_ratio']:.2f}x"
        mem = "-" if r["memory_error"] is None else f"{r['memory_error'] * 100:+.1f}%"
        fit = " that fit" if r["not_fitting"] else ""
        best = f"{r['best_expert']} (of {r['experts'] - len(r['not_fitting'])}{fit})" \
            if r["best_expert"] else "-"
        counts = {None: "-", True: "yes", False: "**no**"}[r["counts_match"]]
        lines.append(f"| {r['model']} | {r['preset']} | {_ms(r['shardc_s'])} | "
                     f"{r['shardc_mesh'] or '-'} | {best} | {r['best_expert_mesh'] or '-'} | "
                     f"{_ms(r['best_expert_s'])} | {ratio} | {err} | {counts} | {share} | "
                     f"{mem} | {saved} |")
    lines += _gmean_line(ratios, "")
    lines += _overlap_table(summary(cells))
    lines += _pricing_table(cells)
    lines += _memory_bound(summary(cells))
    lines += ["## All cells\n",
              "| model | preset | method | mesh | plan s | predicted ms | compiled ms | "
              "overlapped ms | comm ms | compute ms | feed ms | wire MiB | collectives | "
              "predicted peak MiB | peak MiB | matched | error |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for c in cells:
        colls = ", ".join(f"{k} {v}" for k, v in sorted(c.collectives.items())) or "-"
        wire = "-" if c.wire_bytes is None else f"{c.wire_bytes / 2**20:.1f}"
        mem = "-" if c.peak_memory is None else f"{c.peak_memory / 2**20:.1f}" + \
            (" **over**" if c.fits is False else "")
        pmem = "-" if c.predicted_peak is None else f"{c.predicted_peak / 2**20:.1f}"
        plan = "-" if c.plan_s is None else f"{c.plan_s:.2f}"
        matched = {None: "-", True: "yes", False: "**NO**"}[c.matched]
        err = (c.error or "").splitlines()[0][:80] if c.error else ""
        lines.append(f"| {c.model} | {c.preset} | {c.method} | {c.mesh or '-'} | {plan} | "
                     f"{_ms(c.predicted_s)} | {_ms(c.compiled_s)} | "
                     f"{_ms(c.compiled_overlap_s)} | {_ms(c.compiled_comm_s)} | "
                     f"{_ms(c.compiled_compute_s)} | {_ms(c.compiled_feed_s)} | {wire} | "
                     f"{colls} | {pmem} | {mem} | {matched} | {err} |")
    return "\n".join(lines) + "\n"


def _figure(cells: list[Cell]) -> list[str]:
    """The figure :func:`plot` draws beside this page, where it has a panel."""
    if not figure_panels(cells)[1]:
        return []
    return ["![shardc / best expert per cell, one panel per pricing](results.png)\n",
            "`results.png`: per cell, shardc's plan made for each pricing over the best "
            "expert under the same pricing (a log axis; left of 1.0 shardc is faster; a dot "
            "marks the default plan where it differs).\n"]


def _gpu_compiled(cells: list[Cell]) -> list[str]:
    """What differs where XLA:GPU compiled the cells (``shardc bench --compiler gpu``)."""
    if not any(c.compiler == "gpu" for c in cells):
        return []
    return ["**Compiled by XLA:GPU** (`--compiler gpu`): every program is XLA:GPU's for H100s "
            "(JAX's CUDA plugin compiling ahead of time, `shardc/bench/deviceless.py`; nothing "
            "runs), so its collectives are the GPU's, combined and scheduled as there. Such a "
            "compile reports no `cost_analysis()`: compute is the FLOPs the overlap replay "
            "weighs (`shardc.inspect.schedule.replay_flops`: dots and convolutions from "
            "their shapes, elementwise ops one per element), not XLA's count. The numerics "
            "check runs the tiny config on CPU devices; the saved-plan timing is "
            f"{GPU_TIMING_RUNS} run of each.\n"]


def _memory_bound(rows: list[dict]) -> list[str]:
    """The memory-bound cells' table: shardc's compiled peak against the device memory, the
    best expert that fits, and the experts that do not fit with their peaks."""
    rows = [r for r in rows if r["budget"] is not None]
    if not rows:
        return []
    out = ["## Memory-bound cells\n",
           "Models too large for data parallelism on the device (zoo `device_memory`): a "
           "method fits when its compiled peak (`memory_analysis()`) is within the device "
           "memory; *best expert* above and here is the fastest that fits. shardc plans "
           f"with `memory_budget` = {1 - MEMORY_MARGIN:.2f} x the device memory (the margin "
           "covers its predicted peak's worst error on the zoo, `harness.MEMORY_MARGIN`). "
           "These cells skip the numerics check (their tiny config is another model's, "
           "checked there) and the saved-plan timing.\n",
           "| model | preset | device GiB | shardc ms | shardc peak GiB | fits | best expert "
           "that fits | its ms | its peak GiB | shardc / expert | experts over (peak GiB) |",
           "|---|---|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        fits = {None: "-", True: "yes", False: "**NO**"}[r["shardc_fits"]]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        over = ", ".join(f"{m} ({_gib(p)})" for m, p in r["not_fitting"].items()) or "none"
        out.append(f"| {r['model']} | {r['preset']} | {_gib(r['budget'])} | "
                   f"{_ms(r['shardc_s'])} | {_gib(r['shardc_peak'])} | {fits} | "
                   f"{r['best_expert'] or '-'} | {_ms(r['best_expert_s'])} | "
                   f"{_gib(r['best_expert_peak'])} | {ratio} | {over} |")
    return [*out, ""]


def figure_panels(cells: list[Cell]) -> tuple[list[str], list[dict]]:
    """The bench figure's data, ``(labels, panels)``: a ``"model  preset"`` label per cell
    and, per pricing of :func:`pricing_rows` serial and overlapped, a panel: its ``title``
    and per label the ratios of shardc's plan made for that pricing (``planned``) and of its
    default plan (``default``) over the best fitting expert so priced (None: missing).
    Results made before the pricings give a serial and an overlapped panel of
    :func:`summary`'s ratios."""
    rows = [r for r in pricing_rows(cells) if r["serial_expert_s"]]
    if not rows:  # results made before the pricings: as compiled
        rows = summary(cells)
        labels = [f"{r['model']}  {r['preset']}" for r in rows]
        out = [{"title": title, "planned": [r[key] for r in rows],
                "default": [r[key] for r in rows]}
               for title, key in (("serial", "ratio"), ("overlapped", "overlap_ratio"))]
        return labels, [p for p in out if any(p["planned"])]
    labels = list(dict.fromkeys(f"{r['model']}  {r['preset']}" for r in rows))
    by = {(f"{r['model']}  {r['preset']}", r["pricing"]): r for r in rows}
    out = []
    for pricing in (p for p in PRICINGS if any(r["pricing"] == p for r in rows)):
        for mode, what in (("serial", "serial"), ("overlap", "overlapped")):
            got = [by.get((label, pricing), {}) for label in labels]
            out.append({"title": f"{pricing}, {what}",
                        "planned": [g.get(f"{mode}_planned_ratio") for g in got],
                        "default": [g.get(f"{mode}_default_ratio") for g in got]})
    return labels, [p for p in out if any(p["planned"]) or any(p["default"])]


def plot(cells: list[Cell], path: Path) -> None:
    """The bench figure (:mod:`shardc.bench.figure`): shardc / best expert per cell, one
    panel per pricing, into ``path``; nothing where no cell has a ratio."""
    labels, panels = figure_panels(cells)
    if panels:
        draw(labels, panels, path)


def load(out: Path) -> tuple[list[Cell], list[str]]:
    """The cells and commands of an earlier ``results.json`` in ``out`` (none if none)."""
    path = out / "results.json"
    if not path.exists():
        return [], []
    data = json.loads(path.read_text())
    return [Cell(**c) for c in data["cells"]], data.get("commands", [data.get("command")])


def merge(old: list[Cell], new: list[Cell]) -> list[Cell]:
    """``old`` with every cell that ``new`` measured again replaced, in ``old``'s order."""
    key = lambda c: (c.model, c.preset, c.method)  # noqa: E731
    fresh = {key(c): c for c in new}
    out = [fresh.pop(key(c), c) for c in old]
    return out + list(fresh.values())


def write(cells: list[Cell], out: Path, commands: list[str], header: str = "",
          plot_png: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "results.md", out / "results.json", out / "results.png"
    md.write_text(markdown(cells, commands, header))
    js.write_text(json.dumps({"commands": commands, "cells": [c.to_json() for c in cells],
                              "summary": summary(cells)}, indent=1))
    if plot_png:
        plot(cells, png)
    return [md, js, png]


def rewrite(out: Path) -> list[Path]:
    """Write ``results.md`` and ``results.png`` in ``out`` again from its ``results.json``,
    measuring nothing (after a change to the report or the figure)."""
    cells, commands = load(out)
    if not cells:
        raise NotFoundError(f"no bench results in {out / 'results.json'}; run shardc bench "
                            "first")
    return write(cells, out, commands)


if __name__ == "__main__":  # python -m shardc.bench.report [DIR]: the report from DIR's results
    import sys

    for written in rewrite(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks")):
        print(f"wrote {written}")
