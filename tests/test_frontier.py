"""The time-memory frontier: non-dominated plans that run, pick by budget, and a plot."""

import json

import jax
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType

import shardc
from shardc.models import mlp

CFG = mlp.MLPConfig(batch=64, d_in=256, hidden=256, d_out=256, n_layers=2)


def _mlp():
    return mlp.make_train_step(CFG)


MESH = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _peak(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


@pytest.fixture(scope="module")
def planned():
    """The MLP's step, its arguments and its frontier (planned once for the module)."""
    step_fn, (state, data) = _mlp()
    step = shardc.auto_shard(step_fn, mesh=MESH, cluster=shardc.Cluster.multi_node(),
                             time_limit=2.0)
    return step_fn, step, state, data, step.pareto(state, data)


def test_the_frontier_trades_time_for_memory_and_every_point_runs(tmp_path, planned):
    step_fn, step, state, data, frontier = planned
    points = frontier.points()
    assert len(points) >= 3
    # leanest first; each later point uses more memory and is strictly faster
    assert all(m1 < m2 and t1 > t2 for (t1, m1), (t2, m2) in zip(points, points[1:]))
    fastest = step.plan(state, data)  # no budget: the frontier's fast end
    assert points[-1][0] == pytest.approx(fastest.predicted.step_time, rel=1e-9)

    lean_t, lean_m = points[0]
    middle = (points[0][1] + points[-1][1]) / 2
    chosen = frontier.pick(middle)
    assert chosen.predicted.peak_memory <= middle
    assert all(t >= chosen.predicted.step_time for t, m in points if m <= middle)
    with pytest.raises(shardc.MemoryBudgetError) as err:
        frontier.pick(lean_m / 2)
    assert err.value.needed >= lean_m

    # the two ends run, match jax.jit, and XLA's compiled peaks keep their order
    ref_state, ref_loss = jax.jit(step_fn)(state, data)
    peaks = []
    for plan in (frontier.plans[0], frontier.plans[-1]):
        run = shardc.auto_shard(step_fn, mesh=MESH, cluster=shardc.Cluster.multi_node())
        run.use_plan(plan, state, data)
        new_state, loss = run(state, data)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        # Adam divides each gradient element by its own magnitude: the parameters to the
        # tolerance its update allows (shardc.bench.numerics)
        assert_close(new_state, ref_state, lr=CFG.learning_rate)
        peaks.append(_peak(run.lower(state, data).compile()))
    assert peaks[0] < peaks[1]

    path = tmp_path / "frontier.png"
    frontier.plot(str(path), experts={"data-parallel": (points[-1][0] * 2, points[-1][1])})
    assert path.stat().st_size > 10_000
    assert "peak per device" in str(frontier)


def test_the_frontier_is_a_sequence_of_plans_leanest_first(planned):
    frontier = planned[-1]
    assert len(frontier) == len(frontier.plans) >= 3
    assert list(frontier) == list(frontier.plans)
    assert all(isinstance(p, shardc.Plan) for p in frontier)
    assert frontier[0] is frontier.plans[0] and frontier[-1] is frontier.plans[-1]
    assert frontier[1:] == frontier.plans[1:]
    assert frontier[0] in frontier and frontier.index(frontier[-1]) == len(frontier) - 1
    peaks = [p.predicted.peak_memory for p in frontier]
    assert peaks == sorted(peaks) and frontier.pick(peaks[0]) is frontier[0]
    with pytest.raises(IndexError):
        frontier[len(frontier)]


def test_the_module_function_plans_the_same_frontier():
    step_fn, (state, data) = _mlp()
    a = shardc.pareto(step_fn, state, data, mesh=MESH, cluster=shardc.Cluster.multi_node(),
                      time_limit=2.0, budgets=2)
    b = shardc.auto_shard(step_fn, mesh=MESH, cluster=shardc.Cluster.multi_node(),
                          time_limit=2.0).pareto(state, data, budgets=2)
    assert a.points() == b.points()


def test_the_cli_prints_plots_and_saves_the_frontier(tmp_path, capsys):
    from shardc.cli import main

    out, png = tmp_path / "f.json", tmp_path / "f.png"
    # a short ILP guard: the test reads the command's output, not the plans' quality
    main(["pareto", "mlp", "--mesh", "2x4", "--budgets", "2", "--time-limit", "0.5",
          "--plot", str(png), "--out", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert "plans on the time-memory frontier" in printed and "peak per device" in printed
    # progress: each plan on stderr as it is found
    assert "shardc: frontier plan 1 of " in captured.err and "(no budget)" in captured.err
    plans = [shardc.Plan.from_json(json.dumps(d)) for d in json.loads(out.read_text())]
    assert len(plans) >= 2 and png.stat().st_size > 10_000
    peaks = [p.predicted.peak_memory for p in plans]
    times = [p.predicted.step_time for p in plans]
    assert peaks == sorted(peaks) and times == sorted(times, reverse=True)
    with pytest.raises(SystemExit, match="neither a zoo model"):
        main(["pareto", "nosuchmodel"])
