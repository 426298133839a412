"""The memory model against what XLA compiled: ``memory_analysis()`` arguments + results +
temporaries - aliased, per device."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import shardc
from shardc.inspect.hlo import compiled_peak_memory
from shardc.models import mlp
from shardc.solve.problem import _packed

MESH = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
CASES = {
    "mlp": (mlp, mlp.MLPConfig(batch=64, d_in=256, hidden=512, d_out=256, n_layers=3)),
}
# not yet: a small scanned Llama (d 128, vocab 512, 2 layers on (2, 4)) predicts 24.8 MiB
# where XLA compiles 37.3 MiB (-34%); the bench's Llama cells are within 1%


@pytest.mark.parametrize("name", sorted(CASES))
def test_predicted_peak_is_within_15_percent_of_the_compiled_one(name):
    module, cfg = CASES[name]
    step = shardc.auto_shard(module.build_step(cfg), mesh=MESH,
                             cluster=shardc.Cluster.multi_node(), time_limit=2.0)
    args = module.abstract_args(cfg)
    predicted = step.plan(*args).predicted.peak_memory
    compiled = compiled_peak_memory(step.lower(*args).compile())
    assert predicted == pytest.approx(compiled, rel=0.15)


def test_temporaries_are_placed_one_to_a_larger_result_buffer():
    # the largest first, each into the smallest buffer that holds it
    assert _packed(np.array([4.0, 3.0, 1.0]), np.array([3.0, 5.0])) == 7.0
    assert _packed(np.array([8.0]), np.array([2.0, 2.0, 2.0, 2.0])) == 0.0
    assert _packed(np.array([1.0, 1.0]), np.array([])) == 0.0
