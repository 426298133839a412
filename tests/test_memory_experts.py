"""A budget any expert's compiled program meets is never infeasible: shardc plans at the
leanest expert's compiled peak on the unrolled Llama, XLA's compiled program fits it, and its
step, priced like a bench cell, is no slower than the best expert that fits (no plan kept on
the devices compiles within it: the plan keeps its optimizer state in host memory). And the
memory model on that Llama: the predicted peak against what XLA allocates. (Split from
test_memory_budget.py, so that the two run on both test workers.)"""

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
    return cost.time + feed_seconds(compiled, batch, CLUSTER), \
        cost.peak_memory


@pytest.mark.slow
def test_a_budget_the_leanest_expert_meets_plans_fits_and_is_no_slower():
    """Under the leanest expert's compiled peak (FSDP x TP's), where no plan kept on the
    devices compiles within it, the step keeps its optimizer state in host memory and
    compiles within the budget, no slower than the expert, host transfers priced."""
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
