"""Measure the devices at hand for a calibrated :class:`~shardc.cost.cluster.Cluster`.

For every mesh axis of more than one device, the all-reduce, all-gather and all-to-all of a
few message sizes are timed along that axis alone (``jax.shard_map`` with ``lax.psum`` /
``lax.all_gather`` / ``lax.all_to_all`` over the axis name, the other axes running the
same collective side by side, as in a sharded step). Each timed program runs ``chain``
collectives one after the other in a ``lax.fori_loop`` (each reads the previous result, so
XLA can neither combine nor drop them), so one program launch is spread over ``chain``
collectives; the time of one collective is the fastest of ``reps`` runs, after a warm-up
run, divided by ``chain``.

Two models the planner prices with (:mod:`shardc.cost.collectives`) are fit to the
timings, and the calibrated Cluster prices with the one that fits them better:

- ``"alpha-beta"``: one collective takes ``α + wire / bandwidth`` seconds;
- ``"ring"``: NCCL's ring/Simple base latency, then a latency per ring step (``2(n−1)``
  steps for an all-reduce, ``n−1`` for the others, as NCCL's ``ncclTopoTuneModel`` counts
  them; an all-to-all's sends one step), then ``wire / bandwidth``:
  ``base + steps·λ + wire / bandwidth``. Where a link's
  latency grows with the ring's length (GPUs, NCCL), this fits the small messages of
  every collective kind at once where one α cannot.

``wire`` is the bytes each device moves for a per-device message of ``L`` bytes on an axis
of ``n`` devices: all-gather ``(n−1)·L``, all-reduce ``2(n−1)/n·L``, all-to-all
``(n−1)/n·L``. The latency (``α`` or ``λ``) and ``β = 1/bandwidth`` are fit per axis by
least squares over every (collective, size) sample, weighted by ``1/time`` so the small
messages that carry the latency count as much as the large ones that carry ``β``; the
model whose weighted squared residuals, summed over the axes, are smaller is kept, and the
fit reports R² and each sample's relative residual under it. NCCL's algorithm and protocol
tables are not fit (``"nccl"`` is never chosen): they describe NCCL on GPUs, not whatever
runs the collectives of the devices measured.

References:
  NVIDIA NCCL ``src/graph/tuning.cc`` (``ncclTopoTuneModel``: ring steps ``2(n−1)`` for
  all-reduce, ``n−1`` otherwise; ``baseLat`` of ring/Simple).

Achievable FLOP/s is a ``matmul_size`` square float32 matmul on every device at once (the
fastest of ``reps`` runs after a warm-up), so the Cluster's ``utilization`` is 1: the
figure is what kernels reach, not a datasheet peak. Device memory is the runtime's
``bytes_limit`` where it reports one (GPUs, TPUs); CPU devices report none, so they are
given the host's physical memory shared among its local devices.

Under several processes (``jax.distributed``), process 0's timings are broadcast to all,
so every process builds the same Cluster, and so the same plans.

:func:`measure` times and fits; :meth:`shardc.cost.cluster.Cluster.calibrate` makes the
Cluster of what it returns, with the :class:`~shardc.cost.cluster.Calibration` behind it.
This module does not import the Cluster it measures for.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardc.cost.collectives import Group, seconds
from shardc.errors import CalibrationError as CalibrationError
from shardc.errors import OptionsError, OptionsTypeError

#: the models :func:`measure` fits, in the order a tie goes
FIT_MODELS = ("alpha-beta", "ring")

__all__ = ["AxisFit", "CalibrateOptions", "CalibrationError", "FIT_MODELS", "Sample",
           "WIRE_FACTOR", "measure"]

#: bytes each device moves per byte of its message on an axis of ``n`` devices: the ring
#: costs of Thakur, Rabenseifner & Gropp (IJHPCA 2005), as :mod:`shardc.cost.comm` prices
WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: float(n - 1),
    "all-to-all": lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class CalibrateOptions:
    """What :func:`measure` measures. ``sizes``: per-device message bytes of each timed
    collective (at least two distinct; the largest should take well over the smallest for
    the bandwidth to show); ``reps``: timed runs per program (the fastest counts);
    ``chain``: collectives per program; ``matmul_size``: side of the timed square
    matmul."""

    sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 18, 1 << 20)
    reps: int = 5
    chain: int = 8
    matmul_size: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(sorted(set(self.sizes))))
        if len(self.sizes) < 2 or any(not isinstance(s, int) or s < 16 for s in self.sizes):
            raise OptionsError(f"CalibrateOptions: sizes must hold at least two distinct message "
                               f"sizes in bytes, each >= 16, got {self.sizes!r}; e.g. "
                               "(1024, 16384, 262144, 1048576)")
        for name in ("reps", "chain", "matmul_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise OptionsError(f"CalibrateOptions: {name} must be a positive integer, "
                                   f"got {v!r}")


@dataclass(frozen=True)
class Sample:
    """One timed collective: ``message`` bytes per device, ``wire`` bytes each device
    moves, ``seconds`` per collective."""

    kind: str
    message: int
    wire: float
    seconds: float


@dataclass(frozen=True)
class AxisFit:
    """The fit of one mesh axis under ``model``: ``latency`` in seconds (α for
    ``"alpha-beta"``, per ring step for ``"ring"``), ``bandwidth`` 1/β in bytes/s per
    device, ``r2`` the fit's R² on the samples' times, ``residuals`` each sample's
    ``(measured - fitted) / measured``."""

    axis: str
    size: int
    latency: float
    bandwidth: float
    r2: float
    samples: tuple[Sample, ...]
    residuals: tuple[float, ...]
    model: str = "alpha-beta"

    def fitted(self, s: Sample) -> float:
        """The model's seconds for the sample ``s``."""
        return _latency(self.model, s.kind, self.size, self.latency) + s.wire / self.bandwidth

    @property
    def weighted_sse(self) -> float:
        """Σ residual², the quantity the fit minimised (residuals are relative: weights
        1/time)."""
        return float(sum(r * r for r in self.residuals))

    @property
    def max_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


def measure(mesh: Mesh, opts: CalibrateOptions
            ) -> tuple[str, list[AxisFit], float, float, str]:
    """Time collectives on each axis of ``mesh`` and a matmul on its devices, and fit the
    models to the timings: ``(model, fits, matmul_flops, device_memory, memory_source)``,
    the better fit of :data:`FIT_MODELS` and its fit per axis of more than one device
    (keyed by the mesh's axis names), the FLOP/s per device, and the bytes of memory per
    device with where that figure came from; the same on every process. What
    :meth:`shardc.cost.cluster.Cluster.calibrate` makes its Cluster of."""
    if not isinstance(mesh, Mesh):
        raise OptionsTypeError(f"calibrate needs a jax.sharding.Mesh of the devices to measure, "
                               f"got {type(mesh).__name__}; make one with jax.make_mesh((2, 4), "
                               "('node', 'gpu'))")
    timed = [(axis, kind, size) for axis, n in mesh.shape.items() if n > 1
             for kind in WIRE_FACTOR for size in opts.sizes]
    memory, source = _device_memory(mesh)
    measured = _agreed(np.array([_time_collective(mesh, axis, kind, size, opts)
                                 for axis, kind, size in timed]
                                + [_time_matmul(mesh, opts), memory]))
    seconds, memory = measured[:-1], float(measured[-1])
    per_model = {model: [] for model in FIT_MODELS}
    for axis, n in mesh.shape.items():
        if n == 1:
            continue
        samples = tuple(Sample(kind, size, WIRE_FACTOR[kind](n) * size, float(t))
                        for (a, kind, size), t in zip(timed, seconds) if a == axis)
        for model in FIT_MODELS:
            per_model[model].append(_fit(axis, n, samples, model))
    model = min(FIT_MODELS, key=lambda m: (sum(f.weighted_sse for f in per_model[m]),
                                           FIT_MODELS.index(m)))
    fits = per_model[model]
    side = opts.matmul_size
    flops = 2 * side ** 3 / float(seconds[-1])
    return model, fits, flops, memory, source


def _agreed(measured: np.ndarray) -> np.ndarray:
    """Process 0's figures on every process (each measures its own; plans must not
    differ)."""
    if jax.process_count() == 1:
        return measured
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(measured))


def _fastest(fn: Callable, x, reps: int) -> float:
    jax.block_until_ready(fn(x))  # warm-up: compile and first touch
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t0)
    return best


def _per_device(mesh: Mesh, elems: int, dtype=jnp.float32):
    """A float array with ``elems`` elements on each device of ``mesh``, made in place."""
    every = PartitionSpec(tuple(mesh.axis_names))
    sharding = NamedSharding(mesh, every)
    return jax.jit(lambda: jnp.ones((mesh.size * elems,), dtype), out_shardings=sharding)()


def _time_collective(mesh: Mesh, axis: str, kind: str, size: int,
                     opts: CalibrateOptions) -> float:
    """Seconds of one ``kind`` of ``size`` bytes per device along ``axis``."""
    elems = max(size // 4, 1)
    n = mesh.shape[axis]
    elems -= elems % n  # an all-to-all splits the message in n
    every = PartitionSpec(tuple(mesh.axis_names))

    def one(x):
        if kind == "all-reduce":
            return jax.lax.psum(x, axis)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
        return jax.lax.all_gather(x, axis, tiled=True)[: x.shape[0]]

    def body(x):
        return jax.lax.fori_loop(0, opts.chain, lambda _, y: one(y), x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=every, out_specs=every,
                               check_vma=False))
    return _fastest(fn, _per_device(mesh, elems), opts.reps) / opts.chain


def _time_matmul(mesh: Mesh, opts: CalibrateOptions) -> float:
    """Seconds of one ``matmul_size`` square float32 matmul, every device at once."""
    side = opts.matmul_size
    every = PartitionSpec(tuple(mesh.axis_names))
    x = _per_device(mesh, side * side)
    fn = jax.jit(jax.shard_map(lambda v: (v.reshape(side, side) @ v.reshape(side, side)).ravel(),
                               mesh=mesh, in_specs=every, out_specs=every, check_vma=False))
    return _fastest(fn, x, opts.reps)


def _latency(model: str, kind: str, n: int, latency: float) -> float:
    """The latency part of one ``kind``'s seconds on ``n`` devices of one node under
    ``model``, as the planner prices it (:func:`shardc.cost.collectives.seconds` of an empty
    buffer): α, or NCCL's ring/Simple base plus ``latency`` per ring step (an all-to-all's
    sends one step)."""
    return seconds(kind, Group(n, 1, "nvlink", "net", 1.0, latency, latency, latency), 0.0,
                   model)


def _fit(axis: str, n: int, samples: Sequence[Sample], model: str = "alpha-beta"
         ) -> AxisFit:
    """Weighted least squares (weights ``1/seconds``) of ``seconds = α + β·wire``
    (``"alpha-beta"``) or ``seconds - base = λ·steps + β·wire`` (``"ring"``)."""
    x = np.array([s.wire for s in samples])
    t = np.array([s.seconds for s in samples])
    # the latency part is linear in the fitted latency: fixed + latency * per
    fixed = np.array([_latency(model, s.kind, n, 0.0) for s in samples])
    per = np.array([_latency(model, s.kind, n, 1.0) for s in samples]) - fixed
    y, w = t - fixed, 1.0 / t
    (lat, beta), *_ = np.linalg.lstsq(np.stack([w * per, w * x], axis=1), w * y, rcond=None)
    if lat < 0:  # noise at the small sizes: the best fit without a latency of its own
        lat, beta = 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    if not beta > 0:
        raise CalibrationError(
            f"axis {axis!r}: collective time does not grow with message size over "
            f"{sorted({s.message for s in samples})} bytes, so its bandwidth cannot be fit; "
            "calibrate with larger sizes (CalibrateOptions(sizes=...))")
    fitted = fixed + lat * per + beta * x
    r2 = 1.0 - float(np.sum((t - fitted) ** 2) / np.sum((t - t.mean()) ** 2))
    return AxisFit(axis, n, float(lat), float(1.0 / beta), r2, tuple(samples),
                   tuple(float(r) for r in (t - fitted) / t), model)


def _device_memory(mesh: Mesh) -> tuple[float, str]:
    device = mesh.devices.flat[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), "the runtime's bytes_limit"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = len(jax.local_devices())
    return float(host) / local, f"host memory shared by {local} local devices"
