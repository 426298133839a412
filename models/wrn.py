"""Wide Residual Network image classifier (Flax NNX, NHWC), cross entropy, SGD + momentum.

Zagoruyko & Komodakis 2016, "Wide Residual Networks" (BMVC). WRN-``depth``-``width``:
a 3x3 stem conv to 16 channels, then three groups of ``N = (depth - 4) / 6`` pre-activation
basic blocks (norm, ReLU, 3x3 conv, norm, ReLU, 3x3 conv; a strided 1x1 conv shortcut where
the shape changes) at widths ``16k, 32k, 64k`` and strides ``1, 2, 2``, then norm, ReLU,
global average pooling and a Linear classifier. No dropout.

GroupNorm replaces the paper's BatchNorm so that the training state is parameters only
(the zoo's ``{"params", "opt"}`` contract has no mutable ``batch_stats``) and the step has
no cross-batch reduction whose sharding would depend on the batch split. Optimizer: SGD
with Nesterov momentum 0.9 and weight decay 5e-4 on convolution / dense kernels, as in
the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from shardc.models.common import (
    Batch,
    TrainState,
    TrainStep,
    abstract_graphdef,
    build_train_step,
    decay_mask,
    image_batch,
    init_train_state,
    jit_by_config,
    prng_key,
    unjitted,
)
from shardc.models.layers import Axes, checked
from shardc.models.logical import constrain

__all__ = ["abstract_args", "build_step", "cross_entropy_loss", "DATA_SEED", "example_batch",
           "FEATURES", "init_state", "make_optimizer", "make_train_step", "param_axes",
           "PARAM_SEED", "WideBlock", "WideResNet", "WRNConfig"]

PARAM_SEED = 0
DATA_SEED = 1
FEATURES: Axes = ("batch", None, None, "conv_out")
"""A feature map ``[B, H, W, C]``."""


@dataclass(frozen=True)
class WRNConfig:
    """Shapes and hyper-parameters of the WRN training step."""

    depth: int = 10
    width: int = 1
    image_size: int = 8
    channels: int = 3
    n_classes: int = 16
    batch: int = 16
    norm_groups: int = 8
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        if (self.depth - 4) % 6 or self.depth < 10:
            raise ValueError("WRN depth must be 6N + 4 with N >= 1")

    @property
    def blocks_per_group(self) -> int:
        return (self.depth - 4) // 6

    @property
    def widths(self) -> tuple[int, int, int]:
        return (16 * self.width, 32 * self.width, 64 * self.width)

    @classmethod
    def tiny(cls) -> WRNConfig:
        """WRN-10-1 on 8x8x3 images, 16 classes, batch 16 (tests)."""
        return cls()

    @classmethod
    def realistic(cls, depth: int = 28, width: int = 10) -> WRNConfig:
        """WRN-28-10 on CIFAR-10 shaped input: 32x32x3, 10 classes, batch 128 (36.5M)."""
        return cls(depth=depth, width=width, image_size=32, n_classes=10, batch=128)


def _conv(c_in: int, c_out: int, k: int, stride: int, cfg: WRNConfig,
          rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(c_in, c_out, (k, k), strides=stride, padding="SAME", use_bias=False,
                    kernel_init=nnx.initializers.he_normal(), dtype=cfg.dtype,
                    param_dtype=cfg.dtype, rngs=rngs)


def _norm(c: int, cfg: WRNConfig, rngs: nnx.Rngs) -> nnx.GroupNorm:
    return nnx.GroupNorm(c, num_groups=cfg.norm_groups, epsilon=1e-5, dtype=cfg.dtype,
                         param_dtype=cfg.dtype, rngs=rngs)


class WideBlock(nnx.Module):
    """Pre-activation basic block ``c_in -> c_out`` with stride on the first conv."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: WRNConfig, *,
                 rngs: nnx.Rngs) -> None:
        self.norm1 = _norm(c_in, cfg, rngs)
        self.conv1 = _conv(c_in, c_out, 3, stride, cfg, rngs)
        self.norm2 = _norm(c_out, cfg, rngs)
        self.conv2 = _conv(c_out, c_out, 3, 1, cfg, rngs)
        self.shortcut = (_conv(c_in, c_out, 1, stride, cfg, rngs)
                         if stride != 1 or c_in != c_out else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        o = jax.nn.relu(self.norm1(x))
        y = constrain(self.conv1(o), FEATURES)
        y = constrain(self.conv2(jax.nn.relu(self.norm2(y))), FEATURES)
        residual = x if self.shortcut is None else constrain(self.shortcut(o), FEATURES)
        return constrain(y + residual, FEATURES)


class WideResNet(nnx.Module):
    """Stem conv, three groups of :class:`WideBlock`, norm, ReLU, pool, classifier."""

    def __init__(self, cfg: WRNConfig, *, rngs: nnx.Rngs) -> None:
        self.stem = _conv(cfg.channels, 16, 3, 1, cfg, rngs)
        blocks, c_in = [], 16
        for c_out, stride in zip(cfg.widths, (1, 2, 2), strict=True):
            for i in range(cfg.blocks_per_group):
                blocks.append(WideBlock(c_in, c_out, stride if i == 0 else 1, cfg,
                                        rngs=rngs))
                c_in = c_out
        self.blocks = nnx.List(blocks)
        self.norm = _norm(c_in, cfg, rngs)
        self.head = nnx.Linear(c_in, cfg.n_classes, dtype=cfg.dtype,
                               param_dtype=cfg.dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits ``[B, classes]`` for NHWC ``images [B, H, W, C]``."""
        x = constrain(images, ("batch", None, None, None))
        x = constrain(self.stem(x), FEATURES)
        for block in self.blocks:
            x = block(x)
        x = jnp.mean(jax.nn.relu(self.norm(x)), axis=(1, 2))
        x = constrain(x, ("batch", "conv_out"))
        return constrain(self.head(x), ("batch", "classes"))


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Conv kernels ``(None, None, "conv_in", "conv_out")``, norm scale / bias
    ``("conv_out",)`` (the channels of the feature map they normalise), classifier
    ``("conv_in", "classes")`` and ``("classes",)``."""
    path = tuple(path)
    names: Axes | None = None
    if path[-2:] == ("head", "kernel"):
        names = ("conv_in", "classes")
    elif path[-2:] == ("head", "bias"):
        names = ("classes",)
    elif path[-1] == "kernel" and len(path) >= 2 and (
            path[-2] in ("stem", "shortcut") or path[-2].startswith("conv")):
        names = (None, None, "conv_in", "conv_out")
    elif path[-1] in ("scale", "bias") and len(path) >= 2 and path[-2].startswith("norm"):
        names = ("conv_out",)
    return checked(path, shape, names)


def cross_entropy_loss(model: WideResNet, batch: Batch) -> jax.Array:
    """Mean softmax cross entropy of ``model(images)`` against integer ``labels``."""
    logits = model(batch["images"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))


def make_optimizer(config: WRNConfig) -> optax.GradientTransformation:
    """SGD, Nesterov momentum, weight decay on >= 2-D params (kernels) only."""
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.sgd(config.learning_rate, momentum=config.momentum, nesterov=True),
    )


@jit_by_config
def example_batch(config: WRNConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random ``{"images": [B, H, W, C] f32, "labels": [B] i32}``."""
    return image_batch(config.batch, config.image_size, config.channels, config.n_classes,
                       config.dtype, seed)


@jit_by_config
def init_state(config: WRNConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    model = WideResNet(config, rngs=nnx.Rngs(prng_key(seed)))
    return init_train_state(model, make_optimizer(config))


def build_step(config: WRNConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: WideResNet(config, rngs=nnx.Rngs(PARAM_SEED)))
    return build_train_step(graphdef, cross_entropy_loss, make_optimizer(config))


def make_train_step(config: WRNConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: WRNConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(
        lambda: (unjitted(init_state)(config), unjitted(example_batch)(config)))
