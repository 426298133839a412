"""Ring signatures of ``dot_general`` (collective matmuls): each one the rule offers, run by
the lowering's ring (``shardc.lower.local``), equals the product on one device; a ring is
offered only where the cluster overlaps communication and only for dots with batch dims."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc.cost.ring import ring_cost, ring_workspace
from shardc.ir.sbp import B, NdSbp, Split
from shardc.ir.trace import trace
from shardc.lower.local import run_ring
from shardc.rules.dot import dot_general_rule, ring_of
from shardc.rules.registry import strategies


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("a", "d"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])


EINSUMS = {  # attention's products and their gradients, batch (b, h) first
    "scores": ("bhqd,bhkd->bhqk", (2, 4, 16, 8), (2, 4, 16, 8)),
    "output": ("bhqk,bhkd->bhqd", (2, 4, 16, 16), (2, 4, 16, 8)),
    "keys' gradient": ("bhqk,bhqd->bhkd", (2, 4, 16, 16), (2, 4, 16, 8)),
}


def _one(name):
    spec, ls, rs = EINSUMS[name]
    kl, kr = jax.random.split(jax.random.key(len(name)))
    args = (jax.random.normal(kl, ls), jax.random.normal(kr, rs))
    fn = lambda x, y: jnp.einsum(spec, x, y)  # noqa: E731
    return fn, args, jax.make_jaxpr(fn)(*args).eqns, trace(fn, *args).graph


@pytest.mark.parametrize("name", list(EINSUMS))
def test_each_ring_signature_equals_the_product_on_one_device(mesh, name):
    """Every ring signature the rule offers for the product, on the 2 x 4 mesh (the ring
    on "d"; "a" splits the batch of both operands and the result), forward and gradients,
    in one program."""
    fn, args, eqns, graph = _one(name)
    op = next(o for o in graph.ops if o.name == "dot_general")
    eqn = next(e for e in eqns if e.primitive.name == "dot_general")
    sigs = [sig for sig in dot_general_rule(op) if sig.ring >= 0]
    assert {sig.ring for sig in sigs} == {0, 1, 2}
    runs = []
    for sig in sigs:
        ins = tuple(NdSbp((Split(0), s)) for s in sig.ins)
        outs = (NdSbp((Split(0), sig.outs[0])),)
        assert ring_of(op, ins, outs) == (1, sig.ring), sig
        runs.append((SimpleNamespace(ins=ins, outs=outs), (1, sig.ring)))

    def rings(x, y):
        return [run_ring(mesh, eqn, op, planned, [x, y], ring)[0] for planned, ring in runs]

    def loss(x, y):
        return sum(jnp.sum(jnp.sin(r) * (k + 1)) for k, r in enumerate(rings(x, y)))

    got, grads = jax.jit(lambda x, y: (rings(x, y), jax.grad(loss, (0, 1))(x, y)))(*args)
    for sig, g in zip(sigs, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(fn(*args)), rtol=1e-5,
                                   atol=1e-5, err_msg=str(sig))
    scale = sum(range(1, len(sigs) + 1))
    want = jax.grad(lambda x, y: scale * jnp.sum(jnp.sin(fn(x, y))), (0, 1))(*args)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_rings_are_offered_for_dots_with_batch_dims_one_axis_at_a_time():
    _, _, _, graph = _one("scores")
    op = next(o for o in graph.ops if o.name == "dot_general")
    strats = strategies(op, (2, 4))
    rings = [s for s in strats if s.ring]
    assert rings and all(len(s.ring) == 2 for s in rings)
    assert {s.ring[0] for s in rings} == {0, 1}
    for s in rings:  # no other axis splits what the ring splits, nor holds a partial
        a = s.ring[0]
        for nd in (*s.ins, *s.outs):
            assert not nd.has_partial
            assert all(nd.sbps[b] != nd.sbps[a] or nd.sbps[a] == B
                       for b in range(2) if b != a)
    x = jnp.ones((16, 8))
    classifier = trace(lambda x, w: x @ w, x, x.T).graph.ops[0]
    assert not any(s.ring for s in strategies(classifier, (8,)))


def test_a_ring_pays_what_its_sends_outlast_where_the_cluster_overlaps():
    _, _, _, graph = _one("scores")
    op = next(o for o in graph.ops if o.name == "dot_general")
    ring = next(s for s in strategies(op, (8,)) if s.ring == (0, 1))
    slow = shardc.Cluster(device_flops=1e6, overlap=True)  # the products outlast the sends
    fast = shardc.Cluster(device_flops=1e15, overlap=True)
    serial = shardc.Cluster(device_flops=1e6)
    cost = {k: ring_cost(c, graph, op, ring, (8,), ("d",))
            for k, c in (("slow", slow), ("fast", fast), ("serial", serial))}
    assert cost["slow"].sends == 0.0 and cost["slow"].steps == 7
    assert cost["fast"].sends == pytest.approx(7 * (cost["fast"].send - cost["fast"].step))
    assert cost["serial"].sends == pytest.approx(7 * cost["serial"].send)
    assert cost["slow"].block_bytes == op.inputs[1].nbytes / 8


@pytest.mark.parametrize("reader,whole", [("exp", False), ("dot", True), ("output", True),
                                          ("exp and output", True)])
def test_an_unrolled_ring_holds_its_products_apart_only_where_a_reader_needs_the_result_whole(
        reader, whole):
    """Each step of an unrolled ring writes one block's product into a slice of the
    result: XLA:GPU fuses that concatenation into elementwise readers (the products are the
    result's one buffer), and writes the result apart, beside the products, for any other."""
    spec, ls, rs = EINSUMS["scores"]
    readers = {"exp": jnp.exp, "dot": lambda s: jnp.einsum("bhqk,bhkd->bhqd", s, s[..., :8]),
               "output": lambda s: s, "exp and output": lambda s: (s, jnp.exp(s))}
    fn = lambda x, y: readers[reader](jnp.einsum(spec, x, y))  # noqa: E731
    graph = trace(fn, jnp.ones(ls), jnp.ones(rs)).graph
    op = next(o for o in graph.ops if o.name == "dot_general")
    ring = next(s for s in strategies(op, (8,)) if s.ring == (0, 1))  # the keys pass
    result = op.outputs[0].nbytes / 8
    assert ring.outs[0].shard_fraction((8,)) == 1 / 8
    assert ring_workspace(graph, op, ring, (8,)) == (result if whole else 0.0)
