"""Vision Transformer image classifier (Flax NNX), cross entropy, Optax AdamW.

Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale" (ICLR). Images ``[B, H, W, C]`` are cut into ``P x P`` patches by a
reshape + transpose (no convolution) to ``[B, N, P*P*C]`` and embedded by a Linear layer;
a learned class token is prepended and a learned position embedding added; pre-LN
non-causal transformer blocks (:mod:`shardc.models.layers`) follow, then a LayerNorm and a
zero-initialised Linear head on the class token. Activations carry logical-axis
annotations (inert by default) and :func:`param_axes` names every parameter dim.
"""

from __future__ import annotations

import math
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
from shardc.models.layers import (
    RESID,
    Axes,
    Block,
    checked,
    dense,
    layer_norm,
    transformer_param_axes,
)
from shardc.models.logical import constrain

__all__ = ["abstract_args", "build_step", "cross_entropy_loss", "DATA_SEED", "example_batch",
           "init_state", "INIT_STD", "make_optimizer", "make_train_step", "param_axes",
           "PARAM_SEED", "patchify", "ViT", "ViTConfig"]

PARAM_SEED = 0
DATA_SEED = 1
INIT_STD = 0.02


@dataclass(frozen=True)
class ViTConfig:
    """Shapes and hyper-parameters of the ViT training step."""

    image_size: int = 16
    patch: int = 4
    channels: int = 3
    n_classes: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    batch: int = 16
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        if self.image_size % self.patch:
            raise ValueError("image_size must be divisible by patch")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * self.channels

    @classmethod
    def tiny(cls) -> ViTConfig:
        """16x16x3 images, 4x4 patches (16 tokens + class token), d 64, 2 blocks."""
        return cls()

    @classmethod
    def realistic(cls, n_layers: int = 12) -> ViTConfig:
        """ViT-B/16 at 224x224 (196 patches + class token), 1000 classes, batch 32."""
        return cls(image_size=224, patch=16, n_classes=1000, d_model=768, n_heads=12,
                   n_layers=n_layers, d_ff=3072, batch=32, learning_rate=3e-4)


def patchify(images: jax.Array, patch: int) -> jax.Array:
    """``[B, H, W, C] -> [B, (H/P)*(W/P), P*P*C]``, patches in row-major order."""
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, patch * patch * c)


class ViT(nnx.Module):
    """Patch embedding, class token, position embedding, blocks, LayerNorm, head."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.patch = cfg.patch
        self.patch_embed = dense(cfg.patch_dim, d, std=1 / math.sqrt(cfg.patch_dim),
                                 dtype=cfg.dtype, rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, d), cfg.dtype))
        self.pos = nnx.Param(nnx.initializers.normal(INIT_STD)(
            rngs.params(), (1, cfg.n_patches + 1, d), cfg.dtype))
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.blocks = nnx.List([
            Block(d, cfg.n_heads, cfg.d_ff, causal=False, std=INIT_STD, proj_std=proj_std,
                  dtype=cfg.dtype, rngs=rngs)
            for _ in range(cfg.n_layers)
        ])
        self.ln_f = layer_norm(d, dtype=cfg.dtype, rngs=rngs)
        self.head = dense(d, cfg.n_classes, std=0.0, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits ``[B, classes]`` for NHWC ``images [B, H, W, C]``."""
        x = constrain(patchify(images, self.patch), ("batch", "seq", "patch"))
        x = constrain(self.patch_embed(x), RESID)
        b, _, d = x.shape
        cls = jnp.broadcast_to(self.cls[...], (b, 1, d))
        x = constrain(jnp.concatenate([cls, x], axis=1) + self.pos[...], RESID)
        for block in self.blocks:
            x = block(x)
        x = constrain(self.ln_f(x[:, 0]), ("batch", "embed"))
        return constrain(self.head(x), ("batch", "classes"))


_VIT_AXES: dict[tuple[str, ...], Axes] = {
    ("patch_embed", "kernel"): ("patch", "embed"),
    ("patch_embed", "bias"): ("embed",),
    ("cls",): (None, None, "embed"),
    ("pos",): (None, None, "embed"),
    ("head", "kernel"): ("embed", "classes"),
    ("head", "bias"): ("classes",),
}


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Logical axis names of the parameter at ``path`` (string keys) with ``shape``."""
    path = tuple(path)
    return checked(path, shape, _VIT_AXES.get(path) or transformer_param_axes(path))


def cross_entropy_loss(model: ViT, batch: Batch) -> jax.Array:
    """Mean softmax cross entropy of ``model(images)`` against integer ``labels``."""
    logits = model(batch["images"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))


def make_optimizer(config: ViTConfig) -> optax.GradientTransformation:
    """AdamW (betas 0.9 / 0.999), weight decay on >= 2-D params only."""
    return optax.adamw(config.learning_rate, weight_decay=config.weight_decay, mask=decay_mask)


@jit_by_config
def example_batch(config: ViTConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random ``{"images": [B, H, W, C] f32, "labels": [B] i32}``."""
    return image_batch(config.batch, config.image_size, config.channels, config.n_classes,
                       config.dtype, seed)


@jit_by_config
def init_state(config: ViTConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    return init_train_state(ViT(config, rngs=nnx.Rngs(prng_key(seed))), make_optimizer(config))


def build_step(config: ViTConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: ViT(config, rngs=nnx.Rngs(PARAM_SEED)))
    return build_train_step(graphdef, cross_entropy_loss, make_optimizer(config))


def make_train_step(config: ViTConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: ViTConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(
        lambda: (unjitted(init_state)(config), unjitted(example_batch)(config)))
