"""A budget any expert's compiled program meets is never infeasible (issue 14): shardc plans
at the leanest expert's compiled peak, XLA's compiled program fits it, and its step, priced
like a bench cell, is no slower than the best expert that fits (on the unrolled Llama it no
longer holds, the compiled check refusing the plan the 15% slack once kept; on the scanned
one the search still stops short of the FSDP x TP expert's 4.53 MiB: docs/design-notes.md,
"A seed's leanest completion"). And the memory model on that Llama: the predicted peak
against what XLA allocates. (Split from test_memory_budget.py, so that the two run on both
test workers.)"""

import jax
import pytest
from helpers import PEAK_SLACK as SLACK
from jax.sharding import AxisType

import shardc
from shardc.bench.experts import batch_specs, compile_expert, seed_experts, state_specs
from shardc.bench.harness import feed_seconds
from shardc.inspect import price
from shardc.models import llama

MESH = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
CLUSTER = shardc.Cluster.multi_node()


def _cfg(scan: bool) -> llama.LlamaConfig:
    # 1.4 M parameters (with Adam: 16.5 MiB of state) against 8 x 16 tokens of d 256:
    # parameters dominate, so sharding them is what saves memory
    return llama.LlamaConfig(vocab=512, seq_len=16, d_model=256, n_heads=4, n_kv_heads=2,
                             d_ff=512, n_layers=2, batch=8, scan_layers=scan)


def _priced(compiled, mesh, batch) -> tuple[float, float]:
    """(step seconds, compiled peak bytes per device) as the bench prices a cell."""
    cost = price(compiled, mesh, CLUSTER)
    return cost.comm_time + cost.compute_time + feed_seconds(compiled, batch, CLUSTER), \
        cost.peak_memory


@pytest.mark.slow
@pytest.mark.xfail(raises=shardc.MemoryBudgetError, strict=True, reason=(
    "a budget holds on the compiled program: under the FSDP x TP expert's 5.47 MiB the "
    "fastest plan predicts 4.96 MiB and compiles to 5.76 (kept before within the 15% "
    "slack), none is predicted under the 4.71 that would leave room for that miss, and "
    "the experts' own layouts complete to plans predicted over 5.47 MiB"))
def test_a_budget_the_leanest_expert_meets_plans_fits_and_is_no_slower():
    cfg = _cfg(False)
    fn, args = llama.build_step(cfg), llama.abstract_args(cfg)
    experts, seeds = {}, {}
    for e in seed_experts(MESH, CLUSTER):
        _, lowered = compile_expert(fn, *args, MESH, e, llama.param_axes)
        experts[e.name] = _priced(lowered.compile(), e.mesh(MESH), args[1])
        view = e.mesh(MESH)
        seeds[e.name] = (state_specs(args[0], view, e, llama.param_axes),
                         batch_specs(args[1], view, e))
    budget = min(peak for _, peak in experts.values())
    assert budget < 0.5 * experts["data-parallel"][1]  # the leanest is far leaner than DP
    best = min(t for t, peak in experts.values() if peak <= budget)

    # seeded with the experts' in_shardings, as the bench seeds shardc
    step = shardc.auto_shard(fn, mesh=MESH, cluster=CLUSTER, memory_budget=budget,
                             seeds=seeds, time_limit=5.0)
    try:
        plan = step.plan(*args)
    except shardc.MemoryBudgetError as exc:
        assert exc.predicted is not None, exc  # refused by the compiled check, not the search
        raise
    assert plan.predicted.peak_memory <= budget
    t, peak = _priced(step.lower(*args).compile(), step.mesh_for(plan), args[1])
    print(f"budget {budget / 2**20:.3f} MiB; experts (ms, MiB): " + ", ".join(
        f"{k} {s * 1e3:.3f} {m / 2**20:.3f}" for k, (s, m) in experts.items()) +
        f"; shardc {t * 1e3:.3f} ms {peak / 2**20:.3f} MiB compiled, "
        f"{plan.predicted.peak_memory / 2**20:.3f} MiB predicted")
    assert peak <= budget, (peak, budget)
    assert t <= best * 1.001, (t, best)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_the_predicted_peak_is_what_xla_allocates(scan):
    # the memory model against memory_analysis() (arguments + results + temporaries) on the
    # fastest plan: within the 15% the bench holds every cell to
    cfg = _cfg(scan)
    fn, args = llama.build_step(cfg), llama.abstract_args(cfg)
    step = shardc.auto_shard(fn, mesh=MESH, cluster=CLUSTER, time_limit=5.0)
    plan = step.plan(*args)
    _, peak = _priced(step.lower(*args).compile(), step.mesh_for(plan), args[1])
    assert abs(plan.predicted.peak_memory / peak - 1) <= SLACK - 1, \
        (plan.predicted.peak_memory, peak)
