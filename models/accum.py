"""Gradient accumulation written as a Python loop over micro-batches, on the zoo's MLP.

The step cuts its batch into ``micro_batches`` micro-batches, computes ``jax.grad`` on each
in a Python ``for`` loop (so the jaxpr holds that many gradient computations, unrolled),
averages the gradients and the losses, and applies one Adam update. Micro-batch ``i`` is
rows ``i, i + K, i + 2K, ...`` of the batch (``reshape(B // K, K, ...)[:, i]``), so with the
batch split over the devices each device holds an equal share of every micro-batch, as a
data loader that feeds each device its own slice would give. The simple data-parallel plan
reduces the summed gradients once after the loop (or per micro-batch, combined by XLA); a
planner must tie it.

The network, loss and optimizer are :mod:`shardc.models.mlp`'s (Megatron-style feature
names, so every expert applies).

References:
    Huang et al. 2019, "GPipe" (micro-batches, gradients accumulated over them before one
    update); Shoeybi et al. 2019, "Megatron-LM" (the tensor-parallel forms the experts try).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax
from flax import nnx

from shardc.models import mlp
from shardc.models.common import Batch, PyTree, TrainState, TrainStep, abstract_graphdef
from shardc.models.mlp import abstract_args, example_batch, init_state, param_axes

__all__ = ["AccumConfig", "abstract_args", "build_step", "example_batch", "init_state",
           "make_train_step", "micro_batch", "param_axes"]


@dataclass(frozen=True)
class AccumConfig(mlp.MLPConfig):
    """:class:`shardc.models.mlp.MLPConfig` and the number of micro-batches."""

    micro_batches: int = 4

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.batch % self.micro_batches:
            raise ValueError(f"AccumConfig: batch {self.batch} does not split into "
                             f"micro_batches={self.micro_batches} equal micro-batches; pick "
                             "a batch that is a multiple of micro_batches")

    @classmethod
    def tiny(cls) -> AccumConfig:
        """Small preset for tests (all dims divisible by 8)."""
        return cls(batch=64, d_in=16, hidden=32, d_out=16, n_layers=3, micro_batches=4)

    @classmethod
    def bench(cls, n_layers: int = 4, micro_batches: int = 4) -> AccumConfig:
        """Benchmark preset: ``n_layers`` layers of width 1024 over a batch of 8192 (for 8
        devices; the zoo scales it with the device count) in ``micro_batches`` steps."""
        return cls(batch=8192, d_in=1024, hidden=1024, d_out=1024, n_layers=n_layers,
                   learning_rate=1e-3, micro_batches=micro_batches)


def micro_batch(batch: Batch, i: int, k: int) -> Batch:
    """Micro-batch ``i`` of ``k``: rows ``i, i + k, i + 2k, ...`` of every batch leaf."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:])[:, i], batch)


def build_step(config: AccumConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: mlp.MLP(config, rngs=nnx.Rngs(mlp.PARAM_SEED)))
    tx = mlp.make_optimizer(config)
    k = config.micro_batches

    def loss_of_params(params: PyTree, micro: Batch) -> jax.Array:
        return mlp.mse_loss(nnx.merge(graphdef, params), micro)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        params = state["params"]
        total_loss, total_grads = None, None
        for i in range(k):  # unrolled: k gradient computations in the jaxpr
            loss, grads = jax.value_and_grad(loss_of_params)(params, micro_batch(batch, i, k))
            if total_grads is None:
                total_loss, total_grads = loss, grads
            else:
                total_loss = total_loss + loss
                total_grads = jax.tree.map(jax.numpy.add, total_grads, grads)
        grads = jax.tree.map(lambda g: g / k, total_grads)
        updates, new_opt = tx.update(grads, state["opt"], params)
        return {"params": optax.apply_updates(params, updates), "opt": new_opt}, total_loss / k

    return train_step


def make_train_step(config: AccumConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))

