"""The bench's expert forms on 8 CPU devices: each new form's step equals the unsharded step,
and its program has the layout the form claims (ZeRO-1, vocab-parallel FSDP, sequence
parallelism, three-axis views)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from shardc.bench import harness
from shardc.bench.experts import Expert, compile_expert, preset_experts, state_specs
from shardc.bench.zoo import PRESETS, ZOO
from shardc.cost.cluster import Cluster
from shardc.errors import BenchError
from shardc.inspect.hlo import collectives
from shardc.models import common, mlp
from shardc.tradeoff.views import views


def _expert(model: str, name: str, preset: str = "node-8") -> Expert:
    return next(e for e in harness.experts(ZOO[model], PRESETS[preset]) if e.name == name)


def _checked(model: str, expert: Expert, mesh=None):
    """The expert's compiled tiny step, after checking it equals the unsharded step."""
    zm = ZOO[model]
    mesh = mesh if mesh is not None else harness.make_mesh(PRESETS["node-8"])
    fn, (state, batch), want = harness._tiny(model)
    _, lowered = compile_expert(fn, state, batch, mesh, expert, zm.load().param_axes)
    compiled = lowered.compile()
    args = jax.device_put((state, batch), compiled.input_shardings[0])  # offloaded: on host
    assert_close(compiled(*args), want, lr=harness._tiny_lr(zm), what=expert.name)
    return lowered, compiled


def _state_specs(compiled):
    return jax.tree.map(lambda s: s.spec, compiled.input_shardings[0][0])


def _replicated(compiled) -> bool:
    """Whether every parameter is an input replicated on every device."""
    return all(s.is_fully_replicated
               for s in jax.tree.leaves(compiled.input_shardings[0][0]["params"]))


def test_zero1_replicates_parameters_and_shards_the_optimizer_state():
    _, compiled = _checked("mlp", _expert("mlp", "zero1"))
    assert _replicated(compiled)
    specs = _state_specs(compiled)
    mu = specs["opt"][0].mu["layers"][0]
    assert mu["kernel"] == PartitionSpec("gpu", None)  # [d_in, hidden]: "embed" over all 8
    assert mu["bias"] == PartitionSpec("gpu")  # [hidden] ("mlp")
    assert specs["opt"][0].count == PartitionSpec()


def test_zero1_node_local_and_with_tensor_parallelism():
    """On two nodes of four, zero1-shard4 shards the optimizer state within the node and
    splits the batch over both axes; zero1-x-tp4 (Megatron's default) keeps the
    parameters split by TP and shards their optimizer state over the data axis too."""
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    found = {e.name: e for e in preset_experts((2, 4), ("node", "gpu"),
                                               Cluster.multi_node("node", "gpu"))}
    local = found["zero1-shard4"]
    assert local.view.names == ("node", "gpu")
    _, compiled = _checked("mlp", local, mesh)
    assert _replicated(compiled)
    specs = _state_specs(compiled)
    assert specs["opt"][0].nu["layers"][1]["kernel"] == PartitionSpec("gpu", None)
    assert jax.tree.leaves(compiled.input_shardings[0][1])[0].spec[0] == ("node", "gpu")
    _, compiled = _checked("mlp", found["zero1-x-tp4"], mesh)
    specs = _state_specs(compiled)
    assert specs["params"]["layers"][0]["kernel"] == PartitionSpec(None, "gpu")  # column
    assert specs["opt"][0].mu["layers"][0]["kernel"] == PartitionSpec("node", "gpu")


def _constraints(lowered) -> list[str]:
    return re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[[^>]*\])> : tensor<(\S+)>",
                      lowered.as_text())


def _normalised(text: str) -> list[str]:
    """A compiled module's instructions without names, metadata or source tables, sorted
    (the schedule may order independent instructions differently)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    lines = [re.sub(r"%[\w.\-]+", "%", line).strip() for line in text.splitlines()
             if re.match(r"\s+(ROOT )?%", line)]
    return sorted(lines)


def test_zero2_compiles_to_zero1s_program():
    """ZeRO-2 (the gradients constrained sharded like the optimizer state) compiles to the
    ZeRO-1 program: why the expert set lists ZeRO-1 alone (``experts._zero``)."""
    cfg = mlp.MLPConfig.tiny()
    mesh = harness.make_mesh(PRESETS["node-8"])
    zero1 = _expert("mlp", "zero1")
    model = mlp.MLP(cfg, rngs=nnx.Rngs(mlp.PARAM_SEED))
    graphdef, params = common.split_params(model)
    grads = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(
        {"params": params}, mesh, Expert("g", zero1.opt, {}, zero1.view), mlp.param_axes))
    shard = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.lax.with_sharding_constraint(u, grads["params"]), s))
    programs, results, constraints = [], [], []
    for first in (optax.identity(), shard):  # the same state structure either way
        tx = optax.chain(first, mlp.make_optimizer(cfg))
        state = common.init_train_state(model, tx)
        step = common.build_train_step(graphdef, mlp.mse_loss, tx)
        _, lowered = compile_expert(step, state, mlp.example_batch(cfg), mesh, zero1,
                                    mlp.param_axes)
        constraints.append(len(_constraints(lowered)))
        compiled = lowered.compile()
        programs.append(_normalised(compiled.as_text()))
        results.append(compiled(state, mlp.example_batch(cfg)))
    assert constraints[1] == constraints[0] + len(jax.tree.leaves(params))  # the gradients
    assert programs[0] == programs[1]
    assert harness._close(results[0], results[1])


def test_vocab_parallel_fsdp_splits_the_tables_on_the_vocabulary():
    _, compiled = _checked("gpt", _expert("gpt", "fsdp-vp"))
    specs = _state_specs(compiled)
    assert specs["params"]["wte"]["embedding"] == PartitionSpec("gpu", None)  # [vocab, d]
    assert specs["opt"][0].mu["wte"]["embedding"] == PartitionSpec("gpu", None)
    # plain FSDP splits the model dim, and the TP forms split the vocabulary already
    fsdp, tp = (_expert("gpt", n) for n in ("fsdp", "megatron-tp8"))
    mesh = harness.make_mesh(PRESETS["node-8"])
    state = ZOO["gpt"].load().abstract_args(ZOO["gpt"].config("tiny"))[0]
    table = lambda e: state_specs(state, mesh, e, ZOO["gpt"].load().param_axes)[  # noqa: E731
        "params"]["wte"]["embedding"]
    assert table(fsdp) == PartitionSpec(None, "gpu") and table(tp) == PartitionSpec("gpu", None)
    # llama's untied output layer is [d, vocab]: the vocabulary takes the axis first
    llama = ZOO["llama"].load()
    state = llama.abstract_args(ZOO["llama"].config("tiny"))[0]
    vp = state_specs(state, mesh, _expert("llama", "fsdp-vp"), llama.param_axes)["params"]
    assert vp["lm_head"]["kernel"] == PartitionSpec(None, "gpu")
    assert vp["embed"]["embedding"] == PartitionSpec("gpu", None)


def test_sequence_parallelism_splits_the_residual_stream_on_the_sequence():
    """dp-x-tp2-sp: outside attention and the MLP the residual stream ``[8, 16, 64]`` is
    split on the sequence over the TP axis; inside, q/k/v stay split on the heads."""
    expert = _expert("gpt", "dp-x-tp2-sp")
    a, b = expert.view.names
    lowered, _ = _checked("gpt", expert)
    got = _constraints(lowered)
    assert (f'[{{"{a}"}}, {{"{b}"}}, {{}}]', "8x16x64xf32") in got  # the residual stream
    assert (f'[{{"{a}"}}, {{}}, {{"{b}"}}, {{}}]', "8x16x4x16xf32") in got  # heads
    fn, args, _ = harness._tiny("gpt")
    plain = _constraints(compile_expert(fn, *args, harness.make_mesh(PRESETS["node-8"]),
                                        _expert("gpt", "dp-x-tp2"),
                                        ZOO["gpt"].load().param_axes)[1])
    assert (f'[{{"{a}"}}, {{}}, {{}}]', "8x16x64xf32") in plain  # without SP: whole


def test_three_axis_views_and_data_x_fsdp_x_tp():
    assert [v.shape for v in views((8,), ("gpu",), Cluster(), max_axes=3)] == \
        [(8,), (2, 4), (4, 2), (2, 2, 2)]
    two = {v.shape: v.names for v in views((2, 8), ("node", "gpu"), Cluster.multi_node(),
                                           max_axes=3)}
    assert two[(2, 2, 4)] == ("node", "gpu2", "gpu4")  # HSDP x TP: data across nodes
    assert two[(4, 2, 2)] == ("node_gpu2", "gpu2a", "gpu2b")
    assert all(len(s) < 3 for s in (v.shape for v in views((2, 8), ("node", "gpu"),
                                                           Cluster.multi_node())))
    expert = _expert("mlp", "dp-x-fsdp2-x-tp2")
    _, compiled = _checked("mlp", expert)
    specs = _state_specs(compiled)
    a, b, c = expert.view.names
    assert compiled.input_shardings[0][0]["params"]["layers"][0]["kernel"].mesh.axis_names \
        == (a, b, c)
    assert specs["params"]["layers"][0]["kernel"] == PartitionSpec(b, c)  # [embed, mlp]
    assert jax.tree.leaves(compiled.input_shardings[0][1])[0].spec[0] == (a, b)


def test_expert_seeds_name_only_views_the_mesh_search_plans():
    """shardc is seeded with every expert on a view its mesh search plans (1-D and 2-D):
    the three-axis experts are measured, not seeded."""
    zm, preset = ZOO["gpt"], PRESETS["node-8"]
    mesh = harness.make_mesh(preset)
    args = zm.load().abstract_args(zm.config("tiny"))
    seeds = harness.expert_seeds(zm, mesh, preset, args, mesh_search=True)
    assert {"zero1", "zero1-shard4", "fsdp-vp", "megatron-tp4-sp"} <= set(seeds)
    assert not {"dp-x-fsdp2-x-tp2", "dp-x-fsdp2-x-tp2-sp"} & set(seeds)


def test_pipelined_experts_run_the_deep_stack_as_gpipe_over_the_slow_axis():
    """Over Ethernet-joined nodes a model whose layers are a shardc.pipeline.layers stack
    gets GPipe over the node axis with DP, FSDP or TP within the node (1F1B so too where
    the stack ends in its loss), and MaxText's
    default circular pipeline with FSDP within (none without a stack,
    nor where the nodes are joined by links as fast as the node's); each keeps a stage's
    layers on its node (the stacked state split over it) and equals the unsharded step, and
    its program sends each micro-batch on with a collective-permute over the node axis."""
    from shardc.bench.experts import Traits

    eth = Cluster.ethernet_nodes("node", "gpu")
    names = {e.name for e in preset_experts((2, 4), ("node", "gpu"), eth, Traits(stack=True))}
    assert {"gpipe2-x-dp4", "gpipe2-x-fsdp4", "gpipe2-x-tp4", "maxtext-circular2-x-fsdp4"} \
        <= names and not any(n.startswith("1f1b") for n in names)
    loss = Traits(stack=True, loss=True)
    assert {"1f1b2-x-dp4", "1f1b2-x-fsdp4", "1f1b2-x-tp4"} <= \
        {e.name for e in preset_experts((2, 4), ("node", "gpu"), eth, loss)}
    assert not any(n.startswith(("gpipe", "maxtext")) for n in
                   {e.name for e in preset_experts((2, 4), ("node", "gpu"), eth)} |
                   {e.name for e in preset_experts((2, 4), ("node", "gpu"),
                                                   Cluster.nvlink_node(("node", "gpu")),
                                                   Traits(stack=True))})
    assert harness.traits(ZOO["deep"]).stack and harness.traits(ZOO["deep"]).loss
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    found = {e.name: e for e in preset_experts((2, 4), ("node", "gpu"), eth, loss)}
    assert found["maxtext-circular2-x-fsdp4"].pipeline.schedule == "circular"
    for name in ("1f1b2-x-dp4", "gpipe2-x-tp4", "maxtext-circular2-x-fsdp4"):
        _, compiled = _checked("deep", found[name], mesh)
        specs = _state_specs(compiled)
        assert specs["params"]["layers"]["mlp"]["up"]["kernel"][0] == "node", name
        sends = [c for c in collectives(compiled, mesh) if c.kind == "collective-permute"]
        assert any(c.axes == ("node",) for c in sends), name


def test_offloading_experts_keep_the_optimizer_state_in_host_memory():
    for name in ("zero-offload", "fsdp-offload"):
        expert = _expert("mlp-offload", name)
        _, compiled = _checked("mlp-offload", expert)  # equal to the unsharded step
        state = compiled.input_shardings[0][0]
        assert {s.memory_kind for s in jax.tree.leaves(state["opt"])} == {"pinned_host"}
        assert {s.memory_kind for s in jax.tree.leaves(state["params"])} == {"device"}
        assert "S(5)" in compiled.as_text()  # host-resident buffers in the compiled program
    assert not any(e.offload for e in harness.experts(ZOO["mlp"], PRESETS["node-8"]))
    with pytest.raises(BenchError, match="no host memory"):  # XLA:GPU's compile drops it
        harness.run_expert(ZOO["mlp-offload"], PRESETS["node-8"], expert, "tiny", False,
                           compiler="gpu")


def test_context_parallel_experts_split_the_sequence_or_the_heads():
    """cp8-x-fsdp splits every activation's sequence (queries, keys and values included:
    XLA gathers the keys for the scores); ring8-x-fsdp so too, its attention passing the
    key/value blocks round the devices (collective-permutes); ulysses4-x-fsdp (on the
    2 x 4 view: the tiny model has 4 heads) the residual stream on the sequence and the
    attention on the heads; each equals the unsharded step, and none is offered for a
    model without a long sequence."""
    names = {e.name for e in harness.experts(ZOO["llama-long"], PRESETS["2nodes-2x8"])}
    assert {"cp8-x-fsdp", "ring8-x-fsdp", "ulysses8-x-fsdp", "cp16-x-fsdp", "ring16-x-fsdp",
            "ulysses16-x-fsdp"} <= names
    assert not any(e.name.startswith(("cp", "ring", "ulysses"))
                   for e in harness.experts(ZOO["llama"], PRESETS["node-8"]))
    cp = _constraints(_checked("llama-long", _expert("llama-long", "cp8-x-fsdp"))[0])
    assert ('[{}, {"gpu"}, {}, {}]', "8x16x4x16xf32") in cp  # queries along the sequence
    assert ('[{}, {}, {"gpu"}, {}]', "8x4x16x16xf32") in cp  # the scores' query rows
    _, compiled = _checked("llama-long", _expert("llama-long", "ring8-x-fsdp"))
    sends = [c for c in collectives(compiled, harness.make_mesh(PRESETS["node-8"]))
             if c.kind == "collective-permute"]
    # in the scanned layer: 7 sends of the keys and 7 of the values forward, again where
    # the backward recomputes the layer (remat), and 7 of each one's gradient back
    assert len(sends) == 3 * 2 * 7 and {c.axes for c in sends} == {("gpu",)}, sends
    expert = _expert("llama-long", "ulysses4-x-fsdp")
    a, b = expert.view.names
    uly = _constraints(_checked("llama-long", expert)[0])
    assert (f'[{{"{a}"}}, {{"{b}"}}, {{}}]', "8x16x64xf32") in uly  # the residual stream
    assert (f'[{{"{a}"}}, {{}}, {{"{b}"}}, {{}}]', "8x16x4x16xf32") in uly  # the heads


def test_the_hand_written_ring_equals_plain_attention_where_the_batch_does_not_split():
    """models.ring's attention (the ringN-x-fsdp experts') equals the Llama's own causal
    GQA attention, values and gradients, with one sequence on a (2, 4) mesh: the ring over
    the 4, the batch axis of 2 left unsplit (it does not divide one sequence)."""
    from shardc.models import llama, ring

    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 16, 4, 8))
    k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in keys[1:])

    def loss(q, k, v):
        return jnp.sum(ring.attend(q, k, v, llama._causal_attention) ** 2)

    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    with ring.ring_over(ring.Ring(mesh, ("b",), ("a",))):
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
