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

One module per command (``demo.py``, ``plan.py``, ``pareto.py``, ``calibrate.py``,
``explain.py``, ``export.py``, ``bench.py``), what they share in ``common.py``; this one
holds the parser and :func:`main`.
"""

from __future__ import annotations

import argparse
import gc

from shardc.bench import COMPILERS
from shardc.cli.bench import cmd_bench
from shardc.cli.calibrate import cmd_calibrate
from shardc.cli.common import PRESETS, axis_names, mesh_shape, positive
from shardc.cli.demo import cmd_demo
from shardc.cli.explain import cmd_explain
from shardc.cli.export import cmd_export
from shardc.cli.pareto import cmd_pareto
from shardc.cli.plan import cmd_plan
from shardc.solve.ilp import DEFAULT_TIME_LIMIT
from shardc.tradeoff.frontier import BUDGETS

__all__ = ["command", "main"]


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
    q.add_argument("--layers", type=positive(int), default=None, help="zoo models only")
    q.add_argument("--tiny", action="store_true", help="zoo models only")
    q.add_argument("--time-limit", type=positive(float), default=DEFAULT_TIME_LIMIT)
    q.add_argument("--mesh-search", action="store_true",
                   help="also plan the other logical views of the devices (e.g. 16, 4x4)")


DESCRIPTION = ("shardc, an auto-sharding compiler for JAX: demo | plan | pareto | calibrate | "
               "explain | export | bench (each command's --help says more)")


def _demo_parser(sub) -> None:
    """``shardc demo``'s arguments."""
    d = sub.add_parser("demo", help="plan and run a GPT train step on 8 simulated devices")
    d.add_argument("--layers", type=positive(int), default=2)
    d.add_argument("--rows", type=positive(int), default=25,
                   help="op rows shown in the plan table")
    d.set_defaults(func=cmd_demo)


def _plan_parser(sub) -> None:
    """``shardc plan``'s arguments."""
    q = sub.add_parser("plan", help="plan a zoo model or your program from abstract shapes",
                       description="Plan a zoo model (gpt, mlp) or your own program: "
                       "path/to/file.py:make or pkg.module:make, where make() returns (fn, "
                       "args), args a tuple of fn's positional arguments (arrays or "
                       "jax.ShapeDtypeStructs).")
    _target_arguments(q)
    q.add_argument("--rows", type=positive(int), default=30)
    q.add_argument("--plain", action="store_true", help="plain text, not rich tables")
    q.add_argument("--margins", action="store_true",
                   help="also price generic data-parallel, FSDP, Megatron and DP x TP "
                        "layouts of the program on the same cost model")
    q.add_argument("--out", default=None, help="save the plan as JSON here")
    q.set_defaults(func=cmd_plan)


def _pareto_parser(sub) -> None:
    """``shardc pareto``'s arguments."""
    f = sub.add_parser("pareto", help="the time-memory frontier of a zoo model or your program",
                       description="Plan at no memory budget, at the smallest one a plan was "
                       "found for, and at budgets between; print the non-dominated plans.")
    _target_arguments(f)
    f.add_argument("--budgets", type=positive(int, zero=True), default=BUDGETS,
                   help="budgets searched at fixed points between the leanest and the fastest "
                   "plan, besides the searches into the gaps the placements leave (default "
                   "%(default)s)")
    f.add_argument("--plot", default=None, help="save the time-memory plot (PNG) here")
    f.add_argument("--out", default=None, help="save the frontier's plans as a JSON list here")
    f.add_argument("--devices", action="store_true",
                   help="instead: the best plan on each device count that divides the mesh "
                        "(1..N), and whether it fits the memory budget")
    f.add_argument("--memory-budget", type=positive(float), default=None, metavar="GIB",
                   help="with --devices: GiB per device (default: the cluster's device memory)")
    f.set_defaults(func=cmd_pareto)


def _calibrate_parser(sub) -> None:
    """``shardc calibrate``'s arguments."""
    c = sub.add_parser("calibrate", help="measure the devices at hand into a Cluster JSON")
    c.add_argument("--mesh", type=mesh_shape, default=(2, 4),
                   help="mesh shape, e.g. 8 or 2x4")
    c.add_argument("--axes", type=axis_names, default=None, help="comma-separated axis names")
    c.add_argument("--devices", type=positive(int), default=8,
                   help="CPU devices to simulate when there is no accelerator")
    c.add_argument("--out", required=True, help="write the Cluster JSON here")
    c.add_argument("--report", default=None, help="also write the fit (samples, R²) here")
    # unset options take CalibrateOptions' defaults (shardc/cost/calibrate.py)
    c.add_argument("--sizes", type=positive(int), nargs="+", default=None,
                   help="per-device message bytes of the timed collectives (default 1 KiB, "
                        "16 KiB, 256 KiB, 1 MiB)")
    c.add_argument("--reps", type=positive(int), default=None,
                   help="timed runs of each program; the fastest counts (default 5)")
    c.add_argument("--chain", type=positive(int), default=None,
                   help="collectives per timed program (default 8)")
    c.add_argument("--matmul-size", type=positive(int), default=None,
                   help="side of the timed square matmul (default 1024)")
    c.set_defaults(func=cmd_calibrate)


def _explain_parser(sub) -> None:
    """``shardc explain``'s arguments."""
    e = sub.add_parser("explain", help="print a saved plan (with --compile: against what XLA "
                       "compiles)")
    e.add_argument("plan", help="a plan saved by shardc plan --out")
    e.add_argument("--compile", action="store_true",
                   help="compile the plan's program and compare its collectives")
    e.add_argument("--program", default=None,
                   help="the program the plan is for (path/to/file.py:make): prices generic "
                        "data-parallel, FSDP, Megatron and DP x TP layouts beside the plan; "
                        "needed by --compile")
    e.add_argument("--rows", type=positive(int), default=30)
    e.add_argument("--plain", action="store_true", help="plain text, not rich tables")
    e.add_argument("--plot", default=None, metavar="PATH",
                   help="also draw the per-op layouts and the compute / comm split (PNG)")
    e.set_defaults(func=cmd_explain)


def _export_parser(sub) -> None:
    """``shardc export``'s arguments."""
    x = sub.add_parser("export", help="write a Python module that runs a saved plan with "
                       "plain jax.jit")
    x.add_argument("plan", help="a plan saved by shardc plan --out")
    x.add_argument("--format", choices=["python", "rules"], default="python",
                   help="python: jax.jit in/out shardings per argument and result leaf; "
                        "rules: a PartitionSpec per parameter path pattern, layer indices "
                        "folded")
    x.add_argument("--out", default=None, help="write here instead of standard output")
    x.set_defaults(func=cmd_export)


def _bench_parser(sub) -> None:
    """``shardc bench``'s arguments."""
    b = sub.add_parser("bench", help="shardc vs expert plans on the compiled programs")
    b.add_argument("--quick", action="store_true",
                   help="small models (the default presets), shardc's default and serial "
                   "plans against every expert; numerics checked for shardc only")
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
    b.add_argument("--compiler", choices=COMPILERS, default="cpu",
                   help="cpu: compile on simulated CPU devices (XLA:CPU); gpu: XLA:GPU's "
                        "ahead-of-time compile for H100s, no GPU needed (needs JAX's CUDA "
                        "plugin: pip install 'shardc[gpu-aot]'); the numerics check stays on "
                        "the CPU devices")
    b.add_argument("--no-check", action="store_true", help="skip the numerics check")
    b.add_argument("--no-mesh-search", action="store_true",
                   help="plan shardc on the preset's mesh only")
    b.add_argument("--time-limit", type=positive(float), default=DEFAULT_TIME_LIMIT)
    b.add_argument("--planning", action="store_true",
                   help="measure planning time instead (GPT-2-small unrolled and the scanned "
                        "Llama, 12 and 48 layers) into planning.{md,json}")
    b.add_argument("--faults", action="store_true",
                   help="the fault campaign: a 2-process training job killed, cut to one "
                        "host, its checkpoints damaged and its disk filled at seeded random "
                        "steps, into faults.{md,json} (docs/faults.md)")
    b.add_argument("--fault-seed", type=int, default=0, help="--faults: the schedule's seed")
    b.add_argument("--fault-steps", type=positive(int), default=300,
                   help="--faults: the job's steps (a checkpoint every 10)")
    b.add_argument("--calls", action="store_true",
                   help="time a steady-state call against jax.jit's at 20, 200 and 1,000 "
                        "argument leaves, and the first call of a 2,000-leaf step "
                        "(docs/benchmarks/calls.md)")
    b.add_argument("--scale", action="store_true",
                   help="plan a 70B-class decoder for 128x8 and 8x16x8 H100s (abstract meshes) "
                        "beside HSDP and FSDP x TP, into scale.{md,json}")
    b.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line) and run the command it names."""
    p = argparse.ArgumentParser(prog="shardc", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)
    _demo_parser(sub)
    _plan_parser(sub)
    _pareto_parser(sub)
    _calibrate_parser(sub)
    _explain_parser(sub)
    _export_parser(sub)
    _bench_parser(sub)
    args = p.parse_args(argv)
    args.func(args)


def command() -> None:
    """The ``shardc`` console script (and ``python -m shardc.cli``): :func:`main`, then the
    heap left to the process's exit (:func:`gc.freeze`) rather than walked by a last
    collection: a frontier leaves many IR objects in reference cycles (an op and its values
    refer to each other), and collecting them at exit delays the end of the command
    (docs/design-notes.md). :func:`main` itself, called in a process that goes on, leaves
    the collector alone."""
    main()
    gc.freeze()
