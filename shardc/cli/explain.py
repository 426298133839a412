"""``shardc explain plan.json``: print a saved plan (``--program``: with its margins against
generic layouts; ``--compile``: and predicted vs compiled collectives; ``--plot``: drawn)."""

from __future__ import annotations

import math
import sys

from shardc.cli.common import (
    abstract_mesh,
    device_mesh,
    load_plan,
    load_program,
    show,
)
from shardc.util.devices import force_cpu_devices

__all__ = ["cmd_explain"]


def cmd_explain(args) -> None:
    if args.compile and not args.program:
        sys.exit("shardc explain: --compile compiles the plan's program; name it with "
                 "--program path/to/file.py:make")
    plan = load_plan(args.plan, "explain")  # imports jax; its backend starts later
    if args.plot:
        _plot(plan, args.plot)
    if not args.program:
        show(plan.report(max_rows=args.rows), args.plain)
        return
    if args.compile:
        force_cpu_devices(max(8, math.prod(plan.axis_sizes)))
    import shardc

    program = load_program(args.program, "explain")
    # the margins need the program only; compiling needs devices
    mesh = device_mesh(plan.axis_sizes, plan.axis_names) if args.compile else \
        abstract_mesh(plan.axis_sizes, plan.axis_names)
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
