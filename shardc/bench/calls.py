"""Call overhead: what a steady-state call of an ``auto_shard`` step costs beside
``jax.jit`` of the same function with the same shardings.

The function takes a pytree of ``n`` small arrays (f32[8, 16], 20 to 1,000 leaves) and
returns one of them doubled, so dispatch (flattening the arguments, checking their types
and placements, launching the executable) is nearly all of a call. Its arguments are placed where
the plan wants them (``step.input_shardings``), as a training loop's state is after its
first step; ``jax.jit`` gets the plan's input and output shardings. Each repeat times
``CALLS`` calls of one then the other, the order alternating between repeats, and each keeps
its fastest repeat. The target: shardc's call within 1.1x ``jax.jit``'s plus 50 us. A
donated case (1,000 leaves, the step returning its whole argument and fed its own result)
prices the check that refuses an argument an earlier call donated. The first call at
2,000 leaves is :mod:`shardc.bench.first_call`'s.

References:
  JAX ``jax.jit`` (C++ dispatch: ``pjit``'s fast path checks argument signatures in C++).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CALLS", "DONATED", "LEAVES", "REPEATS", "CallCase", "markdown", "measure", "write"]

LEAVES = (20, 200, 1000)
DONATED = 1000  # leaves of the case whose argument is donated (state = step(state))
CALLS = 50  # calls per repeat
REPEATS = 30  # many short repeats: the fastest is robust to a busy machine


@dataclass(frozen=True)
class CallCase:
    leaves: int
    jit_us: float  # per call, the fastest repeat
    shardc_us: float
    donated: bool = False

    @property
    def target_us(self) -> float:
        return 1.1 * self.jit_us + 50.0

    @property
    def ratio(self) -> float:
        return self.shardc_us / self.jit_us


def _per_call(fn, args, donated: bool) -> tuple[float, tuple]:
    """Microseconds per call of ``CALLS`` calls, and the arguments for the next: a donated
    step is fed its own result (``state = step(state)``)."""
    import jax

    out = None
    t0 = time.perf_counter()
    for _ in range(CALLS):
        out = fn(*args)
        if donated:
            args = (out,)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / CALLS * 1e6, args


def measure(leaves: int, donated: bool = False) -> CallCase:
    """Time a steady-state call of the step and of ``jax.jit`` on ``leaves`` leaves; with
    ``donated``, a step that returns its whole argument (one leaf doubled), donated."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import shardc

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    def fresh() -> dict:  # a donated call deletes its argument: each side its own
        return {f"w{k:04d}": jnp.full((8, 16), k, jnp.float32) for k in range(leaves)}

    tree = fresh()

    def first(tree):
        return tree["w0001"] * 2.0

    def whole(tree):
        return {**tree, "w0001": tree["w0001"] * 2.0}

    fn, donate = (whole, 0) if donated else (first, None)
    step = shardc.auto_shard(fn, mesh=mesh, time_limit=0.0, donate_argnums=donate)
    (shardings,), _ = step.input_shardings(tree)
    out = step(jax.device_put(fresh(), shardings))
    jitted = jax.jit(fn, in_shardings=(shardings,), donate_argnums=donate,
                     out_shardings=jax.tree.map(lambda a: a.sharding, out))
    for a, b in zip(jax.tree.leaves(jitted(jax.device_put(fresh(), shardings))),
                    jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    best = {"jit": float("inf"), "shardc": float("inf")}
    fns = {"jit": jitted, "shardc": step}
    args = {name: (jax.device_put(fresh(), shardings),) for name in fns}
    for r in range(REPEATS + 1):  # the first round warms both up and is not kept
        order = ("jit", "shardc") if r % 2 else ("shardc", "jit")
        for name in order:
            t, args[name] = _per_call(fns[name], args[name], donated)
            if r:
                best[name] = min(best[name], t)
    return CallCase(leaves, best["jit"], best["shardc"], donated)


def markdown(cases: list[CallCase], command: str, first: list[str] = ()) -> str:
    """``calls.md``: the steady-state table, then ``first`` (the first-call section,
    :func:`shardc.bench.first_call.markdown`)."""
    import jax

    lines = ["# Call overhead", "",
             f"`{command}` on {jax.devices()[0].platform.upper()} ({len(jax.devices())} "
             f"devices on {os.cpu_count()} cores, mesh node=2 x gpu=4), JAX "
             f"{jax.__version__}. A steady-state call of an `auto_shard` step against "
             "`jax.jit` of the same function with the plan's shardings (a pytree of "
             "f32[8,16] leaves, one of them doubled; arguments placed as the plan wants; "
             "the donated case returns the whole pytree, one leaf doubled, and is fed its "
             "own result); "
             f"per call, the fastest of {REPEATS} repeats of {CALLS} calls, the two timed "
             "side by side in alternating order. Target: 1.1x jax.jit + 50 us.", "",
             "| leaves | jax.jit | shardc | ratio | target | within |",
             "|---:|---:|---:|---:|---:|:---:|"]
    for c in cases:
        label = f"{c.leaves}, donated" if c.donated else f"{c.leaves}"
        lines.append(f"| {label} | {c.jit_us:.0f} us | {c.shardc_us:.0f} us | "
                     f"{c.ratio:.2f}x | {c.target_us:.0f} us | "
                     f"{'yes' if c.shardc_us <= c.target_us else 'no'} |")
    return "\n".join([*lines, *first]) + "\n"


def write(cases: list[CallCase], out: Path, command: str, first: list[str] = ()) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calls.md"
    path.write_text(markdown(cases, command, first))
    return path
