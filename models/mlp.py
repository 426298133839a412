"""A plain multi-layer perceptron regressor (Flax NNX), MSE loss, Optax Adam.

Feature dims are named Megatron-style (Shoeybi et al. 2019) for the expert baselines: the
input features are ``"embed"``, then the outputs of layers 0, 1, 2, ... alternate ``"mlp"``
(column-parallel layer) and ``"embed"`` (row-parallel layer), the last layer's included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardc.models.common import (
    Batch,
    TrainState,
    TrainStep,
    abstract_graphdef,
    build_train_step,
    init_train_state,
)
from shardc.models.layers import Axes, checked
from shardc.models.logical import constrain

__all__ = ["abstract_args", "build_step", "DATA_SEED", "example_batch", "features_axis",
           "init_state", "make_optimizer", "make_train_step", "MLP", "MLPConfig", "mse_loss",
           "param_axes", "PARAM_SEED", "TINY"]

PARAM_SEED = 0
DATA_SEED = 1


@dataclass(frozen=True)
class MLPConfig:
    """Shapes and hyper-parameters of the MLP training step."""

    batch: int = 8
    d_in: int = 16
    hidden: int = 32
    d_out: int = 8
    n_layers: int = 3
    learning_rate: float = 1e-2

    @classmethod
    def tiny(cls) -> MLPConfig:
        """Small preset for tests (all dims divisible by 8)."""
        return cls()

    @classmethod
    def realistic(cls, n_layers: int = 8) -> MLPConfig:
        """Benchmark preset: 8 layers of width 8192 over a batch of 1024 (weights dominate
        activations, the regime where tensor parallelism pays)."""
        return cls(batch=1024, d_in=4096, hidden=8192, d_out=4096, n_layers=n_layers,
                   learning_rate=1e-3)

    @property
    def layer_dims(self) -> list[tuple[int, int]]:
        """(in, out) features of each Linear layer."""
        if self.n_layers < 1:
            raise ValueError("n_layers must be >= 1")
        dims = [self.d_in] + [self.hidden] * (self.n_layers - 1) + [self.d_out]
        return list(itertools.pairwise(dims))


TINY = MLPConfig.tiny()


class MLP(nnx.Module):
    """``n_layers`` Linear layers (with bias) and ReLU between them."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [nnx.Linear(i, o, rngs=rngs) for i, o in config.layer_dims]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, ("batch", features_axis(0)))
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = jax.nn.relu(x)
            x = constrain(layer(x), ("batch", features_axis(i + 1)))
        return x


def features_axis(j: int) -> str:
    """Logical name of the features entering layer ``j`` (``j - 1``'s output)."""
    return "mlp" if j % 2 else "embed"


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Logical axis names of ``("layers", i, "kernel" | "bias")`` (see the module doc)."""
    names: Axes | None = None
    if len(path) == 3 and path[0] == "layers" and path[1].isdigit():
        i = int(path[1])
        fin, fout = features_axis(i), features_axis(i + 1)
        names = {"kernel": (fin, fout), "bias": (fout,)}.get(path[2])
    return checked(path, shape, names)


def mse_loss(model: MLP, batch: Batch) -> jax.Array:
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]``."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_optimizer(config: MLPConfig) -> optax.GradientTransformation:
    """Adam at ``config.learning_rate``."""
    return optax.adam(config.learning_rate)


def example_batch(config: MLPConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random regression batch ``{"x": [B, d_in], "y": [B, d_out]}``."""
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (config.batch, config.d_in), jnp.float32),
        "y": jax.random.normal(ky, (config.batch, config.d_out), jnp.float32),
    }


def init_state(config: MLPConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    model = MLP(config, rngs=nnx.Rngs(seed))
    return init_train_state(model, make_optimizer(config))


def build_step(config: MLPConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: MLP(config, rngs=nnx.Rngs(PARAM_SEED)))
    return build_train_step(graphdef, mse_loss, make_optimizer(config))


def make_train_step(config: MLPConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: MLPConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(lambda: (init_state(config), example_batch(config)))
