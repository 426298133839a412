"""``shardc export plan.json``: write a Python module that runs a saved plan with plain
``jax.jit`` (``--format rules``: logical-axis rules)."""

from __future__ import annotations

import os
import sys

from shardc.cli.common import load_plan

__all__ = ["cmd_export"]


def cmd_export(args) -> None:
    from shardc.report.export import python_module, rules_module

    plan = load_plan(args.plan, "export")
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
