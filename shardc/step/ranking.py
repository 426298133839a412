"""Ranking the best candidate plans by their compiled programs (``rank_compiled``).

Under ``Cluster(overlap=True)`` the search ranks plans by an estimate of the step with its
collectives run beside compute (:func:`shardc.plan.overlap.ranking_time`): the plan's ops
in an order like the one XLA's latency-hiding scheduler emits. Where the compiler orders a
program otherwise, the estimate misranks it: XLA:GPU issues a data-parallel step's gradient
all-reduces mid-backward, one after another, where the estimate starts them at the end of
the compute (the wide ResNet on 8 H100s: data parallelism estimated at 2.668 ms, compiled
and replayed 2.246; the plan ranked first estimated lower and compiled to 2.709). The
compiled program says where each collective's operands are ready and where its result is
first read, so the best few candidates by each of two estimates (:func:`to_compile`:
every view's plan and every seed's, one per program) are compiled for the step's mesh and
the fastest compiled program is chosen: each priced as the bench prices it
(:func:`shardc.inspect.hlo.price`, overlapped: one compute stream in program order, one
communication stream) plus the plan's feed. A candidate that
does not compile is passed over (its error is kept in ``plan.solver``); nothing compiles
on an AbstractMesh, where the estimate alone ranks.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from jax.sharding import NamedSharding

from shardc.inspect.hlo import price
from shardc.inspect.verify import planned
from shardc.ir.sbp import device_pieces, to_partition_spec
from shardc.lower.program import jit_plan
from shardc.plan.overlap import chained_time, ranking_time
from shardc.plan.record import Plan
from shardc.report.explain import mesh_label
from shardc.step.signature import TracedCall

__all__ = ["UNTILED", "compile_lowered", "compiled_best", "compiled_program", "compiled_row",
           "compiled_time", "layout_key", "program_key", "to_compile"]

UNTILED = "Couldn't find output tile sizes"
"""XLA:GPU's error where its Triton GEMM emitter finds no tiling for a dot it was given
without autotuning (an ahead-of-time compile with no GPU: the ViT's 197-token dots,
``f32[788,768]``); on a GPU, autotuning would pick cuBLAS for it."""


def compile_lowered(lowered):
    """``lowered.compile()``; where XLA:GPU's Triton GEMM emitter finds no tiling
    (:data:`UNTILED`), compiled again with its dots on cuBLAS
    (``xla_gpu_enable_triton_gemm=False``): the same partitioning and collectives."""
    try:
        return lowered.compile()
    except Exception as exc:  # noqa: BLE001 - jax's runtime error type is private
        if UNTILED not in str(exc):
            raise
        return lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})


def compiled_program(step, tr: TracedCall, plan: Plan):
    """``(compiled, mesh)``: ``plan``'s program (of ``tr``'s traced program) compiled on the
    view of the step's devices the plan names."""
    mesh = step.mesh_for(plan)
    graph = tr.traced.graph
    n = len(graph.inputs)
    jitted = jit_plan(tr.traced, plan, mesh, mesh, jax.tree.structure((tuple(range(n)), {})),
                      tr.traced.out_tree)
    args = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, to_partition_spec(nd, v.ndim, mesh.axis_names)))
        for v, nd in zip(graph.inputs, plan.inputs, strict=True)]
    return compile_lowered(jitted.lower(*args)), mesh


def compiled_time(step, tr: TracedCall, plan: Plan) -> float:
    """Seconds of ``plan``'s compiled program (:func:`compiled_program`), priced on its
    cluster: overlapped where the cluster asks for overlap, else serial; the plan's feed
    added."""
    compiled, mesh = compiled_program(step, tr, plan)
    cost = price(compiled, mesh, plan.cluster)
    step_time = cost.overlapped_time if plan.cluster.overlap else cost.time
    return step_time + plan.predicted.feed_time  # the host-memory moves: in cost's times


def compiled_row(step, tr: TracedCall, plan: Plan) -> dict:
    """``{"compiled_s": ..., "compile_s": ...}`` for ``plan`` (:func:`compiled_time`), or
    ``{"error": ..., "compile_s": ...}`` where it does not compile (a candidate passed over)."""
    t0 = time.perf_counter()
    try:
        row = {"compiled_s": compiled_time(step, tr, plan)}
    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is passed over
        row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {**row, "compile_s": time.perf_counter() - t0}


def layout_key(plan: Plan) -> tuple:
    """What sets ``plan``'s program apart from another candidate's: the piece of every
    input, output and value each device holds (:func:`shardc.ir.sbp.device_pieces`), the
    settlings and the recomputed segments. Candidates on two views of the same devices
    whose devices hold the same pieces (data parallelism on ``gpu=8`` and on
    ``gpu2=2 x gpu4=4``) compile to one program: compiled once."""
    shape = plan.axis_sizes

    def pieces(layouts):
        return tuple(device_pieces(nd, shape) for nd in layouts)

    return (pieces(plan.inputs), pieces(plan.outputs),
            tuple(sorted(plan.values)), pieces(plan.values[v] for v in sorted(plan.values)),
            tuple(sorted(plan.settled)),
            pieces(plan.settled[v] for v in sorted(plan.settled)), plan.remat)


def program_key(plan: Plan) -> tuple:
    """What the step compiles for ``plan``: the pieces its devices hold
    (:func:`layout_key`) on its mesh, its pipeline, and the state it keeps in host
    memory."""
    return (layout_key(plan), plan.mesh_axes, plan.pipeline, plan.offloaded,
            plan.offloaded_outputs)


def to_compile(plans: list[Plan], count: int) -> list[Plan]:
    """Which of ``plans`` the compiled ranking compiles: the ``count`` best with distinct
    programs (:func:`layout_key`) by each of two estimates of the overlapped step, the
    first's first: :func:`ranking_time` (the mean of the two estimates of
    :func:`shardc.plan.overlap.plan_overlap`) and :func:`chained_time` (gradients reduced
    during the backward pass, as XLA:GPU chains them); of the others, the
    program best by the two ranks together (their sum); and of the rest, the program with
    the fewest collectives (ties: the better of its two estimates), the simple plan a
    practitioner runs by default (data parallelism where the parameters fit): on two nodes
    of 8 GPUs the wide ResNet's data parallelism is 21st by the first estimate (3.757 ms)
    and 8th by the second (2.968) and compiles fastest (2.966, against 3.120 for the
    fastest of the seven compiled without it). Neither estimate
    ranks every program as it compiles: on the wide ResNet over 8 GPUs the first puts data
    parallelism seventh of the distinct programs (2.658 ms estimated, 2.246 compiled), the
    second first; on two nodes the second puts first an HSDP plan that compiles 7% slower
    than the first's first, and under ring steps data parallelism is fourth by each (2.413
    ms compiled, the three each put first 2.994 to 3.319). Ties keep the search's order
    (its choice first)."""
    keys = [layout_key(p) for p in plans]
    times = [(ranking_time(p), chained_time(p)) for p in plans]  # each estimate once
    chosen: dict[tuple, int] = {}  # program -> the candidate compiled for it
    ranks: dict[tuple, list[int]] = {}  # program -> its rank by each estimate
    for e in range(2):
        ranked: dict[tuple, int] = {}
        for i in sorted(range(len(plans)), key=lambda i: times[i][e]):
            if keys[i] not in ranked:
                ranked[keys[i]] = len(ranked)
                if ranked[keys[i]] < count:
                    chosen.setdefault(keys[i], i)
        for key, rank in ranked.items():
            ranks.setdefault(key, []).append(rank)
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    rest = [k for k in ranks if k not in chosen]
    if rest:
        both = min(rest, key=lambda k: (sum(ranks[k]), first[k]))
        chosen[both] = first[both]
    fewest = {}  # program -> (its collectives, the better of its two estimates)
    for i, key in enumerate(keys):
        if key not in chosen:
            score = (sum(planned(plans[i])[0].values()), min(times[i]), first[key])
            fewest[key] = min(fewest.get(key, score), score)
    if fewest:
        simple = min(fewest, key=fewest.get)
        chosen[simple] = first[simple]
    return [plans[i] for i in chosen.values()]


def compiled_best(step, tr: TracedCall, plans: list[Plan], count: int) -> Plan:
    """Of ``plans`` (the search's candidates, the first its choice), those
    :func:`to_compile` names compiled, and the one whose compiled program is fastest
    (:func:`compiled_time`); ``plan.solver["compiled_ranking"]`` lists each candidate's
    estimates and compiled time (or error), in the order compiled, the one kept marked."""
    compiled = to_compile(plans, count)
    rows, best, best_s = [], plans[0], None
    for p in compiled:
        row = {"mesh": mesh_label(p.mesh_axes),
               "seed": p.solver.get("seed"), "estimated_s": ranking_time(p),
               "chained_s": chained_time(p), **compiled_row(step, tr, p)}
        rows.append(row)
        if "compiled_s" in row and (best_s is None or row["compiled_s"] < best_s):
            best, best_s = p, row["compiled_s"]
    for row, p in zip(rows, compiled, strict=True):
        row["kept"] = p is best
    return dataclasses.replace(best, solver={**best.solver, "compiled_ranking": rows})
