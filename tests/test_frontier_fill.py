"""The frontier's staircase: its gaps filled where plans exist, its remat choices finer
than all or half, and no generic layout below it."""

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

import shardc
from shardc.ir.remat import Segment, order, prefixes
from shardc.ir.sbp import B, NdSbp
from shardc.models import llama
from shardc.plan.record import Plan, Predicted
from shardc.solve.search import MemoryBudgetError
from shardc.tradeoff.frontier import GAP, Sources, sweep

MESH = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
ABSTRACT = AbstractMesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)


def _plan(peak: float, step: float, remat: tuple[int, ...] = ()) -> Plan:
    """A plan that stands for one point: the sweep reads its peak, step and remat only."""
    return Plan(mesh_axes=(("x", 8),), cluster=shardc.Cluster.multi_node(), inputs=(NdSbp((B,)),),
                outputs=(), values={}, ops=(), reshards=(),
                predicted=Predicted(0.0, step, 0.0, peak), remat=remat)


def _gaps(frontier) -> list[float]:
    peaks = [p.predicted.peak_memory for p in frontier]
    return [(b - a) / (peaks[-1] - peaks[0]) for a, b in zip(peaks, peaks[1:])]


def test_the_sweep_fills_every_gap_where_a_plan_exists():
    """A program with a plan at every peak from 1 to 10 (step 1/peak) and no placements: the
    searches into the gaps fill them, each splitting a gap where the parts need the fewest
    searches more (nine for a gap of ten widths)."""
    asked = []

    def solve(budget, remat=()):
        asked.append(budget)
        if budget is not None and budget < 1.0:
            raise MemoryBudgetError(budget, 1)
        peak = 10.0 if budget is None else min(budget, 10.0)
        return _plan(peak, 1.0 / peak)

    frontier = sweep(Sources(solve))
    assert max(_gaps(frontier)) <= GAP + 1e-9
    points = frontier.points()
    assert all(m1 < m2 and t1 > t2 for (t1, m1), (t2, m2) in zip(points, points[1:]))
    assert len(asked) <= 2 + 9  # the ends, the gaps' searches


def test_a_gap_without_plans_is_searched_and_left():
    """Plans only at peaks 1, 2, 9 and 10: the gap from 2 to 9 is searched (a budget inside
    it is asked for) and stays, as it must; the sweep ends."""
    points = {1.0: 10.0, 2.0: 5.0, 9.0: 1.5, 10.0: 1.0}
    asked = []

    def solve(budget, remat=()):
        asked.append(budget)
        fits = [m for m in points if budget is None or m <= budget]
        if not fits:
            raise MemoryBudgetError(budget, 1)
        best = min(fits, key=points.get)
        return _plan(best, points[best])

    frontier = sweep(Sources(solve), budgets=2)
    assert [m for _, m in frontier.points()] == [1.0, 2.0, 9.0, 10.0]
    assert any(b is not None and 2.0 < b < 9.0 for b in asked)


def test_a_search_landing_below_the_gap_is_not_asked_again():
    """Plans at peaks 1 and 10, and for any budget between a plan at peak 2 that the lean
    plan dominates: each search into the gap lands below where its unexplored part starts,
    which explores the gap from there on; the searches step up it, none asked twice (one
    was asked again until the sweep's searches ran out)."""
    asked = []

    def solve(budget, remat=()):
        asked.append(budget)
        if budget is not None and budget < 1.0:
            raise MemoryBudgetError(budget, 1)
        if budget is None or budget >= 10.0:
            return _plan(10.0, 1.0)
        return _plan(1.0, 10.0) if budget < 2.0 else _plan(2.0, 10.0)

    frontier = sweep(Sources(solve))
    assert [m for _, m in frontier.points()] == [1.0, 10.0]
    searched = [b for b in asked if b is not None and b > 1.0]
    assert searched == sorted(set(searched)), searched  # each higher than the last
    assert len(searched) < 9  # the gap explored, not the searches run out


@pytest.mark.parametrize("lean, searched", [(1600.0, False), (900.0, True)])
def test_the_leanest_plan_recomputing_nothing_is_searched_where_it_may_be_leanest(lean,
                                                                                  searched):
    """The program recomputing nothing has its leanest plan searched (at the budget its
    first ask names) only where that peak is below the fastest plan recomputing every
    segment (1500 here): above it, a plan between the two is what the gaps' fills search
    for (GPT-2 small's leanest plan without remat, 2.94 GiB, lay above the 2.62 GiB of its
    fastest remat plan, and its search took a tenth of the frontier)."""
    segs = (Segment(0, (0,), (0,), 500, 100),)
    asked = []

    def solve(budget, remat=()):
        asked.append((budget, remat))
        fastest, least = (1500.0, 1000.0) if remat else (2000.0, lean)
        if budget is not None and budget < least:
            raise MemoryBudgetError(budget, int(least))
        peak = fastest if budget is None or budget >= fastest else max(budget, least)
        return _plan(peak, 1.0 + (fastest - peak) * 1e-3 + (0.1 if remat else 0.0), remat)

    frontier = sweep(Sources(solve, segments=segs), budgets=0)
    assert ((lean, ()) in asked) == searched
    assert frontier.plans[0].predicted.peak_memory == (lean if searched else 1000.0)


def test_the_remat_choices_follow_the_greedy_and_the_budget():
    """Four segments with different trades: the sweep plans the greedy's prefixes (best
    bytes per recomputed FLOP first), and between none and all of them, not only all or
    half; recomputing costs less per byte here than sharding, so each budget recomputes
    the fewest segments whose fastest plan fits it."""
    segs = tuple(Segment(k, (k,), (0,), kept, flops) for k, (kept, flops) in
                 enumerate([(400, 800), (100, 1000), (300, 300), (200, 1200)]))
    assert order(segs) == [2, 0, 3, 1]  # 1, 2, 6 and 10 FLOPs per byte
    chain = prefixes(segs)
    assert chain == [(), (2,), (0, 2), (0, 2, 3), (0, 1, 2, 3)]
    flops = {c: sum(segs[i].flops for i in c) for c in chain}
    kept = {c: sum(segs[i].kept for i in c) for c in chain}
    asked = []

    def solve(budget, remat=()):
        asked.append((budget, remat))
        fastest = 2000.0 - kept[remat]  # remat alone: 1 byte per byte it stops holding
        lean = 1000.0 - kept[remat] / 4  # sharding: each held byte split four ways
        if budget is not None and budget < lean:
            raise MemoryBudgetError(budget, int(lean))
        peak = fastest if budget is None or budget >= fastest else max(budget, lean)
        # recomputing: its FLOPs; sharding: 10x as much per byte saved
        return _plan(peak, 1.0 + flops[remat] * 1e-4 + (fastest - peak) * 1e-2, remat)

    frontier = sweep(Sources(solve, segments=segs), budgets=6)  # budgets chosen between
    tried = {remat for _, remat in asked}
    assert tried <= set(chain)
    assert tried & set(chain[1:-1]), "no choice between none and every segment was planned"
    between = [(budget, remat) for budget, remat in asked
               if budget is not None and 1000.0 < budget < 2000.0]
    assert len(between) >= 4
    for budget, remat in between:  # the fewest segments whose fastest plan fits
        assert remat == next(c for c in chain if 2000.0 - kept[c] <= budget)
    # every prefix's fastest plan is on this frontier: 0, 1, 2, 3 and 4 segments recomputed
    assert {len(p.remat) for p in frontier} == {0, 1, 2, 3, 4}


@pytest.fixture(scope="module")
def scanned():
    """The scanned Llama (three forward segments outside its scan) and its frontier on 8
    CPU devices, descent only (no ILP: fast, and the same on every machine)."""
    cfg = llama.LlamaConfig.tiny()
    fn, args = llama.build_step(cfg), llama.abstract_args(cfg)
    kw = dict(cluster=shardc.Cluster.multi_node(), time_limit=0.0)
    frontier = shardc.auto_shard(fn, mesh=MESH, **kw).pareto(*args, budgets=1)
    return fn, args, kw, frontier


def test_no_generic_layout_lies_below_the_staircase(scanned):
    fn, args, kw, frontier = scanned
    # the same layouts, estimated on the same cost model (an abstract mesh compiles nothing)
    margins = shardc.auto_shard(fn, mesh=ABSTRACT, **kw).margins(*args)
    names = [b.name for b in margins.baselines if b.predicted is not None]
    assert names == ["data parallel", "FSDP", "Megatron TP", "DP x TP", "ZeRO-1"]
    points = frontier.points()
    for b in margins.baselines:
        t, m = b.predicted.step_time, b.predicted.peak_memory
        assert any(pt <= t * (1 + 1e-9) and pm <= m * (1 + 1e-9) for pt, pm in points), \
            f"{b.name} ({t * 1e6:.1f} us, {m / 2**10:.1f} KiB) lies below the staircase"


def test_the_gaps_left_are_where_the_planner_finds_no_plan(scanned):
    """A gap wider than GAP of the range is left only where planning at its middle finds
    no plan below the staircase. (Its lean end is a plan without recomputation: a
    seed's leanest completion, 492 KiB at 2.0 ms, is leaner and faster than the plan
    recomputing three segments that was its end before, 569 KiB at 3.5 ms.)"""
    fn, args, kw, frontier = scanned
    points = frontier.points()
    assert len(points) >= 8
    gaps = _gaps(frontier)
    widest = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[widest] > GAP:
        middle = (points[widest][1] + points[widest + 1][1]) / 2
        plan = shardc.auto_shard(fn, mesh=ABSTRACT, memory_budget=middle, **kw).plan(*args)
        t, m = plan.predicted.step_time, plan.predicted.peak_memory
        assert any(pt <= t * (1 + 1e-9) and pm <= m * (1 + 1e-9) for pt, pm in points)
