"""The device measurements (:mod:`shardc.bench.device`) beside the planner's predictions.

Reads what ``python -m shardc.bench.device`` wrote on a GPU machine (``steps.json``,
``schedule.json`` and the compiled programs, ``*.hlo.gz``) and writes
``docs/benchmarks/gpu.md``:

- **Compute.** Each zoo model's one-device step, timed there, against the compute the
  planner predicts for the same step (``Plan.predicted.compute_time``: the program's FLOPs
  over ``device_flops * utilization``), planned here on a one-device mesh of the node-8
  preset's cluster.
- **Schedule.** The FSDP step XLA compiled for eight H100s, priced on the node-8 preset
  three ways: serial (every collective added to compute, the bench's first pricing);
  overlapped as :mod:`shardc.inspect.schedule` replays it (a collective starts once its
  operands are ready, whatever its place in the program: the bench's second pricing); and
  in the order XLA scheduled it (:func:`in_order`: a ``-start`` is issued where XLA put it
  and awaited at its ``-done``). The same program compiled by XLA:CPU here (where the bench
  compiles) is priced beside it.

Usage: ``python -m shardc.bench.gpu_report DIR [--out docs/benchmarks/gpu.md]``.

References:
  XLA ``latency_hiding_scheduler.cc`` (the GPU schedule's ``-start`` / ``-done`` positions);
  NCCL user guide, "CUDA stream semantics" (a stream's collectives run in issue order);
  NVIDIA H200 datasheet (2024): the H100's compute (989 TFLOP/s dense BF16, 494 TF32) with
  141 GB of HBM3e at 4.8 TB/s; NVIDIA H100 datasheet (2023): H100 SXM5 80 GB, HBM3 at
  3.35 TB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from shardc.bench.compute_fit import section, step_holdout
from shardc.util.devices import force_cpu_devices

__all__ = ["HBM_BANDWIDTH", "in_order", "main"]

#: bytes/s of HBM by the device name JAX reports (References)
HBM_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
_BODY = re.compile(r"\bbody=%?([^\s,}]+)")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([^\s,}]+)")


def in_order(hlo_text: str, seconds: dict[tuple[str, str], float], scale: float) -> dict:
    """Replay ``hlo_text`` in XLA's scheduled order on one compute and one communication
    stream: compute instructions run one after another (``scale`` seconds per FLOP of
    :class:`shardc.inspect.schedule._Replay`'s weights); a collective (``seconds`` per
    ``(computation, instruction)``, an ``async-start`` charged its wrapped collectives) is
    issued at its place in the text, runs once the communication stream is free, and is
    awaited at its ``-done`` (a synchronous one at once); a ``while`` body runs its trip
    count, a ``call`` inline. Returns ``time`` (end to end), ``exposed`` (seconds the
    compute stream waited on communication) and ``comm`` (all collective seconds)."""
    from shardc.inspect.hlotext import parse_module
    from shardc.inspect.loops import _entry, trip_count
    from shardc.inspect.schedule import _Replay

    comps = parse_module(hlo_text)
    per: dict[str, dict[str, float]] = {}
    for (comp, name), t in seconds.items():
        per.setdefault(comp, {})[name] = t
    replay = _Replay(comps, per)
    clock = {"compute": 0.0, "comm": 0.0, "exposed": 0.0, "total_comm": 0.0}

    def wait(until: float) -> None:
        if until > clock["compute"]:
            clock["exposed"] += until - clock["compute"]
            clock["compute"] = until

    def run(name: str) -> None:
        comp = comps.get(name)
        pending: dict[str, float] = {}  # a -start's name -> when its collective ends
        for instr in comp.instructions.values() if comp is not None else ():
            if instr.opcode == "while" and (body := _BODY.search(instr.attrs)):
                for _ in range(trip_count(instr) or 1):
                    run(body.group(1))
                continue
            if instr.opcode == "call" and (callee := _CALLS.search(instr.attrs)):
                run(callee.group(1))
                continue
            coll = replay.collective(comp, instr)
            if coll is not None:
                start = max(clock["comm"], clock["compute"])
                clock["comm"] = start + sum(coll.values())
                clock["total_comm"] += sum(coll.values())
                if instr.opcode.endswith("-start"):
                    pending[instr.name] = clock["comm"]
                else:
                    wait(clock["comm"])
                continue
            if instr.opcode.endswith("-done"):
                for op in instr.operands:
                    if op in pending:
                        wait(pending.pop(op))
                continue
            clock["compute"] += replay.weight(comp, instr) * scale
        for end in pending.values():  # started, never awaited here: awaited at the end
            wait(end)

    run(_entry(hlo_text))
    wait(clock["comm"])
    return {"time": clock["compute"], "exposed": clock["exposed"], "comm": clock["total_comm"]}


def _schedule_prices(text: str, mesh, cluster) -> dict:
    """One compiled program's collectives and its three pricings (module doc), its compute
    from the FLOPs :mod:`shardc.inspect.schedule` weighs (both compilers' programs counted
    alike: GPU library calls have no ``cost_analysis`` FLOPs)."""
    from shardc.inspect.hlo import collective_seconds, collectives
    from shardc.inspect.loops import multiplicity
    from shardc.inspect.schedule import replay_flops, schedule

    found = collectives(text, mesh)
    secs = [collective_seconds(c, mesh, cluster) for c in found]
    runs = multiplicity(text)
    per: dict[tuple[str, str], float] = {}
    for c, t in zip(found, secs):
        per[(c.computation, c.name)] = per.get((c.computation, c.name), 0.0) + t
    flops = replay_flops(text, found)
    compute = flops / (cluster.device_flops * cluster.utilization)
    comm = sum(t * runs.get(c.computation, 1) for c, t in zip(found, secs))
    ordered = in_order(text, per, compute / flops if flops else 0.0)
    return {"counts": dict(Counter(c.kind for c in found)), "flops": flops,
            "compute_s": compute, "comm_s": comm, "serial_s": compute + comm,
            "free_s": schedule(text, found, secs, compute).time,
            "in_order_s": ordered["time"], "exposed_s": ordered["exposed"]}


def _one_device_compute(name: str) -> tuple[float, int]:
    """The planner's predicted compute seconds of zoo model ``name``'s one-device step, and
    the step's array arguments."""
    import jax
    from jax.sharding import AxisType

    from shardc import auto_shard
    from shardc.bench.zoo import PRESETS, ZOO

    zm = ZOO[name]
    mod, cfg = zm.load(), zm.config("bench", devices=1)
    mesh = jax.make_mesh((1,), ("gpu",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])
    cluster = dataclasses.replace(PRESETS["node-8"].cluster, kernels="h100")
    plan = auto_shard(mod.build_step(cfg), mesh=mesh,
                      cluster=cluster).plan(*mod.abstract_args(cfg))
    return plan.predicted.compute_time, len(jax.tree.leaves(mod.abstract_args(cfg)))


def _cpu_fsdp_text(name: str) -> str:
    """The FSDP expert of zoo model ``name`` on node-8, compiled by XLA:CPU here."""
    from shardc.bench.experts import compile_expert, preset_experts
    from shardc.bench.harness import make_mesh, traits
    from shardc.bench.zoo import PRESETS, ZOO

    preset, zm = PRESETS["node-8"], ZOO[name]
    mod, cfg = zm.load(), zm.config("bench", preset.devices)
    fsdp = next(e for e in preset_experts(preset.mesh_shape, preset.axis_names, preset.cluster,
                                          traits(zm)) if e.name == "fsdp")
    _, lowered = compile_expert(mod.build_step(cfg), *mod.abstract_args(cfg),
                                make_mesh(preset), fsdp, mod.param_axes)
    return lowered.compile().as_text()


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def report(folder: Path) -> str:
    from shardc.bench.harness import make_mesh
    from shardc.bench.zoo import PRESETS

    steps = json.loads((folder / "steps.json").read_text())
    v = steps["versions"]
    lines = ["# shardc on a GPU", "",
             f"Measured with `python -m shardc.bench.device` on one {v['device']} "
             f"(jax {v['jax']}, Python {v['python']}); this page by `python -m "
             f"shardc.bench.gpu_report {folder.as_posix()}` from the measurements kept in "
             f"`{folder.as_posix()}/`. To measure again on a GPU machine, from a checkout "
             "installed with `pip install -e . --no-deps` (the zoo's models are the package's "
             "`shardc.models`): `python -m shardc.bench.device all --out DIR`, then copy "
             "DIR's `*.json` and `schedule-*.hlo.gz` there.", "",
             "## Compute: one device's step against the predicted compute", "",
             "Each step at one device's share of the bench batch, compiled with `jax.jit` and "
             "timed (median of 15 after 3 warm-ups). *kernels* is the planner's compute "
             "(`Plan.predicted.compute_time` on a one-device mesh of the node-8 preset's "
             "cluster with `kernels=\"h100\"`): `shardc.cost.kernels`, each kernel XLA "
             "fuses the larger of its arithmetic at "
             "the measured dot throughput for its size and width and its bytes at the "
             "measured memory curve, never under the launch floor (the kernel table below). "
             "*per-call* is the one constant fitted to these steps, per array argument of "
             "the step, each model's fitted without it (`shardc.bench.compute_fit`).", ""]
    rows = []
    for row in steps["rows"]:
        if "error" in row:
            lines.append(f"- {row['model']}: error: {row['error'].splitlines()[0][:80]}")
            continue
        compute, arguments = _one_device_compute(row["model"])
        rows.append((row["model"], row["step_s"], compute, arguments))
    kernel_rows = (json.loads((folder / "kernels.json").read_text())["rows"]
                   if (folder / "kernels.json").exists() else [])
    lines += section(step_holdout(rows), kernel_rows)
    sched = folder / "schedule.json"
    if sched.exists():
        info = json.loads(sched.read_text())
        preset = PRESETS["node-8"]
        mesh = make_mesh(preset)
        lines += ["", "## Schedule: the FSDP step as XLA's GPU compiler orders it", "",
                  f"Compiled for eight H100s ({info['mode']}: "
                  f"{info['device']}), priced on node-8 (NCCL's model). *free overlap*: the "
                  "bench's overlapped pricing (a collective starts once its operands are "
                  "ready); *in XLA's order*: each collective issued where the compiler put it "
                  "and awaited at its `-done`; *exposed*: compute-stream seconds spent "
                  "waiting on communication in XLA's order.", "",
                  "| model | compiler | collectives | compute ms | comm ms | serial ms | "
                  "free overlap ms | in XLA's order ms | exposed ms |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        seen: dict[str, dict] = {}
        for row in info["rows"]:
            if "error" in row:
                lines.append(f"| {row['model']} {row['method']} | XLA:GPU | not compiled: "
                             f"{row['error'][:160]} | | | | | | |")
                continue
            with gzip.open(folder / row["hlo"], "rt") as f:
                gpu_text = f.read()
            for compiler, text in (("XLA:GPU", gpu_text), ("XLA:CPU", _cpu_fsdp_text(
                    row["model"]))):
                p = seen[f"{row['model']} {compiler}"] = _schedule_prices(text, mesh,
                                                                           preset.cluster)
                counts = ", ".join(f"{n} {k}" for k, n in sorted(p["counts"].items()))
                lines.append(f"| {row['model']} {row['method']} | {compiler} | {counts} | "
                             f"{_ms(p['compute_s'])} | {_ms(p['comm_s'])} | "
                             f"{_ms(p['serial_s'])} | {_ms(p['free_s'])} | "
                             f"{_ms(p['in_order_s'])} | {_ms(p['exposed_s'])} |")
        lines += _schedule_summary(seen)
    kernels = folder / "kernels.json"
    if kernels.exists():
        lines += _kernels(json.loads(kernels.read_text()))
    return "\n".join(lines) + "\n"


def _kernels(info: dict) -> list[str]:
    """The single-kernel table (``python -m shardc.bench.device kernels``) and what it
    says of a compute term: the floor every kernel pays, the dots' throughput by size, the
    elementwise kernels' bandwidth."""
    from shardc.cost.cluster import Cluster

    peak, share = Cluster().device_flops, Cluster().utilization
    rows = info["rows"]
    v = info["versions"]
    out = ["", "## Kernels: time against FLOPs and bytes", "",
           f"Single kernels on one {v['device']} (jax {v['jax']}), each run "
           f"{info['repeats']} times in a chain inside one executable, so host dispatch is "
           "not timed; f32 dots run on TF32 tensor cores (XLA:GPU's default precision). "
           f"*of peak*: against the {peak / 1e12:.0f} TFLOP/s the cost model's device "
           "assumes.", "",
           "| kernel | dtype | shape | us | TFLOP/s | of peak | GB/s |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        shape = (f"{r['m']} x {r['k']} x {r['n']}" if r["kind"] == "dot"
                 else f"{r['elements']:,} elements")
        dtype = r.get("dtype", "float32")
        out.append(f"| {r['kind']} | {dtype} | {shape} | {r['s'] * 1e6:.1f} | "
                   f"{r['flops'] / r['s'] / 1e12:.2f} | {r['flops'] / r['s'] / peak:.0%} | "
                   f"{r['bytes'] / r['s'] / 1e9:,.0f} |")
    floor = min(r["s"] for r in rows)
    dots = [r for r in rows if r["kind"] == "dot"]
    best = max(dots, key=lambda r: r["flops"] / r["s"])
    mem = [r for r in rows if r["kind"] != "dot"]
    big = max(mem, key=lambda r: r["elements"])
    half = min((r for r in dots if r["flops"] / r["s"] >= 0.5 * peak),
               key=lambda r: r["flops"], default=None)
    slow = max(r["flops"] / r["s"] for r in dots) / (share * peak)
    fast = max(r["s"] * share * peak / r["flops"] for r in dots)
    out += ["", f"- **Floor:** no kernel took less than {floor * 1e6:.1f} us; elementwise "
            f"kernels stay within 2x of it up to "
            f"{max(r['elements'] for r in mem if r['s'] <= 2 * floor):,} elements. A step of "
            "many small kernels pays this per kernel, whatever its FLOPs.",
            f"- **Dots:** at most {best['flops'] / best['s'] / 1e12:.0f} TFLOP/s "
            f"({best['dtype']}, {best['m']} x {best['k']} x {best['n']}, "
            f"{best['flops'] / best['s'] / peak:.0%} of the assumed peak)"
            + (f"; half the peak from {half['flops'] / 1e9:.0f} GFLOP a dot"
               if half else "; none reaches half the peak") + ". FLOPs at "
            f"{share:.0%} of the peak (the compute term of `Cluster(kernels=None)`) would "
            f"price the largest dots {slow:.1f}x too slow and the smallest {fast:.0f}x too "
            "fast; the "
            "kernel model reads the dots' seconds off these points.",
            f"- **Memory:** {big['bytes'] / big['s'] / 1e12:.2f} TB/s on "
            f"{big['elements']:,} elements (the {v['device']}'s HBM; its datasheet: "
            + (f"{HBM_BANDWIDTH[v['device']] / 1e12:.2f} TB/s" if v["device"] in HBM_BANDWIDTH
               else "not known here") + "). The kernel model prices every other kernel "
            "by its bytes on these points (the floor below the first)."]
    return out


def _schedule_summary(seen: dict[str, dict]) -> list[str]:
    """What the schedule table says, in figures read from it."""
    out = []
    for model in sorted({k.split()[0] for k in seen}):
        gpu, cpu = seen.get(f"{model} XLA:GPU"), seen.get(f"{model} XLA:CPU")
        if not (gpu and cpu):
            continue
        n_gpu, n_cpu = sum(gpu["counts"].values()), sum(cpu["counts"].values())
        gap = gpu["free_s"] / gpu["in_order_s"] - 1
        out += ["", f"- **{model}, combining:** XLA:GPU compiles the FSDP step into {n_gpu} "
                f"collectives, XLA:CPU into {n_cpu}: the GPU pipeline's combiners merge the "
                "per-parameter all-gathers and reduce-scatters. The bench compiles on XLA:CPU, "
                f"so its FSDP-like experts pay {_ms(cpu['comm_s'])} ms of communication where "
                f"the GPU program pays {_ms(gpu['comm_s'])} ms: the bench's yardstick is "
                "pessimistic for them by the difference.",
                f"- **{model}, overlap:** on the GPU program the bench's free-overlap pricing "
                f"({_ms(gpu['free_s'])} ms) is {gap:+.1%} from XLA's own order "
                f"({_ms(gpu['in_order_s'])} ms, {_ms(gpu['exposed_s'])} ms of it waiting on "
                "communication): the overlap model matches what XLA's latency-hiding "
                "scheduler emits to within that. XLA:CPU's collectives are synchronous, so in "
                "its order nothing overlaps."]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardc.bench.gpu_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="what `python -m shardc.bench.device` wrote")
    p.add_argument("--out", default="docs/benchmarks/gpu.md")
    a = p.parse_args(argv)
    force_cpu_devices(8)
    text = report(Path(a.folder))
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
