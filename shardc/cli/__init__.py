"""The ``shardc`` command: ``demo`` | ``plan`` | ``pareto`` | ``explain`` | ``export`` |
``bench`` | ``calibrate``.

``shardc demo`` plans a GPT train step on 8 simulated CPU devices (mesh node=2 x gpu=4),
prints the plan, runs 3 steps and prints the losses beside the unsharded run's.
``shardc plan`` plans a zoo model from abstract shapes, or the user's program
(``path/to/file.py:make`` or ``pkg.module:make``, ``make()`` returning ``(fn, args)``), on an
AbstractMesh of any size (``--mesh 128x8``, ``--mesh 4x16x8``: no devices needed), and
prints (or saves) the plan; ``shardc pareto`` prints (and plots) its time-memory frontier.
``shardc explain plan.json`` prints a saved plan (``--program ...``: with
its margins against generic layouts; ``--compile``: and predicted vs compiled
collectives); ``shardc export plan.json`` writes a Python module that runs it with plain
``jax.jit`` (``--format rules``: logical-axis rules). ``shardc calibrate`` measures
the devices at hand into a Cluster JSON that ``shardc plan --cluster`` and
``Cluster.from_json`` read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time


def _force_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices; must run before JAX initialises its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def mesh_shape(text: str) -> tuple[int, ...]:
    """``--mesh``: ``8``, ``2x4``, ``2x2x2`` (an argparse type: a bad value is one line)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape; write sizes joined "
                                         "by x, e.g. 8 or 2x4")
    return shape


def axis_names(text: str) -> tuple[str, ...]:
    """``--axes``: comma-separated, distinct, non-empty names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct axis names separated by "
                                         "commas, e.g. node,gpu")
    return names


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
        return v
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _abstract_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """The mesh ``shape`` with Auto axes ``names`` and no devices: planning needs neither
    the devices nor their number."""
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    import jax
    from jax.sharding import AxisType

    n = 1
    for s in shape:
        n *= s
    if len(jax.devices()) < n:
        sys.exit(f"shardc: mesh {shape} needs {n} devices but JAX sees {len(jax.devices())}; "
                 f"pass --devices {n}")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


ZOO = ("gpt", "mlp")
PRESETS = ("default", "nvlink-node", "multi-node", "multi-pod", "tpu-v4")


def cluster_of(text: str | None, names: tuple[str, ...], cmd: str = "plan"):
    """``--cluster``: a preset's name (its axes are the mesh's) or a JSON file as
    ``Cluster.to_json`` writes it; None: NDR InfiniBand over the first of two axes and
    NVLink within; on three axes pods, nodes and GPUs (``multi-pod``); else NVLink on every
    axis."""
    from shardc.cost.cluster import Cluster

    if text is None:
        text = {2: "multi-node", 3: "multi-pod"}.get(len(names), "nvlink-node")
    preset = text.replace("_", "-")
    for name, rank, axes in (("multi-node", 2, "node, gpu"), ("multi-pod", 3, "pod, node, gpu")):
        if preset == name and len(names) != rank:
            sys.exit(f"shardc {cmd}: --cluster {name} needs a {rank}-axis mesh ({axes}); this "
                     f"one has {len(names)} axes")
    if preset in PRESETS:
        return {"default": lambda: Cluster(), "nvlink-node": lambda: Cluster.nvlink_node(names),
                "multi-node": lambda: Cluster.multi_node(*names),
                "multi-pod": lambda: Cluster.multi_pod(*names),
                "tpu-v4": lambda: Cluster.tpu_v4(names)}[preset]()
    if not os.path.isfile(text):
        sys.exit(f"shardc {cmd}: --cluster {text!r} is neither a preset ({', '.join(PRESETS)}) "
                 "nor a JSON file")

    try:
        with open(text) as f:
            cluster = Cluster.from_json(json.load(f))
        cluster.check_axes(names)
    except (ValueError, TypeError) as exc:
        sys.exit(f"shardc {cmd}: --cluster {text}: {str(exc).splitlines()[0]} (write it as "
                 "Cluster.to_json() does)")
    return cluster


def _program(spec: str, cmd: str):
    from shardc.step.program import ProgramError, load_program

    try:
        return load_program(spec)
    except ProgramError as exc:
        sys.exit(f"shardc {cmd}: {exc}")


def _needs_zoo(cmd: str) -> None:
    """The model zoo (Flax, Optax) and the bench's tools come with the ``bench`` extra."""
    import importlib.util

    missing = [m for m in ("flax", "optax", "rich", "matplotlib")
               if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"shardc {cmd}: needs {', '.join(missing)} (the model zoo and the bench): "
                 "pip install 'shardc[bench]'")


def _model(name: str, layers: int | None, tiny: bool):
    _needs_zoo("plan")
    if name == "gpt":
        from shardc.models import gpt

        cfg = gpt.GPTConfig.tiny() if tiny else gpt.GPTConfig.gpt2_small(n_layers=layers or 12)
        if tiny and layers:
            cfg = gpt.GPTConfig(**{**cfg.__dict__, "n_layers": layers})
        return gpt, cfg
    if name == "mlp":
        from shardc.models import mlp

        return mlp, mlp.MLPConfig.tiny()
    sys.exit(f"shardc plan: unknown model {name!r}; choose gpt or mlp")


def cmd_demo(args) -> None:
    _needs_zoo("demo")
    _force_cpu_devices(8)
    import jax
    import numpy as np

    import shardc
    from shardc.models import gpt

    # the smallest GPT whose plan shards on this cluster (a smaller one is cheapest run
    # replicated: its collectives' latency exceeds the compute they would save)
    cfg = gpt.GPTConfig(vocab=2048, seq_len=128, d_model=256, n_heads=8, n_layers=args.layers,
                        batch=32, learning_rate=1e-3)
    print(f"shardc demo: GPT ({cfg.n_layers} layers, d={cfg.d_model}, heads={cfg.n_heads}, "
          f"seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}) on 8 CPU devices, "
          "mesh node=2 x gpu=4")
    mesh = _mesh((2, 4), ("node", "gpu"))
    cluster = shardc.Cluster.multi_node("node", "gpu")
    step_fn, (state, batch) = gpt.make_train_step(cfg)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster)
    t0 = time.perf_counter()
    plan = step.plan(state, batch)
    print(f"planned in {time.perf_counter() - t0:.2f} s\n")
    compiled = step.lower(state, batch).compile()
    print(plan.explain(max_rows=args.rows, compiled=compiled, mesh=mesh))
    ref_step = jax.jit(step_fn)
    s_state, r_state = state, state
    print("\nstep   shardc loss   unsharded loss")
    for i in range(3):
        s_state, s_loss = step(s_state, batch)
        r_state, r_loss = ref_step(r_state, batch)
        print(f"{i:>4}   {float(s_loss):11.6f}   {float(r_loss):14.6f}")
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(s_state), jax.tree.leaves(r_state)))
    print(f"max |param difference| after 3 steps: {diff:.3g}")


@contextlib.contextmanager
def _progress():
    """shardc's INFO lines (what a long search is doing: each frontier plan, a budget that
    binds) printed on stderr while the command runs."""
    logger = logging.getLogger("shardc")
    handler, level = logging.StreamHandler(sys.stderr), logger.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _planned_step(args, cmd: str):
    """``(auto_shard step, abstract args)`` for ``shardc plan`` / ``pareto``: a zoo model or
    the user's program, on an AbstractMesh (planning needs no devices: any size plans)."""
    shape = args.mesh
    is_zoo = args.target in ZOO
    if not is_zoo and ":" not in args.target:
        sys.exit(f"shardc {cmd}: {args.target!r} is neither a zoo model ({', '.join(ZOO)}) "
                 "nor a program; write path/to/file.py:make or pkg.module:make, where make() "
                 "returns (fn, args)")
    if not is_zoo and (args.layers or args.tiny):
        sys.exit(f"shardc {cmd}: --layers and --tiny size the zoo models; a program's make() "
                 "sizes its own")
    import shardc

    names = _axes_for(cmd, shape, args.axes)
    cluster = cluster_of(args.cluster, names, cmd)
    mesh = _abstract_mesh(shape, names)
    if is_zoo:
        module, cfg = _model(args.target, args.layers, args.tiny)
        fn, abstract = module.build_step(cfg), module.abstract_args(cfg)
    else:
        program = _program(args.target, cmd)
        fn, abstract = program.fn, program.args
    step = shardc.auto_shard(fn, mesh=mesh, cluster=cluster, time_limit=args.time_limit,
                             mesh_search=args.mesh_search)
    return step, abstract


def show(report, plain: bool = False) -> None:
    """Print a :class:`shardc.report.tables.Report`: rich tables on a terminal when rich is
    installed (the ``bench`` extra), else (or with ``plain``, or into a pipe) plain text."""
    import importlib.util

    if plain or not sys.stdout.isatty() or importlib.util.find_spec("rich") is None:
        print(report)
        return
    from rich.console import Console

    Console().print(report)


def cmd_plan(args) -> None:
    step, abstract = _planned_step(args, "plan")
    t0 = time.perf_counter()
    with _progress():
        plan = step.plan(*abstract)
    print(f"planned in {time.perf_counter() - t0:.2f} s (tracing included)")
    margins = step.margins(*abstract) if args.margins else None
    show(plan.report(max_rows=args.rows, margins=margins), args.plain)
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
        print(f"plan saved to {args.out}")


def cmd_pareto(args) -> None:
    step, abstract = _planned_step(args, "pareto")
    t0 = time.perf_counter()
    if args.devices:
        budget = None if args.memory_budget is None else args.memory_budget * 2**30
        with _progress():
            counts = step.device_sweep(*abstract, memory_budget=budget)
        print(f"the best plan on each device count that divides the mesh, found in "
              f"{time.perf_counter() - t0:.2f} s (tracing included):")
        print(counts)
        return
    with _progress():
        frontier = step.pareto(*abstract, budgets=args.budgets)
    print(f"{len(frontier.plans)} plans on the time-memory frontier, found in "
          f"{time.perf_counter() - t0:.2f} s (tracing included):")
    print(frontier)
    if args.plot:
        frontier.plot(args.plot)
        print(f"plot saved to {args.plot}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([json.loads(p.to_json()) for p in frontier.plans], f)
        print(f"plans saved to {args.out} (a JSON list, leanest first; Plan.from_json each)")


def _axes_for(cmd: str, shape: tuple[int, ...], names: tuple[str, ...] | None):
    default = ("pod", "node", "gpu")[-len(shape):] if len(shape) <= 3 else tuple(
        f"a{i}" for i in range(len(shape)))
    names = names or default
    if len(names) != len(shape):
        sys.exit(f"shardc {cmd}: --axes names {len(names)} axes but --mesh has {len(shape)}")
    return names


def cmd_calibrate(args) -> None:
    _force_cpu_devices(args.devices)
    import shardc
    from shardc.cost.calibrate import CalibrateOptions

    names = _axes_for("calibrate", args.mesh, args.axes)
    mesh = _mesh(args.mesh, names)
    given = {"sizes": tuple(args.sizes) if args.sizes else None, "reps": args.reps,
             "chain": args.chain, "matmul_size": args.matmul_size}
    try:
        options = CalibrateOptions(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        sys.exit(f"shardc calibrate: {exc}")
    t0 = time.perf_counter()
    cluster, calibration = shardc.Cluster.calibrate(mesh, options)
    print(f"calibrated {mesh.size} {mesh.devices.flat[0].platform} devices in "
          f"{time.perf_counter() - t0:.1f} s")
    print(calibration.report())
    with open(args.out, "w") as f:
        json.dump(cluster.to_json(), f, indent=1)
        f.write("\n")
    print(f"cluster saved to {args.out} (shardc plan --cluster {args.out})")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
        print(f"fit saved to {args.report}")


def _load_plan(path: str, cmd: str):
    from shardc.plan.codec import PlanFormatError
    from shardc.plan.record import Plan

    try:
        with open(path) as f:
            return Plan.from_json(f.read())
    except OSError as exc:
        sys.exit(f"shardc {cmd}: {path}: {exc.strerror}")
    except PlanFormatError as exc:
        sys.exit(f"shardc {cmd}: {path}: {exc}")


def cmd_explain(args) -> None:
    if args.compile and not args.program:
        sys.exit("shardc explain: --compile compiles the plan's program; name it with "
                 "--program path/to/file.py:make")
    plan = _load_plan(args.plan, "explain")  # imports jax; its backend starts later
    if args.plot:
        _plot(plan, args.plot)
    if not args.program:
        show(plan.report(max_rows=args.rows), args.plain)
        return
    if args.compile:
        _force_cpu_devices(max(8, math.prod(plan.axis_sizes)))
    import shardc

    program = _program(args.program, "explain")
    # the margins need the program only; compiling needs devices
    mesh = _mesh(plan.axis_sizes, plan.axis_names) if args.compile else \
        _abstract_mesh(plan.axis_sizes, plan.axis_names)
    step = shardc.auto_shard(program.fn, mesh=mesh, cluster=plan.cluster)
    try:
        step.use_plan(plan, *program.args)
    except ValueError as exc:
        sys.exit(f"shardc explain: {args.plan} is not a plan of {args.program}: {exc}")
    margins = step.margins(*program.args)
    compiled = step.lower(*program.args).compile() if args.compile else None
    show(step.plan(*program.args).report(
        max_rows=args.rows, compiled=compiled, mesh=step.mesh_for(plan) if compiled else None,
        margins=margins), args.plain)


def _plot(plan, path: str) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("shardc explain: --plot needs matplotlib: pip install 'shardc[bench]'")
    try:
        plan.plot(path)
    except (OSError, ValueError) as exc:  # no such folder, an unknown image suffix
        sys.exit(f"shardc explain: --plot {path}: {str(exc).splitlines()[0]}")
    print(f"plot saved to {path}", file=sys.stderr)


def cmd_export(args) -> None:
    from shardc.report.export import python_module, rules_module

    plan = _load_plan(args.plan, "export")
    write = python_module if args.format == "python" else rules_module
    try:
        text = write(plan, source=os.path.basename(args.plan))
    except ValueError as exc:
        sys.exit(f"shardc export: {args.plan}: {exc}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _bench_planning(out) -> None:
    from shardc.bench import planning

    cases = []
    for name, layers in planning.CASES:
        print(f"planning {name} with {layers} layers ...", flush=True)
        cases.append(planning.measure_fresh(name, layers))
        print(f"  {cases[-1].plan_s:.2f} s, {cases[-1].status}, "
              f"{cases[-1].predicted_ms:.3f} ms predicted", flush=True)
    loops = []
    for preset in planning.LOOP_PRESETS:
        print(f"the Llama decoder scanned and unrolled on {preset} ...", flush=True)
        loops.append(planning.measure_loop_forms_fresh(preset))
    print("coordinate descent against the ILP on the quick zoo ...", flush=True)
    gaps = planning.descent_gaps()
    frontiers = []
    for name, layers in planning.FRONTIER_CASES:
        print(f"the frontier of {name} with {layers} layers ...", flush=True)
        frontiers.append(planning.measure_frontier_fresh(name, layers))
        print(f"  {frontiers[-1].pareto_s:.1f} s, {frontiers[-1].plans} plans", flush=True)
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    paths = planning.write(cases, out, command, gaps, loops, frontiers)
    print(planning.markdown(cases, command, gaps, loops, frontiers))
    print("wrote " + ", ".join(str(p) for p in paths))


def _bench_scale(out) -> None:
    from shardc.bench import planning

    todo = [(shape, names, True) for shape, names in planning.SCALE_MESHES]
    todo += [((n // 8, 8), ("node", "gpu"), False) for n in planning.WEAK_SCALING
             if ((n // 8, 8), ("node", "gpu")) not in planning.SCALE_MESHES]
    cases = []
    for shape, names, experts in todo:
        print(f"planning the 70B decoder on {shape} ...", flush=True)
        cases.append(planning.measure_scale_fresh(shape, names, experts))
        print(f"  {cases[-1].plan_s:.1f} s, {cases[-1].status}, "
              f"{cases[-1].predicted_ms:.0f} ms predicted, {cases[-1].peak_gib:.1f} GiB, "
              f"pipeline: {cases[-1].pipeline or 'none'}", flush=True)
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    paths = planning.write_scale(cases, out, command)
    print(planning.scale_markdown(cases, command))
    print("wrote " + ", ".join(str(p) for p in paths))


def _bench_calls(out) -> None:
    from shardc.bench import calls

    cases = []
    for leaves in calls.LEAVES:
        print(f"calling with {leaves} argument leaves ...", flush=True)
        cases.append(calls.measure(leaves))
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    path = calls.write(cases, out, command)
    print(calls.markdown(cases, command))
    print(f"wrote {path}")


def cmd_bench(args) -> None:
    _needs_zoo("bench")
    from shardc.bench.zoo import PRESETS, ZOO

    models = args.models.split(",") if args.models else list(ZOO)
    asked = args.presets.split(",") if args.presets else \
        [p for m in models if m in ZOO for p in ZOO[m].presets]
    # as many devices as the largest preset asked for has (4nodes-eth: 32), at least 16
    _force_cpu_devices(max([16] + [PRESETS[p].devices for p in asked if p in PRESETS]))
    from pathlib import Path

    if args.planning:
        return _bench_planning(Path(args.out or "docs/benchmarks"))
    if args.scale:
        return _bench_scale(Path(args.out or "docs/benchmarks"))
    if args.calls:
        return _bench_calls(Path(args.out or "docs/benchmarks"))

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from shardc.bench import harness, report
    from shardc.bench.zoo import PRESETS, ZOO

    models = args.models.split(",") if args.models else (
        ["mlp", "gpt"] if args.quick else list(ZOO))
    presets = args.presets.split(",") if args.presets else None  # each model's own
    for name, known in (*((m, ZOO) for m in models), *((p, PRESETS) for p in presets or ())):
        if name not in known:
            sys.exit(f"shardc bench: unknown {name!r}; choose from {sorted(known)}")
    which = "quick" if args.quick else "bench"
    methods = args.methods.split(",") if args.methods else None
    todo = harness.cells(models, presets, methods)
    if not todo:
        sys.exit("shardc bench: no cells match; check --models / --presets / --methods")
    _needs_gpu_compiler(args.compiler)
    out = Path(args.out or _bench_folder(args.quick, args.compiler))
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    kept, commands = _kept_cells(out, args.compiler) if args.update else ([], [])
    commands = [*commands, command]
    done: list = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("bench", total=len(todo))
        for zm, preset, method in todo:
            bar.update(task, description=f"{zm.name} {preset.name} {method}")
            # --quick checks shardc's numerics only (the experts are plain jax.jit programs,
            # checked by the full bench)
            check = not args.no_check and (method == "shardc" or not args.quick)
            cell = harness.run_cell(zm, preset, method, which, check, args.time_limit,
                                    not args.no_mesh_search, args.compiler)
            if cell.error:
                bar.console.print(f"[red]{zm.name} {preset.name} {method}: "
                                  f"{cell.error.splitlines()[0]}")
            done.append(cell)
            # written after every cell: an interrupted run keeps what it measured
            report.write(report.merge(kept, done), out, commands, plot_png=False)
            bar.advance(task)
    cells = report.merge(kept, done)
    paths = report.write(cells, out, commands)
    print(report.markdown(cells, commands).split("## All cells")[0])
    print("wrote " + ", ".join(str(p) for p in paths))


def _bench_folder(quick: bool, compiler: str) -> str:
    """Where ``shardc bench`` writes by default: XLA:GPU's figures apart from XLA:CPU's;
    the full matrix compiled by XLA:GPU (what the hardware runs) is the headline."""
    if quick:
        return "docs/benchmarks/quick" if compiler == "cpu" else \
            "docs/benchmarks/gpu-compiled/quick"
    return "docs/benchmarks" if compiler == "gpu" else "docs/benchmarks/cpu-compiled"


def _needs_gpu_compiler(compiler: str) -> None:
    """``--compiler gpu`` needs JAX's CUDA plugin (and ptxas): exit naming the install."""
    from shardc.bench import deviceless

    if compiler == "gpu" and deviceless.plugin() is None:
        sys.exit("shardc bench --compiler gpu: compiling for H100s on this machine needs "
                 "JAX's CUDA plugin at jax's version and ptxas: " + deviceless.install_hint()
                 + " (or pip install 'shardc[gpu-aot]')")


def _kept_cells(out, compiler: str) -> tuple[list, list[str]]:
    """The results already in ``out`` that ``--update`` merges into: refused when another
    compiler made them (one report compares one compiler's programs)."""
    from shardc.bench import report

    kept, commands = report.load(out)
    if {c.compiler for c in kept} - {compiler}:
        sys.exit(f"shardc bench: {out} holds cells compiled by another compiler than "
                 f"--compiler {compiler}; give another --out")
    return kept, commands


def _target_arguments(q) -> None:
    """The arguments ``shardc plan`` and ``shardc pareto`` share: what to plan, on what."""
    q.add_argument("target", metavar="MODEL_OR_PROGRAM",
                   help="gpt | mlp | path/to/file.py:make | pkg.module:make")
    q.add_argument("--mesh", type=mesh_shape, default=(2, 4),
                   help="mesh shape, e.g. 8, 2x4, 128x8 or 4x16x8 (any size: planning needs "
                        "no devices)")
    q.add_argument("--axes", type=axis_names, default=None,
                   help="comma-separated axis names (default node,gpu; pod,node,gpu on 3 axes)")
    q.add_argument("--cluster", default=None,
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON file as Cluster.to_json "
                        "writes it (default: multi-node on a 2-axis mesh, multi-pod on 3, "
                        "else nvlink-node)")
    q.add_argument("--layers", type=_positive(int), default=None, help="zoo models only")
    q.add_argument("--tiny", action="store_true", help="zoo models only")
    q.add_argument("--time-limit", type=_positive(float), default=10.0)
    q.add_argument("--mesh-search", action="store_true",
                   help="also plan the other logical views of the devices (e.g. 16, 4x4)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="shardc", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="plan and run a GPT train step on 8 simulated devices")
    d.add_argument("--layers", type=_positive(int), default=2)
    d.add_argument("--rows", type=_positive(int), default=25,
                   help="op rows shown in the plan table")
    d.set_defaults(func=cmd_demo)
    q = sub.add_parser("plan", help="plan a zoo model or your program from abstract shapes",
                       description="Plan a zoo model (gpt, mlp) or your own program: "
                       "path/to/file.py:make or pkg.module:make, where make() returns (fn, "
                       "args), args a tuple of fn's positional arguments (arrays or "
                       "jax.ShapeDtypeStructs).")
    _target_arguments(q)
    q.add_argument("--rows", type=_positive(int), default=30)
    q.add_argument("--plain", action="store_true", help="plain text, not rich tables")
    q.add_argument("--margins", action="store_true",
                   help="also price generic data-parallel, FSDP, Megatron and DP x TP "
                        "layouts of the program on the same cost model")
    q.add_argument("--out", default=None, help="save the plan as JSON here")
    q.set_defaults(func=cmd_plan)
    f = sub.add_parser("pareto", help="the time-memory frontier of a zoo model or your program",
                       description="Plan at no memory budget, at the smallest one a plan was "
                       "found for, and at budgets between; print the non-dominated plans.")
    _target_arguments(f)
    f.add_argument("--budgets", type=_positive(int), default=6,
                   help="budgets planned between the leanest and the fastest plan")
    f.add_argument("--plot", default=None, help="save the time-memory plot (PNG) here")
    f.add_argument("--out", default=None, help="save the frontier's plans as a JSON list here")
    f.add_argument("--devices", action="store_true",
                   help="instead: the best plan on each device count that divides the mesh "
                        "(1..N), and whether it fits the memory budget")
    f.add_argument("--memory-budget", type=_positive(float), default=None, metavar="GIB",
                   help="with --devices: GiB per device (default: the cluster's device memory)")
    f.set_defaults(func=cmd_pareto)
    c = sub.add_parser("calibrate", help="measure the devices at hand into a Cluster JSON")
    c.add_argument("--mesh", type=mesh_shape, default=(2, 4),
                   help="mesh shape, e.g. 8 or 2x4")
    c.add_argument("--axes", type=axis_names, default=None, help="comma-separated axis names")
    c.add_argument("--devices", type=_positive(int), default=8,
                   help="CPU devices to simulate when there is no accelerator")
    c.add_argument("--out", required=True, help="write the Cluster JSON here")
    c.add_argument("--report", default=None, help="also write the fit (samples, R²) here")
    # unset options take CalibrateOptions' defaults (shardc/cost/calibrate.py)
    c.add_argument("--sizes", type=_positive(int), nargs="+", default=None,
                   help="per-device message bytes of the timed collectives (default 1 KiB, "
                        "16 KiB, 256 KiB, 1 MiB)")
    c.add_argument("--reps", type=_positive(int), default=None,
                   help="timed runs of each program; the fastest counts (default 5)")
    c.add_argument("--chain", type=_positive(int), default=None,
                   help="collectives per timed program (default 8)")
    c.add_argument("--matmul-size", type=_positive(int), default=None,
                   help="side of the timed square matmul (default 1024)")
    c.set_defaults(func=cmd_calibrate)
    e = sub.add_parser("explain", help="print a saved plan (with --compile: against what XLA "
                       "compiles)")
    e.add_argument("plan", help="a plan saved by shardc plan --out")
    e.add_argument("--compile", action="store_true",
                   help="compile the plan's program and compare its collectives")
    e.add_argument("--program", default=None,
                   help="the program the plan is for (path/to/file.py:make): prices generic "
                        "data-parallel, FSDP, Megatron and DP x TP layouts beside the plan; "
                        "needed by --compile")
    e.add_argument("--rows", type=_positive(int), default=30)
    e.add_argument("--plain", action="store_true", help="plain text, not rich tables")
    e.add_argument("--plot", default=None, metavar="PATH",
                   help="also draw the per-op layouts and the compute / comm split (PNG)")
    e.set_defaults(func=cmd_explain)
    x = sub.add_parser("export", help="write a Python module that runs a saved plan with "
                       "plain jax.jit")
    x.add_argument("plan", help="a plan saved by shardc plan --out")
    x.add_argument("--format", choices=["python", "rules"], default="python",
                   help="python: jax.jit in/out shardings per argument and result leaf; "
                        "rules: a PartitionSpec per parameter path pattern, layer indices "
                        "folded")
    x.add_argument("--out", default=None, help="write here instead of standard output")
    x.set_defaults(func=cmd_export)
    b = sub.add_parser("bench", help="shardc vs expert plans on the compiled programs")
    b.add_argument("--quick", action="store_true",
                   help="small models (the default presets); numerics checked for shardc only")
    b.add_argument("--models", default=None, help="comma-separated, e.g. gpt,moe")
    b.add_argument("--presets", default=None, help="comma-separated, e.g. node-8,2nodes-2x8 "
                   "(default: each model's own, node-8 and 2nodes-2x8 but deep's "
                   "4nodes-eth)")
    b.add_argument("--methods", default=None,
                   help="comma-separated, e.g. shardc,fsdp; experts: all but shardc")
    b.add_argument("--update", action="store_true",
                   help="merge into the results already in --out (re-measured cells replace "
                        "theirs)")
    b.add_argument("--out", default=None, help="folder for results.{md,json,png} "
                   "(default: docs/benchmarks with --compiler gpu, docs/benchmarks/"
                   "cpu-compiled without; with --quick, docs/benchmarks/gpu-compiled/quick "
                   "and docs/benchmarks/quick)")
    b.add_argument("--compiler", choices=["cpu", "gpu"], default="cpu",
                   help="cpu: compile on simulated CPU devices (XLA:CPU); gpu: XLA:GPU's "
                        "ahead-of-time compile for H100s, no GPU needed (needs JAX's CUDA "
                        "plugin: pip install 'shardc[gpu-aot]'); the numerics check stays on "
                        "the CPU devices")
    b.add_argument("--no-check", action="store_true", help="skip the numerics check")
    b.add_argument("--no-mesh-search", action="store_true",
                   help="plan shardc on the preset's mesh only")
    b.add_argument("--time-limit", type=_positive(float), default=10.0)
    b.add_argument("--planning", action="store_true",
                   help="measure planning time instead (GPT-2-small unrolled and the scanned "
                        "Llama, 12 and 48 layers) into planning.{md,json}")
    b.add_argument("--calls", action="store_true",
                   help="time a steady-state call against jax.jit's at 20, 200 and 1,000 "
                        "argument leaves (docs/benchmarks/calls.md)")
    b.add_argument("--scale", action="store_true",
                   help="plan a 70B-class decoder for 128x8 and 8x16x8 H100s (abstract meshes) "
                        "beside HSDP and FSDP x TP, into scale.{md,json}")
    b.set_defaults(func=cmd_bench)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
