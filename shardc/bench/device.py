"""Measure what the cost model assumes on a real accelerator (run on a GPU machine).

Three measurements, each written as JSON (and the compiled programs as HLO text) under
``--out``; :mod:`shardc.bench.gpu_report` reads them back on any machine and compares them
with the planner's predictions (``docs/benchmarks/gpu.md``):

- ``steps``: every zoo model's train step at one device's share of the bench batch (the
  per-device batch of the bench's weak scaling), compiled with plain ``jax.jit`` on one
  device and timed: its wall time against the compute the cost model predicts for it.
- ``schedule``: the bench's FSDP experts, and shardc's saved plan for the GPT model,
  compiled by XLA's GPU pipeline for eight H100s (the node-8 preset): by a deviceless
  compile for a described topology (:func:`shardc.bench.deviceless.gpu_devices`, which
  needs no GPU at all), else through JAX's mock GPU client (``mock_num_gpu_processes``,
  then ``jax_mock_gpu_topology``: the client reports the devices of the topology behind a
  mock NCCL). The scheduled
  program shows where XLA's latency-hiding scheduler puts each asynchronous collective's
  start and done. Nothing runs: the schedule is what the compiler emits.

- ``kernels``: single kernels (dots of the bench models' shapes, an elementwise add, a row
  sum) timed against their FLOPs and bytes: the data a compute term beyond FLOPs (launch
  and memory traffic) is fitted to.

Usage: ``python -m shardc.bench.device steps|schedule|kernels|all --out DIR
[--plan PLAN.json]``.

References:
  JAX ``jax/_src/xla_bridge.py``: ``jax_mock_gpu_topology`` ("<slices> x <hosts per slice>
    x <devices per host>") and ``mock_num_gpu_processes`` set the GPU client's
    ``enable_mock_nccl`` / ``num_nodes`` / ``mock_gpu_topology`` options;
    ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
    topology=...)`` describes GPUs for a deviceless (ahead-of-time) compile.
  XLA ``latency_hiding_scheduler.cc`` (the GPU pipeline schedules async collective
    ``-start`` / ``-done`` pairs around independent compute).
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from shardc.bench.deviceless import H100_TARGET, gpu_devices

__all__ = ["ELEMENTS", "H100_TARGET", "MATMULS", "MODES", "REPEATS", "SCHEDULE_MODELS", "kernels",
           "main", "schedule", "steps"]

WARMUP = 3
TIMED = 15
#: how a child process gets eight GPUs to compile for, tried in order until one does
#: (module doc): a deviceless compile for one host of eight H100s, the mock client with
#: eight one-GPU processes, the mock client with the topology of eight hosts (with JAX
#: 0.11.2 on one H200 the deviceless compile worked and both mock clients hung past 100 s)
MODES = ("deviceless", "mock-processes", "mock-topology")
#: the models whose FSDP expert is compiled for eight GPUs (the bench's node-8 preset)
SCHEDULE_MODELS = ("gpt", "llama")


def _versions() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(),
            "platform": dev.platform, "device": getattr(dev, "device_kind", str(dev)),
            "devices": len(jax.devices())}


def _save_text(out: Path, name: str, text: str) -> str:
    path = out / f"{name}.hlo.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    return path.name


def _time_step(compiled, args) -> list[float]:
    import jax

    for _ in range(WARMUP):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return times


def _analyses(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    return {"xla_flops": float((cost or {}).get("flops", 0.0)),
            "xla_bytes_accessed": float((cost or {}).get("bytes accessed", 0.0)),
            "memory": {f: int(getattr(mem, f, 0) or 0) for f in fields} if mem else None}


def steps(out: Path, models: list[str], deadline: float) -> list[dict]:
    """Each model's one-device train step, compiled and timed (module doc)."""
    import jax

    from shardc.bench.zoo import ZOO

    rows = []
    for name in models:
        row: dict = {"model": name, "batch_devices": 1}
        if time.monotonic() > deadline:
            row["error"] = "skipped: the run's deadline passed"
            rows.append(row)
            continue
        try:
            zm = ZOO[name]
            cfg = zm.config("bench", devices=1)
            fn, args = zm.load().make_train_step(cfg)
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            row["compile_s"] = time.perf_counter() - t0
            times = _time_step(compiled, args)
            row.update(_analyses(compiled), step_s=statistics.median(times),
                       step_min_s=min(times), step_max_s=max(times),
                       hlo=_save_text(out, f"step-{name}", compiled.as_text()))
            del compiled, args
        except Exception as exc:  # noqa: BLE001 - one model's failure is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"[:400] + "\n" + traceback.format_exc(
                limit=4)[-800:]
        print(json.dumps({k: v for k, v in row.items() if k != "memory"}), flush=True)
        rows.append(row)
        (out / "steps.json").write_text(json.dumps({"versions": _versions(), "rows": rows},
                                                   indent=1))
    return rows


def _eight_gpus(mode: str) -> list:
    """Eight GPU devices to compile for, got the way ``mode`` names (:data:`MODES`); run
    before anything starts JAX's backend."""
    import jax

    if mode == "deviceless":
        return gpu_devices(hosts=1, per_host=8)
    if mode == "mock-processes":
        jax.config.update("mock_num_gpu_processes", 8)
    else:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")
    return list(jax.devices())


def _schedule_child(out: Path, plan_path: str | None, mode: str) -> None:
    """Compile the FSDP experts (and shardc's plan) for eight GPUs got as ``mode`` says, and
    save the scheduled programs."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from shardc.bench.experts import compile_expert, preset_experts
    from shardc.bench.harness import traits
    from shardc.bench.zoo import PRESETS, ZOO

    devices = _eight_gpus(mode)
    if len(devices) < 8:
        sys.exit(f"{mode}: {len(devices)} devices, not 8")
    preset = PRESETS["node-8"]
    mesh = Mesh(np.array(devices[:8]).reshape(preset.mesh_shape), preset.axis_names,
                axis_types=(AxisType.Auto,) * len(preset.mesh_shape))
    rows = []
    for name in SCHEDULE_MODELS:
        zm = ZOO[name]
        mod, cfg = zm.load(), zm.config("bench", preset.devices)
        args = mod.abstract_args(cfg)
        fsdp = next(e for e in preset_experts(preset.mesh_shape, preset.axis_names,
                                              preset.cluster, traits(zm)) if e.name == "fsdp")
        t0 = time.perf_counter()
        _, lowered = compile_expert(mod.build_step(cfg), *args, mesh, fsdp, mod.param_axes)
        text = lowered.compile().as_text()
        rows.append({"model": name, "method": "fsdp", "mesh": fsdp.view.label,
                     "compile_s": time.perf_counter() - t0,
                     "hlo": _save_text(out, f"schedule-{name}-fsdp", text)})
        if plan_path and name == "gpt":
            try:
                rows.append(_plan_row(out, plan_path, mod, cfg, args, mesh, preset))
            except Exception as exc:  # noqa: BLE001 - reported; the experts' rows stand
                rows.append({"model": name, "method": "shardc",
                             "error": f"{type(exc).__name__}: {exc}"[:400]})
        print(json.dumps(rows[-1]), flush=True)
        (out / "schedule.json").write_text(json.dumps(
            {"mode": mode, "device": str(devices[0]), "rows": rows}, indent=1))


def _plan_row(out: Path, plan_path: str, mod, cfg, args, mesh, preset) -> dict:
    """shardc's saved plan for ``mod``'s step compiled on ``mesh``. The plan must come
    from the same JAX version: another traces another program (``use_plan`` refuses it)."""
    from shardc import auto_shard
    from shardc.plan.record import Plan

    plan = Plan.from_json(Path(plan_path).read_text())
    step = auto_shard(mod.build_step(cfg), mesh=mesh, cluster=preset.cluster)
    step.use_plan(plan, *args)
    t0 = time.perf_counter()
    text = step.lower(*args).compile().as_text()
    return {"model": "gpt", "method": "shardc",
            "mesh": " x ".join(f"{a}={n}" for a, n in plan.mesh_axes),
            "compile_s": time.perf_counter() - t0,
            "hlo": _save_text(out, "schedule-gpt-shardc", text)}


def schedule(out: Path, plan_path: str | None, timeout: float) -> dict:
    """Run :func:`_schedule_child` in a fresh process per way of :data:`MODES` until one
    compiles for eight GPUs (module doc). Returns what each try printed."""
    tries = {}
    for mode in MODES:
        cmd = [sys.executable, "-m", "shardc.bench.device", "schedule-child", "--out", str(out),
               "--mode", mode]
        if plan_path:
            cmd += ["--plan", plan_path]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            tries[mode] = {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-3000:]}
        except subprocess.TimeoutExpired as exc:
            tries[mode] = {"rc": None, "tail": f"timed out after {timeout} s: "
                           f"{str(exc.stdout or '')[-2000:]}"}
        print(mode, json.dumps(tries[mode])[-1500:], flush=True)
        if tries[mode]["rc"] == 0:
            break
    (out / "schedule-tries.json").write_text(json.dumps(tries, indent=1))
    return tries


#: how many times a kernel runs, one after another, inside one timed executable
REPEATS = 50
#: matmuls timed by ``kernels``: (m, k, n); square ones, and the bench models' token x
#: width shapes (GPT-2 small's 768 and 3072, the 197-token ViT's, a 1B Llama's 2048 / 8192)
MATMULS = tuple((n, n, n) for n in (128, 256, 512, 1024, 2048, 4096, 8192)) + (
    (8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768), (1576, 768, 768),
    (4096, 2048, 2048), (4096, 2048, 8192), (4096, 8192, 2048), (64, 768, 768))
#: element counts of the elementwise and reduction kernels timed by ``kernels``
ELEMENTS = tuple(4 ** k for k in range(5, 15))


def _per_kernel(fn, x) -> float:
    """Seconds per kernel of ``fn`` applied :data:`REPEATS` times in a chain (one
    executable, each result the next input), the median of :data:`TIMED` runs."""
    import jax

    def chain(x):
        for _ in range(REPEATS):
            x = fn(x)
        return x

    compiled = jax.jit(chain).lower(x).compile()
    return statistics.median(_time_step(compiled, (x,))) / REPEATS


def _dots(ws):
    """``x`` multiplied by each of ``ws`` in turn."""
    def f(x):
        for w in ws:
            x = x @ w
        return x
    return f


def kernels(out: Path, deadline: float) -> list[dict]:
    """Kernel times against their FLOPs and bytes, for a compute term beyond FLOPs: dots
    (:data:`MATMULS`, f32 and bf16), an elementwise add and a row sum (:data:`ELEMENTS`,
    f32), each chained :data:`REPEATS` times inside one executable so that dispatch from
    the host is not timed. The elementwise and reduction kernels read and write through an
    optimization barrier so XLA cannot fuse the chain into one kernel."""
    import jax
    import jax.numpy as jnp

    rows = []

    def record(row: dict, seconds: float) -> None:
        row["s"] = seconds
        print(json.dumps(row), flush=True)
        rows.append(row)
        (out / "kernels.json").write_text(json.dumps({"versions": _versions(),
                                                      "repeats": REPEATS, "rows": rows},
                                                     indent=1))

    for dtype in (jnp.float32, jnp.bfloat16):
        for m, k, n in MATMULS:
            if time.monotonic() > deadline:
                return rows
            # (m, k) @ (k, n), and back with (n, k) where n != k: the chain keeps its shape
            ws = [jnp.full((k, n), 1.0 / k, dtype)] + (
                [jnp.full((n, k), 1.0 / n, dtype)] if k != n else [])
            seconds = _per_kernel(_dots(ws), jnp.ones((m, k), dtype)) / len(ws)
            flops = 2 * m * k * n
            size = jnp.dtype(dtype).itemsize
            record({"kind": "dot", "dtype": jnp.dtype(dtype).name, "m": m, "k": k, "n": n,
                    "flops": flops, "bytes": size * (m * k + k * n + m * n)}, seconds)
    barrier = jax.lax.optimization_barrier
    for count in ELEMENTS:
        if time.monotonic() > deadline:
            return rows
        x = jnp.ones((count,), jnp.float32)
        # each reads its input once and writes a result of its size: 8 bytes an element
        record({"kind": "add", "elements": count, "flops": count, "bytes": 8 * count},
               _per_kernel(lambda v: barrier(v + v * 0.5), x))
        rows_, cols = max(count // 1024, 1), min(count, 1024)
        y = jnp.ones((rows_, cols), jnp.float32)
        record({"kind": "row-sum", "elements": count, "flops": count, "bytes": 8 * count},
               _per_kernel(lambda v: barrier(v + v.sum(-1, keepdims=True) * 1e-9), y))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardc.bench.device", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("what", choices=("steps", "schedule", "schedule-child", "kernels", "all"))
    p.add_argument("--out", required=True)
    p.add_argument("--plan", default=None, help="shardc's saved plan (JSON) for the GPT bench "
                   "model on node-8, compiled beside FSDP by `schedule`")
    p.add_argument("--mode", choices=MODES, default=MODES[0])
    p.add_argument("--models", default=None, help="comma-separated zoo models for `steps`")
    p.add_argument("--seconds", type=float, default=240.0,
                   help="`steps` starts no model after this many seconds")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "schedule-child":
        return _schedule_child(out, a.plan, a.mode)
    if a.what in ("schedule", "all"):
        schedule(out, a.plan, timeout=100.0)
    if a.what in ("steps", "all"):
        from shardc.bench.zoo import ZOO

        models = a.models.split(",") if a.models else list(ZOO)
        steps(out, models, time.monotonic() + a.seconds)
    if a.what in ("kernels", "all"):
        kernels(out, time.monotonic() + a.seconds)


if __name__ == "__main__":
    main()
