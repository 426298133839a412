"""Tensor parallelism inside a pipeline's stages (shardc.pipeline.choose: a stage plan
whose weights one axis splits and whose batch it leaves whole) on 8 CPU devices as
(stage=2, data=2, model=2): where a stage cannot hold its layers' weights whole within
the memory budget, the planner splits them over one axis inside the stage; the step
equals jax.jit's, the weights are stored split as priced, the compiled program runs the
collectives the plan priced (the activations' all-reduces inside the loop, once per layer,
micro-batch and tick) and its peak is within 15% of the predicted one; for GPipe and for
1F1B."""


import jax
import pytest
from helpers import MIB, PODS, assert_close, first_call_compiles
from helpers import STACK_LAYERS as LAYERS
from helpers import stack_make as make
from helpers import stack_scanned as scanned
from helpers import stack_stacked as stacked
from helpers import stack_train_step as train_step
from helpers import stack_with_loss as with_loss

import shardc
from shardc.cost.cluster import Cluster
from shardc.inspect.hlo import collectives, compiled_peak_memory
from shardc.inspect.loops import multiplicity
from shardc.pipeline import Pipeline


@pytest.mark.parametrize("stack, pipe", [(stacked, Pipeline("stage", 2, 4)),
                                         (with_loss, Pipeline("stage", 2, 4, "1f1b"))])
def test_a_stage_splits_its_weights_where_whole_ones_do_not_fit(stack, pipe):
    state, batch = make()
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    # a stage's 8 MiB of weights held whole, with their gradient and update, do not fit
    run = shardc.auto_shard(train_step(stack), mesh=mesh, cluster=PODS,
                            memory_budget=14 * MIB, pipeline=pipe)
    plan = run.plan(state, batch)
    priced = plan.solver["pipeline"]
    assert plan.pipeline == pipe
    assert len(priced["tensor_axes"]) == 1 and priced["batch_axes"], priced
    tensor = priced["tensor_axes"][0]
    assert tensor not in priced["batch_axes"]
    # the stored weights: the layers over the stages, another dim over the tensor axis
    specs = jax.tree.leaves(run.input_shardings(state, batch)[0][0][0],
                            is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))
    assert all(s.spec[0] == "stage" and tensor in jax.tree.leaves(tuple(s.spec[1:]))
               for s in specs), specs
    assert "tensor parallelism inside the stage" in " ".join(plan.explain(max_rows=1).split())
    want = jax.jit(train_step(scanned))(state, batch)
    assert_close(run(state, batch), want, rtol=1e-4, atol=1e-5)
    compiled = run.lower(state, batch).compile()
    runs = multiplicity(compiled.as_text())
    inside = [c for c in collectives(compiled, mesh) if runs[c.computation] > 1]
    sends = [c for c in inside if c.kind == "collective-permute"]
    assert sum(runs[c.computation] for c in sends) == priced["permutes"]
    # the activations summed over the tensor axis, once per layer, micro-batch and tick
    # each way
    ticks = priced["permutes"] // 2
    reduced = [c for c in inside if c.kind == "all-reduce"]
    assert reduced and {runs[c.computation] for c in reduced} == \
        {ticks * LAYERS // pipe.stages}, [(c.kind, runs[c.computation]) for c in inside]
    # the pipeline's collectives as planned, count and bytes (outside it, XLA gathers the
    # loss's few bytes once more than the plan says), the communication time within 25%
    check = plan.verify(compiled, mesh)
    rows = {r.kind: r for r in check.rows}
    for kind in ("all-reduce", "collective-permute"):
        row = rows[kind]
        assert row.planned_count == row.compiled_count, check.report()
        assert row.planned_bytes == pytest.approx(row.compiled_bytes, rel=0.02), check.report()
    assert abs(check.time_error) < 0.25, check.report()
    peak = compiled_peak_memory(compiled)
    assert peak == pytest.approx(plan.predicted.peak_memory, rel=0.15), \
        (peak, plan.predicted.peak_memory)
    assert plan.predicted.peak_memory <= 14 * MIB


def test_without_a_binding_budget_the_stage_keeps_its_weights_whole():
    """A budget that whole weights meet: data parallelism inside the stage is cheaper here
    (no activations summed per layer and tick), and the planner keeps it."""
    state, batch = make()
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    run = shardc.auto_shard(train_step(stacked), mesh=mesh, cluster=PODS,
                            pipeline=Pipeline("stage", 2, 4))
    priced = run.plan(state, batch).solver["pipeline"]
    assert priced["tensor_axes"] == [] and priced["batch_axes"] == ["data", "model"], priced
    choice = run.pipeline_choice(state, batch)
    assert choice.best.tensor_spans == ()
    assert str(choice) == choice.summary()


def test_the_stage_plans_keep_the_stored_weights_whole_over_the_batch_axes():
    """Every stage plan priced holds the layers' weights whole over the axes it splits
    the micro-batches over (the pipelined loop is manual there), and splits the batch of
    its carry over none of the axes its weights are split over."""
    state, batch = make()
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    run = shardc.auto_shard(train_step(stacked), mesh=mesh, cluster=PODS,
                            memory_budget=14 * MIB)
    choice = run.pipeline_choice(state, batch)
    assert choice.priced
    for p in choice.priced:
        assert not {n for n, _ in p.batch_spans} & {n for n, _ in p.tensor_spans}, p


@pytest.mark.slow
def test_stages_xla_does_not_lay_out_as_priced_are_checked_and_reported():
    """A Llama's stages with its weights split over the GPU axis (the budget leaves no room
    for whole ones): XLA does not lay the attention out as the stage plan does (it gathers
    weights per layer and tick), so the compiled program is checked: the tensor-parallel
    stages are checked with the figures; asked for, the pipeline still runs (equal to
    jax.jit's step), the choice kept the leanest predicted, and its first call runs the
    compile its check made (it was checked first, the other choice after it)."""
    from shardc.models import llama

    cfg = llama.LlamaConfig.deep_tiny()
    step, (state, batch) = llama.make_train_step(cfg)
    mesh = jax.make_mesh((4, 2), ("node", "gpu"))
    pipe = Pipeline("node", 4, 4)
    run = shardc.auto_shard(step, mesh=mesh, cluster=Cluster.ethernet_nodes(),
                            memory_budget=12 * MIB, pipeline=pipe)
    plan = run.plan(state, batch)
    assert plan.pipeline == pipe
    rejected, kept = plan.solver["pipeline"]["rejected"], plan.solver["pipeline"]["kept_asked"]
    assert all("did not lay the stages out" in why for why in [*rejected, kept])
    assert len(rejected) == 1 and {"micro-batches whole" in kept,
                                   "micro-batches whole" in rejected[0]} == {True, False}
    text = " ".join(plan.explain(max_rows=1).split())
    assert "passed over: " + rejected[0][:40] in text
    assert "WARNING: the pipeline asked for runs although" in text and kept[:40] in text
    compiled, out = first_call_compiles(run, state, batch)
    assert "jit(positional)" not in compiled, compiled  # a check's compile runs: the plan's
    placed = jax.tree.leaves(run.input_shardings(state, batch)[0][0],
                             is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))
    assert all(x.sharding.is_equivalent_to(s, x.ndim)  # the new state laid out as planned
               for x, s in zip(jax.tree.leaves(out[0]), placed, strict=True))
    assert_close(out, jax.jit(step)(state, batch), rtol=1e-3, atol=1e-4)


def test_a_circular_pipeline_prices_laying_its_chunks_out_and_is_checked_against_its_peak():
    """The circular schedule runs chunk v S + s on stage s while the stored stack is split
    over the stages in blocks: each step lays the stacked weights out again over the stage
    axis and their gradients back, one all-to-all per weight each way, priced as compiled
    (count and bytes). Its stages' weights split over an axis XLA lays out, the compiled
    program is checked: here its peak is over the budget; the pipeline asked for still runs,
    equal to jax.jit's step, with the figures and a warning in its record and explain()."""
    state, batch = make()
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    pipe = Pipeline("stage", 2, 4, "circular", 2)
    run = shardc.auto_shard(train_step(stacked), mesh=mesh, cluster=PODS,
                            memory_budget=14 * MIB, pipeline=pipe)
    plan = run.plan(state, batch)
    priced = plan.solver["pipeline"]
    assert plan.pipeline == pipe and priced["tensor_axes"], priced
    assert "over the budget of 14.00 MiB" in priced["kept_asked"], priced
    assert "WARNING: the pipeline asked for runs" in plan.explain(max_rows=1)
    compiled = run.lower(state, batch).compile()
    # over the budget as predicted: the weights laid out in the circular order, a chunk's
    # weights and gradient beside the gradient summed (12.25 MiB predicted before they
    # were counted)
    peak = compiled_peak_memory(compiled)
    assert peak > 14 * MIB
    assert peak == pytest.approx(plan.predicted.peak_memory, rel=0.15), \
        (peak, plan.predicted.peak_memory)
    check = plan.verify(compiled, mesh)
    rows = {r.kind: r for r in check.rows}
    swap = rows["all-to-all"]
    assert swap.planned_count == swap.compiled_count == 4, check.report()
    assert swap.planned_bytes == pytest.approx(swap.compiled_bytes, rel=0.02), check.report()
    assert abs(check.time_error) < 0.25, check.report()
    want = jax.jit(train_step(scanned))(state, batch)
    assert_close(run(state, batch), want, rtol=1e-4, atol=1e-5)
