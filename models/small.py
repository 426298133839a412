"""A small, latency-bound MLP step: the zoo's cell whose best plan is data parallelism.

The network, loss and optimizer are :mod:`shardc.models.mlp`'s (Megatron-style feature
names, so every expert applies); only the shapes differ. Four layers of width 512 over a
batch of 8192 per 8 devices are about 25 microseconds of compute per H100 (the priced step,
with the batch's feed, is 0.15-0.2 ms), and the model has about a million parameters: one
gradient all-reduce of 4 MiB costs little more than NCCL's per-collective latency (tens of
microseconds). Tensor-parallel plans move activations larger than the weights, and
FSDP-style plans issue a collective per layer, each paying that latency again. Splitting the
batch and reducing the gradients once is the plan to beat, and a planner that prices
latency must find it.

References:
    NVIDIA NCCL ``src/graph/tuning.cc`` (per-collective latency, see
    :mod:`shardc.cost.collectives`); Shoeybi et al. 2019, "Megatron-LM" (the tensor-parallel
    forms the experts try).
"""

from __future__ import annotations

from shardc.models import mlp
from shardc.models.mlp import (
    abstract_args,
    build_step,
    example_batch,
    init_state,
    make_train_step,
    param_axes,
)

__all__ = ["SmallConfig", "abstract_args", "build_step", "example_batch", "init_state",
           "make_train_step", "param_axes"]


class SmallConfig(mlp.MLPConfig):
    """:class:`shardc.models.mlp.MLPConfig` with the small cell's presets."""

    @classmethod
    def tiny(cls) -> SmallConfig:
        """Small preset for tests (all dims divisible by 8)."""
        return cls(batch=64, d_in=16, hidden=32, d_out=16, n_layers=3)

    @classmethod
    def bench(cls, n_layers: int = 4) -> SmallConfig:
        """Benchmark preset: ``n_layers`` layers of width 512 over a batch of 8192 (for 8
        devices; the zoo scales it with the device count)."""
        return cls(batch=8192, d_in=512, hidden=512, d_out=512, n_layers=n_layers,
                   learning_rate=1e-3)
