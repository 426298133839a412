"""The scanned Llama decoder (``shardc.models.llama``): it trains, equals an unrolled reference
written out here, is a ``scan`` (remat inside) forward and backward, names every parameter,
and compiles under every expert plan and under ``shardc.auto_shard`` to the ``jax.jit``
result."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import AxisType, PartitionSpec

import shardc
from shardc.bench.experts import compile_expert, seed_experts, state_specs
from shardc.bench.zoo import ZOO
from shardc.models import llama
from shardc.models.common import abstract_graphdef

CFG = llama.LlamaConfig.tiny()
N_STEPS = 3
EXPERT_NAMES = {"batch", "embed", "heads", "mlp", "vocab", None}
REMAT = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name
"""``jax.checkpoint``'s primitive ("remat2" in JAX 0.10)."""


@functools.cache
def _example() -> tuple[Any, tuple[Any, Any]]:
    """``make_train_step`` of the tiny config, built once per test session."""
    return llama.make_train_step(CFG)


@functools.cache
def _jitted() -> Any:
    """The tiny step under plain ``jax.jit``, compiled once."""
    step, args = _example()
    return jax.jit(step).lower(*args).compile()


@functools.cache
def _reference() -> tuple[Any, float]:
    """``(new_state, loss)`` of one ``jax.jit`` step, the reference for sharded runs."""
    _, args = _example()
    new_state, loss = _jitted()(*args)
    return new_state, float(loss)


def _graphdef(cfg: llama.LlamaConfig) -> nnx.GraphDef:
    return abstract_graphdef(lambda: llama.Llama(cfg, rngs=nnx.Rngs(llama.PARAM_SEED)))


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _assert_state_close(got: Any, want: Any) -> None:
    # Adam divides each gradient by its own magnitude: a near-zero gradient's rounding moves
    # its update by up to the learning rate (shardc.bench.numerics bounds it per element)
    assert_close(got, want, lr=CFG.learning_rate)


# --- the model ---------------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible by n_heads"):
        llama.LlamaConfig(d_model=60, n_heads=8)
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        llama.LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="must be even"):
        llama.LlamaConfig(d_model=36, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="n_layers must be positive"):
        llama.LlamaConfig(n_layers=0)
    big = llama.LlamaConfig.realistic()
    assert (big.d_model, big.n_heads, big.n_kv_heads, big.d_ff, big.seq_len, big.batch,
            big.vocab, big.n_layers) == (1024, 16, 4, 2816, 512, 16, 32000, 8)
    assert llama.LlamaConfig.realistic(n_layers=2).n_layers == 2
    assert ZOO["llama"].config("quick") == llama.LlamaConfig.realistic(n_layers=2)


def test_train_step_runs_and_learns() -> None:
    _, (state, batch) = _example()
    losses = []
    for _ in range(N_STEPS):
        new_state, loss = _jitted()(state, batch)
        assert loss.shape == () and loss.dtype == jnp.float32
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        state = new_state
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(CFG.vocab)) < 0.1, losses  # near-uniform at init
    assert losses[-1] < losses[1] < losses[0], losses


def test_abstract_args_match_and_realistic_size() -> None:
    _, example = _example()
    abstract = llama.abstract_args(CFG)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert jax.tree.structure(abstract) == jax.tree.structure(example)
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(example), strict=True):
        assert (a.shape, a.dtype) == (x.shape, x.dtype)
    state, batch = llama.abstract_args(llama.LlamaConfig.realistic())
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    # embed + head 2 * 32000 * 1024, 8 layers of 4.19M attention + 8.65M SwiGLU + 2 norms
    assert n_params == 2 * 32000 * 1024 + 8 * (2 * 1024 * (1024 + 256) + 3 * 1024 * 2816
                                               + 2 * 1024) + 1024
    assert batch["tokens"].shape == (16, 512) and batch["tokens"].dtype == jnp.int32


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + llama.NORM_EPS) * scale


def _rope(x: jax.Array) -> jax.Array:
    """RoPE of ``x [B, T, H, dh]`` as a complex rotation of the (x[i], x[i + dh/2]) pairs."""
    t, dh = x.shape[1], x.shape[-1]
    freq = llama.ROPE_THETA ** (-np.arange(0, dh, 2) / dh)
    rot = np.exp(1j * np.arange(t)[:, None] * freq[None, :]).astype(np.complex64)
    z = jax.lax.complex(x[..., : dh // 2], x[..., dh // 2:]) * rot[None, :, None, :]
    return jnp.concatenate([z.real, z.imag], axis=-1)


def _unrolled_logits(params: Any, tokens: jax.Array, cfg: llama.LlamaConfig) -> jax.Array:
    """The Llama forward written layer by layer (a Python loop over the stacked weights,
    no scan, no remat, GQA by indexing the kv head of each query head)."""
    b, t = tokens.shape
    h, kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kv_of_head = np.arange(h) // (h // kv)
    causal = np.tril(np.ones((t, t), bool))
    x = params["embed"]["embedding"][tokens]
    for i in range(cfg.n_layers):
        w = jax.tree.map(lambda p, i=i: p[i], params["layers"])
        a = w["attn"]
        y = _rms_norm(x, w["attn_norm"]["scale"])
        q = _rope((y @ a["q"]["kernel"]).reshape(b, t, h, dh))
        k = _rope((y @ a["k"]["kernel"]).reshape(b, t, kv, dh))[:, :, kv_of_head]
        v = (y @ a["v"]["kernel"]).reshape(b, t, kv, dh)[:, :, kv_of_head]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h * dh) @ a["o"]["kernel"]
        m = w["mlp"]
        y = _rms_norm(x, w["mlp_norm"]["scale"])
        gated = jax.nn.silu(y @ m["gate"]["kernel"]) * (y @ m["up"]["kernel"])
        x = x + gated @ m["down"]["kernel"]
    return _rms_norm(x, params["norm"]["scale"]) @ params["lm_head"]["kernel"]


def test_scanned_model_equals_unrolled_layers() -> None:
    _, (state, batch) = _example()
    params, tokens = state["params"], batch["tokens"]

    def loss_and_logits(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_probs = jax.nn.log_softmax(logits)
        loss = -jnp.mean(jnp.take_along_axis(log_probs, batch["targets"][..., None], -1))
        return loss, logits

    unrolled = lambda p: loss_and_logits(_unrolled_logits(p, tokens, CFG))  # noqa: E731
    (_, want), want_grads = jax.jit(jax.value_and_grad(unrolled, has_aux=True))(params)
    # scanned with and without remat, and the model's own unrolled form (scan_layers=False)
    for remat, scan in ((True, True), (False, True), (True, False)):
        model = _graphdef(dataclasses.replace(CFG, remat=remat, scan_layers=scan))
        scanned = lambda p, g=model: loss_and_logits(nnx.merge(g, p)(tokens))  # noqa: E731
        (_, got), grads = jax.jit(jax.value_and_grad(scanned, has_aux=True))(params)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
        # the scanned backward (a transposed scan, with or without remat) equals the loop's
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


# --- the jaxpr: scan forward and backward, remat in the body -----------------------------


def _eqns(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation, sub-jaxprs (scan bodies, remat, jit, custom_vjp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)


def _body(eqn: JaxprEqn) -> Jaxpr:
    body = eqn.params["jaxpr"]  # a ClosedJaxpr for scan, a Jaxpr for remat
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body


def _names(jaxpr: Jaxpr) -> list[str]:
    return [e.primitive.name for e in _eqns(jaxpr)]


@pytest.mark.parametrize("remat", [True, False])
def test_train_step_jaxpr_scans_layers_forward_and_backward(remat: bool) -> None:
    cfg = dataclasses.replace(CFG, remat=remat)
    closed = jax.make_jaxpr(llama.build_step(cfg))(*llama.abstract_args(cfg))
    scans = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]
    assert [(e.params["length"], e.params["reverse"]) for e in scans] == [
        (cfg.n_layers, False), (cfg.n_layers, True)]
    forward, backward = scans
    # one layer's dots per iteration: q, k, v, o, scores, probs @ v, gate, up, down
    assert _names(_body(forward)).count("dot_general") == 9
    n_backward = _names(_body(backward)).count("dot_general")
    b, t, d = cfg.batch, cfg.seq_len, cfg.d_model
    residuals = [tuple(v.aval.shape) for v in forward.outvars[1:]]  # after the carry
    remats = [e for e in _eqns(_body(backward)) if e.primitive.name == REMAT]
    if remat:
        # only each layer's input is saved; the transposed scan recomputes the layer in a
        # (differentiated) remat: its forward dots but the last (the down projection's
        # output is never needed) and the 2 x 9 transposes
        assert residuals == [(cfg.n_layers, b, t, d)]
        assert len(remats) == 1 and remats[0].params["differentiated"]
        assert _names(_body(remats[0])).count("dot_general") == 8 + 2 * 9
        assert n_backward == 8 + 2 * 9
    else:
        assert len(residuals) > 10 and not remats
        assert REMAT not in _names(closed.jaxpr)
        assert n_backward == 2 * 9
    # the model alone (no autodiff): a scan whose body is one remat of the whole layer
    graphdef = _graphdef(cfg)
    state, batch = llama.abstract_args(cfg)
    fwd = jax.make_jaxpr(lambda p, x: nnx.merge(graphdef, p)(x))(state["params"],
                                                               batch["tokens"])
    (scan,) = [e for e in fwd.jaxpr.eqns if e.primitive.name == "scan"]
    top = [e.primitive.name for e in _body(scan).eqns]
    if remat:
        assert top == [REMAT], top
    else:
        assert REMAT not in _names(fwd.jaxpr), top
    assert _names(_body(scan)).count("dot_general") == 9


# --- logical axes, experts, shardc -------------------------------------------------------


def _str_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


@pytest.mark.parametrize("which", ["tiny", "realistic"])
def test_param_axes_name_every_leaf(which: str) -> None:
    cfg = getattr(llama.LlamaConfig, which)()
    state, _ = llama.abstract_args(cfg)
    seen = []

    def check(path: tuple[Any, ...], leaf: Any) -> None:
        keys = _str_keys(path)[1:]  # drop "params" / "opt": slots shadow their param
        if not leaf.shape:  # Adam's step count
            return
        names = llama.param_axes(keys, tuple(leaf.shape))
        assert isinstance(names, tuple) and len(names) == len(leaf.shape), (keys, names)
        if keys[0] == "layers":
            assert names[0] == "layers" and leaf.shape[0] == cfg.n_layers, (keys, names)
            assert set(names[1:]) <= EXPERT_NAMES, (keys, names)
        else:
            assert set(names) <= EXPERT_NAMES, (keys, names)
        seen.append(keys)

    jax.tree_util.tree_map_with_path(check, state)
    assert len(seen) == 3 * len(jax.tree.leaves(state["params"]))  # params, mu, nu
    with pytest.raises(KeyError):
        llama.param_axes(("no", "such", "param"), (8,))
    with pytest.raises(ValueError):
        llama.param_axes(("layers", "attn", "q", "kernel"), (64, 64))  # not stacked


def test_weight_decay_skips_norm_scales() -> None:
    state, _ = llama.abstract_args(CFG)
    mask = llama._decay_mask(state["params"])
    flat = {_str_keys(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    assert [k for k, m in flat.items() if not m] == [
        ("layers", "attn_norm", "scale"), ("layers", "mlp_norm", "scale"), ("norm", "scale")]


@pytest.mark.slow
def test_every_expert_compiles_and_matches_jit() -> None:
    step, (state, batch) = _example()
    mesh = _mesh()
    want_state, want_loss = _reference()
    experts = {e.name: e for e in seed_experts(mesh, shardc.Cluster())}
    assert sorted(experts) == ["data-parallel", "dp-x-tp4", "fsdp", "fsdp-x-tp4", "hsdp4",
                               "megatron-tp8", "zero1", "zero1-shard4", "zero1-x-tp4"]
    for expert in experts.values():
        _, lowered = compile_expert(step, state, batch, mesh, expert, llama.param_axes)
        got_state, loss = lowered.compile()(state, batch)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, err_msg=expert.name)
        _assert_state_close(got_state, want_state)
    # the layer axis is never split; dp-x-tp splits the q kernel's heads over "gpu"
    specs = state_specs(state, mesh, experts["dp-x-tp4"], llama.param_axes)
    assert specs["params"]["layers"]["attn"]["q"]["kernel"] == PartitionSpec(None, None, "gpu")
    assert specs["params"]["layers"]["mlp"]["down"]["kernel"] == PartitionSpec(None, "gpu", None)


def test_auto_shard_matches_jit(recwarn: pytest.WarningsRecorder) -> None:
    """On the default cluster the tiny step's plan is replicated (no collective pays for
    itself); on devices 10^5 times slower than an H100 it splits the scanned layers, so this
    checks a sharded scan, forward and transposed, against ``jax.jit``."""
    step, (state, batch) = _example()
    sharded = shardc.auto_shard(step, mesh=_mesh(), time_limit=0.5,
                                cluster=shardc.Cluster(device_flops=1e9))
    got_state, loss = sharded(state, batch)
    want_state, want_loss = _reference()
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4)
    _assert_state_close(got_state, want_state)
    assert not [w for w in recwarn if "no sharding rule" in str(w.message)]
    plan = sharded.plan(state, batch)
    assert plan.predicted.comm_bytes > 0  # not replicated
