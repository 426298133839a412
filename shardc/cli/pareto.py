"""``shardc pareto``: the time-memory frontier of a zoo model or the user's program
(``--devices``: the best plan on each device count that divides the mesh)."""

from __future__ import annotations

import json
import time

from shardc.cli.common import planned_step, progress_logger

__all__ = ["cmd_pareto"]


def cmd_pareto(args) -> None:
    step, abstract = planned_step(args, "pareto")
    t0 = time.perf_counter()
    if args.devices:
        budget = None if args.memory_budget is None else args.memory_budget * 2**30
        with progress_logger():
            counts = step.device_sweep(*abstract, memory_budget=budget)
        print(f"the best plan on each device count that divides the mesh, found in "
              f"{time.perf_counter() - t0:.2f} s (tracing included):")
        print(counts)
        return
    with progress_logger():
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
