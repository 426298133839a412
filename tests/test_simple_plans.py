"""Never losing to a simple plan: where data parallelism (over every axis, or over the
inner axis with the slower outer one replicated) is the cheapest compiled program among the
hand-written forms, shardc's default plan (no seeds, default options) compiles to the same
collectives."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import shardc
import shardc.models.gpt as gpt
from shardc.bench.experts import compile_expert, seed_experts
from shardc.inspect import price

# small weights, a large batch: gradients are cheap to reduce, activations dear to move
CFG = gpt.GPTConfig(vocab=1024, seq_len=128, d_model=256, n_heads=4, n_layers=2, batch=64)


def _signature(cost) -> list:
    return sorted((c.kind, c.axes, c.result_bytes) for c in cost.collectives)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,cluster,winner", [
    ((8,), ("gpu",), shardc.Cluster(), "data-parallel"),
    ((2, 4), ("node", "gpu"), shardc.Cluster.multi_node("node", "gpu"), "data-parallel-node"),
])
def test_default_plan_compiles_to_data_parallelism_where_it_is_cheapest(shape, names, cluster,
                                                                        winner):
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    args = gpt.abstract_args(CFG)
    experts = {}
    for e in seed_experts(mesh, cluster):
        _, lowered = compile_expert(gpt.build_step(CFG), *args, mesh, e, gpt.param_axes)
        experts[e.name] = price(lowered.compile(), mesh, cluster)
    best = min(experts, key=lambda k: experts[k].time)
    assert best == winner, {k: c.time for k, c in experts.items()}  # the premise
    step = shardc.auto_shard(gpt.build_step(CFG), mesh=mesh, cluster=cluster)
    ours = price(step.lower(*args).compile(), mesh, cluster)
    assert _signature(ours) == _signature(experts[winner])
    np.testing.assert_allclose(ours.time, experts[winner].time, rtol=1e-3)
