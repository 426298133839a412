"""Llama-style decoder-only transformer with scanned layers (Flax NNX), Optax AdamW.

Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" (and Llama 2's
grouped-query attention, Ainslie et al. 2023): token embedding, pre-norm RMSNorm blocks
with rotary position embeddings (Su et al. 2021, rotate-half form) on q and k, grouped-query
causal attention (``n_kv_heads`` key/value heads, each shared by ``n_heads / n_kv_heads``
query heads, repeated as in the reference ``repeat_kv``), a SwiGLU feed-forward
(``down(silu(gate(x)) * up(x))``), a final RMSNorm and an untied output projection. No
biases anywhere.

The layers are *scanned*, as MaxText writes large models: one :class:`DecoderLayer` is
created ``n_layers`` times under ``nnx.vmap`` (every parameter stacked along a leading
layer axis) and applied by ``jax.lax.scan`` over the stacked state, each iteration wrapped
in ``jax.checkpoint`` when ``config.remat`` (``prevent_cse=False``, as MaxText does under
scan). The train step's jaxpr is then a forward ``scan`` whose body holds one layer's dots
and saves only each layer's input, and a transposed ``scan`` whose body recomputes the
layer inside a (differentiated) ``checkpoint`` before its transposed dots.
Activations carry logical-axis annotations (:func:`models.logical.constrain`, inert by
default) and :func:`param_axes` names every parameter dim; stacked parameters start with
``"layers"``, a name no expert splits.
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

from shardc import pipeline
from shardc.models.common import (
    Batch,
    TrainState,
    TrainStep,
    abstract_graphdef,
    build_train_step,
    decay_mask,
    init_train_state,
    jit_by_config,
    prng_key,
    token_batch,
    unjitted,
)
from shardc.models.layers import HEADS, HIDDEN, RESID, SCORES, Axes, checked
from shardc.models.logical import constrain
from shardc.models.ring import attend

__all__ = ["abstract_args", "apply_rope", "Attention", "build_step", "cross_entropy", "DATA_SEED",
           "DecoderLayer", "example_batch", "init_state", "INIT_STD", "Llama", "LlamaConfig",
           "make_optimizer", "make_train_step", "next_token_loss", "NORM_EPS", "param_axes",
           "PARAM_SEED", "rope_tables", "ROPE_THETA", "SwiGLU"]

PARAM_SEED = 0
DATA_SEED = 1
INIT_STD = 0.02
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of the Llama training step."""

    vocab: int = 256
    seq_len: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    n_layers: int = 2
    batch: int = 8
    learning_rate: float = 1e-3
    dtype: DTypeLike = jnp.float32
    remat: bool = True
    scan_layers: bool = True  # False: the same stacked layers applied by a Python loop
    #: True: the scan written as :func:`shardc.pipeline.layers` (a stack auto_shard can
    #: pipeline; its backward recomputes the forward, so ``remat`` adds a third forward)
    stack_layers: bool = False
    #: True: the stack and the loss it ends in (final norm, head, cross entropy) written as
    #: :func:`shardc.pipeline.layers_loss`, which a 1F1B pipeline can run
    loss_in_stack: bool = False

    def __post_init__(self) -> None:
        if self.stack_layers and not self.scan_layers:
            raise ValueError("stack_layers=True writes the layer scan as "
                             "shardc.pipeline.layers; it needs scan_layers=True")
        if self.loss_in_stack and not self.stack_layers:
            raise ValueError("loss_in_stack=True writes the stack and its loss as "
                             "shardc.pipeline.layers_loss; it needs stack_layers=True")
        for name in ("vocab", "seq_len", "d_model", "n_heads", "n_kv_heads", "d_ff",
                     "n_layers", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / n_heads ({self.head_dim}) must be even "
                             "for rotary position embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """Small preset for tests: d 64, 4 heads over 2 kv heads, d_ff 128, 2 layers."""
        return cls()

    @classmethod
    def llama32_1b(cls, n_layers: int = 16) -> LlamaConfig:
        """The shape of Meta's Llama 3.2 1B (its ``config.json``: hidden 2048, 16 layers, 32
        heads over 8 kv heads, intermediate 8192, vocab 128256) with this model's untied
        output projection: 1.50B params at 16 layers, 24 GB of float32 weights and Adam
        moments, so data parallelism's step does not fit a 24 GiB device (the bench's
        memory-bound cells). Sequence 2048, batch 8 (one sequence per device on 8)."""
        return cls(vocab=128256, seq_len=2048, d_model=2048, n_heads=32, n_kv_heads=8,
                   d_ff=8192, n_layers=n_layers, batch=8, learning_rate=3e-4)

    @classmethod
    def deep(cls, n_layers: int = 32) -> LlamaConfig:
        """A deep, narrow decoder (the bench's pipelined model): 32 layers of d 512, 8
        heads over 2 kv heads, d_ff 1408, seq 512, vocab 8192 (99M params at 32 layers);
        batch 8 on 8 devices. Its layers and the loss they end in are a
        :func:`shardc.pipeline.layers_loss` stack (any schedule, 1F1B included, can run
        it), not checkpointed (the stack's backward recomputes the forward: the FLOPs of a
        checkpointed scan)."""
        return cls(vocab=8192, seq_len=512, d_model=512, n_heads=8, n_kv_heads=2, d_ff=1408,
                   n_layers=n_layers, batch=8, learning_rate=3e-4, remat=False,
                   stack_layers=True, loss_in_stack=True)

    @classmethod
    def deep_tiny(cls, n_layers: int = 32) -> LlamaConfig:
        """The deep model at test size: :meth:`tiny`'s widths, 32 layers, a stack ending
        in its loss as :meth:`deep`'s."""
        return cls(n_layers=n_layers, remat=False, stack_layers=True, loss_in_stack=True)

    @classmethod
    def realistic(cls, n_layers: int = 8) -> LlamaConfig:
        """Benchmark preset: d 1024, 16 heads over 4 kv heads, d_ff 2816, seq 512, vocab 32000
        (156M params at 8 layers)."""
        return cls(vocab=32000, seq_len=512, d_model=1024, n_heads=16, n_kv_heads=4,
                   d_ff=2816, n_layers=n_layers, batch=16, learning_rate=3e-4)

    @classmethod
    def long_context(cls, n_layers: int = 4, seq_len: int = 32768) -> LlamaConfig:
        """Long-context benchmark preset: :meth:`realistic`'s widths at 32768 tokens per
        sequence, one sequence per 8 devices (fewer sequences than devices: the batch
        cannot split the attention, the heads or the sequence must)."""
        return cls(vocab=32000, seq_len=seq_len, d_model=1024, n_heads=16, n_kv_heads=4,
                   d_ff=2816, n_layers=n_layers, batch=1, learning_rate=3e-4)


def _linear(d_in: int, d_out: int, std: float, cfg: LlamaConfig,
            rngs: nnx.Rngs) -> nnx.Linear:
    """Bias-free ``nnx.Linear`` with a normal(std) kernel, in ``cfg.dtype``."""
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=nnx.initializers.normal(std),
                      dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)


def _rms_norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.d_model, epsilon=NORM_EPS, dtype=cfg.dtype, param_dtype=cfg.dtype,
                       rngs=rngs)


def rope_tables(seq_len: int, head_dim: int, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[seq_len, head_dim / 2]`` of positions times the rotary frequencies
    ``theta ** (-2i / head_dim)``, computed in float32."""
    inv_freq = ROPE_THETA ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, H, dh]`` pairwise (``x[i]``, ``x[i + dh/2]``) by position angles."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE on q and k, no biases."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, dh = cfg.d_model, cfg.head_dim
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.q = _linear(d, cfg.n_heads * dh, INIT_STD, cfg, rngs)
        self.k = _linear(d, cfg.n_kv_heads * dh, INIT_STD, cfg, rngs)
        self.v = _linear(d, cfg.n_kv_heads * dh, INIT_STD, cfg, rngs)
        self.o = _linear(cfg.n_heads * dh, d, proj_std, cfg, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        h, kv, dh = self.n_heads, self.n_kv_heads, self.head_dim
        q = constrain(apply_rope(self.q(x).reshape(b, t, h, dh), cos, sin), HEADS)
        k = constrain(apply_rope(self.k(x).reshape(b, t, kv, dh), cos, sin), HEADS)
        v = constrain(self.v(x).reshape(b, t, kv, dh), HEADS)
        out = constrain(attend(q, k, v, _causal_attention), HEADS)
        return self.o(out.reshape(b, t, h * dh))


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention of ``q`` ``[b, t, h, dh]`` over ``k``, ``v`` ``[b, t, kv, dh]``,
    each key/value head repeated for its ``h / kv`` query heads (the reference
    ``repeat_kv``: query head j reads key/value head j // (h / kv)), causally masked."""
    t, h, kv, dh = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    k = constrain(jnp.repeat(k, h // kv, axis=2), HEADS)
    v = constrain(jnp.repeat(v, h // kv, axis=2), HEADS)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(dh, q.dtype))
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = constrain(jax.nn.softmax(constrain(scores, SCORES), axis=-1), SCORES)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class SwiGLU(nnx.Module):
    """Gated feed-forward ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.gate = _linear(cfg.d_model, cfg.d_ff, INIT_STD, cfg, rngs)
        self.up = _linear(cfg.d_model, cfg.d_ff, INIT_STD, cfg, rngs)
        self.down = _linear(cfg.d_ff, cfg.d_model, proj_std, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = constrain(jax.nn.silu(self.gate(x)), HIDDEN)
        return self.down(constrain(gate * constrain(self.up(x), HIDDEN), HIDDEN))


class DecoderLayer(nnx.Module):
    """Pre-RMSNorm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = constrain(x + self.attn(self.attn_norm(x), cos, sin), RESID)
        return constrain(x + self.mlp(self.mlp_norm(x)), RESID)


class Llama(nnx.Module):
    """Token embedding, ``n_layers`` scanned decoder layers, final RMSNorm, untied head."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model,
                               embedding_init=nnx.initializers.normal(INIT_STD),
                               dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs=rngs)

        self.layers = stacked(rngs)  # every parameter [n_layers, ...]
        self.norm = _rms_norm(cfg, rngs)
        self.lm_head = _linear(cfg.d_model, cfg.vocab, INIT_STD, cfg, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[B, T, vocab]`` for int tokens ``[B, T]``."""
        x, one_layer, stacked = self._stack_input(tokens)
        cfg = self.cfg
        if cfg.stack_layers:
            x, _ = pipeline.layers(one_layer, x, stacked)
        elif cfg.scan_layers:
            x, _ = jax.lax.scan(one_layer, x, stacked)
        else:  # unrolled: the program a scan replaces, for comparing the two
            for layer in range(cfg.n_layers):
                x, _ = one_layer(x, jax.tree.map(lambda a, i=layer: a[i], stacked))
        return _logits(self.norm, self.lm_head, x)

    def loss(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross entropy of the logits of ``tokens`` against ``targets``;
        with ``loss_in_stack``, the layer stack and this loss as one
        :func:`shardc.pipeline.layers_loss` (the final norm and the head its ``head``)."""
        if not self.cfg.loss_in_stack:
            return cross_entropy(self(tokens), targets)
        x, one_layer, stacked = self._stack_input(tokens)
        graphdef, head = nnx.split((self.norm, self.lm_head))

        def head_loss(h: jax.Array, head: nnx.State, targets: jax.Array) -> jax.Array:
            return cross_entropy(_logits(*nnx.merge(graphdef, head), h), targets)

        return pipeline.layers_loss(one_layer, head_loss, x, stacked, head, targets)

    def _stack_input(self, tokens: jax.Array):
        """(the embedded tokens, the layer function a scan over the layers runs, the
        stacked layer state)."""
        cfg = self.cfg
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.dtype)
        x = constrain(self.embed(tokens), RESID)

        # A plain lax.scan over the split state: nnx.scan would also return the (unchanged)
        # stacked layer state as scan outputs, a copy of every weight in the program.
        graphdef, stacked = nnx.split(self.layers)  # every leaf [n_layers, ...]

        def one_layer(h: jax.Array, params: nnx.State) -> tuple[jax.Array, None]:
            if cfg.stack_layers:  # a pipelined stack closes over no traced array
                return nnx.merge(graphdef, params)(h, *rope_tables(h.shape[1], cfg.head_dim,
                                                                   cfg.dtype)), None
            return nnx.merge(graphdef, params)(h, cos, sin), None

        if cfg.remat:  # a scan keeps iterations apart: no CSE barrier there (MaxText too)
            one_layer = jax.checkpoint(one_layer, prevent_cse=not cfg.scan_layers)
        return x, one_layer, stacked


def _logits(norm: nnx.Module, lm_head: nnx.Module, x: jax.Array) -> jax.Array:
    """The final norm and the output projection of the last layer's activations."""
    return constrain(lm_head(constrain(norm(x), RESID)), ("batch", "seq", "vocab"))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy of ``logits`` (in float32) against integer ``targets``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             targets)
    return jnp.mean(losses)


_LLAMA_AXES: dict[tuple[str, ...], Axes] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("norm", "scale"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
    # stacked decoder layers: a leading "layers" dim, which no expert splits
    ("layers", "attn_norm", "scale"): ("layers", "embed"),
    ("layers", "mlp_norm", "scale"): ("layers", "embed"),
    **{("layers", "attn", p, "kernel"): ("layers", "embed", "heads") for p in "qkv"},
    ("layers", "attn", "o", "kernel"): ("layers", "heads", "embed"),
    ("layers", "mlp", "gate", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "up", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "down", "kernel"): ("layers", "mlp", "embed"),
}


def param_axes(path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
    """Logical axis names of the parameter at ``path`` (string keys) with ``shape``."""
    path = tuple(path)
    return checked(path, shape, _LLAMA_AXES.get(path))


def next_token_loss(model: Llama, batch: Batch) -> jax.Array:
    """Mean next-token cross entropy of ``model(tokens)`` against ``targets``."""
    return model.loss(batch["tokens"], batch["targets"])


def make_optimizer(config: LlamaConfig) -> optax.GradientTransformation:
    """AdamW (betas 0.9 / 0.95, weight decay 0.1 on >= 2-D params: not the norm scales)."""
    return optax.adamw(config.learning_rate, b1=0.9, b2=0.95, weight_decay=0.1,
                       mask=_decay_mask)


def _decay_mask(params: Any) -> Any:
    """Decay matrices (stacked ones are 3-D), not the norm scales (stacked: 2-D)."""
    flat = decay_mask(params)
    layers = jax.tree.map(lambda p: p.ndim >= 3, params["layers"])
    return {**flat, "layers": layers}


@jit_by_config
def example_batch(config: LlamaConfig, seed: int = DATA_SEED) -> Batch:
    """Deterministic random token batch; ``targets`` are ``tokens`` shifted by one."""
    return token_batch(config.batch, config.seq_len, config.vocab, seed)


@jit_by_config
def init_state(config: LlamaConfig, seed: int = PARAM_SEED) -> TrainState:
    """Freshly initialised ``{"params", "opt"}`` state."""
    return init_train_state(Llama(config, rngs=nnx.Rngs(prng_key(seed))),
                            make_optimizer(config))


def build_step(config: LlamaConfig) -> TrainStep:
    """The pure train step for ``config``, built without allocating parameters."""
    graphdef = abstract_graphdef(lambda: Llama(config, rngs=nnx.Rngs(PARAM_SEED)))
    return build_train_step(graphdef, next_token_loss, make_optimizer(config))


def make_train_step(config: LlamaConfig) -> tuple[TrainStep, tuple[TrainState, Batch]]:
    """``(train_step, (state, batch))`` with concrete, deterministic example args."""
    return build_step(config), (init_state(config), example_batch(config))


def abstract_args(config: LlamaConfig) -> tuple[TrainState, Batch]:
    """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees; allocates nothing."""
    return jax.eval_shape(
        lambda: (unjitted(init_state)(config), unjitted(example_batch)(config)))
