"""Call overhead: what a steady-state call of an ``auto_shard`` step costs beside
``jax.jit`` of the same function with the same shardings.

The function takes a pytree of ``n`` small arrays (f32[8, 16], 20 to 1,000 leaves) and
returns one of them doubled, so dispatch (flattening the arguments, checking their types
and placements, launching the executable) is nearly all of a call. Its arguments are placed where
the plan wants them (``step.input_shardings``), as a training loop's state is after its
first step; ``jax.jit`` gets the plan's input and output shardings. Each repeat times
``CALLS`` calls of one then the other, the order alternating between repeats, and each keeps
its fastest repeat. The target: shardc's call within 1.1x ``jax.jit``'s plus 50 us.

References:
  JAX ``jax.jit`` (C++ dispatch: ``pjit``'s fast path checks argument signatures in C++).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CALLS", "LEAVES", "REPEATS", "CallCase", "markdown", "measure", "write"]

LEAVES = (20, 200, 1000)
CALLS = 50  # calls per repeat
REPEATS = 30  # many short repeats: the fastest is robust to a busy machine


@dataclass(frozen=True)
class CallCase:
    leaves: int
    jit_us: float  # per call, the fastest repeat
    shardc_us: float

    @property
    def target_us(self) -> float:
        return 1.1 * self.jit_us + 50.0

    @property
    def ratio(self) -> float:
        return self.shardc_us / self.jit_us


def _per_call(fn, args) -> float:
    import jax

    out = None
    t0 = time.perf_counter()
    for _ in range(CALLS):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / CALLS * 1e6


def measure(leaves: int) -> CallCase:
    """Time a steady-state call of the step and of ``jax.jit`` on ``leaves`` leaves."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import shardc

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    tree = {f"w{k:04d}": jnp.full((8, 16), k, jnp.float32) for k in range(leaves)}

    def first(tree):
        return tree["w0001"] * 2.0

    step = shardc.auto_shard(first, mesh=mesh, time_limit=0.0)
    (shardings,), _ = step.input_shardings(tree)
    placed = jax.device_put(tree, shardings)
    out = step(placed)
    jitted = jax.jit(first, in_shardings=(shardings,), out_shardings=out.sharding)
    np.testing.assert_array_equal(np.asarray(jitted(placed)), np.asarray(out))
    best = {"jit": float("inf"), "shardc": float("inf")}
    fns = {"jit": jitted, "shardc": step}
    for r in range(REPEATS + 1):  # the first round warms both up and is not kept
        order = ("jit", "shardc") if r % 2 else ("shardc", "jit")
        for name in order:
            t = _per_call(fns[name], (placed,))
            if r:
                best[name] = min(best[name], t)
    return CallCase(leaves, best["jit"], best["shardc"])


def markdown(cases: list[CallCase], command: str) -> str:
    import jax

    lines = ["# Call overhead", "",
             f"`{command}` on {jax.devices()[0].platform.upper()} ({len(jax.devices())} "
             f"devices on {os.cpu_count()} cores, mesh node=2 x gpu=4), JAX "
             f"{jax.__version__}. A steady-state call of an `auto_shard` step against "
             "`jax.jit` of the same function with the plan's shardings (a pytree of "
             "f32[8,16] leaves, one of them doubled; arguments placed as the plan wants); "
             f"per call, the fastest of {REPEATS} repeats of {CALLS} calls, the two timed "
             "side by side in alternating order. Target: 1.1x jax.jit + 50 us.", "",
             "| leaves | jax.jit | shardc | ratio | target | within |",
             "|---:|---:|---:|---:|---:|:---:|"]
    for c in cases:
        lines.append(f"| {c.leaves} | {c.jit_us:.0f} us | {c.shardc_us:.0f} us | "
                     f"{c.ratio:.2f}x | {c.target_us:.0f} us | "
                     f"{'yes' if c.shardc_us <= c.target_us else 'no'} |")
    return "\n".join(lines) + "\n"


def write(cases: list[CallCase], out: Path, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calls.md"
    path.write_text(markdown(cases, command))
    return path
