"""A step's first call at scale: an ``auto_shard`` training step over ``LEAVES`` parameter
leaves (plan + compile + run) against ``jax.jit`` of the same step given the plan's
shardings (compile + run), each in a fresh process, with each process's peak resident
memory (``ru_maxrss``) and its resident memory after the first call.

The step is an MLP of ``LEAVES // 2`` dense layers (a weight and a bias each), one SGD
update, the parameters donated. The ``shardc`` process saves its plan's input and output
PartitionSpecs; the ``jit`` process, which never imports shardc, reads them. Run as
``python -m shardc.bench.first_call {shardc,jit} LEAVES SPECS.json``: it prints one JSON
line.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEVICES", "LEAVES", "REPEATS", "FirstCall", "compare", "markdown", "run_one"]

LEAVES = 2000
DEVICES = 16  # simulated CPU devices; the mesh is node=2 x gpu=4 of the first 8
REPEATS = 3  # fresh processes per side, alternating; each side keeps its fastest
WIDTH = 16


@dataclass(frozen=True)
class FirstCall:
    """One side's fastest first call (seconds) and its process's memory (bytes)."""

    which: str
    seconds: float
    peak_rss: float  # ru_maxrss: the most the process held
    rss_after: float  # resident after the first call (the plan, executable and state kept)
    plan_seconds: float = 0.0  # shardc: of ``seconds``, tracing and planning
    #: of ``seconds``, JAX's own phases (its duration events): ``trace`` (every jaxpr
    #: traced: shardc's of the function and of the planned program), ``lower`` (to MLIR)
    #: and ``compile`` (XLA)
    phases: dict = field(default_factory=dict)


#: JAX's duration events (``jax.monitoring``) and the phase each adds to
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}


def _step_fn():
    import jax
    import jax.numpy as jnp

    def step(params, x):
        def loss(p):
            h = x
            for k in range(len(p)):
                layer = p[f"l{k:04d}"]
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return jnp.mean(h * h)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), value

    return step


def _inputs(leaves: int):
    import jax.numpy as jnp

    params = {f"l{k:04d}": {"w": jnp.full((WIDTH, WIDTH), 0.01 * (k % 7), jnp.float32),
                            "b": jnp.zeros((WIDTH,), jnp.float32)}
              for k in range(leaves // 2)}
    return params, jnp.ones((64, WIDTH), jnp.float32)


def _rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mesh():
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _specs_json(tree) -> list:
    import jax

    return [[None if e is None else list(e) if isinstance(e, tuple) else e for e in s.spec]
            for s in jax.tree.leaves(tree)]


def _shardings(mesh, specs: list, like):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    flat = [NamedSharding(mesh, PartitionSpec(*(tuple(e) if isinstance(e, list) else e
                                                for e in s))) for s in specs]
    return jax.tree.unflatten(jax.tree.structure(like), flat)


def _worker(which: str, leaves: int, specs_path: str) -> dict:
    """The first call of one side in this (fresh) process."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}")
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    step, mesh = _step_fn(), _mesh()
    params, x = _inputs(leaves)  # unplaced: each side's executable places them
    jax.block_until_ready((params, x))
    phases = dict.fromkeys(_EVENTS.values(), 0.0)

    def heard(event: str, secs: float, **_) -> None:
        if event in _EVENTS:
            phases[_EVENTS[event]] += secs

    jax.monitoring.register_event_duration_secs_listener(heard)
    plan_s = 0.0
    if which == "shardc":
        import shardc

        t0 = time.perf_counter()
        fn = shardc.auto_shard(step, mesh=mesh, donate_argnums=0)
        plan = fn.plan(params, x)
        plan_s = time.perf_counter() - t0
        out = fn(params, x)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
        (p_sh, x_sh), _ = fn.input_shardings(*abstract)
        Path(specs_path).write_text(json.dumps({
            "in": _specs_json((p_sh, x_sh)),
            "out": _specs_json(jax.tree.map(lambda a: a.sharding, out)),
            "status": plan.solver.get("status", "")}))
    else:
        specs = json.loads(Path(specs_path).read_text())
        ins = _shardings(mesh, specs["in"], (params, x))
        outs = _shardings(mesh, specs["out"], (params, x[0, 0]))
        t0 = time.perf_counter()
        out = jax.jit(step, in_shardings=ins, out_shardings=outs, donate_argnums=0)(params, x)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
    now = _rss_now()  # the kernel updates its high-water mark lazily: at least this
    peak = max(now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"which": which, "seconds": seconds, "plan_seconds": plan_s, "peak_rss": peak,
            "rss_after": now, "phases": phases}


def run_one(which: str, leaves: int, specs_path: str) -> FirstCall:
    """One side's first call in a fresh Python process (:func:`_worker`).

    Args:
        which: ``"shardc"`` (plans, then writes its plan's shardings to ``specs_path``) or
            ``"jit"`` (reads them).
        leaves: the step's parameter leaves (two per layer).
        specs_path: where the shardc side writes, and the jit side reads, the shardings.

    Returns:
        The side's time and memory.

    Raises:
        BenchError: the process failed (its standard error's end in the message).
    """
    done = subprocess.run([sys.executable, "-m", "shardc.bench.first_call", which,
                           str(leaves), specs_path], capture_output=True, text=True)
    if done.returncode:
        from shardc.errors import BenchError

        raise BenchError(f"the {which} first call exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return FirstCall(**json.loads(done.stdout.strip().splitlines()[-1]))


def compare(leaves: int = LEAVES, repeats: int = REPEATS, say=print) -> list[FirstCall]:
    """Both sides' first calls, each in fresh processes, in alternating order (the shardc
    side first: the jit side reads its plan's shardings).

    Args:
        leaves: the step's parameter leaves.
        repeats: processes per side; each side keeps its fastest.
        say: where each process's line goes.

    Returns:
        ``[shardc, jit]``, each side's fastest first call.
    """
    best: dict[str, FirstCall] = {}
    with tempfile.TemporaryDirectory(prefix="shardc-first-call-") as tmp:
        specs = str(Path(tmp) / "specs.json")
        for r in range(repeats):
            for which in ("shardc", "jit") if r % 2 == 0 else ("jit", "shardc"):
                got = run_one(which, leaves, specs)
                say(f"  {which}: first call {got.seconds:.1f} s, peak RSS "
                    f"{got.peak_rss / 2**30:.2f} GiB")
                if which not in best or got.seconds < best[which].seconds:
                    best[which] = got
    return [best["shardc"], best["jit"]]


def markdown(calls: list[FirstCall], leaves: int, repeats: int) -> list[str]:
    """The first-call section of ``calls.md``.

    Args:
        calls: ``[shardc, jit]`` as :func:`compare` returns them.
        leaves: the step's parameter leaves.
        repeats: processes per side the figures are the fastest of.

    Returns:
        The section's lines.
    """
    mine, jit = calls
    gib = 2**30
    return ["", "## First call", "",
            f"An `auto_shard` training step over {leaves} parameter leaves (an MLP of "
            f"{leaves // 2} dense layers of f32[{WIDTH},{WIDTH}] and f32[{WIDTH}], one SGD "
            "update, parameters donated) against `jax.jit` of the same step given the "
            "plan's input and output shardings. The first call: shardc traces, plans, "
            "compiles and runs; jax.jit compiles and runs. Each side in a fresh process, "
            f"the fastest of {repeats} alternating; memory is the process's peak "
            "(`ru_maxrss`) and what it holds after the first call. Targets: first call "
            "<= 1.1x jax.jit's, resident memory <= 1.5x. The \"of which\" rows are JAX's "
            "own duration events (`jax.monitoring`): shardc's tracing counts both its trace "
            "of the function (inside the plan's time) and its trace of the planned program; "
            "its XLA compile is of the program with the plan's constraints.", "",
            "| | jax.jit | shardc | ratio | target |", "|---|---:|---:|---:|---:|",
            f"| first call | {jit.seconds:.1f} s | {mine.seconds:.1f} s "
            f"(plan {mine.plan_seconds:.1f} s) | {mine.seconds / jit.seconds:.2f}x | 1.1x |",
            *(f"| of which {what} | {jit.phases.get(k, 0):.1f} s | "
              f"{mine.phases.get(k, 0):.1f} s | | |" for k, what in
              (("trace", "JAX tracing"), ("lower", "lowering"), ("compile", "XLA compile"))),
            f"| peak RSS | {jit.peak_rss / gib:.2f} GiB | {mine.peak_rss / gib:.2f} GiB | "
            f"{mine.peak_rss / jit.peak_rss:.2f}x | 1.5x |",
            f"| RSS after the call | {jit.rss_after / gib:.2f} GiB | "
            f"{mine.rss_after / gib:.2f} GiB | {mine.rss_after / jit.rss_after:.2f}x | 1.5x |"]


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
