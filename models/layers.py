"""Transformer pieces shared by the GPT, MoE and ViT models (Flax NNX).

Attention is written out explicitly (einsum scores, optional causal mask via ``jnp`` ops,
softmax, einsum with values); no fused / cuDNN attention paths. Every main activation is
annotated with :func:`models.logical.constrain` (inert outside ``axis_rules``), as the
Flax Gemma example and MaxText do. :func:`transformer_param_axes` names the parameter dims
of these layers for the expert baselines.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from shardc.models.logical import constrain

__all__ = ["Axes", "Block", "checked", "dense", "FeedForward", "HEADS", "HIDDEN", "layer_norm",
           "ParamAxes", "RESID", "SCORES", "SelfAttention", "transformer_param_axes"]

Axes = tuple[str | None, ...]
ParamAxes = Callable[[tuple[str, ...], tuple[int, ...]], Axes]

RESID: Axes = ("batch", "resid_seq", "embed")
"""The residual stream ``[B, T, d]`` (and the norms' outputs on it). Its sequence dim is
named apart from the one inside attention and the MLP (``"seq"``) so that sequence
parallelism (Korthikanti et al. 2022) can split it alone: the norms, dropout and residual
adds outside attention and the MLP split on the sequence over the tensor-parallel axis."""
HEADS: Axes = ("batch", "seq", "heads", None)
"""q / k / v and the attention output after the head split ``[B, T, H, dh]``."""
SCORES: Axes = ("batch", "heads", "seq", None)
"""Attention scores / probabilities ``[B, H, T, T]``."""
HIDDEN: Axes = ("batch", "seq", "mlp")
"""The feed-forward hidden activation ``[B, T, ffn]``."""


def dense(
    d_in: int, d_out: int, *, std: float, dtype: DTypeLike, rngs: nnx.Rngs,
    use_bias: bool = True,
) -> nnx.Linear:
    """``nnx.Linear`` with a normal(std) kernel, computing and storing in ``dtype``."""
    return nnx.Linear(
        d_in, d_out, use_bias=use_bias, kernel_init=nnx.initializers.normal(std),
        dtype=dtype, param_dtype=dtype, rngs=rngs,
    )


def layer_norm(d: int, *, dtype: DTypeLike, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm over the last dim (epsilon 1e-5, with scale and bias)."""
    return nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with separate q/k/v projections, causal or not."""

    def __init__(
        self, d_model: int, n_heads: int, *, causal: bool, std: float, proj_std: float,
        dtype: DTypeLike, rngs: nnx.Rngs,
    ) -> None:
        if d_model % n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        d = d_model
        self.n_heads = n_heads
        self.causal = causal
        self.query = dense(d, d, std=std, dtype=dtype, rngs=rngs)
        self.key = dense(d, d, std=std, dtype=dtype, rngs=rngs)
        self.value = dense(d, d, std=std, dtype=dtype, rngs=rngs)
        self.proj = dense(d, d, std=proj_std, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        dh = d // h
        q = constrain(self.query(x).reshape(b, t, h, dh), HEADS)
        k = constrain(self.key(x).reshape(b, t, h, dh), HEADS)
        v = constrain(self.value(x).reshape(b, t, h, dh), HEADS)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(
            jnp.asarray(dh, x.dtype)
        )
        if self.causal:
            causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
            scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = constrain(jax.nn.softmax(constrain(scores, SCORES), axis=-1), SCORES)
        out = constrain(jnp.einsum("bhqk,bkhd->bqhd", probs, v), HEADS)
        return self.proj(out.reshape(b, t, d))


class FeedForward(nnx.Module):
    """Position-wise feed-forward: d -> hidden -> GELU (tanh) -> d."""

    def __init__(
        self, d_model: int, hidden: int, *, std: float, proj_std: float,
        dtype: DTypeLike, rngs: nnx.Rngs,
    ) -> None:
        self.fc = dense(d_model, hidden, std=std, dtype=dtype, rngs=rngs)
        self.proj = dense(hidden, d_model, std=proj_std, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(constrain(jax.nn.gelu(self.fc(x), approximate=True), HIDDEN))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(
        self, d_model: int, n_heads: int, hidden: int, *, causal: bool, std: float,
        proj_std: float, dtype: DTypeLike, rngs: nnx.Rngs,
    ) -> None:
        kw = {"std": std, "proj_std": proj_std, "dtype": dtype, "rngs": rngs}
        self.ln1 = layer_norm(d_model, dtype=dtype, rngs=rngs)
        self.attn = SelfAttention(d_model, n_heads, causal=causal, **kw)
        self.ln2 = layer_norm(d_model, dtype=dtype, rngs=rngs)
        self.mlp = FeedForward(d_model, hidden, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x + self.attn(self.ln1(x)), RESID)
        return constrain(x + self.mlp(self.ln2(x)), RESID)


_BLOCK_AXES: dict[tuple[str, ...], Axes] = {
    **{("attn", qkv, "kernel"): ("embed", "heads") for qkv in ("query", "key", "value")},
    **{("attn", qkv, "bias"): ("heads",) for qkv in ("query", "key", "value")},
    ("attn", "proj", "kernel"): ("heads", "embed"),
    ("attn", "proj", "bias"): ("embed",),
    ("mlp", "fc", "kernel"): ("embed", "mlp"),
    ("mlp", "fc", "bias"): ("mlp",),
    ("mlp", "proj", "kernel"): ("mlp", "embed"),
    ("mlp", "proj", "bias"): ("embed",),
}


def transformer_param_axes(path: tuple[str, ...]) -> Axes | None:
    """Logical axes of an attention / feed-forward / LayerNorm parameter, else ``None``.

    q/k/v kernels are ``("embed", "heads")`` (head-parallel output columns), the attention
    output projection ``("heads", "embed")``; the MLP is column- then row-parallel.
    """
    if tuple(path[-3:]) in _BLOCK_AXES:
        return _BLOCK_AXES[tuple(path[-3:])]
    if len(path) >= 2 and path[-2].startswith("ln") and path[-1] in ("scale", "bias"):
        return ("embed",)
    return None


def checked(path: tuple[str, ...], shape: tuple[int, ...], names: Axes | None) -> Axes:
    """``names`` after checking it exists and has one name per dim of ``shape``."""
    if names is None:
        raise KeyError(f"no logical axes for parameter {'/'.join(path)}")
    if len(names) != len(shape):
        raise ValueError(f"{'/'.join(path)}: {len(names)} names {names} for shape {shape}")
    return names
