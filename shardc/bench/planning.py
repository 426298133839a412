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

__all__ = ["CASES", "FRONTIER_CASES", "LOOP_PRESETS", "SCALE_MESHES", "WEAK_SCALING",
           "DescentGap", "FrontierCase", "LoopForms", "PlanningCase",
           "ScaleCase", "descent_gaps", "markdown", "measure", "measure_fresh",
           "measure_frontier", "measure_frontier_fresh",
           "measure_loop_forms", "measure_loop_forms_fresh", "measure_scale",
           "measure_scale_fresh", "scale_markdown", "write", "write_scale"]

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


def _fresh(call: str, what: str, setup: str = "") -> dict:
    """The dataclass ``call`` (an expression over this module) returns, run in a fresh
    Python process after ``setup``, as a dict."""
    code = (f"{setup}import json, dataclasses; from shardc.bench import planning; "
            f"print(json.dumps(dataclasses.asdict(planning.{call})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"planning {what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_EIGHT_DEVICES = "from shardc.cli.common import force_cpu_devices; force_cpu_devices(8); "


def measure_fresh(name: str, layers: int) -> PlanningCase:
    """:func:`measure` in a fresh Python process with 8 simulated CPU devices."""
    return PlanningCase(**_fresh(f"measure({name!r}, {layers})", f"{name} with {layers} layers",
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
    return FrontierCase(**_fresh(f"measure_frontier({name!r}, {layers})",
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
            raise RuntimeError(f"{cell.method} on {preset} did not compile")
    return LoopForms(preset, got[True].predicted_s * 1e3, got[True].compiled_s * 1e3,
                     got[False].predicted_s * 1e3, got[False].compiled_s * 1e3,
                     got[True].plan_s, got[False].plan_s)


def measure_loop_forms_fresh(preset: str) -> LoopForms:
    """:func:`measure_loop_forms` in a fresh process with the preset's simulated devices."""
    from shardc.bench.zoo import PRESETS

    return LoopForms(**_fresh(f"measure_loop_forms({preset!r})", f"loop forms on {preset}",
                              "from shardc.cli.common import force_cpu_devices; "
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
    by = {(c.model, c.layers): c for c in cases}
    for model in dict.fromkeys(c.model for c in cases):
        if (model, 12) in by and (model, 48) in by:
            lines.append(f"| {model} | {by[model, 48].plan_s / by[model, 12].plan_s:.2f}x |")
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
                  f" | {c.scanned_predicted_ms / c.unrolled_predicted_ms:.3f} | "
                  f"{c.scanned_compiled_ms:.3f} | {c.unrolled_compiled_ms:.3f} | "
                  f"{c.scanned_compiled_ms / c.unrolled_compiled_ms:.3f} | "
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
                              "descent_gaps": [{**asdict(g), "gap": g.gap,
                                                "staged_gap": g.staged_gap} for g in gaps],
                              "loop_forms": [asdict(c) for c in loops],
                              "frontiers": [asdict(c) for c in frontiers]}, indent=1))
    return [md, js]


# ---- planning for clusters larger than this machine ---------------------------------------

#: Llama 3 70B's shapes (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3): 80
#: layers, d 8192, 64 heads over 8 kv heads, FFN 28672, vocabulary 128,256; sequences of
#: 4096 tokens, one per device, bfloat16 parameters and Adam state; the layers and the loss
#: they end in a :func:`shardc.pipeline.layers_loss` stack, so the planner may pipeline
#: them, 1F1B included (as a plain :func:`shardc.pipeline.layers` stack every figure of
#: the page is the same)
SCALE_MESHES = (((128, 8), ("node", "gpu")), ((8, 16, 8), ("pod", "node", "gpu")))
#: weak scaling: the same decoder at one sequence per device on nodes of 8 GPUs, from 8 to
#: 128 nodes (PaddlePaddle's adaptive training reports 91.7% weak-scaling efficiency for
#: ERNIE 260B; Ao et al. 2021, "End-to-end Adaptive Distributed Training on PaddlePaddle")
WEAK_SCALING = (64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class ScaleCase:
    mesh: str
    devices: int
    plan_s: float  # wall seconds of step.plan on abstract arguments, tracing included
    status: str
    predicted_ms: float
    peak_gib: float  # predicted per-device peak
    budget_gib: float  # the cluster's device memory, given as memory_budget
    experts: dict  # expert name -> (predicted step ms, peak GiB), priced by the same model
    pipeline: str = ""  # the plan's pipeline ("" none)
    #: the cheapest pipeline priced (chosen or not): what it is, its step (ms) and peak
    #: (GiB), and why it was or was not chosen ("" where not asked)
    best_pipeline: str = ""


def _scale_config(devices: int):
    import jax.numpy as jnp

    from shardc.models import llama

    return llama, llama.LlamaConfig(vocab=128256, seq_len=4096, d_model=8192, n_heads=64,
                                    n_kv_heads=8, d_ff=28672, n_layers=80, batch=devices,
                                    learning_rate=3e-4, dtype=jnp.bfloat16,
                                    stack_layers=True, loss_in_stack=True)


def _scale_experts(view) -> list:
    """HSDP (parameters sharded within the node, the batch over every device) and FSDP x
    TP (Megatron within the node, parameters sharded and the batch split across nodes)."""
    from shardc.bench.experts import FSDP, TENSOR, Expert

    outer, inner = view.names[:-1], view.names[-1]
    outer = outer[0] if len(outer) == 1 else outer
    tensor = {n: inner for n in TENSOR}
    return [Expert("hsdp", {n: inner for n in FSDP}, {"batch": view.names}, view),
            Expert("fsdp-x-tp", {**tensor, "embed": outer}, {**tensor, "batch": outer}, view)]


def measure_scale(shape: tuple[int, ...], names: tuple[str, ...],
                  experts: bool = True) -> ScaleCase:
    """Plan the 70B-class decoder on an AbstractMesh of ``shape`` (no devices), within the
    cluster's device memory, pipelines allowed, and (``experts``) price the HSDP and FSDP x
    TP experts on the same model (their input layouts fixed, the rest completed by the
    planner)."""
    import math

    import jax

    import shardc
    from shardc.bench.experts import batch_specs, state_specs
    from shardc.tradeoff.views import View

    cluster = (shardc.Cluster.multi_node(*names) if len(shape) == 2
               else shardc.Cluster.multi_pod(*names))
    devices = math.prod(shape)
    module, cfg = _scale_config(devices)
    mesh = jax.sharding.AbstractMesh(shape, names)
    args = module.abstract_args(cfg)
    budget = cluster.device_memory
    step = shardc.auto_shard(module.build_step(cfg), mesh=mesh, cluster=cluster,
                             memory_budget=budget)
    t0 = time.perf_counter()
    plan = step.plan(*args)
    plan_s = time.perf_counter() - t0
    priced = {}
    for e in _scale_experts(View(shape, names, cluster)) if experts else ():
        specs = (state_specs(args[0], mesh, e, module.param_axes),
                 batch_specs(args[1], mesh, e))
        fixed = shardc.auto_shard(module.build_step(cfg), mesh=mesh, cluster=cluster,
                                  in_shardings=specs, pipeline=False).plan(*args)
        priced[e.name] = (fixed.predicted.step_time * 1e3,
                          fixed.predicted.peak_memory / 2**30)
    best = ""
    if experts:
        choice = step.pipeline_choice(*args)
        if choice.best is not None:
            b = choice.best
            best = (f"{_pipeline_text(b.pipeline)}: {b.step_time * 1e3:.0f} ms at "
                    f"{b.peak_memory / 2**30:.1f} GiB ({choice.reason})")
        else:
            best = choice.reason
    label = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
    return ScaleCase(label, devices, plan_s, plan.solver["status"],
                     plan.predicted.step_time * 1e3, plan.predicted.peak_memory / 2**30,
                     budget / 2**30, priced, _pipeline_text(plan.pipeline), best)


def _pipeline_text(pipe) -> str:
    if pipe is None:
        return ""
    return (f"{pipe.schedule}, {pipe.stages} stages over {pipe.axis}, {pipe.microbatches} "
            "micro-batches" + (f", {pipe.virtual} virtual" if pipe.virtual > 1 else ""))


def measure_scale_fresh(shape: tuple[int, ...], names: tuple[str, ...],
                        experts: bool = True) -> ScaleCase:
    """:func:`measure_scale` in a fresh Python process (JAX sees one CPU device)."""
    return ScaleCase(**_fresh(f"measure_scale({shape!r}, {names!r}, {experts!r})",
                              f"the 70B decoder on {shape}"))


def scale_markdown(cases: list[ScaleCase], command: str) -> str:
    lines = ["# Planning for clusters larger than this machine", "",
             f"`{command}` — a Llama-3-70B-shaped decoder (80 scanned, remat'd layers, d 8192, "
             "GQA 64/8, FFN 28672, vocabulary 128,256, 4096-token sequences, one per device, "
             "bfloat16 with Adam) planned on an `AbstractMesh` (no such devices here) with "
             "`memory_budget` = the cluster's device memory; its layers and the loss they end "
             "in are a `shardc.pipeline.layers_loss` stack, so the planner considers "
             "pipelines (GPipe, 1F1B, circular); wall seconds of "
             "`step.plan`, tracing included, each mesh in a fresh process, on this 2-core "
             "machine. The experts are priced by the same cost model (their input layouts "
             "fixed, the rest completed by the planner, unpipelined).", ""]
    full = [c for c in cases if c.experts]
    if full:
        lines += ["| mesh | devices | plan (s) | status | pipeline | predicted step (ms) | "
                  "peak (GiB) | budget (GiB) | HSDP ms / GiB | FSDP x TP ms / GiB |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
        for c in full:
            ex = [f"{c.experts[k][0]:.0f} / {c.experts[k][1]:.1f}"
                  for k in ("hsdp", "fsdp-x-tp")]
            lines.append(f"| {c.mesh} | {c.devices} | {c.plan_s:.1f} | {c.status} | "
                         f"{c.pipeline or 'none'} | {c.predicted_ms:.0f} | {c.peak_gib:.1f} | "
                         f"{c.budget_gib:.0f} | {ex[0]} | {ex[1]} |")
    piped = [c for c in full if c.best_pipeline]
    if piped:
        lines += ["", "The cheapest pipeline the planner priced for each (the layers split "
                  "into stages over one mesh axis, each stage planned by the same search):",
                  ""] + [f"- {c.mesh}: {c.best_pipeline}" for c in piped]
    weak = sorted((c for c in cases if c.mesh.startswith("node=")), key=lambda c: c.devices)
    if len(weak) > 1:
        base = weak[0]
        lines += ["", "## Weak scaling", "",
                  f"The same decoder at one sequence per device, on nodes of 8 GPUs over "
                  f"InfiniBand: predicted weak-scaling efficiency = step at {base.devices} "
                  "devices / step at N (1.0: the step time does not grow with the cluster). "
                  "PaddlePaddle's adaptive training reports 91.7% for ERNIE 260B.", "",
                  "| devices | mesh | pipeline | predicted step (ms) | peak (GiB) | "
                  "efficiency | plan (s) |", "|---:|---|---|---:|---:|---:|---:|"]
        for c in weak:
            lines.append(f"| {c.devices} | {c.mesh} | {c.pipeline or 'none'} | "
                         f"{c.predicted_ms:.0f} | {c.peak_gib:.1f} | "
                         f"{base.predicted_ms / c.predicted_ms:.1%} | {c.plan_s:.1f} |")
    return "\n".join(lines) + "\n"


def write_scale(cases: list[ScaleCase], out: Path, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "scale.md", out / "scale.json"
    md.write_text(scale_markdown(cases, command))
    js.write_text(json.dumps({"command": command, "cases": [asdict(c) for c in cases]},
                             indent=1))
    return [md, js]
