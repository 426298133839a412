"""The IR: tracing and inlining, the verifier, printing, SBP <-> PartitionSpec."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as PS

from shardc.ir.graph import Graph, GraphError, Op, Value, check_graph
from shardc.ir.sbp import B, NdSbp, P, S, from_partition_spec, parse_sbp, to_partition_spec
from shardc.ir.trace import trace


def test_trace_inlines_calls_and_drops_dead_code():
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    g.defvjp(lambda x: (jnp.sin(x), x), lambda r, ct: (ct * jnp.cos(r),))

    @jax.jit
    def inner(x):
        return jax.nn.relu(x) + jax.checkpoint(jnp.cos)(x)

    def f(x):
        _unused = jnp.exp(x)
        return g(inner(x)) * 2.0

    graph = trace(f, jnp.ones((4, 8))).graph
    check_graph(graph)
    names = [op.name for op in graph.ops]
    assert not {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"} & set(
        names)
    assert "exp" not in names  # dead
    assert {"max", "cos", "sin", "add", "mul"} <= set(names)


def test_str_graph_prints_like_a_jaxpr():
    graph = trace(lambda x, w: jnp.tanh(x @ w), jnp.ones((2, 3)), jnp.ones((3, 4))).graph
    assert str(graph) == (
        "{ lambda ; v0:f32[2,3] v1:f32[3,4]. let\n"
        "    v2:f32[2,4] = dot_general[dimension_numbers=(((1,), (0,)), ((), ())) "
        "preferred_element_type=dtype('float32')] v0 v1\n"
        "    v3:f32[2,4] = tanh v2\n"
        "  in (v3) }"
    )


class _Prim:
    name = "neg"
    multiple_results = False


def test_check_graph_names_the_broken_invariant():
    x = Value(0, (2,), "float32")
    op = Op(0, _Prim(), {}, [x], [])
    y = Value(1, (2,), "float32", producer=op)
    op.outputs = [y]
    check_graph(Graph([x], [y], [op]))
    with pytest.raises(GraphError, match="before it is defined"):
        check_graph(Graph([], [y], [op]))
    with pytest.raises(GraphError, match="never defined"):
        check_graph(Graph([x], [Value(7, (2,), "float32")], [op]))
    with pytest.raises(GraphError, match="redefines"):
        check_graph(Graph([x], [y], [op, op.replace(id=1)]))


def test_layouts_made_apart_are_equal_exactly_when_their_sbps_are():
    """NdSbp compares a key of plain values: equal sbps made apart are equal (and hash
    alike, so they find each other's table entries); a split on another dim, another
    partial reduction, broadcast against a split of dim 0, or another type are not."""
    from shardc.ir.sbp import WHOLE, Broadcast, Partial, Split

    a, b = NdSbp((S(0), B, P)), NdSbp((Split(0), Broadcast(), Partial("sum")))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != NdSbp((S(1), B, P)) and a != NdSbp((S(0), B, WHOLE))
    assert NdSbp((B,)) != NdSbp((S(0),)) and NdSbp((S(0),)) != NdSbp((S(0), B))
    assert NdSbp((B,)) != NdSbp((S(-1),))  # no split's dim stands for broadcast
    assert a != a.sbps and a != "(S(0), B, P)"


def test_partition_spec_round_trip():
    names = ("node", "gpu")
    nd = NdSbp((S(0), S(0)))
    assert to_partition_spec(nd, 2, names) == PS(("node", "gpu"))
    assert from_partition_spec(PS(("node", "gpu")), 2, names) == nd
    assert to_partition_spec(NdSbp((B, S(1))), 3, names) == PS(None, "gpu")
    assert from_partition_spec(PS(None, "gpu"), 3, names) == NdSbp((B, S(1)))
    assert to_partition_spec(NdSbp((P, S(0))), 2, names) == PS("gpu")  # partial is XLA's
    with pytest.raises(ValueError, match="out of mesh order"):
        from_partition_spec(PS(("gpu", "node")), 2, names)
    assert NdSbp.from_json(NdSbp((P, S(2))).to_json()) == NdSbp((P, S(2)))
    with pytest.raises(ValueError, match="cannot parse SBP"):
        parse_sbp("X(1)")


def test_device_pieces_agree_with_jax_on_every_view_of_the_devices():
    """Two split layouts, on one view of the 8 devices or on two, hold the same piece on
    every device (JAX's ``devices_indices_map``) exactly when ``device_pieces`` says so;
    partial layouts differ by which devices' summands are added."""
    import itertools

    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from shardc.ir.sbp import device_pieces

    devices = np.asarray(jax.devices()[:8])
    views = [(8,), (2, 4), (4, 2), (2, 2, 2)]
    shape = (8, 8)
    layouts = []
    for view in views:
        names = tuple(f"a{k}" for k in range(len(view)))
        mesh = Mesh(devices.reshape(view), names)
        for sbps in itertools.product((B, S(0), S(1)), repeat=len(view)):
            nd = NdSbp(sbps)
            held = NamedSharding(mesh, to_partition_spec(nd, 2, names)).devices_indices_map(
                shape)
            key = tuple(tuple((s.start, s.stop) for s in held[d]) for d in devices)
            layouts.append((device_pieces(nd, view), key))
    pairs = 0
    for (mine_a, jax_a), (mine_b, jax_b) in itertools.combinations(layouts, 2):
        assert (mine_a == mine_b) == (jax_a == jax_b)
        pairs += mine_a == mine_b
    assert pairs > 20  # views share layouts: data parallelism on each, among others
    assert device_pieces(NdSbp((S(0), S(0))), (2, 4)) == device_pieces(NdSbp((S(0),)), (8,))
    assert device_pieces(NdSbp((P, B)), (2, 4)) != device_pieces(NdSbp((B, P)), (2, 4))
    assert device_pieces(NdSbp((P, P)), (2, 4)) == device_pieces(NdSbp((P,)), (8,))
    assert device_pieces(NdSbp((P,)), (8,)) != device_pieces(NdSbp((B,)), (8,))


def test_fits_checks_divisibility():
    assert NdSbp((S(0), S(0))).fits((8, 3), (2, 4))
    assert not NdSbp((S(0), S(0))).fits((4, 3), (2, 4))
    assert not NdSbp((S(2), B)).fits((4, 3), (2, 4))
