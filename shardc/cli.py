"""The ``shardc`` command: ``demo`` | ``plan`` | ``bench`` | ``calibrate``.

``shardc demo`` plans a GPT train step on 8 simulated CPU devices (mesh node=2 x gpu=4),
prints the plan, runs 3 steps and prints the losses beside the unsharded run's.
``shardc plan`` plans a zoo model from abstract shapes only and prints (or saves) the plan.
``shardc calibrate`` measures the devices at hand into a Cluster JSON that ``shardc plan
--cluster`` and ``Cluster.from_json`` read.
"""

from __future__ import annotations

import argparse
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


#: ``--cluster`` presets: the Cluster constructors of :mod:`shardc.cost.cluster`
CLUSTER_PRESETS = ("nvlink-node", "multi-node", "tpu-v4")


def cluster_arg(text: str):
    """``--cluster``: a preset name (:data:`CLUSTER_PRESETS`) or a Cluster JSON file (as
    ``shardc calibrate --out`` writes); a preset is returned by name, a file as a
    Cluster."""
    if text in CLUSTER_PRESETS:
        return text
    import json

    from shardc.cost.cluster import Cluster

    try:
        with open(text) as f:
            return Cluster.from_json(json.load(f))
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a preset ({', '.join(CLUSTER_PRESETS)}) nor a readable "
            f"file: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"{text}: not a Cluster JSON ({exc}); write one with shardc calibrate --out") \
            from exc


def _cluster(choice, names: tuple[str, ...]):
    """The Cluster ``--cluster`` names for a mesh with axes ``names``: by default (None)
    two axes are a node axis over InfiniBand and a GPU axis over NVLink, any other count
    all NVLink."""
    import shardc

    if choice is None:
        choice = "multi-node" if len(names) == 2 else "nvlink-node"
    if choice == "multi-node":
        if len(names) != 2:
            sys.exit(f"shardc: the multi-node cluster needs a 2-axis mesh (node, gpu), got "
                     f"axes {list(names)}")
        return shardc.Cluster.multi_node(*names)
    if choice == "nvlink-node":
        return shardc.Cluster.nvlink_node(names)
    if choice == "tpu-v4":
        return shardc.Cluster.tpu_v4(names)
    try:
        choice.check_axes(names)
    except ValueError as exc:
        sys.exit(f"shardc: --cluster: {exc}")
    return choice


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


def _model(name: str, layers: int | None, tiny: bool):
    if name == "gpt":
        from models import gpt

        cfg = gpt.GPTConfig.tiny() if tiny else gpt.GPTConfig.gpt2_small(n_layers=layers or 12)
        if tiny and layers:
            cfg = gpt.GPTConfig(**{**cfg.__dict__, "n_layers": layers})
        return gpt, cfg
    if name == "mlp":
        from models import mlp

        return mlp, mlp.MLPConfig.tiny()
    sys.exit(f"shardc: unknown model {name!r}; choose gpt or mlp")


def cmd_demo(args) -> None:
    _force_cpu_devices(8)
    import jax
    import numpy as np

    import shardc
    from models import gpt

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


def cmd_plan(args) -> None:
    _force_cpu_devices(args.devices)
    import shardc

    shape = args.mesh
    names = _axes_for("plan", shape, args.axes)
    mesh = _mesh(shape, names)
    module, cfg = _model(args.model, args.layers, args.tiny)
    step_fn = module.build_step(cfg)
    cluster = _cluster(args.cluster, names)
    step = shardc.auto_shard(step_fn, mesh=mesh, cluster=cluster, time_limit=args.time_limit,
                             mesh_search=args.mesh_search)
    abstract = module.abstract_args(cfg)
    t0 = time.perf_counter()
    plan = step.plan(*abstract)
    print(f"planned in {time.perf_counter() - t0:.2f} s (tracing included)")
    print(plan.explain(max_rows=args.rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
        print(f"plan saved to {args.out}")


def _axes_for(cmd: str, shape: tuple[int, ...], names: tuple[str, ...] | None):
    default = ("node", "gpu")[-len(shape):] if len(shape) <= 2 else tuple(
        f"a{i}" for i in range(len(shape)))
    names = names or default
    if len(names) != len(shape):
        sys.exit(f"shardc {cmd}: --axes names {len(names)} axes but --mesh has {len(shape)}")
    return names


def cmd_calibrate(args) -> None:
    _force_cpu_devices(args.devices)
    import json

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


def _bench_planning(out) -> None:
    from shardc.bench import planning

    cases = []
    for name, layers in planning.CASES:
        print(f"planning {name} with {layers} layers ...", flush=True)
        cases.append(planning.measure_fresh(name, layers))
        print(f"  {cases[-1].plan_s:.2f} s, {cases[-1].status}, "
              f"{cases[-1].predicted_ms:.3f} ms predicted", flush=True)
    print("coordinate descent against the ILP on the tiny zoo ...", flush=True)
    gaps = planning.descent_gaps()
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    paths = planning.write(cases, out, command, gaps)
    print(planning.markdown(cases, command, gaps))
    print("wrote " + ", ".join(str(p) for p in paths))


def cmd_bench(args) -> None:
    _force_cpu_devices(16)
    from pathlib import Path

    if args.planning:
        return _bench_planning(Path(args.out or "docs/benchmarks"))

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from shardc.bench import harness, report
    from shardc.bench.zoo import DEFAULT_PRESETS, PRESETS, ZOO

    models = args.models.split(",") if args.models else (
        ["mlp", "gpt"] if args.quick else list(ZOO))
    presets = args.presets.split(",") if args.presets else list(DEFAULT_PRESETS)
    for name, known in (*((m, ZOO) for m in models), *((p, PRESETS) for p in presets)):
        if name not in known:
            sys.exit(f"shardc bench: unknown {name!r}; choose from {sorted(known)}")
    which = "quick" if args.quick else "bench"
    methods = args.methods.split(",") if args.methods else None
    todo = harness.cells(models, presets, methods)
    if not todo:
        sys.exit("shardc bench: no cells match; check --models / --presets / --methods")
    out = Path(args.out or ("docs/benchmarks/quick" if args.quick else "docs/benchmarks"))
    command = ("shardc bench " + " ".join(sys.argv[2:])).strip()
    kept, commands = report.load(out) if args.update else ([], [])
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
                                    not args.no_mesh_search)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="shardc", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="plan and run a GPT train step on 8 simulated devices")
    d.add_argument("--layers", type=_positive(int), default=2)
    d.add_argument("--rows", type=_positive(int), default=25,
                   help="op rows shown in the plan table")
    d.set_defaults(func=cmd_demo)
    q = sub.add_parser("plan", help="plan a zoo model from abstract shapes")
    q.add_argument("model", choices=["gpt", "mlp"])
    q.add_argument("--mesh", type=mesh_shape, default=(2, 4),
                   help="mesh shape, e.g. 8 or 2x4")
    q.add_argument("--axes", type=axis_names, default=None, help="comma-separated axis names")
    q.add_argument("--devices", type=_positive(int), default=8)
    q.add_argument("--layers", type=_positive(int), default=None)
    q.add_argument("--tiny", action="store_true")
    q.add_argument("--time-limit", type=_positive(float), default=10.0)
    q.add_argument("--rows", type=_positive(int), default=30)
    q.add_argument("--out", default=None, help="save the plan as JSON here")
    q.add_argument("--mesh-search", action="store_true",
                   help="also plan the other logical views of the devices (e.g. 16, 4x4)")
    q.add_argument("--cluster", type=cluster_arg, default=None,
                   help=f"a Cluster JSON (shardc calibrate --out) or a preset: "
                        f"{', '.join(CLUSTER_PRESETS)} (default: multi-node on 2 axes, else "
                        "nvlink-node)")
    q.set_defaults(func=cmd_plan)
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
    b = sub.add_parser("bench", help="shardc vs expert plans on the compiled programs")
    b.add_argument("--quick", action="store_true",
                   help="small models (the default presets); numerics checked for shardc only")
    b.add_argument("--models", default=None, help="comma-separated, e.g. gpt,moe")
    b.add_argument("--presets", default=None, help="comma-separated, e.g. node-8,2nodes-2x8")
    b.add_argument("--methods", default=None,
                   help="comma-separated, e.g. shardc,fsdp; experts: all but shardc")
    b.add_argument("--update", action="store_true",
                   help="merge into the results already in --out (re-measured cells replace "
                        "theirs)")
    b.add_argument("--out", default=None, help="folder for results.{md,json,png} "
                   "(default docs/benchmarks, or docs/benchmarks/quick with --quick)")
    b.add_argument("--no-check", action="store_true", help="skip the numerics check")
    b.add_argument("--no-mesh-search", action="store_true",
                   help="plan shardc on the preset's mesh only")
    b.add_argument("--time-limit", type=_positive(float), default=10.0)
    b.add_argument("--planning", action="store_true",
                   help="measure planning time instead (GPT-2-small unrolled and the scanned "
                        "Llama, 12 and 48 layers) into planning.{md,json}")
    b.set_defaults(func=cmd_bench)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
