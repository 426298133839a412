"""GPT-2 style decoder-only transformer (Flax NNX), next-token loss, Optax AdamW.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners". Blocks come
from :mod:`shardc.models.layers` (explicit einsum attention with a causal mask, no fused paths);
layers are an unrolled Python loop. Activations carry logical-axis annotations
(:func:`models.logical.constrain`, inert by default) and :func:`param_axes` names every
parameter dim for the expert baselines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from shardc.models.common import (
    Batch,
    PyTree,
    TrainState,
    TrainStep,
    abstract_graphdef,
    build_train_step,
    init_train_state,
)
from shardc.models.layers import RESID, Axes, Block, checked, layer_norm, transformer_param_axes
from shardc.models.logical import constrain

__all__ = ["abstract_args", "build_step", "DATA_SEED", "example_batch", "GPT", "GPTConfig",
           "init_state", "INIT_STD", "make_optimizer", "make_train_step", "next_token_loss",
           "param_axes", "PARAM_SEED"]

PARAM_SEED = 0
DATA_SEED = 1
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shapes and hyper-parameters of the GPT training step."""

    vocab: int = 256
    seq_len: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    batch: int = 8
    learning_rate: float = 1e-3
    dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls) -> GPTConfig:
        """Small preset for tests (all dims divisible by 8)."""
        return cls(vocab=256, seq_len=16, d_model=64, n_heads=4, n_layers=2, batch=8)

    @classmethod
    def gpt2_small(cls, n_layers: int = 12) -> GPTConfig:
        """GPT-2 small (124M params at 12 layers; vocab padded to 50304)."""
        return cls(
            vocab=50304,
            seq_len=1024,
            d_model=768,
            n_heads=12,
            n_layers=n_layers,
            batch=8,
            learning_rate=6e-4,
        )


class GPT(nnx.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, tied output head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(INIT_STD)
        kw: dict[str, Any] = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        self.wte = nnx.Embed(
            cfg.vocab, cfg.d_model, embedding_init=init, rngs=rngs, **kw
        )
        self.wpe = nnx.Embed(
            cfg.seq_len, cfg.d_model, embedding_init=init, rngs=rngs, **kw
        )
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.blocks = nnx.List([
            Block(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, causal=True, std=INIT_STD,
                  proj_std=proj_std, dtype=cfg.dtype, rngs=rngs)
            for _ in range(cfg.n_layers)
        ])
        self.ln_f = layer_norm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[B, T, vocab]`` for int tokens ``[B, T]``."""
        t = tokens.shape[1]
        x = constrain(self.wte(tokens) + self.wpe.embedding[...][:t], RESID)
        for block in self.blocks:
            x = block(x)
        x = constrain(self.ln_f(x), RESID)
        return constrain(x @ self.wte.embedding[...].T, ("batch", "seq", "vocab"))


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Logical axis names of the parameter at ``path`` (string keys) with ``shape``."""
    names = {
        ("wte", "embedding"): ("vocab", "embed"),
        ("wpe", "embedding"): (None, "embed"),
    }.get(tuple(path)) or transformer_param_axes(path)
    return checked(path, shape, names)


def next_token_loss(model: GPT, batch: Batch) -> jax.Array:
    """Mean next-token cross entropy of ``model(tokens)`` against ``targets``."""
    logits = model(batch["tokens"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.mean(losses)


def _decay_mask(params: PyTree) -> PyTree:
    """Weight-decay matrices and embeddings only (not biases / LayerNorm)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: GPTConfig) -> optax.GradientTransformation:
    """AdamW (GPT-2 style betas, weight decay 0.1 on >=2-D params)."""
    return optax.adamw(
        config.learning_rate, b1=0.9, b2=0.95, weight_decay=0.1, mask=_decay_mask
    )


def example_batch(config: GPTConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random token batch; ``targets`` are ``tokens`` shifted by one."""
    seq = jax.random.randint(
        jax.random.key(seed),
        (config.batch, config.seq_len + 1),
        0,
        config.vocab,
        jnp.int32,
    )
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def init_state(config: GPTConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    return init_train_state(model, make_optimizer(config))


def build_step(config: GPTConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: GPT(config, rngs=nnx.Rngs(PARAM_SEED)))
    return build_train_step(graphdef, next_token_loss, make_optimizer(config))


def make_train_step(config: GPTConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: GPTConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(lambda: (init_state(config), example_batch(config)))
