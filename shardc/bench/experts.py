"""Hand-written expert plans: what practitioners write today, to measure shardc against.

Each expert is a set of MaxText-style logical-axis rules on one logical view of the
preset's devices (:mod:`shardc.tradeoff.views`, up to three axes): one for parameters, one for the
optimizer state that shadows them (by default the parameters' rule; ZeRO shards it where
the parameters are replicated), one for activations, applied through the models'
``param_axes`` and ``shardc.models.logical.constrain`` annotations. The batch is split by
the activation rule for "batch". Compiled with plain ``jax.jit``.

The set (:func:`preset_experts`) is every form a practitioner runs by default, on every
view of the devices, so "best expert" is the minimum over all of them:

- over all devices (the flat view): data parallel, FSDP / ZeRO-3, ZeRO-1 (Megatron's
  distributed optimizer), Megatron TP, expert parallel;
- on each 2-D view ``(a, b)`` (``b`` the inner axis): HSDP (parameters sharded over ``b``,
  replicated over ``a``, the batch over both), ZeRO-1 sharded over ``b`` (``zero1-shard``),
  DP x TP, FSDP x TP and ZeRO-1 x TP (TP over ``b``; the distributed optimizer over
  ``a``), Megatron TP over ``b`` alone, and for MoE models experts over ``b`` with the
  batch over both (EP x DP);
- on each 3-D view ``(a, b, c)``: data x FSDP x TP (the batch over ``a`` and ``b``, the
  parameters sharded over ``b``, TP over ``c``); HSDP x TP where ``a`` is the node axis;
- where the preset's outer axis is slower (several nodes): data parallel, FSDP and expert
  parallel within the node, replicated across nodes; on that physical mesh ``hsdp`` and
  ``zero1-shard`` are the node-local forms (sharded within the node, data parallel across);
- where the outer axis is slower and the model's layers are a
  :func:`shardc.pipeline.layers` stack: a GPipe pipeline over the outer axis (a stage per
  node, the stacked layers' parameters and optimizer state split over it, each stage
  holding its own; the batch cut into as many micro-batches as stages, written by hand
  with :func:`shardc.pipeline.pipeline_scan` as MaxText's pipeline module wraps its
  decoder layers) with data parallelism, FSDP or Megatron TP within the node
  (``gpipe4-x-dp8``, ``gpipe4-x-fsdp8``, ``gpipe4-x-tp8``), and MaxText's pipeline as
  its defaults configure it: circular, one layer per stage per pass, as many
  micro-batches as stages, FSDP within the node (``maxtext-circular4-x-fsdp8``); 1F1B
  likewise where the stack ends in its loss (``1f1b4-x-dp8``, ... :
  :func:`shardc.pipeline.layers_loss`; on a stack returning its carry it would run
  GPipe's program);
- variants: on a model with a token sequence, every TP form also with sequence parallelism
  (``-sp``: the residual stream split on the sequence over the TP axis); on a model with a
  vocabulary table, every FSDP form also with the tables sharded on the vocabulary
  (``-vp``). The TP forms split the vocabulary already (:data:`TENSOR`).

- on a model whose state outgrows its devices (the zoo's ``offload`` flag, compiled by
  XLA:CPU), the optimizer state in host memory between steps: ZeRO-Offload
  (``zero-offload``) and FSDP with its state offloaded (``fsdp-offload``).

ZeRO-2 is not listed: it compiles to ZeRO-1's program (:func:`_zero`).

References:
  MaxText ``configs/base.yml`` logical_axis_rules and ``dcn_data_parallelism`` x
  ``ici_fsdp_parallelism`` x ``ici_tensor_parallelism`` (HSDP, data x FSDP x TP); PyTorch
  FSDP ``ShardingStrategy.HYBRID_SHARD``; Flax ``examples/gemma`` sharding config;
  Megatron-LM (Shoeybi et al. 2019) column/row split MLP, head-parallel attention and
  vocab-parallel embedding; ZeRO (Rajbhandari et al. 2020) stages 1-3; Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models" (sequence
  parallelism); GShard (Lepikhin et al. 2020) expert parallelism; Huang et al. 2019,
  "GPipe"; MaxText ``layers/pipeline.py`` (``ici_pipeline_parallelism`` /
  ``dcn_pipeline_parallelism``: stages over the slow axis, data/FSDP/TP within).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardc.cost.cluster import Cluster
from shardc.models.logical import axis_rules, no_axis_rules, spec
from shardc.models.ring import Ring, ring_over
from shardc.pipeline.onefb import pipeline_loss
from shardc.pipeline.runtime import pipeline_scan
from shardc.pipeline.schedule import Pipeline
from shardc.pipeline.stack import running
from shardc.tradeoff.views import View, views
from shardc.util.axes import axis_tuple

__all__ = ["batch_specs", "compile_expert", "Expert", "experts_for", "FSDP", "preset_experts",
           "seed_experts", "SEQ", "state_specs", "TENSOR", "Traits"]

TENSOR = ("heads", "mlp", "vocab", "conv_out")
"""Logical dims Megatron-style tensor parallelism splits (column/row pairs, heads, and the
vocabulary of the embedding table and the output layer: Megatron's vocab-parallel
embedding and parallel output layer, so every TP form is vocab-parallel)."""
FSDP = ("embed", "mlp", "conv_out", "classes", "patch")
"""Logical parameter dims FSDP shards (the largest dim of every weight the zoo has)."""
SEQ = "resid_seq"
"""The residual stream's sequence dim (:data:`shardc.models.layers.RESID`), which sequence
parallelism splits over the tensor-parallel axis."""


@dataclass(frozen=True, slots=True)
class Traits:
    """What a model has that some forms need: an ``"expert"`` dim (MoE), a vocabulary table
    (``"vocab"``), a residual stream with a sequence dim (:data:`SEQ`), its layers as a
    :func:`shardc.pipeline.layers` stack (``stack``: a hand-written pipeline can run it),
    ending in its loss (``loss``, :func:`shardc.pipeline.layers_loss`: 1F1B can run it)."""

    moe: bool = False
    vocab: bool = False
    seq: bool = False
    stack: bool = False
    loss: bool = False
    #: a model whose state outgrows its devices (the zoo's ``offload`` flag): the
    #: offloading forms too
    offload: bool = False
    #: a long sequence, fewer sequences than devices (the zoo's ``long`` flag): the
    #: context-parallel forms too
    long: bool = False


@dataclass(frozen=True)
class Expert:
    name: str
    params: Mapping[str, Any]  # logical name -> mesh axes, for parameters
    acts: Mapping[str, Any]  # logical name -> mesh axes, for activations and the batch
    view: View  # the logical mesh the rules name axes of
    opt: Mapping[str, Any] | None = None  # for the optimizer state; None: ``params``
    first: tuple[str, ...] = ()  # logical names that take their mesh axes before the rest
    #: the stack run as this pipeline (written by hand, :func:`_runner`); None: a scan
    pipeline: Pipeline | None = None
    #: the optimizer state lives in host memory between steps, moved to the devices for
    #: the update and back (:func:`compile_expert`)
    offload: bool = False
    #: attention run as a hand-written ring over these mesh axes (the activations'
    #: ``"seq"`` axes, :mod:`shardc.models.ring`); empty: the model's own attention
    ring: tuple[str, ...] = ()

    def mesh(self, physical: Mesh) -> Mesh:
        """The view's mesh over ``physical``'s devices."""
        return self.view.mesh(physical)


def _on(axes, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: axes for n in names}


def _zero(name: str, over, batch, view: View) -> Expert:
    """ZeRO-1 (Rajbhandari et al. 2020 §5.1; Megatron-LM's distributed optimizer,
    ``--use-distributed-optimizer``): parameters replicated, the optimizer state sharded
    over ``over`` (on the dims FSDP shards), the batch over ``batch``.

    ZeRO-2 (the gradients sharded too, §5.2) is not a separate form: a sharding constraint
    on the gradients compiles to the same program (tests/test_experts.py). XLA's
    partitioner already reads only the slice of the summed gradient that the sharded
    optimizer state updates, and a one-step program keeps no gradient buffer past the
    update, which is what ZeRO-2 shards."""
    return Expert(name, {}, {"batch": batch}, view, opt=_on(over, FSDP))


def _offloaded(every, view: View) -> list[Expert]:
    """The optimizer state in host memory, sharded over every device: ZeRO-Offload
    (Ren et al. 2021: ZeRO-2 with the optimizer state on the host; here the update runs
    on the devices, the state moved there for it and back) and FSDP with the state
    offloaded (PyTorch FSDP's ``CPUOffload``, parameters kept on the devices)."""
    return [dataclasses.replace(_zero("zero-offload", every, every, view), offload=True),
            Expert("fsdp-offload", _on(every, FSDP), {"batch": every}, view, offload=True)]


def _tp(name: str, params, acts, view: View, tp, traits: Traits,
        opt: Mapping[str, Any] | None = None) -> list[Expert]:
    """A tensor-parallel form (Megatron-LM, Shoeybi et al. 2019) and, on a model with a
    sequence, the same with sequence parallelism (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", §4.2.2): the residual stream
    and the norms on it split on the sequence over the TP axis ``tp``."""
    out = [Expert(name, params, acts, view, opt=opt)]
    if traits.seq:
        out.append(Expert(f"{name}-sp", params, {**acts, SEQ: tp}, view, opt=opt))
    return out


def _context(seq, batch, view: View) -> list[Expert]:
    """Context parallelism over ``seq`` with FSDP over every device, the batch over
    ``batch`` (None: not split): MaxText's (``context`` on the activations' sequence dims;
    XLA gathers the keys and values for each query block, as its all-gather context
    parallelism does; Llama 3's long-context stage ran CP16 so), the same with the
    attention a hand-written ring (:mod:`shardc.models.ring`: the key/value blocks passed
    round ``seq`` by ``ppermute``) and DeepSpeed-Ulysses' (the residual stream split on
    the sequence, the attention on the heads: an all-to-all each way)."""
    every = view.names if len(view.names) > 1 else view.names[0]
    ring = axis_tuple(seq)
    n = math.prod(view.shape[view.names.index(a)] for a in ring)
    acts = {"batch": batch} if batch is not None else {}
    cp = {**acts, "seq": seq, SEQ: seq}
    return [Expert(f"cp{n}-x-fsdp", _on(every, FSDP), cp, view),
            Expert(f"ring{n}-x-fsdp", _on(every, FSDP), cp, view, ring=ring),
            Expert(f"ulysses{n}-x-fsdp", _on(every, FSDP), {**acts, "heads": seq, SEQ: seq},
                   view)]


def _fsdp(name: str, over, batch, view: View, traits: Traits) -> list[Expert]:
    """FSDP over ``over`` and, on a model with a vocabulary table, the vocab-parallel form:
    the embedding table and output layer sharded on the vocabulary (PyTorch FSDP2 shards
    every parameter on its dim 0, the vocabulary of ``nn.Embedding`` and of the output
    ``nn.Linear``; Megatron-LM's vocab-parallel embedding) instead of the model dim."""
    out = [Expert(name, _on(over, FSDP), {"batch": batch}, view)]
    if traits.vocab:
        out.append(Expert(f"{name}-vp", {**_on(over, FSDP), "vocab": over}, {"batch": batch},
                          view, first=("vocab",)))
    return out


def experts_for(view: View, traits: Traits = Traits(), whole: bool = True,
                node_local: bool = False) -> list[Expert]:
    """The expert forms on ``view``: with ``whole``, those over all its devices (data
    parallel, FSDP, ZeRO, Megatron, expert parallel); on a 2-D view the hybrid forms, on a
    3-D view data x FSDP x TP; with ``node_local`` (a slower outer axis) the forms on the
    inner axis alone."""
    names = view.names
    every = names if len(names) > 1 else names[0]
    out = []
    if whole:
        out += [Expert("data-parallel", {}, {"batch": every}, view),
                *_fsdp("fsdp", every, every, view, traits), _zero("zero1", every, every, view),
                *_tp(f"megatron-tp{math.prod(view.shape)}", _on(every, TENSOR),
                     _on(every, TENSOR), view, every, traits)]
        if traits.moe:
            out.append(Expert("expert-parallel", {"expert": every},
                              {"expert": every, "batch": every}, view))
        if traits.offload:
            out += _offloaded(every, view)
        if traits.long:
            out += _context(every, None, view)
    if len(names) == 2:
        a, b = names
        k = view.shape[1]
        tensor = _on(b, TENSOR)
        out += [*_fsdp(f"hsdp{k}", b, every, view, traits),
                _zero(f"zero1-shard{k}", b, every, view),
                # Megatron-LM's default: TP, and the distributed optimizer over the DP axis
                *_tp(f"zero1-x-tp{k}", tensor, {**tensor, "batch": a}, view, b, traits,
                     opt={**tensor, "embed": a}),
                *_tp(f"dp-x-tp{k}", tensor, {**tensor, "batch": a}, view, b, traits),
                *_tp(f"fsdp-x-tp{k}", {**tensor, "embed": a}, {**tensor, "batch": a}, view,
                     b, traits)]
        if not whole:  # on the flat 2-D view, megatron over both axes is listed above
            out += _tp(f"megatron-tp{k}", tensor, tensor, view, b, traits)
        if traits.long:  # over the inner axis (the node), the sequences over the outer
            out += _context(b, a, view)
        if traits.moe:
            out.append(Expert(f"ep{k}-x-dp", {"expert": b}, {"expert": b, "batch": every},
                              view))
        if node_local:
            out += [Expert("data-parallel-node", {}, {"batch": b}, view),
                    *_fsdp("fsdp-node", b, b, view, traits)]
            if traits.stack:
                out += _pipelined(view, traits.loss)
            if traits.moe:
                out.append(Expert("expert-parallel-node", {"expert": b},
                                  {"expert": b, "batch": b}, view))
    if len(names) == 3:  # data x FSDP x TP; HSDP x TP where the data axis crosses nodes
        a, b, c = names
        tensor = _on(c, TENSOR)
        out += _tp(f"dp-x-fsdp{view.shape[1]}-x-tp{view.shape[2]}", {**tensor, "embed": b},
                   {**tensor, "batch": (a, b)}, view, c, traits)
    return out


def _pipelined(view: View, loss: bool) -> list[Expert]:
    """GPipe over the outer axis ``a`` (a stage per device of it, as many micro-batches as
    stages), the stacked layers' state split over it; within a stage data parallelism,
    FSDP or Megatron TP over the inner axis ``b``; 1F1B so where the stack ends in its
    ``loss``. And MaxText's pipeline as its defaults
    configure it (``dcn_pipeline_parallelism`` over the nodes, ``ici_fsdp_parallelism``
    within): the circular schedule with one layer per stage per pass
    (``num_layers_per_pipeline_stage: 1``, so ``num_pipeline_repeats`` is the layers over
    the stages: :func:`_runner` sets the virtual stages from the stack) and as many
    micro-batches as stages (``num_pipeline_microbatches: -1``), FSDP within the node."""
    a, b = view.names
    s, k = view.shape
    tensor = _on(b, TENSOR)
    fsdp = {**_on(b, FSDP), "layers": a}
    out = []
    schedules = ("gpipe", "1f1b") if loss else ("gpipe",)
    for name in schedules:
        pipe = Pipeline(a, s, s, name)
        out += [Expert(f"{name}{s}-x-dp{k}", {"layers": a}, {"batch": b}, view, pipeline=pipe),
                Expert(f"{name}{s}-x-fsdp{k}", fsdp, {"batch": b}, view, pipeline=pipe),
                Expert(f"{name}{s}-x-tp{k}", {**tensor, "layers": a}, tensor, view,
                       pipeline=pipe)]
    return out + [Expert(f"maxtext-circular{s}-x-fsdp{k}", fsdp, {"batch": b}, view,
                         pipeline=Pipeline(a, s, s, "circular"))]


def _runner(expert: Expert, mesh: Mesh) -> tuple[Callable, Callable | None]:
    """The expert's hand-written pipeline, as :func:`shardc.pipeline.stack.running` takes
    it: the stack run by :func:`~shardc.pipeline.runtime.pipeline_scan` (for 1F1B, the
    stack and its loss by :func:`~shardc.pipeline.onefb.pipeline_loss`) with each
    micro-batch split over the expert's batch axes but the stage axis (data parallelism
    within the stage, the ``shard_map`` manual over them: the layers' own activation
    annotations are off inside), at the most micro-batches up to the expert's that the
    batch allows (the numerics check's small batch takes fewer)."""
    p = expert.pipeline
    circular = p.schedule == "circular"  # MaxText's: one layer per stage per pass
    rule = expert.acts.get("batch")
    axes = tuple(x for x in axis_tuple(rule) if x != p.axis)
    ways = math.prod(mesh.shape[x] for x in axes)

    def bare(fn):
        def call(*args):
            with no_axis_rules():
                return fn(*args)
        return call

    def micro(carry) -> Pipeline:
        n = jax.tree.leaves(carry)[0].shape[0]
        m = max(d for d in range(1, p.microbatches + 1)
                if n % d == 0 and (n // d) % ways == 0)
        return dataclasses.replace(p, microbatches=m)

    def run_loss(layer_fn, loss_fn, carry, params, head, targets):
        return pipeline_loss(bare(layer_fn), bare(loss_fn), carry, params, head, targets,
                             pipeline=micro(carry), mesh=mesh, batch_axes=axes)

    def run(layer_fn, carry, params):
        layer = bare(layer_fn)
        pipe = micro(carry)
        passes = jax.tree.leaves(params)[0].shape[0] // p.stages  # one layer a stage a pass
        # each micro-batch back at stage 0 for its next pass
        if circular and pipe.microbatches >= p.stages and passes > 1:
            pipe = dataclasses.replace(pipe, virtual=passes)
        elif circular:  # a batch of fewer micro-batches than stages (the bench's numerics
            # check on 4 nodes), or one pass: the same stages in GPipe's order
            pipe = dataclasses.replace(pipe, schedule="gpipe")
        return pipeline_scan(layer, carry, params, mesh=mesh, batch_axes=axes,
                             pipeline=pipe)[0]

    return run, run_loss if p.schedule == "1f1b" else None


def _slow_outer(view: View) -> bool:
    return len(view.names) == 2 and \
        view.cluster.bandwidth(view.names[0]) < view.cluster.bandwidth(view.names[1])


def preset_experts(shape: tuple[int, ...], names: tuple[str, ...], cluster: Cluster,
                   traits: Traits = Traits()) -> list[Expert]:
    """Every expert on every logical view of the devices (:func:`shardc.tradeoff.views.views`, up to
    three axes): the whole-device forms once (on the flat view), the hybrid forms on each
    2-D view, data x FSDP x TP on each 3-D view, and the node-local forms on the physical
    mesh when its outer axis is slower."""
    out: dict[str, Expert] = {}
    for i, view in enumerate(views(shape, names, cluster, max_axes=3)):
        for e in experts_for(view, traits, whole=len(view.shape) == 1,
                             node_local=i == 0 and _slow_outer(view)):
            out.setdefault(e.name, e)
    return list(out.values())


def seed_experts(mesh: Mesh, cluster: Cluster, traits: Traits = Traits()) -> list[Expert]:
    """The experts expressible on ``mesh`` itself (its own axes): what shardc is seeded
    with when it plans on that mesh."""
    view = View(tuple(mesh.devices.shape), tuple(mesh.axis_names), cluster)
    return [e for e in experts_for(view, traits, whole=True, node_local=_slow_outer(view))
            if not e.offload]  # a seed is layouts only


def _keys(path) -> tuple[str, ...]:
    """String keys of a state leaf's path: ``state["params"]["blocks"][0]...`` gives
    ``("params", "blocks", "0", ...)`` and ``state["opt"][0].mu["blocks"][0]...`` gives
    ``("opt", "blocks", "0", ...)``, so past the container an optimizer slot maps to the
    parameter it shadows."""
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def _spec(names, rules, shape, mesh: Mesh, first: tuple[str, ...]) -> PartitionSpec:
    """:func:`spec` with the dims named in ``first`` given their mesh axes before the
    others (MaxText's rule order): ``("embed", "vocab")`` with both on one axis splits the
    vocabulary when ``first`` names it."""
    if not any(n in first for n in names):
        return spec(names, rules, shape, mesh)
    head = spec([n if n in first else None for n in names], rules, shape, mesh)
    used = {a for p in head for a in axis_tuple(p)}
    left = {k: tuple(a for a in axis_tuple(v) if a not in used) for k, v in rules.items()}
    tail = spec([None if n in first else n for n in names], left, shape, mesh)
    return PartitionSpec(*(h if h is not None else t for h, t in zip(head, tail)))


def state_specs(state, mesh: Mesh, expert: Expert, param_axes: Callable) -> Any:
    """Specs of the train state ``{"params", "opt"}``: parameters by ``expert.params``, the
    optimizer state by ``expert.opt`` where the expert has one."""
    def one(path, leaf):
        if not getattr(leaf, "shape", ()):
            return PartitionSpec()
        keys = _keys(path)
        by = expert.opt if keys[0] == "opt" and expert.opt is not None else expert.params
        names = param_axes(keys[1:], tuple(leaf.shape))
        return _spec(names, by, leaf.shape, mesh, expert.first)

    return jax.tree_util.tree_map_with_path(one, state)


def batch_specs(batch, mesh: Mesh, expert: Expert) -> Any:
    def one(leaf):
        names = ("batch",) + (None,) * (len(leaf.shape) - 1)
        return spec(names, expert.acts, leaf.shape, mesh)

    return jax.tree.map(one, batch)


def _ring(expert: Expert, mesh: Mesh) -> Ring | None:
    """Where the expert's hand-written ring runs (None: it has none)."""
    if not expert.ring:
        return None
    return Ring(mesh, expert.ring, axis_tuple(expert.acts.get("batch")))


def compile_expert(step: Callable, state, batch, physical: Mesh, expert: Expert,
                   param_axes: Callable):
    """``(jitted, lowered)`` of ``step`` under the expert's shardings and activation rules,
    on the expert's view of ``physical``'s devices."""
    mesh = expert.mesh(physical)
    named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t)  # noqa: E731
    st = named(state_specs(state, mesh, expert, param_axes))
    bt = named(batch_specs(batch, mesh, expert))
    on_device = st
    # the offloading experts' state in host memory (made for them only: devices without
    # host memory, XLA:GPU's for absent devices, refuse the memory kind)
    host = (jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), st["opt"])
            if expert.offload else None)

    # a function of its own: jax.jit's trace cache does not know the activation rules
    # (-sp forms differ by them alone)
    def run(state, batch):
        if expert.offload:  # the state to the devices for the step, then back
            state = {**state, "opt": jax.device_put(state["opt"], on_device["opt"])}
        new, loss = step(state, batch)
        if expert.offload:
            new = {**new, "opt": jax.device_put(new["opt"], host)}
        return new, loss

    if expert.offload:
        st = {**st, "opt": host}

    jitted = jax.jit(run, in_shardings=(st, bt),
                     out_shardings=(st, NamedSharding(mesh, PartitionSpec())))
    with axis_rules(mesh, expert.acts), ring_over(_ring(expert, mesh)), \
            (running(*_runner(expert, mesh)) if expert.pipeline else contextlib.nullcontext()):
        if expert.offload:  # lowered for arguments placed as it wants, not as given
            state, batch = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type),
                (state, batch))
        lowered = jitted.lower(state, batch)
    return jitted, lowered
