"""GShard-style top-2 Mixture-of-Experts decoder-only transformer (Flax NNX), AdamW.

Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional
Computation and Automatic Sharding" (ICLR 2021). GPT-style pre-LN causal blocks
(:mod:`shardc.models.layers`) where every other block (the odd ones) replaces its MLP by an MoE
layer: a router (Linear d -> E), top-2 gating with an expert capacity, and experts held as
stacked weights ``[E, d, ffn]`` / ``[E, ffn, d]``. Each sequence is one routing group of
``S = seq_len`` tokens (the paper's groups) with ``capacity = ceil(2 * S * capacity_factor / E)``.

The dispatch / combine tensors ``[G, S, E, C]`` are dense and built as in the paper's
Algorithm 2 with ``argmax`` (twice, masking the first choice), ``one_hot`` and ``cumsum``:
no sort, no top_k, no gather. Tokens are moved to experts and back by einsum only. The
load-balancing loss ``mean_e(density_e * density_proxy_e) * E^2`` is added to the LM loss.
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

from shardc.models import common
from shardc.models.common import Batch, TrainState, TrainStep, jit_by_config
from shardc.models.layers import RESID, Axes, Block, SelfAttention, checked, layer_norm
from shardc.models.layers import transformer_param_axes as block_param_axes
from shardc.models.logical import constrain

__all__ = ["abstract_args", "build_step", "DATA_SEED", "DISPATCHED", "example_batch",
           "init_state", "INIT_STD", "lm_loss", "make_optimizer", "make_train_step", "MoEBlock",
           "MoEConfig", "MoELayer", "MoETransformer", "param_axes", "PARAM_SEED", "ROUTING",
           "top2_gating"]

PARAM_SEED = 0
DATA_SEED = 1
INIT_STD = 0.02
DISPATCHED: Axes = ("expert", "batch", None, "embed")  # tokens at experts [E, G, C, d]
ROUTING: Axes = ("batch", "seq", "expert", None)  # dispatch / combine [G, S, E, C]


@dataclass(frozen=True)
class MoEConfig:
    """Shapes and hyper-parameters of the MoE training step."""

    vocab: int = 256
    seq_len: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    n_experts: int = 8
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01
    batch: int = 8
    learning_rate: float = 1e-3
    dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        if self.n_experts < 2:
            raise ValueError("top-2 gating needs n_experts >= 2")

    @property
    def capacity(self) -> int:
        """Expert capacity per group: ``ceil(2 * seq_len * capacity_factor / E)``."""
        return math.ceil(2 * self.seq_len * self.capacity_factor / self.n_experts)

    @classmethod
    def tiny(cls) -> MoEConfig:
        """Small preset for tests: 2 blocks (the second MoE), 8 experts, d 64, capacity 8."""
        return cls()

    @classmethod
    def realistic(cls, n_layers: int = 8) -> MoEConfig:
        """Benchmark preset: 8 blocks (4 MoE), d 768, 16 experts, seq 512, capacity 80."""
        return cls(vocab=32000, seq_len=512, d_model=768, n_heads=12, n_layers=n_layers,
                   d_ff=3072, n_experts=16, capacity_factor=1.25, batch=16,
                   learning_rate=3e-4)


def top2_gating(logits: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating of router ``logits [G, S, E]`` (Algorithm 2, float32).

    Returns ``(combine, dispatch, aux_loss)``: ``combine [G, S, E, C]`` holds each token's
    normalised gate weight at its (expert, slot), ``dispatch`` is its 0/1 support; tokens
    past an expert's capacity are dropped (their residual passes through unchanged).
    """
    n_experts = logits.shape[-1]
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    mask_1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), n_experts, dtype=gates.dtype)
    density_1 = jnp.mean(mask_1, axis=1)  # fraction of each group's tokens sent (top-1)
    density_proxy = jnp.mean(gates, axis=1)  # differentiable proxy: mean router prob
    aux = jnp.mean(density_1 * density_proxy) * (n_experts * n_experts)
    gates_2 = gates * (1.0 - mask_1)  # mask the first choice, take the argmax again
    mask_2 = jax.nn.one_hot(jnp.argmax(gates_2, axis=-1), n_experts, dtype=gates.dtype)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    denom = gate_1 + gate_2 + jnp.finfo(gates.dtype).eps
    # Slot of each token in its expert's buffer: exclusive cumsum over the group; second
    # choices queue behind all first choices.
    pos_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (pos_2 < capacity)
    gate_1 = gate_1 / denom * jnp.sum(mask_1, axis=-1)
    gate_2 = gate_2 / denom * jnp.sum(mask_2, axis=-1)
    slot_1 = jax.nn.one_hot(jnp.sum(pos_1 * mask_1, axis=-1).astype(jnp.int32), capacity)
    slot_2 = jax.nn.one_hot(jnp.sum(pos_2 * mask_2, axis=-1).astype(jnp.int32), capacity)
    combine = (gate_1[..., None, None] * mask_1[..., None] * slot_1[..., None, :]
               + gate_2[..., None, None] * mask_2[..., None] * slot_2[..., None, :])
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch, aux


class MoELayer(nnx.Module):
    """Router + top-2 gating + ``E`` GELU experts applied by einsum to dispatched tokens."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs) -> None:
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.capacity = cfg.capacity
        self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs, dtype=cfg.dtype,
                                 param_dtype=cfg.dtype,
                                 kernel_init=nnx.initializers.normal(INIT_STD))
        normal = nnx.initializers.normal
        self.wi = nnx.Param(normal(INIT_STD)(rngs.params(), (e, d, f), cfg.dtype))
        self.wo = nnx.Param(normal(proj_std)(rngs.params(), (e, f, d), cfg.dtype))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(y [G, S, d], aux_loss)`` for tokens ``x [G, S, d]`` (one group per row)."""
        combine, dispatch, aux = top2_gating(self.router(x), self.capacity)
        combine = constrain(combine.astype(x.dtype), ROUTING)
        dispatch = constrain(dispatch.astype(x.dtype), ROUTING)
        xe = constrain(jnp.einsum("gsec,gsd->egcd", dispatch, x), DISPATCHED)
        h = jnp.einsum("egcd,edf->egcf", xe, self.wi[...])
        h = constrain(jax.nn.gelu(h, approximate=True), ("expert", "batch", None, "mlp"))
        ye = constrain(jnp.einsum("egcf,efd->egcd", h, self.wo[...]), DISPATCHED)
        return constrain(jnp.einsum("gsec,egcd->gsd", combine, ye), RESID), aux


class MoEBlock(nnx.Module):
    """Pre-LN causal block whose feed-forward is an :class:`MoELayer`."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs) -> None:
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.ln1 = layer_norm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.attn = SelfAttention(cfg.d_model, cfg.n_heads, causal=True, std=INIT_STD,
                                  proj_std=proj_std, dtype=cfg.dtype, rngs=rngs)
        self.ln2 = layer_norm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.moe = MoELayer(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = constrain(x + self.attn(self.ln1(x)), RESID)
        y, aux = self.moe(self.ln2(x))
        return constrain(x + y, RESID), aux


class MoETransformer(nnx.Module):
    """Embeddings, alternating dense / MoE blocks, final LayerNorm, tied output head."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(INIT_STD)
        kw: dict[str, Any] = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        self.wte = nnx.Embed(cfg.vocab, cfg.d_model, embedding_init=init, rngs=rngs, **kw)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=init, rngs=rngs, **kw)
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.blocks = nnx.List([
            MoEBlock(cfg, rngs=rngs) if i % 2 else
            Block(cfg.d_model, cfg.n_heads, cfg.d_ff, causal=True, std=INIT_STD,
                  proj_std=proj_std, dtype=cfg.dtype, rngs=rngs)
            for i in range(cfg.n_layers)
        ])
        self.ln_f = layer_norm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.aux_loss_weight = cfg.aux_loss_weight

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(logits [B, T, vocab], mean aux loss over MoE layers)`` for tokens ``[B, T]``."""
        t = tokens.shape[1]
        x = constrain(self.wte(tokens) + self.wpe.embedding[...][:t], RESID)
        aux_losses = []
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, aux = block(x)
                aux_losses.append(aux)
            else:
                x = block(x)
        x = constrain(self.ln_f(x), RESID)
        logits = constrain(x @ self.wte.embedding[...].T, ("batch", "seq", "vocab"))
        aux = sum(aux_losses) / len(aux_losses) if aux_losses else jnp.zeros((), jnp.float32)
        return logits, aux


_MOE_AXES: dict[tuple[str, ...], Axes] = {
    ("wte", "embedding"): ("vocab", "embed"),
    ("wpe", "embedding"): (None, "embed"),
    ("moe", "router", "kernel"): ("embed", None),
    ("moe", "wi"): ("expert", "embed", "mlp"),
    ("moe", "wo"): ("expert", "mlp", "embed"),
}


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Logical axis names of the parameter at ``path`` (string keys) with ``shape``."""
    path = tuple(path)
    names = (_MOE_AXES.get(path) or _MOE_AXES.get(path[-3:]) or _MOE_AXES.get(path[-2:])
             or block_param_axes(path))
    return checked(path, shape, names)


def lm_loss(model: MoETransformer, batch: Batch) -> jax.Array:
    """Next-token cross entropy plus ``aux_loss_weight`` times the load-balancing loss."""
    logits, aux = model(batch["tokens"])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"])
    return jnp.mean(losses) + model.aux_loss_weight * aux


def make_optimizer(config: MoEConfig) -> optax.GradientTransformation:
    """AdamW (betas 0.9 / 0.95, weight decay 0.1 on >= 2-D params)."""
    return optax.adamw(config.learning_rate, b1=0.9, b2=0.95, weight_decay=0.1,
                       mask=common.decay_mask)


@jit_by_config
def example_batch(config: MoEConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random token batch; ``targets`` are ``tokens`` shifted by one."""
    return common.token_batch(config.batch, config.seq_len, config.vocab, seed)


@jit_by_config
def init_state(config: MoEConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    return common.init_train_state(MoETransformer(config, rngs=nnx.Rngs(common.prng_key(seed))),
                            make_optimizer(config))


def build_step(config: MoEConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = common.abstract_graphdef(lambda: MoETransformer(config, rngs=nnx.Rngs(PARAM_SEED)))
    return common.build_train_step(graphdef, lm_loss, make_optimizer(config))


def make_train_step(config: MoEConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: MoEConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(
        lambda: (common.unjitted(init_state)(config), common.unjitted(example_batch)(config)))

