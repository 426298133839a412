"""The resharding costs (priced α-β, the model these formulas pin) and the cluster object."""

import pytest

from shardc.cost.cluster import Cluster
from shardc.cost.comm import conversion
from shardc.ir.sbp import WHOLE, B, NdSbp, P, S

CL = Cluster(axis_bandwidth={"a": 100e9, "b": 10e9}, axis_latency={"a": 1e-6, "b": 5e-6},
             collective_model="alpha-beta")
SIZES, NAMES = (2, 4), ("a", "b")
MB = 1e6


def t(src, dst, nbytes=MB):
    return conversion(NdSbp(src), NdSbp(dst), SIZES, NAMES, CL).time(nbytes)


def test_one_axis_collectives_follow_the_ring_formulas():
    assert t((S(0), B), (B, B)) == pytest.approx(1e-6 + 0.5 * MB / 100e9)  # all-gather
    assert t((P, B), (B, B)) == pytest.approx(1e-6 + 2 * 0.5 * MB / 100e9)  # all-reduce
    assert t((B, P), (B, S(1))) == pytest.approx(5e-6 + 0.75 * MB / 10e9)  # reduce-scatter
    assert t((B, S(0)), (B, S(1))) == pytest.approx(5e-6 + 0.75 / 4 * MB / 10e9)  # all-to-all
    assert t((B, B), (S(0), S(1))) == 0.0  # slicing is free
    assert t((S(0), B), (S(0), B)) == 0.0


def test_nd_conversions_run_on_the_already_sharded_size():
    # all-reduce over b of a value split over a: half the bytes
    assert t((S(0), P), (S(0), B)) == pytest.approx(5e-6 + 2 * 0.75 * MB / 2 / 10e9)
    # partial on both axes to replicated: XLA emits ONE all-reduce over the 8 devices, which
    # runs at the slower link with the larger latency
    assert t((P, P), (B, B)) == pytest.approx(5e-6 + 2 * 7 / 8 * MB / 10e9)


def conv(src, dst):
    return conversion(NdSbp(src), NdSbp(dst), SIZES, NAMES, CL)


def test_partials_resolve_first_scatter_then_reduce():
    """(P, P) -> (B, S(1)): reduce-scatter over b, then all-reduce over a on a quarter of the
    data (what XLA compiles for that first constraint)."""
    c = conv((P, P), (B, S(1)))
    assert [(x.kind, x.axes) for x in c.collectives] == [("reduce-scatter", (1,)),
                                                          ("all-reduce", (0,))]
    assert c.time(MB) == pytest.approx(5e-6 + 0.75 * MB / 10e9 + 1e-6 + 2 * 0.5 * MB / 4 / 100e9)
    assert c.layouts == (NdSbp((B, S(1))),)
    # splits of different dims cannot scatter in one collective: all-reduce, then slice
    c = conv((P, P), (S(0), S(1)))
    assert [(x.kind, x.axes) for x in c.collectives] == [("all-reduce", (0, 1))]
    assert c.layouts == (NdSbp((B, B)), NdSbp((S(0), S(1))))


def test_a_whole_partial_is_all_reduced_then_sliced():
    """A scatter-add's partial table is reduced in full where it is made (XLA's scatter
    partitioning): to a split it is an all-reduce and a slice, never a reduce-scatter."""
    c = conv((B, WHOLE), (B, S(0)))
    assert [(x.kind, x.axes) for x in c.collectives] == [("all-reduce", (1,))]
    assert c.time(MB) == pytest.approx(t((B, P), (B, B)))
    assert conv((B, WHOLE), (B, B)).time(MB) == pytest.approx(t((B, P), (B, B)))
    assert [x.kind for x in conv((B, P), (B, S(0))).collectives] == ["reduce-scatter"]


def test_gathers_run_one_axis_at_a_time_slowest_first():
    """(S(0), S(1)) -> (B, B): gather over the slow axis b while the data is small, then over
    a; each step is a layout to pin, so XLA never gathers both at once."""
    c = conv((S(0), S(1)), (B, B))
    assert [(x.kind, x.axes) for x in c.collectives] == [("all-gather", (1,)),
                                                          ("all-gather", (0,))]
    local = MB / 8
    assert c.time(MB) == pytest.approx(5e-6 + 3 * local / 10e9 + 1e-6 + 1 * 4 * local / 100e9)
    assert c.layouts == (NdSbp((S(0), B)), NdSbp((B, B)))


def test_intermediate_layouts_always_divide_evenly():
    """(S(0), B) -> (B, S(0)): slicing first would split dim 0 eight ways, which neither end
    needs to divide; gather over a first, then slice over b."""
    c = conv((S(0), B), (B, S(0)))
    assert [x.kind for x in c.collectives] == ["all-gather"]
    assert c.layouts == (NdSbp((B, B)), NdSbp((B, S(0))))
    # a swap of dims on one axis is an all-to-all
    c = conv((B, S(0)), (B, S(1)))
    assert [(x.kind, x.axes) for x in c.collectives] == [("all-to-all", (1,))]


def test_combined_collectives_share_latency():
    conv = conversion(NdSbp((P, B)), NdSbp((B, B)), SIZES, NAMES, CL)
    assert conv.time(MB, alpha_scale=0.25) == pytest.approx(0.25e-6 + MB / 100e9)
    # XLA:CPU has no all-gather combiner: an all-gather keeps its whole latency
    gather = conversion(NdSbp((S(0), B)), NdSbp((B, B)), SIZES, NAMES, CL)
    assert gather.time(MB, alpha_scale=0.25) == pytest.approx(1e-6 + 0.5 * MB / 100e9)
    both = conversion(NdSbp((S(0), P)), NdSbp((B, B)), SIZES, NAMES, CL)  # gather + reduce
    assert both.time(MB, alpha_scale=0.25) == pytest.approx(
        1e-6 + 0.25 * 5e-6 + 0.5 * MB / 100e9 + 2 * 0.75 * MB / 2 / 10e9)


def test_cluster_validates_and_round_trips():
    with pytest.raises(ValueError, match="must be positive"):
        Cluster(axis_bandwidth={"a": 0.0})
    assert Cluster.from_json(CL.to_json()) == CL
    assert hash(Cluster.multi_node()) == hash(Cluster.multi_node())
    assert CL.bandwidth("zzz") == CL.default_bandwidth


def test_wire_bytes_match_the_planner_conversions():
    from shardc.cost.comm import wire_bytes

    # reduce-scatter P -> S over b (n=4) of a 1 MB value: result per device is MB / 4
    planned = conversion(NdSbp((B, P)), NdSbp((B, S(0))), SIZES, NAMES, CL).wire_bytes(MB)
    assert wire_bytes("reduce-scatter", 4, MB / 4) == pytest.approx(planned)
    planned = conversion(NdSbp((B, S(0))), NdSbp((B, B)), SIZES, NAMES, CL).wire_bytes(MB)
    assert wire_bytes("all-gather", 4, MB) == pytest.approx(planned)
    planned = conversion(NdSbp((B, S(0))), NdSbp((B, S(1))), SIZES, NAMES, CL).wire_bytes(MB)
    assert wire_bytes("all-to-all", 4, MB / 4) == pytest.approx(planned)
    with pytest.raises(ValueError, match="unknown collective kind"):
        wire_bytes("broadcast", 4, MB)


def test_a_dim_split_over_two_axes_gathers_its_minor_axis_first():
    """Dim 0 split over (a, b) is cut a-major; gathering a first would leave each device's
    pieces out of order (XLA adds a collective-permute), so b goes first even when a is the
    slower link."""
    slow_a = Cluster(axis_bandwidth={"a": 10e9, "b": 100e9}, axis_latency={"a": 5e-6, "b": 1e-6})
    c = conversion(NdSbp((S(0), S(0))), NdSbp((B, B)), SIZES, NAMES, slow_a)
    assert [(x.kind, x.axes) for x in c.collectives] == [("all-gather", (1,)),
                                                          ("all-gather", (0,))]
    assert c.layouts == (NdSbp((S(0), B)), NdSbp((B, B)))
    # a slice may only add the minor axis of a dim: (B, S(0)) -> (S(0), S(0)) regathers
    c = conversion(NdSbp((B, S(0))), NdSbp((S(0), S(0))), SIZES, NAMES, slow_a)
    assert c.layouts == (NdSbp((B, B)), NdSbp((S(0), S(0))))


def test_a_preset_takes_one_axis_by_its_name():
    from shardc import Cluster

    assert Cluster.nvlink_node("gpu") == Cluster.nvlink_node(("gpu",))
    assert Cluster.tpu_v4("x") == Cluster.tpu_v4(("x",))
    assert "gpu" in Cluster.nvlink_node("gpu").axis_bandwidth
