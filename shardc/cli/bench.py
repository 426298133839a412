"""``shardc bench``: shardc vs expert plans on the compiled programs, written to a results
folder (``--planning``, ``--scale``, ``--calls``: planning time, the 70B-class decoder at
scale, a call's overhead)."""

from __future__ import annotations

import sys

from shardc.cli.common import needs_zoo
from shardc.util.devices import force_cpu_devices

__all__ = ["cmd_bench"]


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
    from shardc.bench import scale

    todo = [(shape, names, True) for shape, names in scale.SCALE_MESHES]
    todo += [((n // 8, 8), ("node", "gpu"), False) for n in scale.WEAK_SCALING
             if ((n // 8, 8), ("node", "gpu")) not in scale.SCALE_MESHES]
    cases = []
    for shape, names, experts in todo:
        print(f"planning the 70B decoder on {shape} ...", flush=True)
        cases.append(scale.measure_scale_fresh(shape, names, experts))
        print(f"  {cases[-1].plan_s:.1f} s, {cases[-1].status}, "
              f"{cases[-1].predicted_ms:.0f} ms predicted, {cases[-1].peak_gib:.1f} GiB, "
              f"pipeline: {cases[-1].pipeline or 'none'}", flush=True)
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    paths = scale.write_scale(cases, out, command)
    print(scale.scale_markdown(cases, command))
    print("wrote " + ", ".join(str(p) for p in paths))


def _bench_calls(out) -> None:
    from shardc.bench import calls, first_call

    cases = []
    for leaves in calls.LEAVES:
        print(f"calling with {leaves} argument leaves ...", flush=True)
        cases.append(calls.measure(leaves))
    print(f"calling with {calls.DONATED} leaves, donated ...", flush=True)
    cases.append(calls.measure(calls.DONATED, donated=True))
    print(f"first calls of a {first_call.LEAVES}-leaf step, each in a fresh process ...",
          flush=True)
    first = first_call.markdown(first_call.compare(say=lambda s: print(s, flush=True)),
                                first_call.LEAVES, first_call.REPEATS)
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    path = calls.write(cases, out, command, first)
    print(calls.markdown(cases, command, first))
    print(f"wrote {path}")


def _bench_faults(args) -> None:
    import tempfile
    from pathlib import Path

    from shardc.bench import faults

    work = tempfile.mkdtemp(prefix="shardc-faults-")
    plan = faults.schedule(args.fault_seed, faults.CAMPAIGN, args.fault_steps, faults.EVERY)
    print(f"{len(plan)} faults over {args.fault_steps} steps (seed {args.fault_seed}); "
          f"logs under {work}", flush=True)
    result = faults.campaign(work, plan, args.fault_steps, faults.EVERY,
                             say=lambda line: print(line, flush=True))
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    paths = faults.write(result, Path(args.out or "docs/benchmarks"), command, args.fault_seed)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


def cmd_bench(args) -> None:
    if args.faults:  # a training job on its own processes: no zoo, no devices here
        return _bench_faults(args)
    needs_zoo("bench")
    from shardc.bench.zoo import PRESETS, ZOO

    models = args.models.split(",") if args.models else list(ZOO)
    asked = args.presets.split(",") if args.presets else \
        [p for m in models if m in ZOO for p in ZOO[m].presets]
    # as many devices as the largest preset asked for has (4nodes-eth: 32), at least 16
    force_cpu_devices(max([16] + [PRESETS[p].devices for p in asked if p in PRESETS]))
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
    methods = args.methods.split(",") if args.methods else \
        [*harness.QUICK_METHODS, "experts"] if args.quick else None
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

        def one(zm, preset, method):
            bar.update(task, description=f"{zm.name} {preset.name} {method}")
            # --quick checks shardc's numerics only (the experts are plain jax.jit programs,
            # checked by the full bench)
            check = not args.no_check and (method == "shardc" or not args.quick)
            return harness.run_cell(zm, preset, method, which, check, args.time_limit,
                                    not args.no_mesh_search, args.compiler)

        for (zm, preset, method), cell in harness.run_cells(todo, one):
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
