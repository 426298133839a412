"""What several test files share, in one module: comparing pytrees to tolerances derived
from the computation, the clusters the tests plan on, multi-process jobs, the rule families'
numerical check of a signature, and two small models (a scanned MLP's SGD step; an MLP
layer stack for pipelines on 8 devices)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardc.bench.numerics import ATOL, RTOL, mismatches
from shardc.cost.cluster import Cluster
from shardc.ir.graph import Graph, Op
from shardc.ir.prims import BINARY, UNARY
from shardc.ir.sbp import B, NdSbp, Partial, Sbp, Split
from shardc.ir.trace import trace
from shardc.pipeline import layers, layers_loss
from shardc.rules import Signature, signatures

# ---- numerics: a sharded run against the unsharded one ------------------------------------
# tolerances derived from the computation (shardc.bench.numerics), so the comparison holds
# on any machine's floating-point path


def assert_close(got, want, *, rtol: float = RTOL, atol: float = ATOL, lr: float = 0.0,
                 what: str = "") -> None:
    """Assert that the pytrees ``got`` and ``want`` agree leaf for leaf: elementwise to
    ``atol + rtol * |want|``, plus a few units in the last place of each leaf's largest
    magnitude (what reassociated sums move), plus, for parameters after an Adam step of
    learning rate ``lr``, the update's own sensitivity to its gradient."""
    bad = mismatches(got, want, lr, rtol=rtol, atol=atol)
    assert not bad, (what + ": " if what else "") + "; ".join(bad)


def first_call_compiles(step, *args) -> tuple[list[str], object]:
    """The programs the step's first call compiles (by name), and its result."""
    names = []

    def heard(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        out = step(*args)
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    return names, out


# ---- clusters the tests plan on -----------------------------------------------------------
# The tests' models are small (microseconds of H100 compute), and NCCL's collectives cost
# 10-60 us each, so on the default H100 cluster most of them are cheapest replicated. Tests
# of a mechanism that needs a sharded plan (data parallelism, partial accumulators, a
# budget that splits the state) plan on devices 500x slower than an H100, where these
# models are compute-bound as the zoo's models are on H100s.

#: H100 links, devices of 1 TFLOP/s
SLOW_DEVICES = Cluster(device_flops=1e12)
#: H100 nodes over InfiniBand, devices of 1 TFLOP/s
SLOW_NODES = dataclasses.replace(Cluster.multi_node(), device_flops=1e12)
#: pods joined by slow links over the stage axis, InfiniBand and NVLink inside, on
#: devices of 1 TFLOP/s
PODS = dataclasses.replace(Cluster.multi_pod("stage", "data", "model"), device_flops=1e12)


# ---- multi-process jobs: every process a subprocess of this interpreter, on a free ----------
# localhost port, with a time limit (a hung job fails its test)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Ended:
    """How one process ended: its exit code, the JSON lines it printed, its stderr tail."""

    code: int
    events: list
    stderr: str

    @property
    def last(self) -> dict | None:
        return self.events[-1] if self.events else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, argv: list[list[str]], timeout: float = 150) -> list[Ended]:
    """Run ``tests/<script>`` once per entry of ``argv`` (that process's arguments; the
    string ``{port}`` becomes the job's port) and wait for every process."""
    port = str(free_port())
    # each process sets its own device count; the other flags (the suite's fast compiles)
    # carry over
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": " ".join(flags)}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", script),
                               *(a.replace("{port}", port) for a in args)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in argv]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            out.append(Ended(p.returncode, events, stderr[-3000:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


# ---- rule families: a signature checked numerically on a simulated 1-D mesh ---------------
# ``check_signature_numerically`` shards real inputs per the signature (Split: the device's
# chunk, B: whole, P: random summands), runs the primitive per device with its params made
# local (shapes of the device's piece), reassembles per the output SBP and compares with the
# unsharded result.

S = Split
RNG = np.random.default_rng(0)
ELEMENTWISE = set(UNARY) | set(BINARY)


def _bind(op: Op, ins, params: dict) -> list:
    outs = op.prim.bind(*ins, **params)
    return list(outs) if op.prim.multiple_results else [outs]


def evaluate(graph: Graph, args) -> dict[int, np.ndarray]:
    """Concrete value of every Value of ``graph`` (``prim.bind`` op by op, in one jit)."""

    def run(*leaves):
        env = dict(zip((v.id for v in graph.inputs), leaves, strict=True))
        for op in graph.ops:
            ins = [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]
            env.update(zip((v.id for v in op.outputs), _bind(op, ins, op.params), strict=True))
        return env

    return {k: np.asarray(v) for k, v in jax.jit(run)(*jax.tree.leaves(args)).items()}


def op_inputs(fn, *args, name: str, index: int = 0) -> tuple[Op, list[np.ndarray]]:
    """The ``index``-th op called ``name`` in ``fn``'s graph and its concrete inputs."""
    graph = trace(fn, *args).graph
    env = evaluate(graph, args)
    op = [o for o in graph.ops if o.name == name][index]
    return op, [np.asarray(v.const) if v.is_const else env[v.id] for v in op.inputs]


def _local_shape(shape, sbp: Sbp, n: int) -> tuple[int, ...]:
    return tuple(s // n if isinstance(sbp, Split) and sbp.dim == d else s
                 for d, s in enumerate(shape))


def _shard(x: np.ndarray, sbp: Sbp, n: int, rng) -> list[np.ndarray]:
    if isinstance(sbp, Split):
        return np.split(x, n, axis=sbp.dim)
    if not isinstance(sbp, Partial):
        return [x] * n
    if x.dtype == np.bool_:
        raise AssertionError("a bool value cannot be partial")
    if sbp.op in ("max", "min"):  # one device holds x, the others values on its far side
        sign = 1 if sbp.op == "max" else -1
        return [x] + [(x - sign * np.abs(rng.normal(size=x.shape)) * (1 + np.abs(x)))
                      .astype(x.dtype) for _ in range(n - 1)]
    if jnp.issubdtype(x.dtype, jnp.floating):
        finite = np.abs(x) < 1e30  # huge (mask) and non-finite entries are not split
        scale = np.where(finite, np.abs(x), 0.0)  # relative per element: no cancellation
        parts = [(rng.uniform(-1.0, 1.0, x.shape) * scale).astype(x.dtype)
                 for _ in range(n - 1)]
    else:
        parts = [rng.integers(-5, 5, x.shape).astype(x.dtype) for _ in range(n - 1)]
    return [x - sum(parts)] + parts  # entries not split stay whole in part 0


def _local_params(op: Op, sig: Signature, local_ins, n: int) -> dict:
    params = dict(op.params)
    out_shape = _local_shape(op.outputs[0].shape, sig.outs[0], n)
    if op.name in ("broadcast_in_dim", "iota"):
        params["shape"] = out_shape
    if op.name == "reshape":
        params["new_sizes"] = out_shape
    split0 = sig.ins[0] if op.inputs and isinstance(sig.ins[0], Split) else None
    if split0 is not None and op.name == "slice":
        limits = list(params["limit_indices"])
        limits[split0.dim] = local_ins[0].shape[split0.dim]
        params["limit_indices"] = tuple(limits)
    if split0 is not None and "slice_sizes" in params:
        sizes, d = list(params["slice_sizes"]), split0.dim
        if sizes[d] == op.inputs[0].shape[d]:
            sizes[d] = local_ins[0].shape[d]
        params["slice_sizes"] = tuple(sizes)
    return params


def _assert_close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if not jnp.issubdtype(want.dtype, jnp.inexact):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = 1e-4 if jnp.finfo(want.dtype).bits >= 32 else 3e-2
    wide = np.complex128 if np.iscomplexobj(want) else np.float64  # complex: both parts
    finite = np.where(np.isfinite(want), np.abs(want.astype(wide)), 0.0)
    np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=tol,
                               atol=tol * (1.0 + finite.max(initial=0.0)), equal_nan=True,
                               err_msg=what)


def _assemble(pieces: list[np.ndarray], sbp: Sbp, what: str) -> np.ndarray:
    if isinstance(sbp, Split):
        return np.concatenate(pieces, axis=sbp.dim)
    if isinstance(sbp, Partial):
        combine = {"sum": np.add, "whole": np.add, "max": np.maximum, "min": np.minimum}[sbp.op]
        return combine.reduce(pieces)
    for p in pieces[1:]:
        _assert_close(p, pieces[0], what + " (B output differs between devices)")
    return pieces[0]


def _masked_index(op: Op, sig: Signature) -> int | None:
    """The index-vector position of a gather / scatter whose operand is split on a dim the
    indices select (the masked signatures of ``rules/indexing.py``), else None."""
    if op.name not in ("gather",) and not op.name.startswith("scatter"):
        return None
    if not isinstance(sig.ins[0], Split):
        return None
    dn = op.params["dimension_numbers"]
    index_map = dn.start_index_map if op.name == "gather" else dn.scatter_dims_to_operand_dims
    where = [j for j, d in enumerate(index_map) if d == sig.ins[0].dim]
    return where[0] if where else None


def _shift_indices(op: Op, params: dict, indices, j: int, k: int, chunk: int):
    """Device ``k``'s indices into its shard (``chunk`` elements from ``k * chunk``): those
    outside it made out of bounds, dropped (scatter) or read as 0 (gather)."""
    idx = np.array(indices)
    local = idx[..., j] - k * chunk
    idx[..., j] = np.where((local >= 0) & (local < chunk), local, 10 * chunk)
    params = {**params, "mode": jax.lax.GatherScatterMode.FILL_OR_DROP}
    if op.name == "gather":
        params["fill_value"] = 0
    return idx, params


def check_signature_numerically(op: Op, sig: Signature, inputs, n: int = 2,
                                 expected=None) -> bool:
    """Assert ``sig`` is exact for ``op`` with ``inputs`` on ``n`` simulated devices; returns
    False (nothing checked) where ``strategies`` drops it: an uneven split or a partial
    constant, and for a ring signature, which no device runs on its own pieces
    (``tests/test_ring.py`` runs each through the lowering's ring). ``expected``: the
    unsharded outputs, if known (else computed)."""
    if sig.ring >= 0:
        return False
    values, sbps = [*op.inputs, *op.outputs], [*sig.ins, *sig.outs]
    if not all(NdSbp((s,)).fits(v.shape, (n,)) for s, v in zip(sbps, values, strict=True)):
        return False
    if any(v.is_const and isinstance(s, Partial) for v, s in zip(op.inputs, sig.ins, strict=True)):
        return False
    inputs = [np.asarray(x) for x in inputs]
    rng = np.random.default_rng(1)
    shards = [_shard(x, s, n, rng) for x, s in zip(inputs, sig.ins, strict=True)]
    out0, sbp0 = op.outputs[0], sig.outs[0]
    if op.name in ELEMENTWISE and isinstance(sbp0, Split):
        # jax 0.10 elementwise ops broadcast size-1 dims implicitly: a B operand whose dim
        # matches the split output dim is sliced locally (free, each device holds it whole)
        for k, (v, s) in enumerate(zip(op.inputs, sig.ins, strict=True)):
            if s == B and v.ndim == out0.ndim and v.shape[sbp0.dim] == out0.shape[sbp0.dim] > 1:
                shards[k] = np.split(inputs[k], n, axis=sbp0.dim)
    per_device = []
    for k in range(n):
        local = [sh[k] for sh in shards]
        params = _local_params(op, sig, local, n)
        masked = _masked_index(op, sig)
        if masked is not None:  # a device serves the indices that fall in its shard only
            local[1], params = _shift_indices(op, params, local[1], masked, k,
                                              local[0].shape[sig.ins[0].dim])
        outs = [np.asarray(o) for o in _bind(op, local, params)]
        if op.name == "iota" and sbp0 == S(op.params["dimension"]):
            outs[0] = outs[0] + k * outs[0].shape[sbp0.dim]  # each device offsets its slice
        per_device.append(outs)
    ref = expected if expected is not None else _bind(op, inputs, op.params)
    for j, (want, sbp) in enumerate(zip(ref, sig.outs, strict=True)):
        what = f"{op.name} {sig} output {j}"
        got = _assemble([outs[j] for outs in per_device], sbp, what)
        assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
        _assert_close(got, want, what)
    return True


def check_all(fn, *args, name: str, index: int = 0) -> list[Signature]:
    """Signatures of the op; every one that fits 2 devices is verified numerically."""
    op, ins = op_inputs(fn, *args, name=name, index=index)
    sigs = signatures(op)
    assert sum(check_signature_numerically(op, s, ins) for s in sigs) >= 2
    return sigs


def sig(ins, outs) -> Signature:
    return Signature(tuple(ins), tuple(outs))


def f32(*shape):
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


# ---- a scanned MLP's SGD step (test_loops, test_cost_graph) --------------------------------

LOOP_LAYERS, LOOP_WIDTH, LOOP_BATCH = 4, 256, 4096
_LOOP_RNG = np.random.default_rng(0)


def loop_params():
    return {"w": jnp.asarray(_LOOP_RNG.normal(size=(LOOP_LAYERS, LOOP_WIDTH, LOOP_WIDTH))
                             / LOOP_WIDTH ** 0.5, jnp.float32),
            "b": jnp.zeros((LOOP_LAYERS, LOOP_WIDTH), jnp.float32)}


def loss_scanned(params, x):
    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h ** 2)


def sgd_step(loss):
    """An SGD step of ``loss`` and its state (fresh parameters each call)."""
    opt = optax.sgd(0.1)

    def step(state, x):
        value, g = jax.value_and_grad(loss)(state["params"], x)
        u, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

    params = loop_params()
    return step, {"params": params, "opt": opt.init(params)}


LOOP_X = jnp.asarray(_LOOP_RNG.normal(size=(LOOP_BATCH, LOOP_WIDTH)), jnp.float32)


# ---- an MLP layer stack for pipelines on (stage=2, data=2, model=2) ------------------------
# (test_pipeline_tensor, test_memory_budget)

STACK_LAYERS, STACK_WIDTH, STACK_HIDDEN, STACK_BATCH = 8, 256, 1024, 64
MIB = 2 ** 20
#: compiled peak over the predicted one (or the budget) the memory model may miss by
PEAK_SLACK = 1.15


def stack_layer(c, w):
    """An MLP block: the width up to STACK_HIDDEN and back (Megatron's column then row
    split)."""
    return c + jnp.tanh(c @ w["up"]) @ w["down"], None


def stack_loss_fn(y, head, targets):
    return jnp.mean((y @ head - targets) ** 2)


def stack_make():
    k = jax.random.split(jax.random.key(0), 5)
    stacked = {"up": jax.random.normal(k[0], (STACK_LAYERS, STACK_WIDTH, STACK_HIDDEN))
               / STACK_WIDTH ** 0.5,
               "down": jax.random.normal(k[1], (STACK_LAYERS, STACK_HIDDEN, STACK_WIDTH))
               / STACK_HIDDEN ** 0.5}
    head = jax.random.normal(k[2], (STACK_WIDTH, 4)) / STACK_WIDTH ** 0.5
    return (stacked, head), (jax.random.normal(k[3], (STACK_BATCH, STACK_WIDTH)),
                             jax.random.normal(k[4], (STACK_BATCH, 4)))


def stack_train_step(stack_loss):
    def step(state, batch):
        value, g = jax.value_and_grad(lambda s: stack_loss(*s, *batch))(state)
        return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), value
    return step


def stack_scanned(stacked, head, x, targets):
    return stack_loss_fn(jax.lax.scan(stack_layer, x, stacked)[0], head, targets)


def stack_stacked(stacked, head, x, targets):
    return stack_loss_fn(layers(stack_layer, x, stacked)[0], head, targets)


def stack_with_loss(stacked, head, x, targets):
    return layers_loss(stack_layer, stack_loss_fn, x, stacked, head, targets)
