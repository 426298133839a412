"""Planning for clusters larger than this machine (``shardc bench --scale``): a
Llama-3-70B-shaped decoder planned on abstract meshes of 1,024 devices beside HSDP and
FSDP x TP priced by the same cost model, and its predicted weak scaling from 64 to 1,024
devices; each mesh planned in a fresh process (:func:`shardc.bench.planning.fresh`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardc.bench.planning import fresh

__all__ = ["SCALE_MESHES", "WEAK_SCALING", "ScaleCase", "measure_scale",
           "measure_scale_fresh", "scale_markdown", "weak_scaling", "write_scale"]


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
        choice = step.pipeline_choice(*args, tensor=True)
        if choice.best is not None:
            b = choice.best
            best = (f"{_pipeline_text(b.pipeline)}{_inside(b)}: {b.step_time * 1e3:.0f} ms "
                    f"at {b.peak_memory / 2**30:.1f} GiB ({choice.reason})")
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


def _inside(price) -> str:
    """What a stage splits: its micro-batches and its weights, over which axes."""
    def axes(spans):
        return " x ".join(n for n, _ in spans) or "no axis"
    return (f"; inside each stage the micro-batches split over {axes(price.batch_spans)}, "
            f"the weights over {axes(price.tensor_spans)}")


def measure_scale_fresh(shape: tuple[int, ...], names: tuple[str, ...],
                        experts: bool = True) -> ScaleCase:
    """:func:`measure_scale` in a fresh Python process (JAX sees one CPU device)."""
    return ScaleCase(**fresh(f"measure_scale({shape!r}, {names!r}, {experts!r})",
                             f"the 70B decoder on {shape}", module="scale"))


def weak_scaling(cases: list[ScaleCase]) -> list[tuple[ScaleCase, float]]:
    """The cases on nodes of 8 GPUs (``node=...`` meshes), fewest devices first, each with
    its predicted weak-scaling efficiency: the fewest devices' step over its own (none
    where fewer than two)."""
    weak = sorted((c for c in cases if c.mesh.startswith("node=")), key=lambda c: c.devices)
    if len(weak) < 2:
        return []
    return [(c, weak[0].predicted_ms / c.predicted_ms) for c in weak]


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
                  "into stages over one mesh axis, each stage planned by the same search; "
                  "with tensor parallelism inside the stages where data parallelism inside "
                  "fits no budget, `step.pipeline_choice(..., tensor=True)`: on an "
                  "AbstractMesh the planner prices it but does not choose it, since on "
                  "devices such a choice is kept only where its compiled program "
                  "communicates as priced):",
                  ""] + [f"- {c.mesh}: {c.best_pipeline}" for c in piped]
    weak = weak_scaling(cases)
    if weak:
        base = weak[0][0]
        lines += ["", "## Weak scaling", "",
                  f"The same decoder at one sequence per device, on nodes of 8 GPUs over "
                  f"InfiniBand: predicted weak-scaling efficiency = step at {base.devices} "
                  "devices / step at N (1.0: the step time does not grow with the cluster). "
                  "PaddlePaddle's adaptive training reports 91.7% for ERNIE 260B.", "",
                  "| devices | mesh | pipeline | predicted step (ms) | peak (GiB) | "
                  "efficiency | plan (s) |", "|---:|---|---|---:|---:|---:|---:|"]
        for c, efficiency in weak:
            lines.append(f"| {c.devices} | {c.mesh} | {c.pipeline or 'none'} | "
                         f"{c.predicted_ms:.0f} | {c.peak_gib:.1f} | "
                         f"{efficiency:.1%} | {c.plan_s:.1f} |")
    return "\n".join(lines) + "\n"


def write_scale(cases: list[ScaleCase], out: Path, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "scale.md", out / "scale.json"
    md.write_text(scale_markdown(cases, command))
    js.write_text(json.dumps({"command": command, "cases": [asdict(c) for c in cases]},
                             indent=1))
    return [md, js]
