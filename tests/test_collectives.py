"""Collectives priced as NCCL runs them (shardc.cost.collectives), against NCCL's own model
worked by hand from ``src/graph/tuning.cc``'s tables."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from shardc.cost.cluster import IB_BW, NVLINK_BW, Cluster
from shardc.cost.collectives import seconds
from shardc.cost.comm import conversion
from shardc.inspect.groups import group_spans
from shardc.ir.sbp import B, NdSbp, P, S

US = 1e-6
NODE = Cluster.nvlink_node()
TWO = Cluster.multi_node()


def ar(cluster, spans, nbytes):
    return cluster.collective_seconds("all-reduce", spans, nbytes)


def test_one_mib_all_reduce_over_8_nvlink_gpus_is_nccls_26_us():
    """Ring/LL wins at 1 MiB: 3.6 µs + 14 steps x 0.47 µs, then 1 MiB at a quarter of
    450 GB/s bus bandwidth times 8/14 (NCCL's ring bus -> algorithm bandwidth)."""
    t = ar(NODE, [("gpu", 8)], 2**20)
    by_hand = (3.6 + 14 * 0.47) * US + 2**20 / (NVLINK_BW / 4 * 8 / 14)
    assert t == pytest.approx(by_hand)
    assert t == pytest.approx(26e-6, rel=0.10)


def test_an_8_byte_all_reduce_is_nccls_10_us_of_latency():
    assert ar(NODE, [("gpu", 8)], 8) == pytest.approx(10e-6, rel=0.10)
    # the α-β model charged one 3.4 µs step: NCCL pays 3x that
    ab = Cluster(**{**NODE.to_json(), "collective_model": "alpha-beta"})
    assert ab.collective_seconds("all-reduce", [("gpu", 8)], 8) < 3.5e-6


def test_large_messages_run_ring_simple_at_the_bus_bandwidth():
    n = 2**30
    t = ar(NODE, [("gpu", 8)], n)
    assert t == pytest.approx((8.4 + 14 * 3.4) * US + 2 * 7 / 8 * n / NVLINK_BW, rel=1e-6)


def test_pessimistic_ring_pays_every_step_and_optimistic_alpha_beta_one():
    models = {m: Cluster(**{**NODE.to_json(), "collective_model": m})
              for m in ("nccl", "ring", "alpha-beta")}
    for nbytes in (8, 2**16, 2**20, 2**26):
        t = {m: ar(c, [("gpu", 8)], nbytes) for m, c in models.items()}
        assert t["alpha-beta"] <= t["nccl"] <= t["ring"]
    assert ar(models["ring"], [("gpu", 8)], 8) == pytest.approx((8.4 + 14 * 3.4) * US,
                                                                 rel=1e-3)


def test_a_group_over_nodes_uses_every_nic_of_the_node():
    """16 GPUs on 2 nodes: the ring crosses the network on 8 NICs at once (bus bandwidth
    min(NVLink, 8 x 50 GB/s)); the node axis alone, one GPU per node, has one NIC."""
    both = TWO.group([("node", 2), ("gpu", 8)])
    assert (both.ranks, both.nodes, both.bandwidth) == (16, 2, min(NVLINK_BW, 8 * IB_BW))
    across = TWO.group([("node", 2)])
    assert (across.ranks, across.nodes, across.bandwidth) == (2, 2, IB_BW)
    n = 2**30
    # a large all-reduce: ring/Simple, 2 of its 30 steps cross the network (and NCCL's 1.9x
    # plateau latency on several nodes)
    lat = (8.4 + 28 * 3.4 + 2 * 9.6) * 1.9 * US
    assert ar(TWO, [("node", 2), ("gpu", 8)], n) == pytest.approx(
        lat + 2 * 15 / 16 * n / (8 * IB_BW), rel=1e-6)
    assert ar(TWO, [("node", 2)], n) > ar(TWO, [("node", 2), ("gpu", 8)], n)


def test_a_flattened_view_axis_keeps_its_nodes():
    """A view's 16-device axis over (node, gpu) is priced as the two physical axes are."""
    from shardc.tradeoff.views import views

    flat = next(v for v in views((2, 8), ("node", "gpu"), TWO) if len(v.shape) == 1)
    (name,) = flat.names
    assert flat.cluster.group([(name, 16)]) == TWO.group([("node", 2), ("gpu", 8)])


def test_tpu_ici_is_a_bidirectional_ring():
    tpu = Cluster.tpu_v4(("x", "y"))
    n = 2**24
    assert tpu.collective_seconds("all-gather", [("x", 4)], n) == pytest.approx(
        2 * 1e-6 + 3 / 4 * n / (2 * 45e9))


def test_conversions_price_their_collectives_with_the_clusters_model():
    conv = conversion(NdSbp((P,)), NdSbp((B,)), (8,), ("gpu",), NODE)
    assert conv.time(2**20) == pytest.approx(ar(NODE, [("gpu", 8)], 2**20))
    # an all-gather's buffer is the gathered array
    gather = conversion(NdSbp((S(0),)), NdSbp((B,)), (8,), ("gpu",), NODE)
    assert gather.time(2**20) == pytest.approx(
        NODE.collective_seconds("all-gather", [("gpu", 8)], 2**20))
    # combined collectives share the latency, not the bytes
    assert conv.time(8, alpha_scale=0.25) == pytest.approx(
        seconds("all-reduce", NODE.group([("gpu", 8)]), 8.0, "nccl", 0.25))
    assert conv.time(8, alpha_scale=0.25) < conv.time(8)


def test_cluster_checks_link_kinds_and_models():
    with pytest.raises(ValueError, match="collective_model must be one of"):
        Cluster(collective_model="logp")
    with pytest.raises(ValueError, match="axis_link\\['gpu'\\] must be one of"):
        Cluster(axis_link={"gpu": "infiniband"})
    assert Cluster.from_json(TWO.to_json()) == TWO
    old = {k: v for k, v in TWO.to_json().items()
           if k in ("axis_bandwidth", "axis_latency", "device_flops")}
    assert Cluster.from_json(old).collective_model == "nccl"  # plans saved before load


def test_compiled_groups_inside_one_axis_are_priced_on_that_axis():
    """XLA's GQA reshards run groups of 2 GPUs inside a node: NVLink, not the network."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "gpu"))
    assert group_spans(((0, 1), (2, 3), (4, 5), (6, 7)), mesh) == (("gpu", 2),)
    assert group_spans(((0, 4), (1, 5), (2, 6), (3, 7)), mesh) == (("node", 2),)
    assert group_spans(((0, 1, 4, 5), (2, 3, 6, 7)), mesh) == (("node", 2), ("gpu", 2))
