"""``shardc plan``: plan a zoo model or the user's program from abstract shapes and print
(or save) the plan."""

from __future__ import annotations

import time

from shardc.cli.common import planned_step, progress_logger, show

__all__ = ["cmd_plan"]


def cmd_plan(args) -> None:
    step, abstract = planned_step(args, "plan")
    t0 = time.perf_counter()
    with progress_logger():
        plan = step.plan(*abstract)
    print(f"planned in {time.perf_counter() - t0:.2f} s (tracing included)")
    margins = step.margins(*abstract) if args.margins else None
    show(plan.report(max_rows=args.rows, margins=margins), args.plain)
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
        print(f"plan saved to {args.out}")
