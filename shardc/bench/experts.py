"""Hand-written expert plans: what practitioners write today, to measure shardc against.

Each expert is a pair of MaxText-style logical-axis rules on one logical view of the
preset's devices (:mod:`shardc.views`): one for parameters (and the optimizer state that
shadows them), one for activations, applied through the models' ``param_axes`` and
``shardc.models.logical.constrain`` annotations. The batch is split by the activation rule for
"batch". Compiled with plain ``jax.jit``.

The set (:func:`preset_experts`) is every form a practitioner writes, on every view shardc's
mesh search considers, so "best expert" is the minimum over all of them:

- over all devices (the flat view): data parallel, FSDP / ZeRO-3, Megatron TP, expert
  parallel;
- on each 2-D view ``(a, b)`` (``b`` the inner axis): HSDP (parameters sharded over ``b``,
  replicated over ``a``, the batch over both), DP x TP and FSDP x TP (TP over ``b``),
  Megatron TP over ``b`` alone, and for MoE models experts over ``b`` with the batch over
  both (EP x DP);
- where the preset's outer axis is slower (several nodes): data parallel, FSDP and expert
  parallel within the node, replicated across nodes.

References:
  MaxText ``configs/base.yml`` logical_axis_rules and ``dcn_data_parallelism`` x
  ``ici_fsdp_parallelism`` (HSDP); PyTorch FSDP ``ShardingStrategy.HYBRID_SHARD``;
  Flax ``examples/gemma`` sharding config; Megatron-LM (Shoeybi et al. 2019) column/row
  split MLP and head-parallel attention; ZeRO-3 / FSDP (Rajbhandari et al. 2020);
  GShard (Lepikhin et al. 2020) expert parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardc.cost.cluster import Cluster
from shardc.models.logical import axis_rules, spec
from shardc.views import View, views

TENSOR = ("heads", "mlp", "vocab", "conv_out")
"""Logical dims Megatron-style tensor parallelism splits (column/row pairs, heads)."""
FSDP = ("embed", "mlp", "conv_out", "classes", "patch")
"""Logical parameter dims FSDP shards (the largest dim of every weight the zoo has)."""


@dataclass(frozen=True)
class Expert:
    name: str
    params: Mapping[str, Any]  # logical name -> mesh axes, for parameters / optimizer state
    acts: Mapping[str, Any]  # logical name -> mesh axes, for activations and the batch
    view: View  # the logical mesh the rules name axes of

    def mesh(self, physical: Mesh) -> Mesh:
        """The view's mesh over ``physical``'s devices."""
        return self.view.mesh(physical)


def _on(axes, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: axes for n in names}


def experts_for(view: View, moe: bool = False, whole: bool = True,
                node_local: bool = False) -> list[Expert]:
    """The expert forms on ``view``: with ``whole``, those over all its devices (data
    parallel, FSDP, Megatron, expert parallel); on a 2-D view the hybrid forms; with
    ``node_local`` (a slower outer axis) the forms on the inner axis alone."""
    names = view.names
    every = names if len(names) > 1 else names[0]
    out = []
    if whole:
        out += [Expert("data-parallel", {}, {"batch": every}, view),
                Expert("fsdp", _on(every, FSDP), {"batch": every}, view),
                Expert(f"megatron-tp{math.prod(view.shape)}", _on(every, TENSOR),
                       _on(every, TENSOR), view)]
        if moe:
            out.append(Expert("expert-parallel", {"expert": every},
                              {"expert": every, "batch": every}, view))
    if len(names) == 2:
        a, b = names
        k = view.shape[1]
        tensor = _on(b, TENSOR)
        out += [Expert(f"hsdp{k}", _on(b, FSDP), {"batch": every}, view),
                Expert(f"dp-x-tp{k}", tensor, {**tensor, "batch": a}, view),
                Expert(f"fsdp-x-tp{k}", {**tensor, "embed": a}, {**tensor, "batch": a}, view)]
        if not whole:  # on the flat 2-D view, megatron over both axes is listed above
            out.append(Expert(f"megatron-tp{k}", tensor, tensor, view))
        if moe:
            out.append(Expert(f"ep{k}-x-dp", {"expert": b}, {"expert": b, "batch": every},
                              view))
        if node_local:
            out += [Expert("data-parallel-node", {}, {"batch": b}, view),
                    Expert("fsdp-node", _on(b, FSDP), {"batch": b}, view)]
            if moe:
                out.append(Expert("expert-parallel-node", {"expert": b},
                                  {"expert": b, "batch": b}, view))
    return out


def _slow_outer(view: View) -> bool:
    return len(view.names) == 2 and \
        view.cluster.bandwidth(view.names[0]) < view.cluster.bandwidth(view.names[1])


def preset_experts(shape: tuple[int, ...], names: tuple[str, ...], cluster: Cluster,
                   moe: bool = False) -> list[Expert]:
    """Every expert on every logical view of the devices (:func:`shardc.views.views`): the
    whole-device forms once (on the flat view), the hybrid forms on each 2-D view, and the
    node-local forms on the physical mesh when its outer axis is slower."""
    out: dict[str, Expert] = {}
    for i, view in enumerate(views(shape, names, cluster)):
        for e in experts_for(view, moe, whole=len(view.shape) == 1,
                             node_local=i == 0 and _slow_outer(view)):
            out.setdefault(e.name, e)
    return list(out.values())


def seed_experts(mesh: Mesh, cluster: Cluster, moe: bool = False) -> list[Expert]:
    """The experts expressible on ``mesh`` itself (its own axes): what shardc is seeded
    with when it plans on that mesh."""
    view = View(tuple(mesh.devices.shape), tuple(mesh.axis_names), cluster)
    return experts_for(view, moe, whole=True, node_local=_slow_outer(view))


def _keys(path) -> tuple[str, ...]:
    """String keys of a state leaf's path, with the container prefix removed:
    ``state["params"]["blocks"][0]...`` and ``state["opt"][0].mu["blocks"][0]...`` both give
    ``("blocks", "0", ...)`` so an optimizer slot maps to the parameter it shadows."""
    keys = [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)]
    return tuple(keys[1:])


def state_specs(state, mesh: Mesh, expert: Expert, param_axes: Callable) -> Any:
    def one(path, leaf):
        if not getattr(leaf, "shape", ()):
            return PartitionSpec()
        names = param_axes(_keys(path), tuple(leaf.shape))
        return spec(names, expert.params, leaf.shape, mesh)

    return jax.tree_util.tree_map_with_path(one, state)


def batch_specs(batch, mesh: Mesh, expert: Expert) -> Any:
    def one(leaf):
        names = ("batch",) + (None,) * (len(leaf.shape) - 1)
        return spec(names, expert.acts, leaf.shape, mesh)

    return jax.tree.map(one, batch)


def compile_expert(step: Callable, state, batch, physical: Mesh, expert: Expert,
                   param_axes: Callable):
    """``(jitted, lowered)`` of ``step`` under the expert's shardings and activation rules,
    on the expert's view of ``physical``'s devices."""
    mesh = expert.mesh(physical)
    named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t)  # noqa: E731
    st = named(state_specs(state, mesh, expert, param_axes))
    bt = named(batch_specs(batch, mesh, expert))
    jitted = jax.jit(step, in_shardings=(st, bt),
                     out_shardings=(st, NamedSharding(mesh, PartitionSpec())))
    with axis_rules(mesh, expert.acts):
        lowered = jitted.lower(state, batch)
    return jitted, lowered
