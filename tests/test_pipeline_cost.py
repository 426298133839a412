"""Pricing pipelines (shardc.pipeline.cost) and the planner's choice of one
(shardc.pipeline.choose): formulas by hand, the layer scans found, and the choice on the
bench presets (abstract meshes: nothing runs)."""

import dataclasses

import jax
import pytest
from jax.sharding import AbstractMesh

import shardc
from shardc.bench.zoo import PRESETS, ZOO
from shardc.cost.cluster import ETH_BW, Cluster
from shardc.cost.comm import conversion
from shardc.ir.sbp import B, NdSbp, Partial
from shardc.ir.trace import trace
from shardc.models import llama
from shardc.pipeline.choose import ChoiceOptions, best_pipeline, candidates
from shardc.pipeline.cost import combined_sets, price
from shardc.pipeline.parts import Parts
from shardc.pipeline.runs import _joined
from shardc.pipeline.scans import find_layers
from shardc.pipeline.schedule import Pipeline
from shardc.plan.record import Reshard
from shardc.step.options import Options
from shardc.step.signature import tie_outputs

#: alpha-beta links, for prices computed by hand: a permute over ``node`` is
#: ``ALPHA + bytes / BW``
ALPHA, BW = 1e-5, 1e9
CLUSTER = Cluster({"node": BW}, {"node": ALPHA}, axis_link={"node": "net"},
                  collective_model="alpha-beta")


def _parts(**kw) -> Parts:
    base = dict(step=10.0, peak=5e9, layers=8.0, compute=8.0, sample=(), once=0.4,
                state=4e9, other_state=1e8, saved=2e8, carry=1e6)
    return Parts(**{**base, **kw})


def test_bubble_formulas():
    assert Pipeline("node", 4, 8).bubble == pytest.approx(3 / 11)
    assert Pipeline("node", 4, 8, "circular", 2).bubble == pytest.approx(3 / 19)


@pytest.mark.parametrize("pipe", [Pipeline("node", 4, 8), Pipeline("node", 4, 8, "circular", 2)])
def test_price_matches_hand_computation(pipe):
    whole = _parts(own=3e8)
    stage = _parts(step=40.0, layers=32.0, compute=32.0, once=0.8, weights=1.6e9,
                   layer=1e8, results=4e9)
    p = price(pipe, whole, stage, CLUSTER)
    s, m, v = 4, 8, pipe.virtual
    ticks = m * v + s - 1
    work = 32.0 / s
    assert p.layers == pytest.approx(work * ticks / (m * v))
    assert p.bubble / p.layers == pytest.approx(pipe.bubble)
    # one permute of a micro-batch's carry per tick each way; two all-reduces of the carry
    assert p.permutes == 2 * ticks and p.permute_bytes == pytest.approx(1e6 / m)
    assert p.transfers == pytest.approx(p.permutes * (ALPHA + 1e6 / m / BW))
    assert (p.reduces, p.reduce_bytes) == (2, 1e6)
    assert p.gathers == pytest.approx(2 * CLUSTER.collective_seconds("all-reduce",
                                                                     [("node", 4)], 1e6))
    assert p.once == pytest.approx(0.8 / s) and p.rest == pytest.approx(10.0 - 8.0)
    assert p.step_time == pytest.approx(p.rest + p.layers + p.transfers + p.gathers + p.once)
    assert p.summary().startswith(f"4 stages over node{' x 2 virtual' if v > 1 else ''}, "
                                  f"8 micro-batches, {pipe.schedule}: ")
    assert f"bubble {p.bubble:.3f} s, {p.bubble / p.step_time:.0%}" in p.summary()
    # what the rest holds, the updated copy; the weights at work: the gradient's buffer at
    # 1 / S and, GPipe, a layer's weights sliced out; circular, the weights laid out in its
    # order, a chunk's (two layers) and its gradient, a layer's; those beyond the
    # parameters' part of the updated copy (the moments') live in its buffers
    at_work = 1.6e9 / s + (2 * 1.6e9 / (s * v) + 1e8 if v > 1 else 1e8)
    beyond = max(0.0, at_work - (4e9 - 1.6e9) / s)
    assert beyond == pytest.approx(3e8 if v > 1 else 0.0)
    held = 1e6 * ticks / m + 2e8 / (s * v * m) + 3e6 if v > 1 else \
        2e8 * ticks / (s * m) + 2e6
    assert p.peak_memory == pytest.approx(4e9 / s + 1e8 + 3e8 + 4e9 / s + beyond + held)


def test_a_forward_only_program_sends_one_way():
    train = price(Pipeline("node", 4, 8), _parts(), _parts(), CLUSTER)
    forward = price(Pipeline("node", 4, 8), _parts(), _parts(passes=1), CLUSTER)
    assert forward.permutes * 2 == train.permutes and forward.reduces * 2 == train.reduces
    assert forward.transfers * 2 == pytest.approx(train.transfers)


def test_a_send_between_nodes_runs_on_one_port():
    """A ring's channels spread over the node's NICs; a stage's send crosses one."""
    eth = Cluster.ethernet_nodes()
    flat = Cluster({"all": ETH_BW}, {"all": ALPHA}, axis_link={"all": "net"},
                   axis_nodes={"all": 4}, collective_model="alpha-beta")
    assert flat.group([("all", 32)]).bandwidth == 8 * ETH_BW  # 8 GPUs' ports per node
    assert flat.send_seconds([("all", 32)], 1e6) == pytest.approx(ALPHA + 1e6 / ETH_BW)
    assert eth.send_seconds([("node", 4)], 1e6) == \
        eth.collective_seconds("collective-permute", [("node", 4)], 1e6)
    assert eth.send_seconds([("gpu", 8)], 1e6) < eth.send_seconds([("node", 4)], 1e6)


def test_one_f_one_b_holds_fewer_micro_batches_and_runs_the_loss_on_the_last_stage():
    """1F1B (shardc.pipeline.onefb), as its compiled program's cost is counted: M + 2S - 2
    ticks, each a micro-batch's forward, backward and loss on a stage's devices, with a
    permute each way; the residuals of min(M, 2S - 1) micro-batches held, not M + S - 1
    steps'; no all-reduce of the finished micro-batches; the loss's gradient summed by one
    all-reduce over the stage axis and the batch's, not by the whole plan's conversions."""
    s, m = 4, 16
    whole = _parts(head=0.5, head_weights=4e6, head_comm=0.25)
    stage = _parts(head=0.5, head_weights=4e6, batch_spans=(("gpu", 2),), weights=8e6)
    gpipe = price(Pipeline("node", s, m), whole, stage, CLUSTER)
    onefb = price(Pipeline("node", s, m, "1f1b"), whole, stage, CLUSTER)
    ticks = m + 2 * s - 2
    work = 8.0 / s
    assert onefb.bubble == pytest.approx(work * ticks / m - work)
    assert onefb.layers == pytest.approx(work * ticks / m + 0.5 * (ticks * s / m - 1))
    assert onefb.rest == pytest.approx(gpipe.rest - 0.25)
    assert (onefb.ticks, onefb.permutes) == (ticks, 2 * ticks)
    assert onefb.transfers == pytest.approx(2 * ticks * (ALPHA + 1e6 / m / BW))
    assert (onefb.reduces, gpipe.reduces) == (1, 2)
    assert onefb.loss_spans == (("node", s), ("gpu", 2)) and onefb.loss_bytes == 4e6 + 4
    assert onefb.loss_reduce == pytest.approx(
        CLUSTER.collective_seconds("all-reduce", onefb.loss_spans, 4e6 + 4))
    assert onefb.comm == pytest.approx(onefb.transfers + onefb.gathers + onefb.grads
                                       + onefb.loss_reduce)
    residuals = 2e8 / (s * m)  # one micro-batch's residuals of a stage's layers
    assert gpipe.peak_memory - onefb.peak_memory == \
        pytest.approx(residuals * ((m + s - 1) - (2 * s - 1)))


def test_per_sample_conversions_pay_their_latency_per_micro_batch():
    sizes, names = (4, 2), ("node", "gpu")
    cluster = Cluster({"node": BW, "gpu": BW}, {"node": ALPHA, "gpu": ALPHA},
                      collective_model="alpha-beta")
    conv = conversion(NdSbp((B, Partial())), NdSbp((B, B)), sizes, names, cluster)
    n = 4e6
    r = Reshard(0, 1, NdSbp((B, Partial())), NdSbp((B, B)), 32 * conv.time(n),
                32 * conv.wire_bytes(n), (), ())  # a layer scan's 32 trips
    parts = _parts(sample=((conv, n, r, False, False), (conv, n, r, True, False),
                           (conv, n, r, False, True)))
    # a recomputed forward's conversion counts where the schedule recomputes (circular);
    # one over an axis splitting the micro-batches never (a stage is manual there)
    assert parts.sample_seconds(1) == pytest.approx(2 * 32 * conv.time(n))
    assert parts.sample_seconds(1, rerun=False) == pytest.approx(32 * conv.time(n))
    wire = conv.time(n) - ALPHA  # all-reduce over 2: alpha + n / bw
    assert parts.sample_seconds(8, rerun=False) == pytest.approx(32 * (8 * ALPHA + wire))


def _traced(cfg):
    args = llama.abstract_args(cfg)
    tr = trace(llama.build_step(cfg), *args)
    ties = tie_outputs([jax.tree.structure(a) for a in args], tr.out_tree, tr.graph)
    return tr.graph, ties


def test_find_layers_of_a_scanned_decoder():
    cfg = llama.LlamaConfig.deep_tiny()
    graph, ties = _traced(cfg)
    layers = find_layers(graph, ties)
    # a shardc.pipeline.layers stack: its forward (saving the residuals) and its backward,
    # as jax.lax.scan's gradient runs them: nothing recomputed
    assert (layers.length, layers.batch, len(layers.scans)) == (32, cfg.batch, 2)
    assert not layers.rerun
    carried = [v for k, v in enumerate(graph.inputs) if k in {i for _, i in ties}]
    stacked_in = [v for v in carried if v.id in layers.stacked]
    # every stacked parameter and its two Adam moments; nothing else the state holds
    assert stacked_in and len(stacked_in) % 3 == 0
    assert all(v.shape[0] == 32 for v in stacked_in)
    assert not any(v.id in layers.stacked for v in carried if v.shape[:1] != (32,))
    values = {v.id: v for v in graph.values()}
    assert [values[c].shape for c in layers.carry] == [(cfg.batch, cfg.seq_len, cfg.d_model)]
    assert layers.saved and all(values[i].shape[:2] == (32, cfg.batch) for i in layers.saved)
    assert layers.outside  # the stacked parameters' optimizer updates
    assert layers.params and layers.params < layers.stacked


def test_a_scanned_decoder_reruns_no_scan():
    cfg = llama.LlamaConfig.deep_tiny()
    scanned = dataclasses.replace(cfg, stack_layers=False, loss_in_stack=False, remat=True)
    layers = find_layers(*_traced(scanned))
    assert len(layers.scans) == 2 and layers.rerun == () and layers.saved


def test_an_unrolled_model_has_no_layer_scan():
    zm = ZOO["gpt"]
    mod = zm.load()
    args = mod.abstract_args(zm.config("tiny"))
    tr = trace(mod.build_step(zm.config("tiny")), *args)
    ties = tie_outputs([jax.tree.structure(a) for a in args], tr.out_tree, tr.graph)
    assert find_layers(tr.graph, ties) is None


def test_candidates_cover_micro_batches_schedules_and_virtual_stages():
    cfg = llama.LlamaConfig.deep_tiny()
    layers = find_layers(*_traced(cfg))
    got = candidates("node", 4, layers, ChoiceOptions())
    assert len(got) == len(set(got))
    assert {p.microbatches for p in got} == {1, 2, 4, 8}
    assert {p.virtual for p in got if p.schedule == "circular"} == {2, 4}
    # the circular schedule runs only where the micro-batches are at least the stages
    assert {p.microbatches for p in got if p.schedule == "circular"} == {4, 8}


def test_the_choice_keeps_to_the_memory_budget():
    graph, ties = _traced(llama.LlamaConfig.deep_tiny())
    mesh = ((4, 2), ("node", "gpu"))
    eth = Cluster.ethernet_nodes()
    free = best_pipeline(graph, *mesh, eth, ties=ties, options=ChoiceOptions(min_gain=0.0))
    assert free.priced and all(p.peak_memory > 0 for p in free.priced)
    tight = best_pipeline(graph, *mesh, eth, ties=ties,
                          options=ChoiceOptions(memory_budget=1.0, min_gain=0.0))
    assert tight.pipeline is None and tight.reason == "no pipeline fits the memory budget"
    # the same prices, in the same order: the search is deterministic (with no room left,
    # no stage plan with tensor parallelism inside is solved either: within a budget of
    # S bytes none fits)
    assert [p.step_time for p in tight.priced] == [p.step_time for p in free.priced]
    assert {p.tensor_spans for p in free.priced} == {()}
    again = best_pipeline(graph, *mesh, eth, ties=ties, options=ChoiceOptions(min_gain=0.0))
    assert [p.step_time for p in again.priced] == [p.step_time for p in free.priced]


def test_the_choice_may_stage_over_another_view_of_the_devices():
    graph, ties = _traced(llama.LlamaConfig.deep_tiny())
    eth = Cluster.ethernet_nodes()
    own = best_pipeline(graph, (4, 2), ("node", "gpu"), eth, ties=ties)
    more = best_pipeline(graph, (4, 2), ("node", "gpu"), eth, ties=ties,
                         options=ChoiceOptions(views=True))
    meshes = {p.mesh for p in more.priced}
    assert {p.mesh for p in own.priced} == {(("node", 4), ("gpu", 2))}
    assert (("node_gpu", 8),) in meshes and len(meshes) > 2
    assert more.priced[:len(own.priced)] == own.priced  # the mesh's own axes come first


def _choose(model: str, preset: str, **kw):
    return _step(model, preset, **kw)[0]


def _step(model: str, preset: str, scanned: bool = False, **kw):
    """(the pipeline choice, the plan) of the zoo model on the preset (abstract mesh);
    ``scanned``: the deep model's layers as a checkpointed ``lax.scan`` (not a stack)."""
    zm, pre = ZOO[model], PRESETS[preset]
    mesh = AbstractMesh(pre.mesh_shape, pre.axis_names)
    mod = zm.load()
    cfg = zm.config("bench", pre.devices)
    if scanned:
        cfg = dataclasses.replace(cfg, stack_layers=False, loss_in_stack=False, remat=True)
    step = shardc.auto_shard(mod.build_step(cfg), mesh=mesh, cluster=pre.cluster,
                             memory_budget=zm.device_memory, **kw)
    args = mod.abstract_args(cfg)
    return step.pipeline_choice(*args), step.plan(*args)


def test_the_deep_model_pipelines_over_slow_links():
    choice, plan = _step("deep", "4nodes-eth")
    assert choice.pipeline is not None, choice.reason
    # the plan runs the choice, its compute and peak the pipeline's, its communication
    # the conversions the pipelined program runs (shardc.pipeline.runs)
    assert plan.pipeline == choice.pipeline
    got = plan.predicted
    assert got.compute_time + got.feed_time == pytest.approx(
        choice.best.step_time - choice.best.comm)
    assert got.comm_time == pytest.approx(sum(r.time for r in plan.reshards))
    assert got.step_time == pytest.approx(choice.best.step_time, rel=0.05)
    assert plan.predicted.peak_memory == pytest.approx(choice.best.peak_memory)
    assert (choice.pipeline.axis, choice.pipeline.stages) == ("node", 4)
    assert choice.best.step_time < 0.95 * choice.base_time
    assert choice.best.peak_memory <= PRESETS["4nodes-eth"].cluster.device_memory
    assert PRESETS["4nodes-eth"].cluster.bandwidth("node") == ETH_BW
    assert choice.summary().startswith("pipeline (cheapest pipeline): 4 stages over node")


@pytest.mark.parametrize("model,preset,scanned", [
    ("gpt", "node-8", False), ("llama", "node-8", False), ("llama", "2nodes-2x8", False),
    ("deep", "node-8", True), ("deep", "2nodes-2x8", True)])
def test_no_pipeline_on_the_existing_presets(model, preset, scanned):
    """The deep model as a checkpointed scan: against its stack, which recomputes its
    forward for the backward where GPipe keeps the residuals, a pipeline is priced to win
    on these presets too (node-8: 3.23 vs 3.40 ms; 2nodes-2x8: 3.37 vs 3.92 ms)."""
    choice, plan = _step(model, preset, scanned)
    assert choice.pipeline is None and choice.summary().startswith("no pipeline: ")
    assert plan.pipeline is None
    if choice.best is not None:  # priced and lost
        assert choice.best.step_time >= 0.95 * choice.base_time


def test_pipelines_can_be_forbidden_or_requested():
    assert _choose("deep", "4nodes-eth", pipeline=False).reason.startswith(
        "pipelines are forbidden")
    for want in (Pipeline("node", 4, 2), Pipeline("node", 4, 2, "1f1b")):
        # (the deep model's stack ends in its loss: 1F1B can run it)
        choice = _choose("deep", "4nodes-eth", pipeline=want)
        assert choice.pipeline == want and choice.best.pipeline == want
    with pytest.raises(ValueError, match="stages=4"):
        _choose("deep", "4nodes-eth", pipeline=Pipeline("node", 2, 2))
    with pytest.raises(TypeError, match="shardc.pipeline.Pipeline"):
        Options(pipeline="yes")


def test_the_stage_gradients_all_reduce_as_the_combiner_packs_them():
    """The stages' weight gradients are all-reduced once after the backward loop, each
    parameter's its own collective that XLA's combiner packs in program order up to its
    byte limit: one all-reduce of them all where they fit (XLA:CPU, no limit), else a set
    per run of gradients that fits, and a gradient over the limit alone."""
    mib = 2**20
    parts = [2 * mib, 8 * mib, 8 * mib, 2 * mib, 22 * mib, 22 * mib, 40 * mib, 1 * mib]
    assert combined_sets(parts, float(2**63 - 1)) == [sum(parts)]
    assert combined_sets(parts, 30 * mib) == [20 * mib, 22 * mib, 22 * mib, 40 * mib, 1 * mib]
    assert combined_sets(parts[:4], 30 * mib) == [20 * mib]
    assert combined_sets([], 30 * mib) == []


def test_the_stage_gradients_join_a_combined_all_reduce_only_within_its_byte_limit():
    """Gradients that fit one set join the all-reduce over the same devices that the rest
    of the step combines, as XLA's combiner does, but only while the joined buffer stays
    within the combiner's limit; past it they run alone."""
    mib, name, whole = 2**20, "all-reduce@data", NdSbp((B,))

    def ar(nbytes: float, group: int) -> Reshard:  # wire bytes = 2 x buffer (factor 2)
        return Reshard(1, None, whole, whole, 1e-3, 2 * nbytes, (name,), (2 * nbytes,),
                       (group,))

    grouped = [ar(10 * mib, 0), ar(10 * mib, 0)]
    assert _joined(grouped, name, 5 * mib, 30 * mib, 2.0)[1] == 0
    assert _joined(grouped, name, 15 * mib, 30 * mib, 2.0)[1] == -1
    alone = [ar(20 * mib, -1)]
    out, group = _joined(alone, name, 5 * mib, 30 * mib, 2.0)
    assert group == 0 and out[0].combined == (0,)
    out, group = _joined(alone, name, 15 * mib, 30 * mib, 2.0)
    assert group == -1 and out[0].combined == (-1,)
    assert _joined(alone, name, 15 * mib, float("inf"), 2.0)[1] == 0
