"""``shardc bench``: shardc against the experts, on the cost of what XLA compiled.

Per cell (model x preset x method): planning time, predicted step time (shardc), the
compiled program priced on the same cluster model (collectives from the HLO, FLOPs from
``cost_analysis``), wire bytes, collective counts, per-device peak memory, and whether one
step of the model's tiny config matched the unsharded step.

Compilers (:data:`COMPILERS`): by default every cell is compiled by XLA:CPU on simulated CPU
devices. ``compiler="gpu"`` plans and compiles on H100s this machine does not have
(:func:`shardc.bench.deviceless.gpu_devices`, the preset's ``hosts``): XLA:GPU's program,
with its combiners and latency-hiding schedule. It reports no ``cost_analysis``, so its
compute is the FLOPs the overlap replay weighs (:func:`shardc.inspect.hlo.program_flops`);
the numerics check, which runs the program, stays on the CPU devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from shardc.bench import COMPILERS
from shardc.bench.experts import (
    Expert,
    Traits,
    batch_specs,
    compile_expert,
    preset_experts,
    state_specs,
)
from shardc.bench.numerics import step_close
from shardc.bench.zoo import PRESETS, ZOO, Preset, ZooModel
from shardc.errors import BenchError, OptionsError
from shardc.inspect.hlo import price_all
from shardc.plan.record import Plan
from shardc.report.explain import mesh_label
from shardc.solve.beside import beside, cores
from shardc.step.auto_shard import auto_shard
from shardc.step.ranking import compile_lowered
from shardc.tradeoff.views import views

__all__ = ["BESIDE", "Cell", "cells", "expert_seeds", "experts",
           "feed_seconds", "GPU_TIMING_RUNS", "jit_seconds", "make_mesh", "MEMORY_MARGIN",
           "PLANNED", "planned_and_compiled", "planned_for", "planning_budget", "PRICINGS",
           "QUICK_METHODS", "run_cells",
           "run_cell", "run_expert", "run_shardc", "shardc_method", "TIMING_RUNS", "traits"]

MEMORY_MARGIN = 0.2
"""shardc's budget on a memory-bound model is the device memory less this fraction: room for
the error of its predicted peak against the compiled one. The zoo's worst under-prediction
is -14.9% (vit on 2nodes-2x8, docs/benchmarks/cpu-compiled/results.md; llama-1b's cells: +8.9% and
-9.0%), so a plan predicted within 0.8 of the device memory compiles within 0.94 of it."""
TIMING_RUNS = 5
"""Saved-plan and ``jax.jit`` compile timings are each the fastest of this many runs,
interleaved, which goes first alternating: on a shared machine one compile of the same
program varies by a fifth, and with three runs one or two of the twelve cells, a different
one each time, came out a fifth slower than ``jax.jit`` from that noise alone."""
GPU_TIMING_RUNS = 1
"""Saved-plan and ``jax.jit`` compile timings under XLA:GPU: one run each (its compiles take
several times XLA:CPU's: the GPT bench model's FSDP step 28 s; :mod:`shardc.bench.deviceless`)."""
PRICINGS = ("nccl", "ring", "alpha-beta")
"""Every cell's compiled program is priced with each collective model
(:mod:`shardc.cost.collectives`): NCCL's (the presets' default), ring/Simple paying every
step's latency (pessimistic) and one latency per collective (optimistic); shardc also
plans for each, serially and overlapped (:data:`PLANNED`)."""
PLANNED = {"shardc": ("nccl", True), "shardc+serial": ("nccl", False), **{
    f"shardc@{model}{'+overlap' if overlap else ''}": (model, overlap)
    for overlap in (False, True) for model in PRICINGS if model != "nccl"}}
"""shardc's methods: the pricing each plans for, (collective model, overlap). ``shardc`` is
the default plan (the presets' own pricing: NCCL's model, overlapped, as the GPU presets
plan by default); ``shardc+serial`` plans for NCCL's model with communication serial;
``shardc@ring``, ``shardc@alpha-beta`` plan with the other collective models, serially, and
``+overlap`` with ``Cluster(overlap=True)``."""
QUICK_METHODS = ("shardc", "shardc+serial")
"""shardc's methods in the quick matrix (``shardc bench --quick``, a smoke test): the default
plan and the serial one against every expert; the plans made for the other pricings
(:data:`PLANNED`) are the full matrix's."""


@dataclass
class Cell:
    model: str
    preset: str
    method: str
    plan_s: float | None = None
    predicted_s: float | None = None
    predicted_comm_s: float | None = None
    predicted_peak: float | None = None  # shardc: the plan's predicted peak bytes per device
    compiled_s: float | None = None
    compiled_comm_s: float | None = None
    compiled_compute_s: float | None = None
    compiled_feed_s: float | None = None
    #: compiled step with each collective beside the compute that does not wait for it
    #: (``CompiledCost.overlapped_time``) plus the feed; None in results made before it
    compiled_overlap_s: float | None = None
    wire_bytes: float | None = None
    collectives: dict = field(default_factory=dict)
    peak_memory: float | None = None  # compiled: memory_analysis() bytes per device
    matched: bool | None = None
    error: str | None = None
    seeds: dict = field(default_factory=dict)  # shardc: the experts' plans it started from
    mesh: str | None = None  # the view it ran on (shardc: the one its mesh search chose)
    unplanned_comm_s: float | None = None  # shardc: compiled time of collective kinds not planned
    saved_plan_s: float | None = None  # shardc: use_plan of the saved plan + lower + compile
    jit_s: float | None = None  # shardc: trace + jax.jit lower + compile with its shardings
    budget: float | None = None  # memory-bound cells: the device memory to fit (zoo doc)
    #: collective model -> [serial, overlapped] compiled step (feed included) with the
    #: preset's cluster pricing collectives that way (:data:`PRICINGS`); {} in older results
    priced: dict = field(default_factory=dict)
    #: shardc: collectives per kind the plan predicts (combined ones once), against
    #: ``collectives`` compiled (:meth:`shardc.inspect.verify.Verification.counts_match`)
    planned_counts: dict = field(default_factory=dict)
    compiler: str = "cpu"  # the XLA backend that compiled it (:data:`COMPILERS`)

    @property
    def fits(self) -> bool | None:
        """Whether the compiled peak is within the device memory (None: no bound, or not
        compiled)."""
        if self.budget is None or self.peak_memory is None:
            return None
        return self.peak_memory <= self.budget

    def to_json(self) -> dict:
        return asdict(self)


def make_mesh(preset: Preset, compiler: str = "cpu"):
    """The preset's mesh on the devices ``compiler`` compiles for: the simulated CPU
    devices, or H100s in ``preset.hosts`` hosts for XLA:GPU's ahead-of-time compile."""
    n = preset.devices
    if compiler == "gpu":
        return jax.make_mesh(preset.mesh_shape, preset.axis_names,
                             axis_types=(AxisType.Auto,) * len(preset.mesh_shape),
                             devices=_gpus(preset.hosts, n // preset.hosts))
    if compiler != "cpu":
        raise OptionsError(f"compiler {compiler!r}: choose one of {COMPILERS}")
    if len(jax.devices()) < n:
        raise BenchError(f"preset {preset.name} needs {n} devices, JAX sees "
                         f"{len(jax.devices())}; run `shardc bench` (it simulates 16)")
    return jax.make_mesh(preset.mesh_shape, preset.axis_names,
                         axis_types=(AxisType.Auto,) * len(preset.mesh_shape),
                         devices=jax.devices()[:n])


@functools.cache
def _gpus(hosts: int, per_host: int) -> list:
    from shardc.bench.deviceless import gpu_devices

    return gpu_devices(hosts, per_host)


def _close(a, b, lr: float = 0.0) -> bool:
    """Whether one step's results ``a`` equal the unsharded ``b`` (:mod:`shardc.bench.
    numerics`: Adam's updates held to their own sensitivity)."""
    return step_close(a, b, lr)


def _tiny_lr(zm: ZooModel) -> float:
    return float(getattr(zm.config("tiny"), "learning_rate", 0.0))


@functools.cache
def _tiny(name: str) -> tuple:
    """A model's tiny train step, its arguments, and its unsharded result (what every
    method's numerics check compares with: computed once per model, not per cell)."""
    zm = ZOO[name]
    fn, args = zm.load().make_train_step(zm.config("tiny"))
    return fn, args, jax.jit(fn)(*args)


def feed_seconds(compiled, batch, cluster) -> float:
    """Host-to-device time of the batch (the step's second argument) under the compiled
    program's input shardings: each device receives its shard over ``host_bandwidth``. The
    same term shardc's cost model charges, so a plan that splits the batch and gathers it
    on device is compared with one that feeds it replicated on equal terms."""
    return _feed(jax.tree.leaves(compiled.input_shardings[0][1]), batch, cluster)


def _feed(shardings, batch, cluster) -> float:
    """Seconds to feed each device its shard of ``batch`` under ``shardings`` (flat)."""
    per_device = sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for sh, x in zip(shardings, jax.tree.leaves(batch), strict=True))
    return per_device / cluster.host_bandwidth


def _fill_compiled(cell: Cell, compiled, mesh, cluster, batch) -> None:
    models = [cluster.collective_model, *(m for m in PRICINGS if m != cluster.collective_model)]
    costs = price_all(compiled, mesh, [dataclasses.replace(cluster, collective_model=m)
                                       for m in models])
    feed = feed_seconds(compiled, batch, cluster)
    for model, other in zip(models, costs):
        cell.priced[model] = [other.time + feed, other.overlapped_time + feed]
    cost = costs[0]
    cell.compiled_comm_s = cost.comm_time
    cell.compiled_compute_s = cost.compute_time
    cell.compiled_feed_s = feed
    cell.compiled_s = cost.comm_time + cost.compute_time + cost.host_time + feed
    cell.compiled_overlap_s = cost.overlapped_time + feed
    cell.wire_bytes = cost.wire_bytes
    cell.collectives = dict(cost.counts)
    cell.peak_memory = cost.peak_memory


def planned_for(method: str) -> tuple[str, bool] | None:
    """The pricing a shardc method plans for, (collective model, overlap) (:data:`PLANNED`),
    None for an expert."""
    return PLANNED.get(method)


def shardc_method(model: str, overlap: bool) -> str:
    """The shardc method planned for collective model ``model``, overlapped or not."""
    return next(m for m, p in PLANNED.items() if p == (model, overlap))


def _plan_cell(zm: ZooModel, preset: Preset, cfg, time_limit: float, mesh_search: bool,
               method: str = "shardc", compiler: str = "cpu"):
    """shardc's plan of ``zm`` at ``cfg`` on ``preset``'s devices for ``compiler``, seeded
    with the experts: the cell with its planning figures, the step, the plan, its view of
    the devices and the (abstract) arguments. A method planned for another pricing
    (:data:`PLANNED`) plans with the preset's cluster pricing that way; any other label
    (``planned_and_compiled``'s variants) plans with the preset's own pricing."""
    cell = Cell(zm.name, preset.name, method, compiler=compiler)
    mod, mesh = zm.load(), make_mesh(preset, compiler)
    args = mod.abstract_args(cfg)
    cluster = preset.cluster
    model, overlap = planned_for(method) or (cluster.collective_model, cluster.overlap)
    if (model, overlap) != (cluster.collective_model, cluster.overlap):
        cluster = dataclasses.replace(cluster, collective_model=model, overlap=overlap)
    step = auto_shard(mod.build_step(cfg), mesh=mesh, cluster=cluster,
                      time_limit=time_limit, mesh_search=mesh_search,
                      memory_budget=planning_budget(zm),
                      seeds=expert_seeds(zm, mesh, preset, args, mesh_search))
    t0 = time.perf_counter()
    plan = step.plan(*args)
    cell.plan_s = time.perf_counter() - t0
    cell.predicted_s = plan.predicted.step_time
    cell.predicted_comm_s = plan.predicted.comm_time
    cell.predicted_peak = plan.predicted.peak_memory
    cell.seeds = dict(plan.solver.get("seeds", {}))
    cell.mesh = mesh_label(plan.mesh_axes)
    return cell, step, plan, step.mesh_for(plan), args


def planning_budget(zm: ZooModel) -> float | None:
    """The budget shardc plans a memory-bound model under: its device memory less
    :data:`MEMORY_MARGIN` (none for the other models)."""
    return None if zm.device_memory is None else zm.device_memory * (1 - MEMORY_MARGIN)


def planned_and_compiled(zm: ZooModel, preset: Preset, cfg, time_limit: float,
                         method: str, mesh_search: bool = True, compiler: str = "cpu") -> Cell:
    """shardc's plan of ``zm`` at ``cfg`` (a variant of the bench's configuration), compiled
    and priced like a bench cell (no numerics, no saved-plan timing); ``method`` labels it."""
    cell, step, plan, view, args = _plan_cell(zm, preset, cfg, time_limit, mesh_search, method,
                                              compiler)
    compiled = compile_lowered(step.lower(*args))
    _fill_compiled(cell, compiled, view, plan.cluster, args[1])
    cell.planned_counts = _planned_counts(plan, compiled, view)
    return cell


def _planned_counts(plan: Plan, compiled, mesh) -> dict:
    return {r.kind: r.planned_count for r in plan.verify(compiled, mesh).rows
            if r.planned_count}


def run_shardc(zm: ZooModel, preset: Preset, which: str, check: bool,
               time_limit: float, mesh_search: bool = True, compiler: str = "cpu") -> Cell:
    mod, mesh = zm.load(), make_mesh(preset, compiler)
    cfg = zm.config(which, preset.devices)
    cell, _, plan, view, args = _plan_cell(zm, preset, cfg, time_limit, mesh_search,
                                           compiler=compiler)
    # what runs is compiled from the saved plan, timed against jax.jit of the same program
    text = plan.to_json()
    saved, jitted = [], []

    def from_saved():
        fn = mod.build_step(cfg)
        t0 = time.perf_counter()
        again = auto_shard(fn, mesh=mesh, cluster=preset.cluster, mesh_search=mesh_search)
        again.use_plan(Plan.from_json(text), *args)
        compiled = compile_lowered(again.lower(*args))
        saved.append(time.perf_counter() - t0)
        return compiled

    # the quick matrix is a smoke test (and tiny configs a test's): one timing of the saved
    # plan against jax.jit
    runs = 1 if which != "bench" else TIMING_RUNS if compiler == "cpu" else GPU_TIMING_RUNS
    for k in range(runs):  # the saved plan first in even runs, jax.jit in odd ones
        if k % 2:
            jitted.append(jit_seconds(mod.build_step(cfg), args, plan, view))
        compiled = from_saved()
        if not k % 2:
            jitted.append(jit_seconds(mod.build_step(cfg), args, plan, view))
    cell.saved_plan_s, cell.jit_s = min(saved), min(jitted)
    _fill_compiled(cell, compiled, view, plan.cluster, args[1])
    cell.unplanned_comm_s = sum(r.compiled_time for r in plan.verify(compiled, view).unplanned)
    cell.planned_counts = _planned_counts(plan, compiled, view)
    if check:  # runs the program: on the CPU devices whatever the compiler
        tiny_fn, (state, batch), want = _tiny(zm.name)
        cpu = make_mesh(preset)
        tiny = auto_shard(tiny_fn, mesh=cpu, cluster=preset.cluster, time_limit=time_limit,
                          seeds=expert_seeds(zm, cpu, preset, (state, batch),
                                             mesh_search),
                          mesh_search=mesh_search)
        cell.matched = _close(tiny(state, batch), want, _tiny_lr(zm))
    return cell


def jit_seconds(fn, args, plan: Plan, mesh) -> float:
    """Wall time of tracing ``fn`` once and ``jax.jit``-compiling it with ``plan``'s input
    and output shardings: what running a saved plan is measured against (shardc traces
    once more, to check the plan fits the program)."""
    tree = jax.tree.structure(args)

    def flat(*leaves):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, leaves)))

    t0 = time.perf_counter()
    jax.make_jaxpr(fn)(*args)
    jitted = jax.jit(flat, in_shardings=[NamedSharding(mesh, p) for p in plan.input_specs()],
                     out_shardings=[NamedSharding(mesh, p) for p in plan.output_specs()])
    compile_lowered(jitted.lower(*jax.tree.leaves(args)))
    return time.perf_counter() - t0


def expert_seeds(zm: ZooModel, mesh, preset: Preset, args, mesh_search: bool) -> dict:
    """The in_shardings of every expert, each on its own view of the preset's devices, to
    seed shardc with (a seed seeds the view whose axes it names; without the mesh search,
    those on the preset's own mesh): on every mesh planned, shardc's plan then costs no more
    than the experts written on it, in shardc's own cost model."""
    state, batch = args
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    param_axes = zm.load().param_axes
    planned = {v.names for v in views(shape, names, preset.cluster)} if mesh_search \
        else {names}  # the mesh search plans no 3-D view (shardc.tradeoff.views)
    out = {}
    for e in preset_experts(shape, names, preset.cluster, traits(zm)):
        if e.view.names not in planned:
            continue
        view_mesh = e.mesh(mesh)
        out[e.name] = (state_specs(state, view_mesh, e, param_axes),
                       batch_specs(batch, view_mesh, e))
    return out


#: expert cells run at once at most (:func:`run_cells`): measured on two cores; each holds
#: its compile's memory (several GiB for the 1B Llama's), so more cores do not mean more
BESIDE = 2
#: held while an expert's cell traces and lowers its programs: expert cells run beside each
#: other (:func:`run_cells`) overlap their XLA compiles, which let go of the GIL, not their
#: tracing
_LOWERING = threading.Lock()


def run_expert(zm: ZooModel, preset: Preset, expert: Expert, which: str, check: bool,
               compiler: str = "cpu") -> Cell:
    cell = Cell(zm.name, preset.name, expert.name, compiler=compiler)
    if expert.offload and compiler != "cpu":
        raise BenchError(f"{expert.name}: XLA:GPU's ahead-of-time compile for devices this "
                         "machine lacks has no host memory (pinned_host compiles as device "
                         "memory); run offloading cells with --compiler cpu")
    cell.mesh = expert.view.label
    with _LOWERING:
        mod, mesh = zm.load(), make_mesh(preset, compiler)
        cfg = zm.config(which, preset.devices)
        args = mod.abstract_args(cfg)
        _, lowered = compile_expert(mod.build_step(cfg), *args, mesh, expert, mod.param_axes)
    _fill_compiled(cell, compile_lowered(lowered), expert.mesh(mesh),
                   expert.view.cluster, args[1])
    if check:  # on the CPU devices, as run_shardc's
        with _LOWERING:
            tiny_fn, (state, batch), want = _tiny(zm.name)
            _, low = compile_expert(tiny_fn, state, batch, make_mesh(preset), expert,
                                    mod.param_axes)
        compiled = low.compile()  # placed as it wants them (offloaded state on the host)
        args = jax.device_put((state, batch), compiled.input_shardings[0])
        cell.matched = _close(compiled(*args), want, _tiny_lr(zm))
    return cell


def cells(models: list[str], presets: list[str] | None,
          methods: list[str] | None = None) -> list[tuple[ZooModel, Preset, str]]:
    """The (model, preset, method) cells to run, each model on ``presets`` (None: its own,
    ``ZooModel.presets``); ``methods`` filters by name ("experts": every method but
    shardc)."""
    out = []
    for m in models:
        zm = ZOO[m]
        for p in presets or zm.presets:
            pre = PRESETS[p]
            out += [(zm, pre, m) for m in PLANNED]
            for e in experts(zm, pre):
                out.append((zm, pre, e.name))
    if methods is not None:
        out = [c for c in out if c[2] in methods
               or ("experts" in methods and planned_for(c[2]) is None)]
    return out


def experts(zm: ZooModel, preset: Preset) -> list[Expert]:
    """The experts of a cell: every form on every logical view of the preset's devices."""
    return preset_experts(preset.mesh_shape, preset.axis_names, preset.cluster, traits(zm))


def traits(zm: ZooModel) -> Traits:
    """What ``zm`` has that some expert forms need: experts (the zoo's flag), a vocabulary
    table, a token sequence and a layer stack, ending in its loss or not (its config's
    ``vocab``, ``seq_len``, ``stack_layers`` and ``loss_in_stack``)."""
    cfg = zm.config("tiny")
    return Traits(moe=zm.moe, vocab=hasattr(cfg, "vocab"), seq=hasattr(cfg, "seq_len"),
                  stack=getattr(cfg, "stack_layers", False),
                  loss=getattr(cfg, "loss_in_stack", False), offload=zm.offload,
                  long=zm.long)


def run_cells(todo: Sequence[tuple[ZooModel, Preset, str]],
              cell_of: Callable[[ZooModel, Preset, str], Cell]
              ) -> Iterator[tuple[tuple[ZooModel, Preset, str], Cell]]:
    """Each of ``todo``'s cells (``cell_of`` runs one, :func:`run_cell`), in order. Expert
    cells next to each other run beside each other, one per core and :data:`BESIDE` at most
    (their compiles overlap; nothing in them is timed); a shardc cell runs alone, as its
    saved-plan timing needs."""
    width = max(1, min(BESIDE, cores()))
    k = 0
    while k < len(todo):
        n = 1
        while (n < width and k + n < len(todo) and planned_for(todo[k][2]) is None
               and planned_for(todo[k + n][2]) is None):
            n += 1
        group = todo[k:k + n]
        yield from zip(group, beside([functools.partial(cell_of, *item) for item in group]))
        k += n


def run_cell(zm: ZooModel, preset: Preset, method: str, which: str, check: bool,
             time_limit: float, mesh_search: bool = True, compiler: str = "cpu") -> Cell:
    try:
        if planned_for(method) is not None and (zm.device_memory is not None
                                                or method != "shardc"):
            # memory-bound (zoo doc), or planned for another pricing: the compiled plan's
            # time and peak only (the default plan's cell checks the rest). Its numerics
            # check would run the tiny config of a model without a bound (a test holds them
            # equal), checked in that model's cells, and the saved-plan timing is the other
            # cells' figure: each is more compiles of a 1B program that tell nothing new
            cell = planned_and_compiled(zm, preset, zm.config(which, preset.devices),
                                        time_limit, method, mesh_search, compiler)
        elif method == "shardc":
            cell = run_shardc(zm, preset, which, check, time_limit, mesh_search, compiler)
        else:
            expert = next(e for e in experts(zm, preset) if e.name == method)
            cell = run_expert(zm, preset, expert, which,  # as above: checked elsewhere
                              check and zm.device_memory is None, compiler)
    except Exception as exc:  # noqa: BLE001 - a failing cell is reported, not fatal
        cell = Cell(zm.name, preset.name, method, compiler=compiler,
                    error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300] + "\n" +
                    traceback.format_exc(limit=3)[-600:])
    cell.budget = zm.device_memory
    return cell
