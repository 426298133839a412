"""Planning time: how long shardc takes to plan large train steps from abstract arguments.

Each case plans one model (GPT-2-small-sized, layers unrolled; or the scanned Llama decoder)
at 12 and 48 layers on the (node=2, gpu=4) mesh of :meth:`shardc.Cluster.multi_node`, with
the default options and no mesh search, and records the wall time of ``step.plan`` (tracing
included; building the abstract arguments not), the solver's status and the predicted step.
The 48/12 ratio is the figure that says whether planning grows with depth. Each case runs
in a fresh process (:func:`measure_fresh`), so none gains from another's warm caches and
each pays what a user's first plan pays. A second table measures coordinate descent alone
against the whole-graph ILP's proven optimum on the zoo's quick configurations
(:func:`descent_gaps`), a third the time of ``step.pareto`` for GPT-2 small and the
scanned Llama (:func:`measure_frontier`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardc.errors import BenchError

__all__ = ["CASES", "FRONTIER_CASES", "LOOP_PRESETS", "DescentGap", "FrontierCase",
           "LoopForms", "PlanningCase", "depth_ratios", "descent_gaps", "fresh", "markdown",
           "measure", "measure_fresh", "measure_frontier", "measure_frontier_fresh",
           "measure_loop_forms", "measure_loop_forms_fresh", "write"]

#: (model, layers): the unrolled GPT-2-small and the scanned Llama decoder, each at 12 and 48
CASES = (("gpt", 12), ("gpt", 48), ("llama", 12), ("llama", 48))
MESH = ((2, 4), ("node", "gpu"))
GAP_ILP_LIMIT = 60.0  # wall seconds the whole-graph ILP of a descent-gap case may take
#: presets on which the bench's Llama decoder is planned scanned and unrolled
LOOP_PRESETS = ("node-8", "2nodes-2x8")
LOOP_TIME_LIMIT = 10.0  # the bench's default ILP guard


@dataclass(frozen=True)
class PlanningCase:
    model: str
    layers: int
    scanned: bool
    plan_s: float  # wall seconds of step.plan, tracing included
    status: str
    predicted_ms: float
    live_nodes: int
    stages: str


def _model(name: str, layers: int):
    if name == "gpt":
        from shardc.models import gpt

        return gpt, gpt.GPTConfig.gpt2_small(n_layers=layers), False
    from shardc.models import llama

    return llama, llama.LlamaConfig.realistic(n_layers=layers), True


def _case_step(name: str, layers: int):
    """One case's step on the planning mesh (the process must have at least 8 devices),
    its abstract arguments, and whether its layers are scanned."""
    import jax

    import shardc

    module, cfg, scanned = _model(name, layers)
    shape, names = MESH
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    step = shardc.auto_shard(module.build_step(cfg), mesh=mesh,
                             cluster=shardc.Cluster.multi_node(*names))
    return step, module.abstract_args(cfg), scanned


def measure(name: str, layers: int) -> PlanningCase:
    """Plan one case (the process must have at least 8 devices)."""
    step, args, scanned = _case_step(name, layers)
    t0 = time.perf_counter()
    plan = step.plan(*args)
    plan_s = time.perf_counter() - t0
    return PlanningCase(name, layers, scanned, plan_s, plan.solver["status"],
                        plan.predicted.step_time * 1e3, plan.solver["live_nodes"],
                        plan.solver.get("stages", ""))


def fresh(call: str, what: str, setup: str = "", module: str = "planning") -> dict:
    """The dataclass ``call`` (an expression over ``shardc.bench.<module>``) returns, run
    in a fresh Python process after ``setup``, as a dict."""
    code = (f"{setup}import json, dataclasses; from shardc.bench import {module}; "
            f"print(json.dumps(dataclasses.asdict({module}.{call})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise BenchError(f"planning {what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_EIGHT_DEVICES = "from shardc.util.devices import force_cpu_devices; force_cpu_devices(8); "


def measure_fresh(name: str, layers: int) -> PlanningCase:
    """:func:`measure` in a fresh Python process with 8 simulated CPU devices."""
    return PlanningCase(**fresh(f"measure({name!r}, {layers})", f"{name} with {layers} layers",
                                 _EIGHT_DEVICES))


#: (model, layers): the frontiers timed (``step.pareto``): GPT-2 small, the scanned Llama
FRONTIER_CASES = (("gpt", 12), ("llama", 12))


@dataclass(frozen=True)
class FrontierCase:
    """``step.pareto`` of one case on the planning mesh: wall seconds (tracing included),
    its plans, the leanest plan's peak and step, the fastest's, and the widest gap between
    neighbouring plans' peaks as a share of the frontier's memory range."""
    model: str
    layers: int
    scanned: bool
    pareto_s: float
    plans: int
    leanest_gib: float
    leanest_ms: float
    fastest_gib: float
    fastest_ms: float
    widest_gap: float


def measure_frontier(name: str, layers: int) -> FrontierCase:
    """Time one case's frontier (the process must have at least 8 devices)."""
    step, args, scanned = _case_step(name, layers)
    t0 = time.perf_counter()
    frontier = step.pareto(*args)
    seconds = time.perf_counter() - t0
    points = frontier.points()  # (step s, peak bytes), leanest first
    peaks = [m for _, m in points]
    span = peaks[-1] - peaks[0]
    gap = max((b - a for a, b in zip(peaks, peaks[1:])), default=0.0) / span if span else 0.0
    return FrontierCase(name, layers, scanned, seconds, len(frontier), peaks[0] / 2**30,
                        points[0][0] * 1e3, peaks[-1] / 2**30, points[-1][0] * 1e3, gap)


def measure_frontier_fresh(name: str, layers: int) -> FrontierCase:
    """:func:`measure_frontier` in a fresh Python process with 8 simulated CPU devices."""
    return FrontierCase(**fresh(f"measure_frontier({name!r}, {layers})",
                                 f"the frontier of {name} with {layers} layers", _EIGHT_DEVICES))


@dataclass(frozen=True)
class LoopForms:
    """The bench's Llama decoder planned by shardc with its layers scanned and unrolled
    (``scan_layers=False``: the same stacked parameters, a Python loop), on one preset:
    predicted and compiled step (ms, priced like a bench cell) and planning seconds."""
    preset: str
    scanned_predicted_ms: float
    scanned_compiled_ms: float
    unrolled_predicted_ms: float
    unrolled_compiled_ms: float
    scanned_plan_s: float
    unrolled_plan_s: float

    @property
    def predicted_ratio(self) -> float:
        """Scanned over unrolled predicted step."""
        return self.scanned_predicted_ms / self.unrolled_predicted_ms

    @property
    def compiled_ratio(self) -> float:
        """Scanned over unrolled compiled step."""
        return self.scanned_compiled_ms / self.unrolled_compiled_ms


def measure_loop_forms(preset: str) -> LoopForms:
    """Plan, compile and price both forms on ``preset`` (the process needs its devices)."""
    from shardc.bench import harness
    from shardc.bench.zoo import PRESETS, ZOO

    zm, pre = ZOO["llama"], PRESETS[preset]
    cfg = zm.config("bench", pre.devices)
    got = {scan: harness.planned_and_compiled(
        zm, pre, dataclasses.replace(cfg, scan_layers=scan), LOOP_TIME_LIMIT,
        "shardc-scanned" if scan else "shardc-unrolled") for scan in (True, False)}
    for cell in got.values():
        if cell.compiled_s is None:
            raise BenchError(f"{cell.method} on {preset} did not compile")
    return LoopForms(preset, got[True].predicted_s * 1e3, got[True].compiled_s * 1e3,
                     got[False].predicted_s * 1e3, got[False].compiled_s * 1e3,
                     got[True].plan_s, got[False].plan_s)


def measure_loop_forms_fresh(preset: str) -> LoopForms:
    """:func:`measure_loop_forms` in a fresh process with the preset's simulated devices."""
    from shardc.bench.zoo import PRESETS

    return LoopForms(**fresh(f"measure_loop_forms({preset!r})", f"loop forms on {preset}",
                              "from shardc.util.devices import force_cpu_devices; "
                              f"force_cpu_devices({PRESETS[preset].devices}); "))


@dataclass(frozen=True)
class DescentGap:
    model: str
    preset: str
    optimum_ms: float  # the ILP's proven optimum of the cost graph
    descent_ms: float  # coordinate descent alone (its greedy starts, no ILP)
    staged_ms: float  # the stages a graph too large for one ILP goes through, forced

    @property
    def gap(self) -> float:
        return self.descent_ms / self.optimum_ms - 1.0

    @property
    def staged_gap(self) -> float:
        return self.staged_ms / self.optimum_ms - 1.0


def descent_gaps(presets: tuple[str, ...] = ("node-8", "node-2x4"),
                 which: str = "quick") -> list[DescentGap]:
    """Coordinate descent alone, and the stages of a graph too large for one ILP (folding,
    the quotient's ILP stages, blocks; :func:`shardc.solve.refine.quotient_refine`), against
    the ILP over the whole graph at once, on each zoo model's ``which`` configuration: all
    solve the same cost graph, the step as the planner sees it (followers merged, the new
    state tied to the state it replaces). Cases where the ILP does not prove its optimum
    within ``GAP_ILP_LIMIT`` are left out."""
    import jax

    from shardc.bench.zoo import PRESETS, ZOO
    from shardc.ir.trace import trace
    from shardc.solve import descent
    from shardc.solve.fold import fold
    from shardc.solve.ilp import solve_ilp
    from shardc.solve.problem import build
    from shardc.solve.refine import quotient_refine
    from shardc.step.signature import tie_outputs

    out = []
    for zm in ZOO.values():
        mod = zm.load()
        cfg = zm.config(which)
        args = mod.abstract_args(cfg)
        traced = trace(mod.build_step(cfg), *args)
        ties = tie_outputs([jax.tree.structure(a) for a in args], traced.out_tree,
                           traced.graph)
        for name in presets:
            preset = PRESETS[name]
            cg = build(traced.graph, preset.mesh_shape, preset.axis_names, preset.cluster,
                       ties)
            cg.merge_followers()
            x = descent.solve(cg)
            staged, _ = quotient_refine(cg, x, None, time.perf_counter() + GAP_ILP_LIMIT,
                                        fold(cg))
            res = solve_ilp(cg, time_limit=GAP_ILP_LIMIT)
            if res.status == "OPTIMAL":
                out.append(DescentGap(zm.name, name,
                                      descent.objective(cg, res.assignment) * 1e3,
                                      descent.objective(cg, x) * 1e3,
                                      descent.objective(cg, staged) * 1e3))
    return out


def depth_ratios(cases: list[PlanningCase]) -> dict[str, float]:
    """Model -> its planning time at 48 layers over that at 12 (models with both)."""
    by = {(c.model, c.layers): c for c in cases}
    return {model: by[model, 48].plan_s / by[model, 12].plan_s
            for model in dict.fromkeys(c.model for c in cases)
            if (model, 12) in by and (model, 48) in by}


def markdown(cases: list[PlanningCase], command: str, gaps: list[DescentGap] = (),
             loops: list[LoopForms] = (), frontiers: list[FrontierCase] = ()) -> str:
    lines = ["# Planning time", "", f"`{command}` — mesh (node=2, gpu=4), "
             "`Cluster.multi_node`, default options, no mesh search; wall seconds of "
             "`step.plan` on abstract arguments, tracing included, each case in a fresh "
             "process, on this machine.", "",
             "| model | layers | loop | plan (s) | status | predicted step (ms) | live nodes |",
             "|---|---:|---|---:|---|---:|---:|"]
    for c in cases:
        lines.append(f"| {c.model} | {c.layers} | {'scanned' if c.scanned else 'unrolled'} | "
                     f"{c.plan_s:.2f} | {c.status} | {c.predicted_ms:.3f} | {c.live_nodes} |")
    lines += ["", "| model | 48 / 12 layers planning time |", "|---|---:|"]
    lines += [f"| {model} | {ratio:.2f}x |" for model, ratio in depth_ratios(cases).items()]
    if frontiers:
        lines += ["", "## The time-memory frontier", "",
                  "`step.pareto` of each case on the same mesh (the fastest plan, the "
                  "leanest, budgets between and the gaps filled, remat levels and the "
                  "generic layouts beside them), wall seconds in a fresh process; *widest "
                  "gap*: between neighbouring plans' peaks, as a share of the frontier's "
                  "memory range.", "",
                  "| model | layers | loop | pareto (s) | plans | leanest GiB | its step ms | "
                  "fastest GiB | its step ms | widest gap |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {c.model} | {c.layers} | {'scanned' if c.scanned else 'unrolled'} | "
                  f"{c.pareto_s:.1f} | {c.plans} | {c.leanest_gib:.2f} | {c.leanest_ms:.3f} | "
                  f"{c.fastest_gib:.2f} | {c.fastest_ms:.3f} | {c.widest_gap:.1%} |"
                  for c in frontiers]
    if loops:
        lines += ["", "## Scanned against unrolled layers", "",
                  "The bench's Llama decoder (`realistic`: 8 layers, d 1024, batch 16 x 512 "
                  "per 8 devices) planned by shardc with its layers in a `lax.scan` and as a "
                  "Python loop over the same stacked parameters, compiled and priced like a "
                  "bench cell (compiled compute counts loop bodies by trip count).", "",
                  "| preset | scanned predicted (ms) | unrolled predicted (ms) | ratio | "
                  "scanned compiled (ms) | unrolled compiled (ms) | ratio | plan s scanned / "
                  "unrolled |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {c.preset} | {c.scanned_predicted_ms:.3f} | {c.unrolled_predicted_ms:.3f}"
                  f" | {c.predicted_ratio:.3f} | "
                  f"{c.scanned_compiled_ms:.3f} | {c.unrolled_compiled_ms:.3f} | "
                  f"{c.compiled_ratio:.3f} | "
                  f"{c.scanned_plan_s:.1f} / {c.unrolled_plan_s:.1f} |" for c in loops]
    if gaps:
        lines += ["", "## Coordinate descent and the folded stages against the ILP optimum",
                  "", "The zoo's quick configurations, the cost graph as the planner sees it "
                  "(followers merged, the new state tied to the old): coordinate descent "
                  "alone (its greedy starts, no ILP); the stages a graph too large for one "
                  "ILP goes through (folding, the quotient's ILPs, blocks), forced on these "
                  "small graphs; one ILP over the whole graph (proven optimal).", "",
                  "| model | preset | ILP optimum (ms) | descent alone (ms) | descent's gap | "
                  "folded stages (ms) | their gap |", "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {g.model} | {g.preset} | {g.optimum_ms:.3f} | {g.descent_ms:.3f} | "
                  f"{g.gap:+.1%} | {g.staged_ms:.3f} | {g.staged_gap:+.1%} |" for g in gaps]
    return "\n".join(lines) + "\n"


def write(cases: list[PlanningCase], out: Path, command: str,
          gaps: list[DescentGap] = (), loops: list[LoopForms] = (),
          frontiers: list[FrontierCase] = ()) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "planning.md", out / "planning.json"
    md.write_text(markdown(cases, command, gaps, loops, frontiers))
    js.write_text(json.dumps({"command": command, "cases": [asdict(c) for c in cases],
                              "depth_ratios": depth_ratios(cases),
                              "descent_gaps": [{**asdict(g), "gap": g.gap,
                                                "staged_gap": g.staged_gap} for g in gaps],
                              "loop_forms": [{**asdict(c), "predicted_ratio": c.predicted_ratio,
                                              "compiled_ratio": c.compiled_ratio}
                                             for c in loops],
                              "frontiers": [asdict(c) for c in frontiers]}, indent=1))
    return [md, js]
