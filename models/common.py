"""Shared helpers that turn an NNX model, a loss and an Optax transform into a pure step.

The training state is a plain pytree ``{"params": <nested dict of arrays>, "opt": <optax
state>}``. The NNX graph definition and the Optax transform are closed over, so the step is
a pure function of arrays that ``jax.make_jaxpr`` / ``jax.jit`` can trace directly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

__all__ = ["abstract_graphdef", "Batch", "build_train_step", "decay_mask", "F", "image_batch",
           "init_train_state", "jit_by_config", "LossFn", "PRNG_IMPL", "prng_key", "PyTree",
           "split_params", "token_batch", "TrainState", "TrainStep", "unjitted"]

PyTree = Any
TrainState = dict[str, PyTree]
Batch = dict[str, jax.Array]
TrainStep = Callable[[TrainState, Batch], tuple[TrainState, jax.Array]]
LossFn = Callable[[Any, Batch], jax.Array]
"""``loss_fn(model, batch) -> scalar``; ``model`` is the merged NNX module."""
F = TypeVar("F", bound=Callable[..., Any])

PRNG_IMPL = "rbg"
"""PRNG of :func:`prng_key`. XLA's RngBitGenerator compiles in a fraction of threefry's
time on CPU (seconds per distinct shape there); it is deterministic on a given backend."""


def prng_key(seed: int) -> jax.Array:
    """Typed PRNG key (:data:`PRNG_IMPL`) for parameter init and example batches."""
    return jax.random.key(seed, impl=PRNG_IMPL)


def jit_by_config(fn: F) -> F:
    """``jax.jit`` with every argument (``config``, ``seed``) static, so ``init_state`` or
    ``example_batch`` compiles once per config instead of op by op, and without backend
    optimisation (it runs once). It cannot be traced inside another transformation
    (``compiler_options``): use :func:`unjitted` under ``jax.eval_shape``."""
    signature = inspect.signature(fn)
    jitted = jax.jit(fn, static_argnums=tuple(range(len(signature.parameters))),
                     compiler_options={"xla_backend_optimization_level": 0})

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # one cache entry however it is called
        bound.apply_defaults()
        return jitted(*bound.args)

    return call  # type: ignore[return-value]


def unjitted(fn: F) -> F:
    """The plain function under a :func:`jit_by_config` wrapper (``fn`` if there is none)."""
    return getattr(fn, "__wrapped__", fn)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, PyTree]:
    """Split ``model`` into its graphdef and a pure nested dict of parameter arrays."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("zoo models must hold only nnx.Param state")
    return graphdef, nnx.to_pure_dict(params)


def abstract_graphdef(make_model: Callable[[], nnx.Module]) -> nnx.GraphDef:
    """Graphdef of ``make_model()`` obtained without allocating any parameters."""
    graphdef, _ = split_params(nnx.eval_shape(make_model))
    return graphdef


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
    """Initial ``{"params", "opt"}`` state for ``model`` under optimizer ``tx``."""
    _, params = split_params(model)
    return {"params": params, "opt": tx.init(params)}


def build_train_step(
    graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation
) -> TrainStep:
    """Pure ``train_step(state, batch) -> (new_state, loss)`` for one optimizer step.

    The returned state has the same tree structure, shapes and dtypes as the input.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        params = state["params"]

        def loss_of_params(p: PyTree) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, p), batch)

        loss, grads = jax.value_and_grad(loss_of_params)(params)
        updates, new_opt = tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        return {"params": new_params, "opt": new_opt}, loss

    return train_step


def decay_mask(params: PyTree) -> PyTree:
    """Weight decay on matrices, kernels and embeddings only (not biases / norm scales)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def token_batch(batch: int, seq_len: int, vocab: int, seed: int) -> Batch:
    """Random ``{"tokens", "targets"}`` ``[batch, seq_len]`` int32; targets = tokens + 1."""
    seq = jax.random.randint(prng_key(seed), (batch, seq_len + 1), 0, vocab, jnp.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def image_batch(batch: int, size: int, channels: int, n_classes: int, dtype: DTypeLike,
                seed: int) -> Batch:
    """Random ``{"images": [B, size, size, channels] dtype, "labels": [B] int32}``."""
    ki, kl = jax.random.split(prng_key(seed))
    shape = (batch, size, size, channels)
    return {
        "images": jax.random.normal(ki, shape, jnp.float32).astype(dtype),
        "labels": jax.random.randint(kl, (batch,), 0, n_classes, jnp.int32),
    }
