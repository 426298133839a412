"""shardc.inspect.schedule: the compiled program priced with communication overlapped.

Real programs are compiled on the 8 simulated CPU devices of ``conftest.py`` (synchronous
collectives); GPU's ``-start`` / ``-done`` pairs and library matmuls are checked on literal
HLO. Every collective time comes from ``collective_seconds``, whatever its formula.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.cost.cluster import Cluster
from shardc.inspect import collectives, price
from shardc.inspect.hlo import collective_seconds
from shardc.inspect.schedule import schedule

LAYERS, WIDTH, BATCH = 3, 256, 256
REL = 1e-9


@pytest.fixture(scope="module")
def mesh8() -> Mesh:
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def mesh2x4() -> Mesh:
    return jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _forward(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return h


def _scanned(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def _train(forward):
    def step(ws, x):
        g = jax.grad(lambda ws, x: jnp.mean(forward(ws, x) ** 2))(ws, x)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, ws, g)
    return step


def _fsdp(mesh: Mesh, fn, ws, spec_w: P, spec_x: P):
    """``fn(ws, x)`` jitted with every weight stored as ``spec_w`` and the batch as
    ``spec_x`` (FSDP: both split on the same axis, weights gathered per layer)."""
    x = jnp.ones((BATCH, WIDTH), jnp.float32)
    w_sh = jax.tree.map(lambda _: NamedSharding(mesh, spec_w), ws)
    return jax.jit(fn, in_shardings=(w_sh, NamedSharding(mesh, spec_x))).lower(ws, x).compile()


def _layers():
    return [jnp.ones((WIDTH, WIDTH), jnp.float32) for _ in range(LAYERS)]


def _overlap(compiled, mesh, cluster):
    """price() of ``compiled`` and the schedule behind its overlapped time."""
    cost = price(compiled, mesh, cluster)
    text = compiled.as_text()
    found = collectives(text, mesh)
    seconds = [collective_seconds(c, mesh, cluster) for c in found]
    return cost, schedule(text, found, seconds, cost.compute_time)


SLOW_NODE = Cluster(axis_bandwidth={"node": 50e9}, axis_latency={"node": 9.6e-6})


def _programs(mesh8, mesh2x4):
    stacked = jnp.ones((LAYERS, WIDTH, WIDTH), jnp.float32)
    return {
        "fsdp step": (_fsdp(mesh8, _train(_forward), _layers(), P("x", None), P("x", None)),
                      mesh8),
        "scanned fsdp step": (_fsdp(mesh8, _train(_scanned), stacked, P(None, "x", None),
                                    P("x", None)), mesh8),
        "dp x tp step": (_fsdp(mesh2x4, _train(_forward), _layers(), P(None, "gpu"),
                               P("node", None)), mesh2x4),
    }


@pytest.mark.parametrize("flops", [494e12, 1e11, 1e9])
def test_overlapped_lies_between_the_longer_stream_and_the_serial_sum(mesh8, mesh2x4, flops):
    cluster = Cluster(axis_bandwidth=SLOW_NODE.axis_bandwidth,
                      axis_latency=SLOW_NODE.axis_latency, device_flops=flops)
    for name, (compiled, mesh) in _programs(mesh8, mesh2x4).items():
        cost, ov = _overlap(compiled, mesh, cluster)
        assert cost.comm_time > 0 and cost.compute_time > 0, name
        # the schedule carries the serial pricing's compute and collectives, run by run
        assert ov.compute == cost.compute_time and ov.time == cost.overlapped_time, name
        assert ov.comm == pytest.approx(cost.comm_time, rel=REL), name
        longer = max(cost.comm_time, cost.compute_time)
        assert longer * (1 - REL) <= cost.overlapped_time <= cost.time * (1 + REL), name
        assert ov.exposed == pytest.approx(cost.overlapped_time - cost.compute_time)


def test_a_chain_of_collectives_each_feeding_the_next_matmul_hides_nothing(mesh8):
    """Every all-reduce reads the matmul before it and the next matmul reads it: no
    collective has compute beside it, so overlapped == serial."""
    def chain(x, ws):
        h = x
        for w in ws:
            h = jax.lax.psum(jnp.tanh(h) @ w, "x")
        return h

    fn = jax.shard_map(chain, mesh=mesh8, in_specs=(P(), P()), out_specs=P())
    x = jnp.ones((64, WIDTH), jnp.float32)
    compiled = jax.jit(fn).lower(x, _layers()).compile()
    for flops in (494e12, 1e9):
        cost = price(compiled, mesh8, Cluster(device_flops=flops))
        assert cost.counts == {"all-reduce": LAYERS}
        assert cost.overlapped_time == pytest.approx(cost.time, rel=REL)


@pytest.mark.parametrize("ratio", [2.0, 0.5])
def test_fsdp_gathers_run_ahead_of_the_layers(mesh8, ratio):
    """Forward of 3 FSDP layers: the 3 weight gathers read parameters only, so they run
    back to back from the start while the layers compute. Each layer computes ``d``, each
    gather takes ``g``; by hand, layer k starts at ``max((k+1) g, g + k d)``:
    ``d = 2g``: g + 3d (one gather exposed, two hidden);
    ``d = g/2``: 3g + d (the last layer waits for the last gather)."""
    compiled = _fsdp(mesh8, _forward, _layers(), P("x", None), P("x", None))
    found = collectives(compiled, mesh8)
    assert [c.kind for c in found] == ["all-gather"] * LAYERS
    g = collective_seconds(found[0], mesh8, Cluster())
    assert g > 0
    flops = price(compiled, mesh8, Cluster()).flops
    # the device speed at which one layer computes ratio * g (gathers do not depend on it)
    cluster = Cluster(device_flops=flops / (Cluster().utilization * LAYERS * ratio * g))
    cost = price(compiled, mesh8, cluster)
    d = cost.compute_time / LAYERS
    assert d == pytest.approx(ratio * g) and cost.comm_time == pytest.approx(LAYERS * g)
    want = g + LAYERS * d if d >= g else LAYERS * g + d
    assert cost.overlapped_time == pytest.approx(want, rel=1e-6)
    assert cost.overlapped_time < cost.time
    hidden = cost.time - cost.overlapped_time
    assert hidden == pytest.approx((LAYERS - 1) * (g if d >= g else d), rel=1e-6)


def test_scan_iterations_are_sync_points(mesh8):
    """The scanned forward's gather of layer k+1 cannot run during layer k (a loop
    iteration starts when the previous one's compute ends): nothing hides but the loop
    counter's increment (1 FLOP of a layer's millions), unlike the unrolled layers, where
    two of the three gathers hide (each layer computing ``d = 2g``)."""
    stacked = jnp.ones((LAYERS, WIDTH, WIDTH), jnp.float32)
    scanned = _fsdp(mesh8, _scanned, stacked, P(None, "x", None), P("x", None))
    unrolled = _fsdp(mesh8, _forward, _layers(), P("x", None), P("x", None))
    g = collective_seconds(collectives(unrolled, mesh8)[0], mesh8, Cluster())
    flops = price(unrolled, mesh8, Cluster()).flops
    cluster = Cluster(device_flops=flops / (Cluster().utilization * LAYERS * 2 * g))
    cost = price(scanned, mesh8, cluster)
    assert cost.runs == (LAYERS,)
    assert cost.comm_time == pytest.approx(LAYERS * g)
    assert cost.compute_time == pytest.approx(LAYERS * 2 * g, rel=1e-2)  # + loop counters
    assert cost.overlapped_time == pytest.approx(cost.time, rel=1e-5)
    ahead = price(unrolled, mesh8, cluster)
    assert ahead.time - ahead.overlapped_time == pytest.approx((LAYERS - 1) * g, rel=1e-5)


GPU_FSDP = """\
HloModule gpu_fsdp, is_scheduled=true, num_partitions=8

ENTRY %main (x: f32[64,256], w0: f32[32,256], w1: f32[32,256]) -> f32[64,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %w0 = f32[32,256]{1,0} parameter(1)
  %w1 = f32[32,256]{1,0} parameter(2)
  %ag0 = (f32[32,256]{1,0}, f32[256,256]{1,0}) all-gather-start(f32[32,256]{1,0} %w0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag1 = (f32[32,256]{1,0}, f32[256,256]{1,0}) all-gather-start(f32[32,256]{1,0} %w1), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %w0.full = f32[256,256]{1,0} all-gather-done((f32[32,256]{1,0}, f32[256,256]{1,0}) %ag0)
  %w1.full = f32[256,256]{1,0} all-gather-done((f32[32,256]{1,0}, f32[256,256]{1,0}) %ag1)
  %h0 = f32[64,256]{1,0} dot(f32[64,256]{1,0} %x, f32[256,256]{1,0} %w0.full), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(f32[64,256]{1,0} %h0, f32[256,256]{1,0} %w1.full), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %h1 = f32[64,256]{1,0} get-tuple-element((f32[64,256]{1,0}, s8[1024]{0}) %gemm), index=0
}
"""  # noqa: E501


def test_gpu_async_pairs_are_awaited_at_first_use(mesh8):
    """Two gathers started up front, both ``-done`` printed before the first matmul: the
    first matmul waits for its own gather only (first use, not the ``-done``'s place), the
    second (a cuBLAS custom-call, 2 * 64 * 256 * 256 FLOPs like the dot) for the other. With
    each matmul ``d = 2g``: g + 2d, against 2g + 2d serially."""
    found = collectives(GPU_FSDP, mesh8)
    assert [(c.kind, c.name, c.group_size) for c in found] == \
        [("all-gather", "ag0", 8), ("all-gather", "ag1", 8)]
    g = collective_seconds(found[0], mesh8, Cluster())
    d = 2 * g
    ov = schedule(GPU_FSDP, found, [g, g], 2 * d)
    assert ov.time == pytest.approx(g + 2 * d)
    assert (ov.comm, ov.exposed, ov.hidden) == pytest.approx((2 * g, g, g))
    # the matmuls are weighed by their FLOPs: a compute time split 1:1 between them
    slow = schedule(GPU_FSDP, found, [4 * g, 4 * g], 2 * d)
    assert slow.time == pytest.approx(8 * g + d)  # the second matmul waits for gather 2


CPU_ORDER = """\
HloModule cpu_order, is_scheduled=true, num_partitions=8

ENTRY %main (x: f32[64,256], late: f32[32,256], soon: f32[32,256]) -> f32[64,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %late = f32[32,256]{1,0} parameter(1)
  %soon = f32[32,256]{1,0} parameter(2)
  %ag.late = f32[256,256]{1,0} all-gather(f32[32,256]{1,0} %late), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag.soon = f32[256,256]{1,0} all-gather(f32[32,256]{1,0} %soon), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %view = f32[256,256]{0,1} copy(f32[256,256]{1,0} %ag.soon)
  %h0 = f32[64,256]{1,0} dot(f32[64,256]{1,0} %x, f32[256,256]{0,1} %view), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %h1 = f32[64,256]{1,0} dot(f32[64,256]{1,0} %h0, f32[256,256]{1,0} %ag.late), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501


def test_the_communication_stream_runs_first_what_is_needed_first(mesh8):
    """XLA:CPU printed the gather used last first. A latency-hiding scheduler issues the
    one the first matmul needs (through a free copy) first: ``g + d + d`` with the other
    gather (``g``) behind the first matmul (``d = 2g``), where text order would expose both
    (``2g + 2d``)."""
    found = collectives(CPU_ORDER, mesh8)
    assert [c.name for c in found] == ["ag.late", "ag.soon"]
    g = collective_seconds(found[0], mesh8, Cluster())
    ov = schedule(CPU_ORDER, found, [g, g], 4 * g)
    assert ov.time == pytest.approx(5 * g) and ov.hidden == pytest.approx(g)


PIPELINED = """\
HloModule pipelined, is_scheduled=true, num_partitions=8

%body (param: (s32[], f32[64,256], f32[256,256], f32[4,32,256])) -> (s32[], f32[64,256], f32[256,256], f32[4,32,256]) {
  %param = (s32[], f32[64,256]{1,0}, f32[256,256]{1,0}, f32[4,32,256]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %h = f32[64,256]{1,0} get-tuple-element(%param), index=1
  %w = f32[256,256]{1,0} get-tuple-element(%param), index=2
  %ws = f32[4,32,256]{2,1,0} get-tuple-element(%param), index=3
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %zero = s32[] constant(0)
  %slice = f32[1,32,256]{2,1,0} dynamic-slice(%ws, %next, %zero, %zero), dynamic_slice_sizes={1,32,256}
  %shard = f32[32,256]{1,0} bitcast(%slice)
  %ag = f32[256,256]{1,0} all-gather(%shard), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %h2 = f32[64,256]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (s32[], f32[64,256]{1,0}, f32[256,256]{1,0}, f32[4,32,256]{2,1,0}) tuple(%next, %h2, %ag, %ws)
}

%cond (param.1: (s32[], f32[64,256], f32[256,256], f32[4,32,256])) -> pred[] {
  %param.1 = (s32[], f32[64,256]{1,0}, f32[256,256]{1,0}, f32[4,32,256]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (x: f32[64,256], ws: f32[4,32,256]) -> f32[64,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %ws.0 = f32[4,32,256]{2,1,0} parameter(1)
  %first = f32[1,32,256]{2,1,0} slice(%ws.0), slice={[0:1], [0:32], [0:256]}
  %shard.0 = f32[32,256]{1,0} bitcast(%first)
  %ag.0 = f32[256,256]{1,0} all-gather(%shard.0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %start = s32[] constant(0)
  %init = (s32[], f32[64,256]{1,0}, f32[256,256]{1,0}, f32[4,32,256]{2,1,0}) tuple(%start, %x, %ag.0, %ws.0)
  %loop = (s32[], f32[64,256]{1,0}, f32[256,256]{1,0}, f32[4,32,256]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %result = f32[64,256]{1,0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


def test_a_loop_carrying_the_next_layers_gather_overlaps_it_with_this_layer():
    """The collective pipeliner's form: each iteration gathers the next layer's weight
    and carries it to the next iteration through the loop state. Replayed iteration by
    iteration with the state element by element, the gather runs beside this
    iteration's matmul (d = 2g): g (the prologue's) + 3d, against 4g + 3d serially."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    found = collectives(PIPELINED, mesh)
    assert [(c.name, c.computation) for c in found] == [("ag", "body"), ("ag.0", "main")]
    g = collective_seconds(found[0], mesh, Cluster())
    ov = schedule(PIPELINED, found, [g, g], 6 * g)
    assert ov.comm == pytest.approx(4 * g)  # the body's gather runs 3 times
    assert ov.time == pytest.approx(7 * g, rel=1e-6)


# ---- bench columns ---------------------------------------------------------------------------


def test_bench_cell_reports_the_overlapped_step_beside_the_serial_one(mesh8):
    from shardc.bench.harness import Cell, _fill_compiled

    compiled = _fsdp(mesh8, _forward, _layers(), P("x", None), P("x", None))
    cluster = Cluster(device_flops=1e9)
    cell = Cell("fsdp", "node-8", "fsdp")
    _fill_compiled(cell, compiled, mesh8, cluster, jnp.ones((BATCH, WIDTH), jnp.float32))
    cost = price(compiled, mesh8, cluster)
    assert cell.compiled_overlap_s == cost.overlapped_time + cell.compiled_feed_s
    assert cell.compiled_feed_s < cell.compiled_overlap_s < cell.compiled_s


def _cell(method, serial, overlapped, **kw):
    from shardc.bench.harness import Cell

    return Cell("gpt", "node-8", method, compiled_s=serial, compiled_overlap_s=overlapped,
                mesh="8", **kw)


def test_summary_ranks_the_experts_under_each_pricing():
    """FSDP communicates more than data parallelism but hides most of it: the best expert
    is data-parallel serially and FSDP with overlap."""
    from shardc.bench import report

    cells = [_cell("shardc", 1.0, 0.8, predicted_s=1.0, predicted_comm_s=0.1,
                   compiled_comm_s=0.1),
             _cell("data-parallel", 1.25, 1.0), _cell("fsdp", 2.0, 0.5)]
    row, = report.summary(cells)
    assert (row["best_expert"], row["ratio"]) == ("data-parallel", 0.8)
    assert (row["best_overlap_expert"], row["overlap_ratio"]) == ("fsdp", 1.6)
    md = report.markdown(cells, ["shardc bench --models gpt"])
    assert "## With communication overlapped" in md
    assert "| gpt | node-8 | shardc | 800.000 | 1000.000 | fsdp | 8 | 500.000 | 1.600 |" in md
    assert "Geometric mean shardc / best expert with overlap: **1.600** over 1 cells." in md


def test_results_made_before_the_overlap_column_still_load_and_render(tmp_path):
    import json

    from shardc.bench import report

    old = [_cell("shardc", 1.0, None).to_json(), _cell("fsdp", 2.0, None).to_json()]
    for c in old:
        del c["compiled_overlap_s"]
    (tmp_path / "results.json").write_text(json.dumps({"commands": ["shardc bench"],
                                                       "cells": old}))
    cells, commands = report.load(tmp_path)
    assert [c.compiled_overlap_s for c in cells] == [None, None]
    row, = report.summary(cells)
    assert row["ratio"] == 0.5 and row["overlap_ratio"] is None
    md = report.markdown(cells, commands)
    assert "## With communication overlapped" not in md
    assert "| gpt | node-8 | fsdp | 8 | - | - | 2000.000 | - |" in md


# ---- a plan's own overlap estimate -----------------------------------------------------------


def _plan(ops, reshards, values):
    from shardc.plan.record import Plan, Predicted

    return Plan(mesh_axes=(("x", 8),), cluster=Cluster(), inputs=(), outputs=(),
                values=values, ops=tuple(ops), reshards=tuple(reshards),
                predicted=Predicted(sum(r.time for r in reshards),
                                    sum(o.compute_time for o in ops), 0.0, 0.0))


def test_plan_overlap_gathers_ahead_and_settles_beside_independent_ops():
    """By hand, g = 1, d = 2. FSDP: two weights (values 0, 1) gathered for the two layers
    that read them: gather 1 runs during layer 0, g + 2d = 5 against 2g + 2d = 6. A value
    produced partial and settled (all-reduced once, for every reader) runs beside an op
    independent of it: 3d = 6 against 3d + g = 7."""
    from shardc.ir.sbp import B, NdSbp, P, S
    from shardc.plan.overlap import plan_overlap
    from shardc.plan.record import OpPlan, Reshard

    s0, b, p = NdSbp((S(0),)), NdSbp((B,)), NdSbp((P,))

    def op(i, reads, ins, writes, outs):
        return OpPlan(i, "dot_general", "", ins, outs, 2.0, 0.0, reads, writes)

    fsdp = _plan([op(0, (2, 0), (b, b), (3,), (b,)), op(1, (3, 1), (b, b), (4,), (b,))],
                 [Reshard(0, 0, s0, b, 1.0, 0.0, ("all-gather@x",)),
                  Reshard(1, 1, s0, b, 1.0, 0.0, ("all-gather@x",))],
                 {0: s0, 1: s0, 2: b, 3: b, 4: b})
    got = plan_overlap(fsdp)
    assert (got.time, got.compute, got.comm, got.hidden) == (5.0, 4.0, 2.0, 1.0)
    settle = _plan([op(0, (0, 1), (b, b), (3,), (p,)), op(1, (0, 2), (b, b), (4,), (b,)),
                    op(2, (3, 4), (b, b), (5,), (b,))],
                   [Reshard(3, None, p, b, 2.0, 0.0, ("all-reduce@x",))],
                   {0: b, 1: b, 2: b, 3: p, 4: b, 5: b})
    assert plan_overlap(settle).time == 6.0
    # the ops run in the order XLA's scheduler gives them, from the dataflow, not as
    # listed: the independent op still runs between producer and reader
    listed = _plan([settle.ops[0], settle.ops[2], settle.ops[1]], settle.reshards,
                   settle.values)
    assert plan_overlap(listed).time == 6.0


def test_a_plans_overlap_estimate_is_computed_once_and_goes_with_the_plan():
    """The search asks for a candidate's estimate several times: the same plan's is the
    same object; a plan made from it with other conversions (a new record) is priced
    afresh (gathers twice as long: 2 + 2d = 6 against 5), and an estimate's entry goes
    when its plan does."""
    import dataclasses
    import gc

    from shardc.ir.sbp import B, NdSbp, S
    from shardc.plan import overlap
    from shardc.plan.record import OpPlan, Reshard

    s0, b = NdSbp((S(0),)), NdSbp((B,))
    ops = [OpPlan(0, "dot_general", "", (b, b), (b,), 2.0, 0.0, (2, 0), (3,)),
           OpPlan(1, "dot_general", "", (b, b), (b,), 2.0, 0.0, (3, 1), (4,))]
    fsdp = _plan(ops, [Reshard(v, v, s0, b, 1.0, 0.0, ("all-gather@x",)) for v in (0, 1)],
                 {0: s0, 1: s0, 2: b, 3: b, 4: b})
    first = overlap.plan_overlap(fsdp)
    assert first.time == 5.0 and overlap.plan_overlap(fsdp) is first
    assert overlap.plan_overlap(fsdp, chained=True) is not first  # each estimate its own
    slow = dataclasses.replace(fsdp, reshards=tuple(dataclasses.replace(r, time=2.0)
                                                    for r in fsdp.reshards))
    assert overlap.plan_overlap(slow).time == 6.0 and overlap.plan_overlap(fsdp) is first
    key = (id(slow), False)
    assert key in overlap._ESTIMATES
    del slow
    gc.collect()
    assert key not in overlap._ESTIMATES


def test_plan_overlap_runs_combined_conversions_as_one_block():
    """The two gathers of the FSDP case above, combined by XLA into one collective: the
    first layer waits for both (2g), then the layers run: 2g + 2d = 6, not 5."""
    from shardc.ir.sbp import B, NdSbp, S
    from shardc.plan.overlap import _blocks, _in_order, _tail, plan_overlap
    from shardc.plan.record import OpPlan, Reshard

    s0, b = NdSbp((S(0),)), NdSbp((B,))
    ops = [OpPlan(0, "dot_general", "", (b, b), (b,), 2.0, 0.0, (2, 0), (3,)),
           OpPlan(1, "dot_general", "", (b, b), (b,), 2.0, 0.0, (3, 1), (4,))]
    gathers = [Reshard(v, v, s0, b, 1.0, 0.0, ("all-gather@x",)) for v in (0, 1)]
    values = {0: s0, 1: s0, 2: b, 3: b, 4: b}
    assert plan_overlap(_plan(ops, gathers, values)).time == 5.0
    combined = [dataclasses.replace(r, combined=(0,)) for r in gathers]
    assert plan_overlap(_plan(ops, combined, values)).time == 6.0
    # a member computed late in program order (the embedding's token ids gathered again for
    # its gradient) is computed before the block's first reader: ops of 1, gathers of 1,
    # neg (0-1), the block (1-3), then the three dots: 6
    ops = [OpPlan(0, "dot_general", "", (b, b), (b,), 1.0, 0.0, (1, 0), (2,)),
           OpPlan(1, "dot_general", "", (b,), (b,), 1.0, 0.0, (2,), (3,)),
           OpPlan(2, "neg", "", (b,), (s0,), 1.0, 0.0, (1,), (4,)),
           OpPlan(3, "dot_general", "", (b, b), (b,), 1.0, 0.0, (3, 4), (5,))]
    late = [Reshard(0, 0, s0, b, 1.0, 0.0, ("all-gather@x",), combined=(0,)),
            Reshard(4, 3, s0, b, 1.0, 0.0, ("all-gather@x",), combined=(0,))]
    plan = _plan(ops, late, {0: s0, 1: b, 2: b, 3: b, 4: s0, 5: b})
    assert [op.id for op in _in_order(plan, _blocks(plan), False, _tail(plan.ops))] == [2, 0, 1, 3]
    assert plan_overlap(plan).time == 6.0


def test_plan_overlap_reduces_a_weight_gradient_after_the_rest_of_the_backward():
    """XLA's scheduler runs an op as late as its uses allow: the weight gradient (op 1),
    read only by the update, runs after the activation gradient (op 2) that comes after it
    in program order, and its all-reduce (2) with it. Ops of 1: a = x.w (0-1), dx = a.w
    (1-2), g = x.a (2-3), all-reduce 3-5 beside tanh(dx) (3-4), the update waits (5-6),
    then the last use of tanh (6-7): 7, where program order gives 6. Chained (as XLA:GPU
    computes a weight gradient where its reduction is issued, during the backward pass):
    a (0-1), g (1-2), all-reduce 2-4 beside dx (2-3) and tanh(dx) (3-4), the update (4-5),
    the last use of tanh (5-6): 6."""
    from shardc.ir.sbp import B, NdSbp, P
    from shardc.plan.overlap import plan_overlap
    from shardc.plan.record import OpPlan, Reshard

    b, p = NdSbp((B,)), NdSbp((P,))

    def op(i, prim, reads, writes):
        return OpPlan(i, prim, "", (b,) * len(reads), (b,), 1.0, 0.0, reads, writes)

    ops = [op(0, "dot_general", (0, 1), (2,)), op(1, "dot_general", (0, 2), (3,)),
           op(2, "dot_general", (2, 1), (4,)), op(3, "tanh", (4,), (5,)),
           op(4, "sub", (1, 3), (6,)), op(5, "mul", (5,), (7,))]
    plan = _plan(ops, [Reshard(3, 4, p, b, 2.0, 0.0, ("all-reduce@x",))],
                 {v: b for v in range(8)} | {3: p})
    plan = dataclasses.replace(plan, input_ids=(0, 1))  # x (the batch), w (the state)
    assert plan_overlap(plan).time == 7.0
    assert plan_overlap(plan, chained=True).time == 6.0


def test_plan_overlap_issues_the_gradient_reductions_as_a_chain_ending_at_the_last_kernel():
    """Chained: XLA:GPU keeps one collective in flight and places KERNELS_UNDER_COLLECTIVE
    (5) kernels under each: the step's gradient reductions run back to back, the last issued five
    kernels before the step's last kernel ends. One weight gradient g (op 1, made at 2)
    and six more dots after it (2-8): its all-reduce (6) is issued at the fifth-last
    kernel (op 3, at 3), not at 2, and ends at 9; the update waits (9-10): 10. With
    fewer kernels than the chain asks for, it starts when its value is made."""
    from shardc.ir.sbp import B, NdSbp, P
    from shardc.plan.overlap import KERNELS_UNDER_COLLECTIVE, plan_overlap
    from shardc.plan.record import OpPlan, Reshard

    assert KERNELS_UNDER_COLLECTIVE == 5
    b, p = NdSbp((B,)), NdSbp((P,))

    def op(i, prim, reads, writes):
        return OpPlan(i, prim, "", (b,) * len(reads), (b,), 1.0, 0.0, reads, writes)

    def step(more: int):
        chain = [op(2 + j, "dot_general", (10 + j, 1), (11 + j,)) for j in range(more)]
        ops = [op(0, "dot_general", (0, 1), (10,)), op(1, "dot_general", (0, 10), (3,)),
               *chain, op(9, "sub", (1, 3), (6,))]
        plan = _plan(ops, [Reshard(3, 9, p, b, 6.0, 0.0, ("all-reduce@x",))],
                     {v: b for v in range(20)} | {3: p})
        return dataclasses.replace(plan, input_ids=(0, 1))

    assert plan_overlap(step(6), chained=True).time == 10.0
    # 2 kernels after the gradient (4 in all): all-reduce 2-8, the update 8-9
    assert plan_overlap(step(2), chained=True).time == 9.0


def test_plan_overlap_of_a_planned_fsdp_step_lies_within_the_bounds(mesh8):
    import shardc
    from shardc.plan.overlap import plan_overlap

    ws, x = _layers(), jnp.ones((BATCH, WIDTH), jnp.float32)
    for flops in (1e9, 1e8):  # slow devices: splitting pays for its communication
        step = shardc.auto_shard(_train(_forward), mesh=mesh8, cluster=Cluster(device_flops=flops),
                                 time_limit=5.0, mesh_search=False)
        plan = step.plan(ws, x)
        got = plan_overlap(plan)
        pred = plan.predicted
        assert (got.compute, got.comm) == (pred.compute_time, pred.comm_time)
        assert pred.comm_time > 0, plan.explain()
        assert max(pred.comm_time, pred.compute_time) * (1 - REL) <= got.time
        assert got.time <= (pred.comm_time + pred.compute_time) * (1 + REL)


def test_an_overlap_cluster_ranks_the_mesh_views_by_their_overlapped_step():
    """Cluster(overlap=True): the search keeps the view whose overlapped step is least
    (estimated: rank_compiled=0), and each view tried records the time it was ranked by."""
    import shardc
    from shardc.plan.overlap import plan_overlap, ranking_time

    ws, x = _layers(), jnp.ones((BATCH, WIDTH), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    cluster = dataclasses.replace(Cluster.multi_node(), device_flops=1e9, overlap=True)
    plan = shardc.auto_shard(_train(_forward), mesh=mesh, cluster=cluster, time_limit=5.0,
                             mesh_search=True, rank_compiled=0).plan(ws, x)
    assert "compiled_ranking" not in plan.solver
    assert ranking_time(plan) == pytest.approx(
        (plan_overlap(plan).time + plan_overlap(plan, chained=True).time) / 2
        + plan.predicted.feed_time)
    assert ranking_time(plan) <= plan.predicted.step_time
    tried = plan.solver["mesh_search"]
    ranked = [t["ranked_s"] for t in tried if t.get("ranked_s") is not None]
    assert len(ranked) > 1 and ranking_time(plan) == pytest.approx(min(ranked))
    serial = dataclasses.replace(cluster, overlap=False)
    assert Cluster.from_json(cluster.to_json()) == cluster != serial


def test_an_overlap_plan_is_the_fastest_compiled_of_the_best_candidates():
    """Under overlap the best ``rank_compiled`` candidates by each estimate (every view's,
    every seed's; ``to_compile``) are compiled and the plan is the one whose compiled
    program is fastest overlapped (``plan.solver["compiled_ranking"]``, the first
    estimate's best first); it runs as jax.jit does. Serial plans, and plans on an
    AbstractMesh, compile nothing."""
    import shardc
    from shardc.cost.units import fmt_time
    from shardc.inspect.hlo import price
    from shardc.plan.overlap import ranking_time

    ws, x = _layers(), jnp.ones((BATCH, WIDTH), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    cluster = dataclasses.replace(Cluster.multi_node(), device_flops=1e9, overlap=True)
    seeds = {"data-parallel": (None, P(("node", "gpu")))}
    step = shardc.auto_shard(_train(_forward), mesh=mesh, cluster=cluster, time_limit=5.0,
                             mesh_search=True, rank_compiled=3, seeds=seeds)
    plan = step.plan(ws, x)
    rows = plan.solver["compiled_ranking"]
    assert 1 < len(rows) <= 8 and all("compiled_s" in r for r in rows), rows
    estimates = [r["estimated_s"] for r in rows]
    assert estimates[0] == min(estimates)
    got = min(r["compiled_s"] for r in rows)
    assert [r["compiled_s"] for r in rows if r["kept"]] == [got]
    compiled = price(step.lower(ws, x).compile(), step.mesh_for(plan), plan.cluster)
    assert compiled.overlapped_time + plan.predicted.feed_time == pytest.approx(got, rel=1e-9)
    assert ranking_time(plan) in estimates
    text = plan.explain()
    assert "ranked on their compiled programs" in text and "(kept)" in text
    assert f"with communication overlapped (Cluster(overlap=True), what the plan was chosen " \
        f"by): {fmt_time(ranking_time(plan))} estimated, its compiled HLO priced " \
        f"{fmt_time(got)}" in text
    want = jax.jit(_train(_forward))(ws, x)
    assert_close(step(ws, x), want, rtol=1e-5, atol=1e-6)
    serial = shardc.auto_shard(_train(_forward), mesh=mesh, time_limit=5.0,
                               cluster=dataclasses.replace(cluster, overlap=False))
    assert "compiled_ranking" not in serial.plan(ws, x).solver
    abstract = shardc.auto_shard(_train(_forward), mesh=mesh.abstract_mesh, cluster=cluster,
                                 time_limit=5.0)
    assert "compiled_ranking" not in abstract.plan(ws, x).solver


def test_the_compiled_ranking_compiles_each_program_once_the_best_by_either_estimate(
        monkeypatch):
    """``to_compile``: the ``count`` best distinct programs by the estimate with the
    gradient reductions late, then those by the chained one not already taken, then of the
    rest the best by the two ranks' sum (``p2``, third by each: the wide ResNet's data
    parallelism under ring steps, fourth by each, compiled fastest), then of the rest the
    one with the fewest collectives (``p3``, last by the first estimate and fifth by the
    second: the wide ResNet's data parallelism on two nodes, compiled fastest). A
    candidate on another view whose devices hold the same pieces (``x=8`` split against
    ``a=2 x b=4`` split over both) is the same program: compiled once, as the first
    estimate's first."""
    import shardc.step.ranking as ranking
    from shardc.ir.sbp import B, NdSbp, S
    from shardc.plan.record import Reshard

    split, whole = NdSbp((S(0),)), NdSbp((B,))
    p0 = _plan([], [Reshard(0, None, split, whole, 0.0, 0.0, ("all-gather@x",), (0.0,))],
               {0: split, 1: whole})
    again = dataclasses.replace(p0, mesh_axes=(("a", 2), ("b", 4)),
                                values={0: NdSbp((S(0), S(0))), 1: NdSbp((B, B))})
    p1, p2, p3, p4 = (dataclasses.replace(p0, values={0: whole, 1: NdSbp((S(k),))},
                                          reshards=p0.reshards if k != 2 else ())
                      for k in range(4))
    late = {id(again): 1.0, id(p0): 1.5, id(p1): 2.0, id(p2): 3.0, id(p3): 9.0, id(p4): 8.0}
    chained = {id(p4): 1.0, id(p0): 1.5, id(p2): 2.0, id(again): 2.5, id(p1): 3.0,
               id(p3): 4.0}
    monkeypatch.setattr(ranking, "ranking_time", lambda p: late[id(p)])
    monkeypatch.setattr(ranking, "chained_time", lambda p: chained[id(p)])
    plans = [p0, again, p1, p2, p3, p4]
    assert ranking.layout_key(p0) == ranking.layout_key(again) != ranking.layout_key(p1)
    assert [id(p) for p in ranking.to_compile(plans, 2)] == [id(again), id(p1), id(p4),
                                                               id(p2), id(p3)]
    assert [id(p) for p in ranking.to_compile(plans, 3)] == [id(again), id(p1), id(p2),
                                                               id(p4), id(p3)]
    # p1 and p2 tie on the ranks' sum (4): the search's order keeps p1; of p2 and p3, p3
    # has the fewest collectives (none)
    assert [id(p) for p in ranking.to_compile(plans, 1)] == [id(again), id(p4), id(p1),
                                                               id(p3)]
    # with as many collectives as the others, p2's better estimates keep it
    p3b = dataclasses.replace(p3, reshards=p0.reshards)
    late[id(p3b)], chained[id(p3b)] = late[id(p3)], chained[id(p3)]
    plans = [p0, again, p1, p2, p3b, p4]
    assert [id(p) for p in ranking.to_compile(plans, 1)][-1] == id(p2)


def test_rank_compiled_is_a_whole_number():
    import shardc

    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="rank_compiled"):
            shardc.auto_shard(lambda x: x, mesh=mesh, rank_compiled=bad)


def test_the_gpu_and_tpu_presets_plan_for_overlap_without_compiling():
    """The GPU and TPU presets rank plans by their overlapped step, estimated (nothing
    compiled by default); a Cluster built by hand stays serial."""
    import shardc

    presets = [Cluster.nvlink_node(), Cluster.multi_node(), Cluster.ethernet_nodes(),
               Cluster.multi_pod(), Cluster.tpu_v4()]
    assert all(c.overlap for c in presets) and not Cluster().overlap
    ws, x = _layers(), jnp.ones((BATCH, WIDTH), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    plan = shardc.auto_shard(_train(_forward), mesh=mesh, cluster=Cluster.multi_node(),
                             time_limit=5.0).plan(ws, x)
    assert "compiled_ranking" not in plan.solver
    assert plan.solver["overlapped_s"] <= plan.predicted.step_time
    assert "with communication overlapped" in plan.explain(max_rows=1)


def test_a_compile_without_a_gemm_tiling_falls_back_to_cublas():
    """XLA:GPU's Triton emitter finds no tiling for some dots when nothing autotunes (an
    ahead-of-time compile): the program is compiled again with its dots on cuBLAS."""
    from shardc.step.ranking import UNTILED, compile_lowered

    class Lowered:
        asked = []

        def compile(self, compiler_options=None):
            self.asked.append(compiler_options)
            if compiler_options is None:
                raise RuntimeError(f"INTERNAL: {UNTILED} for dot.12")
            return "compiled"

    assert compile_lowered(Lowered()) == "compiled"
    assert Lowered.asked == [None, {"xla_gpu_enable_triton_gemm": False}]

    class Broken(Lowered):
        def compile(self, compiler_options=None):
            raise RuntimeError("INTERNAL: something else")

    with pytest.raises(RuntimeError, match="something else"):
        compile_lowered(Broken())


_CONV_HLO = """HloModule conv, entry_computation_layout={(f32[16,32,32,16]{3,2,1,0}, f32[16,3,3,16]{3,2,1,0}, f32[16,32,32,16]{3,2,1,0})->f32[16,32,32,16]{3,2,1,0}}

ENTRY %main (x: f32[16,32,32,16], w: f32[16,3,3,16], dy: f32[16,32,32,16]) -> f32[16,32,32,16] {
  %x = f32[16,32,32,16]{3,2,1,0} parameter(0)
  %w = f32[16,3,3,16]{3,2,1,0} parameter(1)
  %dy = f32[16,32,32,16]{3,2,1,0} parameter(2)
  %fwd = (f32[16,32,32,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %dx = (f32[16,32,32,16]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dw = (f32[16,3,3,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %y = f32[16,32,32,16]{3,2,1,0} get-tuple-element(%fwd), index=0
  ROOT %g = f32[16,32,32,16]{3,2,1,0} get-tuple-element(%dx), index=0
}
"""  # noqa: E501


def test_cudnn_convolutions_weigh_their_forward_convolutions_flops():
    """XLA:GPU runs a convolution and both its gradients as cuDNN custom-calls; each
    weighs 2 x |forward output| x |kernel| / output features (a 3x3 conv of 16 to 16
    features over 16 x 32 x 32: 75.5 MFLOP each), as ``cost_analysis()`` counts them."""
    from shardc.inspect.schedule import replay_flops

    one = 2 * (16 * 32 * 32 * 16) * (3 * 3 * 16)
    assert replay_flops(_CONV_HLO, []) == 3 * one
