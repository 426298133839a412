"""shardc.inspect.hlo: collectives read from compiled HLO, and their price.

Real programs are compiled on the 8 simulated CPU devices of ``conftest.py``; the replica
group spellings and async forms this build does not print are checked on literal HLO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.cost.cluster import Cluster
from shardc.inspect import CompiledCost, HloCollective, collectives, price
from shardc.inspect.groups import group_axes, parse_replica_groups
from shardc.inspect.hlo import collective_seconds
from shardc.inspect.loops import multiplicity

F32 = 4
GPU_LINES = ((0, 1, 2, 3), (4, 5, 6, 7))
NODE_LINES = ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _put(mesh: Mesh, shape: tuple[int, ...], spec: P) -> jax.Array:
    return jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))


def _compile(mesh: Mesh, fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _constrain(mesh: Mesh, x: jax.Array, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _contract(mesh: Mesh, axis: str):
    """x @ w contracted over a dim split on ``axis``: partial sums, all-reduced to P()."""
    x = _put(mesh, (32, 256), P(None, axis))
    w = _put(mesh, (256, 64), P(axis, None))
    return _compile(mesh, lambda x, w: _constrain(mesh, x @ w, P()), x, w)


def _only(found: list[HloCollective]) -> HloCollective:
    assert len(found) == 1, found
    return found[0]


# ---- (a) all-reduce over one mesh axis ---------------------------------------------------


@pytest.mark.parametrize("axis, size, groups", [("gpu", 4, GPU_LINES), ("node", 2, NODE_LINES)])
def test_all_reduce_over_one_axis(mesh, axis, size, groups):
    c = _only(collectives(_contract(mesh, axis), mesh))
    assert (c.kind, c.group_size, c.groups, c.axes) == ("all-reduce", size, groups, (axis,))
    assert c.shapes == ("f32[32,64]",) and c.result_bytes == 32 * 64 * F32
    assert not c.from_all_reduce and c.computation.startswith("main")
    assert c.wire_bytes == pytest.approx(2 * (size - 1) / size * 32 * 64 * F32)


def test_shard_map_psum_is_explicit_all_reduce(mesh):
    fn = jax.shard_map(lambda a: jax.lax.psum(a, "gpu"), mesh=mesh,
                       in_specs=P(None, "gpu"), out_specs=P())
    compiled = _compile(mesh, fn, jnp.ones((32, 256), jnp.float32))
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in compiled.as_text()
    c = _only(collectives(compiled, mesh))
    assert (c.kind, c.groups, c.axes, c.result_bytes) == ("all-reduce", GPU_LINES, ("gpu",),
                                                          32 * 64 * F32)


def test_group_over_both_axes(mesh):
    x = _put(mesh, (32, 256), P(None, ("node", "gpu")))
    w = _put(mesh, (256, 64), P(("node", "gpu"), None))
    c = _only(collectives(_compile(mesh, lambda x, w: _constrain(mesh, x @ w, P()), x, w),
                          mesh))
    assert (c.kind, c.group_size, c.axes) == ("all-reduce", 8, ("node", "gpu"))


def test_groups_are_mesh_positions_not_device_ids():
    # Rows of this mesh are devices {0,2,4,6} and {1,3,5,7}; HLO still names positions.
    devices = np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    permuted = Mesh(devices, ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    c = _only(collectives(_contract(permuted, "gpu"), permuted))
    assert (c.groups, c.axes) == (GPU_LINES, ("gpu",))


# ---- (b) all-gather, (c) CPU reduce-scatter, (d) all-to-all ----------------------------------


def test_all_gather_split_to_broadcast(mesh):
    x = _put(mesh, (32, 256), P("gpu", None))
    c = _only(collectives(_compile(mesh, lambda x: _constrain(mesh, x * 2, P()), x), mesh))
    assert (c.kind, c.group_size, c.groups, c.axes) == ("all-gather", 4, GPU_LINES, ("gpu",))
    assert c.shapes == ("f32[32,256]",) and c.result_bytes == 32 * 256 * F32
    assert c.wire_bytes == pytest.approx(0.75 * 32 * 256 * F32)


def test_cpu_reduce_scatter_is_all_reduce_plus_dynamic_slice(mesh):
    x = _put(mesh, (32, 256), P(None, "gpu"))
    w = _put(mesh, (256, 64), P("gpu", None))
    compiled = _compile(
        mesh, lambda x, w: _constrain(mesh, jnp.einsum("ij,jk->ik", x, w), P(None, "gpu")), x, w)
    text = compiled.as_text()
    assert " all-reduce(" in text and "dynamic-slice" in text and "reduce-scatter(" not in text
    c = _only(collectives(compiled, mesh))
    assert (c.kind, c.from_all_reduce, c.axes, c.group_size) == ("reduce-scatter", True,
                                                                 ("gpu",), 4)
    assert c.shapes == ("f32[32,16]",) and c.result_bytes == 32 * 16 * F32
    assert c.wire_bytes == pytest.approx(0.75 * 32 * 64 * F32)  # (n-1)/n of the full sum


def test_shard_map_psum_scatter_is_a_real_reduce_scatter(mesh):
    fn = jax.shard_map(lambda a: jax.lax.psum_scatter(a, "gpu", scatter_dimension=0, tiled=True),
                       mesh=mesh, in_specs=P(None, "gpu"), out_specs=P("gpu", None))
    c = _only(collectives(_compile(mesh, fn, jnp.ones((32, 256), jnp.float32)), mesh))
    assert (c.kind, c.from_all_reduce, c.result_bytes) == ("reduce-scatter", False, 8 * 64 * F32)


def test_all_to_all_split_to_split(mesh):
    x = _put(mesh, (32, 256), P("gpu", None))
    c = _only(collectives(_compile(mesh, lambda x: _constrain(mesh, x * 2, P(None, "gpu")), x),
                          mesh))
    assert (c.kind, c.group_size, c.groups, c.axes) == ("all-to-all", 4, GPU_LINES, ("gpu",))
    assert c.result_bytes == 8 * 256 * F32  # the tuple's parts add up to the local block
    assert c.wire_bytes == pytest.approx(0.75 * 8 * 256 * F32)


def test_collective_permute_groups_are_components(mesh):
    shift = [(i, (i + 1) % 4) for i in range(4)]
    fn = jax.shard_map(lambda a: jax.lax.ppermute(a, "gpu", shift), mesh=mesh,
                       in_specs=P(None, "gpu"), out_specs=P(None, "gpu"))
    compiled = _compile(mesh, fn, jnp.ones((32, 256), jnp.float32))
    assert "source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5}" in compiled.as_text()
    c = _only(collectives(compiled, mesh))
    assert (c.kind, c.groups, c.axes, c.wire_bytes) == ("collective-permute", GPU_LINES,
                                                        ("gpu",), 32 * 64 * F32)


def test_while_body_collective_names_its_computation(mesh):
    def body(carry, _):
        return jax.lax.pcast(jax.lax.psum(carry, "gpu"), "gpu", to="varying"), None

    fn = jax.shard_map(lambda a: jax.lax.scan(body, a, None, length=5)[0], mesh=mesh,
                       in_specs=P(None, "gpu"), out_specs=P(None, "gpu"))
    compiled = _compile(mesh, fn, jnp.ones((32, 256), jnp.float32))
    c = _only(collectives(compiled, mesh))
    assert c.kind == "all-reduce" and not c.computation.startswith("main")
    runs = multiplicity(compiled.as_text())
    assert runs[c.computation] == 5 and max(runs.values()) == 5  # one loop, 5 trips


# ---- (e) the three replica-group spellings ---------------------------------------------------


@pytest.mark.parametrize("spelling, groups", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{{0,2},{1,3}}", ((0, 2), (1, 3))),
    ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("[2,4]<=[8]", GPU_LINES),
    ("[4,2]<=[2,4]T(1,0)", NODE_LINES),
    ("[1,8]<=[2,4]T(1,0)", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", GPU_LINES),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", NODE_LINES),
    ("mesh['axis_0'=1,'axis_1'=8], device_ids=([2,4]T(1,0)) {'axis_1'}",
     ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh[a=2,b=4], device_ids=(0,4,1,5,2,6,3,7) {a}", ((0, 2), (4, 6), (1, 3), (5, 7))),
    ("mesh['x'=8] {'x':(1)2}", NODE_LINES),
    ("mesh['x'=8] {'x':(2)4}", GPU_LINES),
    ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),  # outer and inner bit
])
def test_parse_replica_groups(spelling, groups):
    assert parse_replica_groups(spelling, 8) == groups


def test_parse_replica_groups_names_what_arrived():
    with pytest.raises(ValueError, match="maximal_mesh"):
        parse_replica_groups("maximal_mesh[device_id=3]", 8)
    with pytest.raises(ValueError, match="not a permutation"):
        parse_replica_groups("[2,4]<=[8]T(1,0)", 8)
    with pytest.raises(ValueError, match="unknown axis 'c'"):
        parse_replica_groups("mesh['a'=2,'b'=4] {'c'}", 8)


THREE_SPELLINGS = """\
HloModule three, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[32,64]) -> f32[32,64] {
  %p = f32[32,64]{1,0} parameter(0)
  %ar.explicit = f32[32,64]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ar.iota = f32[32,64]{1,0} all-reduce(%ar.explicit), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ar.half = f32[32,64]{1,0} all-reduce(%ar.iota), channel_id=3, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %ar.mesh = f32[32,64]{1,0} all-reduce(%ar.half), channel_id=4, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/(psum)" stack_frame_id=1}
}
"""  # noqa: E501


def test_literal_module_with_every_spelling(mesh):
    found = collectives(THREE_SPELLINGS, mesh)
    assert [(c.name, c.groups, c.axes) for c in found] == [
        ("ar.explicit", GPU_LINES, ("gpu",)),
        ("ar.iota", NODE_LINES, ("node",)),
        ("ar.half", ((0, 1), (2, 3), (4, 5), (6, 7)), None),  # half a gpu line: no mesh axis
        ("ar.mesh", GPU_LINES, ("gpu",)),
    ]
    assert {c.kind for c in found} == {"all-reduce"} and {c.computation for c in found} == {"main"}


ASYNC = """\
HloModule async, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%async_computation (p0: f32[32,64]) -> f32[32,64] {
  %p0 = f32[32,64]{1,0} parameter(0)
  ROOT %a2a = f32[32,64]{1,0} all-to-all(%p0), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}
}

ENTRY %main (p: f32[8,64]) -> f32[8,64] {
  %p = f32[8,64]{1,0} parameter(0)
  %ag-start = (f32[8,64]{1,0}, f32[32,64]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[32,64]{1,0} all-gather-done(%ag-start)
  %cp-start = (f32[32,64]{1,0}, f32[32,64]{1,0}, u32[], u32[]) collective-permute-start(%ag-done), channel_id=2, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cp-done = f32[32,64]{1,0} collective-permute-done(%cp-start)
  %ar-start = (f32[32,64]{1,0}, f32[]) all-reduce-start(%cp-done, %p), channel_id=3, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %ar-done = (f32[32,64]{1,0}, f32[]) all-reduce-done(%ar-start)
  %gte = f32[32,64]{1,0} get-tuple-element(%ar-done), index=0
  %async-start = ((f32[32,64]{1,0}), f32[32,64]{1,0}, s32[]) async-start(%gte), calls=%async_computation
  %async-done = f32[32,64]{1,0} async-done(%async-start), calls=%async_computation
  %rs-start = ((f32[32,64]{1,0}), f32[8,64]{1,0}) reduce-scatter-start(%async-done), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %rs-done = f32[8,64]{1,0} reduce-scatter-done(%rs-start)
}
"""  # noqa: E501


def test_async_forms_count_once_with_their_result_part(mesh):
    found = collectives(ASYNC, mesh)
    rows = [(c.kind, c.name, c.result_bytes, c.axes, c.computation) for c in found]
    assert sorted(rows) == sorted([
        ("all-to-all", "a2a", 32 * 64 * F32, ("gpu",), "async_computation"),
        ("all-gather", "ag-start", 32 * 64 * F32, ("gpu",), "main"),
        ("collective-permute", "cp-start", 32 * 64 * F32, ("node",), "main"),
        ("all-reduce", "ar-start", 32 * 64 * F32 + F32, ("node", "gpu"), "main"),
        ("reduce-scatter", "rs-start", 8 * 64 * F32, ("gpu",), "main"),
    ])


CPU_SCATTER = """\
HloModule cpu_scatter, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[32,64], q: f32[32,64]) -> (f32[8,64], f32[16,64], f32[32,64], f32[8,64]) {
  %p = f32[32,64]{1,0} parameter(0)
  %q = f32[32,64]{1,0} parameter(1)
  %ar.sliced = f32[32,64]{1,0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %bc = f32[4,8,64]{2,1,0} bitcast(%ar.sliced)
  %rs = f32[1,8,64]{2,1,0} slice(%bc), slice={[1:2], [0:8], [0:64]}
  %ar.half = f32[32,64]{1,0} all-reduce(%q), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %keep.half = f32[16,64]{1,0} slice(%ar.half), slice={[0:16], [0:64]}
  %ar.shared = f32[32,64]{1,0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %twice = f32[32,64]{1,0} add(%ar.shared, %ar.shared)
  %quarter = f32[8,64]{1,0} slice(%ar.shared), slice={[0:8], [0:64]}
  ROOT %out = (f32[1,8,64]{2,1,0}, f32[16,64]{1,0}, f32[32,64]{1,0}, f32[8,64]{1,0}) tuple(%rs, %keep.half, %twice, %quarter)
}
"""  # noqa: E501


def test_cpu_reduce_scatter_only_when_the_sole_user_keeps_one_nth(mesh):
    found = {c.name: c for c in collectives(CPU_SCATTER, mesh)}
    rs = found["ar.sliced"]
    assert (rs.kind, rs.from_all_reduce, rs.shapes, rs.result_bytes) == (
        "reduce-scatter", True, ("f32[1,8,64]",), 8 * 64 * F32)
    assert found["ar.half"].kind == "all-reduce"  # keeps 1/2 of a 4-way sum
    assert found["ar.shared"].kind == "all-reduce"  # two users


GPU_UNPACKED = """\
HloModule gpu_unpacked, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[256]) -> (f32[64], f32[64], f32[64], f32[64]) {
  %p = f32[256]{0} parameter(0)
  %ars = f32[256]{0} all-reduce-start(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ard = f32[256]{0} all-reduce-done(%ars)
  %a = f32[64]{0} slice(%ard), slice={[0:64]}
  %b = f32[64]{0} slice(%ard), slice={[64:128]}
  %c = f32[64]{0} slice(%ard), slice={[128:192]}
  %d = f32[64]{0} slice(%ard), slice={[192:256]}
  ROOT %out = (f32[64]{0}, f32[64]{0}, f32[64]{0}, f32[64]{0}) tuple(%a, %b, %c, %d)
}
"""  # noqa: E501


def test_gpu_combined_all_reduce_unpacked_by_slices_runs_whole(mesh):
    """XLA:GPU's combined all-reduce of four equal members over four devices, unpacked by
    four quarter slices, is an all-reduce of the whole buffer, not XLA:CPU's reduce-scatter
    pattern (XLA:GPU rewrites the reduce-scatters it can)."""
    c, = collectives(GPU_UNPACKED, mesh)
    assert (c.kind, c.result_bytes, c.from_all_reduce) == ("all-reduce", 256 * F32, False)


TUPLE_SCATTER = """\
HloModule tuple_scatter, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%adam_m (m: f32[8,64], g: f32[32,64], pid: u32[]) -> f32[8,64] {
  %g = f32[32,64]{1,0} parameter(1)
  %pid = u32[] parameter(2)
  %row = s32[] convert(%pid)
  %zero = s32[] constant(0)
  %mine = f32[8,64]{1,0} dynamic-slice(%g, %row, %zero), dynamic_slice_sizes={8,64}
  %m = f32[8,64]{1,0} parameter(0)
  ROOT %new = f32[8,64]{1,0} add(%m, %mine)
}

ENTRY %main (p: f32[32,64], q: f32[16], m: f32[8,64], v: f32[8,64]) -> (f32[8,64], f32[8,64], f32[16]) {
  %p = f32[32,64]{1,0} parameter(0)
  %q = f32[16]{0} parameter(1)
  %m = f32[8,64]{1,0} parameter(2)
  %v = f32[8,64]{1,0} parameter(3)
  %pid = u32[] partition-id()
  %ar = (f32[32,64]{1,0}, f32[16]{0}) all-reduce(%p, %q), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %g0 = f32[32,64]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[16]{0} get-tuple-element(%ar), index=1
  %new.m = f32[8,64]{1,0} fusion(%m, %g0, %pid), kind=kLoop, calls=%adam_m
  %new.v = f32[8,64]{1,0} fusion(%v, %g0, %pid), kind=kLoop, calls=%adam_m
  %whole = f32[16]{0} add(%g1, %g1)
  ROOT %out = (f32[8,64]{1,0}, f32[8,64]{1,0}, f32[16]{0}) tuple(%new.m, %new.v, %whole)
}
"""  # noqa: E501


def test_combined_all_reduce_splits_into_reduce_scatter_and_all_reduce(mesh):
    """A tuple all-reduce is several combined; an element whose every use (here two
    optimizer fusions) keeps the same 1/n slice is a reduce-scatter."""
    found = collectives(TUPLE_SCATTER, mesh)
    assert [(c.kind, c.name, c.shapes, c.result_bytes, c.from_all_reduce) for c in found] == [
        ("all-reduce", "ar", ("f32[16]",), 16 * F32, False),
        ("reduce-scatter", "ar", ("f32[8,64]",), 8 * 64 * F32, True),
    ]
    alone = TUPLE_SCATTER.replace("%whole = f32[16]{0} add(%g1, %g1)",
                                  "%whole = f32[4]{0} slice(%g1), slice={[0:4]}")
    alone = alone.replace("f32[16]{0}) tuple(", "f32[4]{0}) tuple(")
    assert [(c.kind, c.shapes) for c in collectives(alone, mesh)] == [
        ("reduce-scatter", ("f32[8,64]", "f32[4]"))]


def test_collectives_names_what_arrived(mesh):
    with pytest.raises(TypeError, match="got int"):
        collectives(3, mesh)
    with pytest.raises(ValueError, match="no HLO computations"):
        collectives("not hlo at all", mesh)
    bad = THREE_SPELLINGS.replace("{{0,1,2,3},{4,5,6,7}}", "{{0,1,2,3},{4,5,6,9}}")
    with pytest.raises(ValueError, match=r"device ids \[9\]"):
        collectives(bad, mesh)


def test_group_axes_requires_full_lines(mesh):
    assert group_axes(GPU_LINES, mesh) == ("gpu",)
    assert group_axes(((0, 1, 2, 3, 4, 5, 6, 7),), mesh) == ("node", "gpu")
    assert group_axes(((0,), (1,)), mesh) == ()
    assert group_axes(((0, 1, 2, 3), (4, 5)), mesh) is None
    assert group_axes(((0, 5), (1, 4)), mesh) is None  # diagonals vary over both axes


# ---- (f) price ---------------------------------------------------------------------------------

CLUSTER = Cluster(axis_bandwidth={"node": 1e9, "gpu": 1e11},
                  axis_latency={"node": 1e-5, "gpu": 1e-6},
                  device_flops=1e12, utilization=0.5, collective_model="alpha-beta")


def test_price_by_hand(mesh):
    a = _put(mesh, (32, 256), P(None, "gpu"))
    b = _put(mesh, (256, 64), P("gpu", None))
    c = _put(mesh, (32, 256), P(None, "node"))
    d = _put(mesh, (256, 64), P("node", None))
    compiled = _compile(mesh, lambda a, b, c, d: (_constrain(mesh, a @ b, P()),
                                                  _constrain(mesh, c @ d, P())), a, b, c, d)
    cost = price(compiled, mesh, CLUSTER)
    assert isinstance(cost, CompiledCost)
    assert cost.counts == {"all-reduce": 2}
    nbytes = 32 * 64 * F32
    gpu = 1e-6 + 2 * 3 / 4 * nbytes / 1e11
    node = 1e-5 + 2 * 1 / 2 * nbytes / 1e9
    assert sorted(cost.times) == pytest.approx(sorted([gpu, node]))
    assert cost.comm_time == pytest.approx(gpu + node)
    assert cost.wire_bytes == pytest.approx(2 * 3 / 4 * nbytes + nbytes)
    flops = compiled.cost_analysis()["flops"]
    assert cost.flops == flops >= 2 * (32 * 64 * 64 + 32 * 128 * 64)
    assert cost.compute_time == pytest.approx(flops / (1e12 * 0.5))
    stats = compiled.memory_analysis()
    assert cost.peak_memory == (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                                + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def test_price_multi_axis_at_the_slowest_link_and_unaligned_groups_on_the_links_they_cross(mesh):
    found = {c.name: c for c in collectives(THREE_SPELLINGS, mesh)}
    nbytes = 32 * 64 * F32
    both = HloCollective("all-reduce", "x", nbytes, ("f32[32,64]",), 8,
                         ((0, 1, 2, 3, 4, 5, 6, 7),), ("node", "gpu"))
    assert collective_seconds(both, mesh, CLUSTER) == pytest.approx(
        1e-5 + 2 * 7 / 8 * nbytes / 1e9)
    assert found["ar.half"].axes is None  # groups of 2 inside a node: part of the gpu axis
    assert collective_seconds(found["ar.half"], mesh, CLUSTER) == pytest.approx(
        1e-6 + 2 * 1 / 2 * nbytes / 1e11)
    assert collective_seconds(found["ar.explicit"], mesh, CLUSTER) == pytest.approx(
        1e-6 + 2 * 3 / 4 * nbytes / 1e11)


# ---- (g) data-parallel MLP: one combined gradient all-reduce ---------------------------------


def test_mlp_data_parallel_step_has_one_combined_all_reduce():
    # build_step + abstract_args is make_train_step without allocating (2.9 s -> 0.1 s).
    from shardc.models.mlp import MLPConfig, abstract_args, build_step

    config = MLPConfig(batch=256, d_in=32, hidden=32, d_out=32, n_layers=6, learning_rate=1e-2)
    step, (state, batch) = build_step(config), abstract_args(config)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                         axis_types=(AxisType.Auto,))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state_s = jax.tree.map(lambda _: rep, state)
    batch_s = jax.tree.map(lambda _: split, batch)
    compiled = jax.jit(step, in_shardings=(state_s, batch_s),
                       out_shardings=(state_s, rep)).lower(state, batch).compile()
    c = _only(collectives(compiled, mesh))
    grad_bytes = sum(np.prod(leaf.shape) * leaf.dtype.itemsize
                     for leaf in jax.tree.leaves(state["params"]))
    assert (c.kind, c.group_size, c.axes) == ("all-reduce", 4, ("data",))
    assert len(c.shapes) == 2 * config.n_layers + 1  # kernels, biases and the loss
    assert c.result_bytes == grad_bytes + F32 == 6 * (32 * 32 + 32) * F32 + F32


def test_bf16_collectives_xla_cpu_widens_read_as_the_bf16_ones_planned():
    """XLA:CPU moves bf16 through f32 collectives (converts around them, its reduce-scatter
    an f32 all-reduce combined with others, then converted and sliced); read back, every
    kind the plan chose is matched at the bytes it planned."""
    import optax

    import shardc

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    ks = jax.random.split(jax.random.key(0), 5)
    params = [jax.random.normal(k, (512, 512), jnp.bfloat16) * 0.05 for k in ks[:4]]
    opt = optax.adam(1e-3)
    state, x = opt.init(params), jax.random.normal(ks[4], (2048, 512), jnp.bfloat16)

    def step(params, state, x):
        def loss(p):
            h = x
            for w in p:
                h = jnp.tanh(h @ w)
            return jnp.mean(h.astype(jnp.float32) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    free = shardc.auto_shard(step, mesh=mesh).plan(params, state, x)
    sharded = shardc.auto_shard(step, mesh=mesh, memory_budget=free.predicted.peak_memory / 1.5)
    plan = sharded.plan(params, state, x)
    compiled = sharded.lower(params, state, x).compile()
    assert "f32[512,512]{1,0} all-gather(" in compiled.as_text()  # widened by XLA:CPU
    check = plan.verify(compiled, sharded.mesh_for(plan))
    kinds = {r.kind for r in check.rows}
    assert {"all-gather", "reduce-scatter"} <= kinds and not check.unplanned and \
        not check.missing, check.report()
    for r in check.rows:
        assert r.compiled_bytes == pytest.approx(r.planned_bytes, rel=0.01), check.report()
    assert check.compiled_comm_time == pytest.approx(check.predicted_comm_time, rel=0.05)
