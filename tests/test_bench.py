"""``shardc bench``'s harness and report on the tiny MLP (the full matrix runs in the bench)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from shardc.bench import harness, report
from shardc.bench.experts import batch_specs, compile_expert, seed_experts
from shardc.bench.zoo import PRESETS, ZOO


@pytest.fixture(autouse=True)
def _one_timing_run(monkeypatch):
    """A shardc cell compiles its saved plan and jax.jit's once each, not the bench's
    TIMING_RUNS times: the tests read the timings' presence, not their minimum."""
    monkeypatch.setattr(harness, "TIMING_RUNS", 1)


def test_cells_filter_by_method():
    every = harness.cells(["mlp"], ["node-8", "2nodes-2x8"])
    node = {m for _, p, m in every if p.name == "node-8"}
    # every form on every logical view: (8,), (2, 4), (4, 2)
    assert node == {*harness.PLANNED, "data-parallel", "fsdp",
                    "zero1", "megatron-tp8",
                    *(f"{form}{k}" for form in ("hsdp", "zero1-shard", "dp-x-tp", "fsdp-x-tp",
                                                "zero1-x-tp", "megatron-tp")
                      for k in (2, 4)), "dp-x-fsdp2-x-tp2"}
    two = {m for _, p, m in every if p.name == "2nodes-2x8"}
    # the node-local forms where the outer axis is slower, and the views (4, 4), (8, 2)
    assert {"data-parallel-node", "fsdp-node", "hsdp8", "dp-x-tp4", "megatron-tp16"} <= two
    assert "expert-parallel" not in two  # only for MoE models
    assert {"dp-x-fsdp2-x-tp4", "dp-x-fsdp4-x-tp2", "dp-x-fsdp2-x-tp2"} <= two  # 3-D views
    gpt = {m for _, _, m in harness.cells(["gpt"], ["node-8"])}
    assert {"fsdp-vp", "hsdp4-vp", "megatron-tp8-sp", "dp-x-tp4-sp"} <= gpt  # vocab, sequence
    moe = {m for _, _, m in harness.cells(["moe"], ["2nodes-2x8"])}
    assert {"expert-parallel", "ep8-x-dp", "ep2-x-dp", "expert-parallel-node"} <= moe
    only = harness.cells(["mlp"], ["node-8", "2nodes-2x8"], ["shardc"])
    # without presets, each model runs on its own: deep on the slow-link preset only
    assert {p.name for _, p, _ in harness.cells(["deep", "mlp"], None, ["shardc"])} == {
        "4nodes-eth", "node-8", "2nodes-2x8"}
    assert {p.name for z, p, _ in harness.cells(["deep"], None)} == {"4nodes-eth"}
    assert [(z.name, p.name, m) for z, p, m in only] == [("mlp", "node-8", "shardc"),
                                                         ("mlp", "2nodes-2x8", "shardc")]


def test_weak_scaling_batch_grows_with_devices():
    for zm in ZOO.values():
        eight, sixteen = zm.config("bench", 8), zm.config("bench", 16)
        assert sixteen.batch == 2 * eight.batch, zm.name
        assert zm.config("tiny", 16) == zm.config("tiny")  # the numerics check is unscaled


def test_feed_is_the_batch_shard_per_device():
    zm, preset = ZOO["mlp"], PRESETS["node-8"]
    mod, mesh = zm.load(), harness.make_mesh(preset)
    cfg = zm.config("tiny")
    state, batch = mod.abstract_args(cfg)
    full = sum(np.dtype(x.dtype).itemsize * np.prod(x.shape) for x in jax.tree.leaves(batch))
    feeds = {}
    for expert in seed_experts(mesh, preset.cluster):
        _, lowered = compile_expert(mod.build_step(cfg), state, batch, mesh, expert,
                                    mod.param_axes)
        feeds[expert.name] = harness.feed_seconds(lowered.compile(), batch, preset.cluster)
        # the compiled input shardings are the expert's batch specs
        specs = jax.tree.leaves(batch_specs(batch, mesh, expert))
        expect = sum(np.dtype(x.dtype).itemsize *
                     np.prod(NamedSharding(mesh, s).shard_shape(x.shape))
                     for s, x in zip(specs, jax.tree.leaves(batch), strict=True))
        assert np.isclose(feeds[expert.name] * preset.cluster.host_bandwidth, expect)
    host = preset.cluster.host_bandwidth
    assert np.isclose(feeds["megatron-tp8"], full / host)  # replicated batch: all of it
    assert np.isclose(feeds["data-parallel"], full / host / 8)  # split over 8 devices


def test_cells_run_match_and_merge(tmp_path):
    zm, preset = ZOO["mlp"], PRESETS["node-8"]
    ours = harness.run_cell(zm, preset, "shardc", "tiny", check=True, time_limit=5.0)
    dp = harness.run_cell(zm, preset, "data-parallel", "tiny", check=True, time_limit=5.0)
    for cell in (ours, dp):
        assert cell.error is None, cell.error
        assert cell.matched is True
        assert cell.compiled_s == cell.compiled_comm_s + cell.compiled_compute_s + \
            cell.compiled_feed_s
        # the same program under the three collective models: latency grows from one per
        # collective (alpha-beta) to NCCL's to every ring step's
        assert set(cell.priced) == set(harness.PRICINGS)
        assert cell.priced["nccl"] == [cell.compiled_s, cell.compiled_overlap_s]
        t = {m: serial for m, (serial, _) in cell.priced.items()}
        assert t["alpha-beta"] <= t["nccl"] <= t["ring"]
        assert all(overlap <= serial * (1 + 1e-9) for serial, overlap in cell.priced.values())
    assert ours.plan_s > 0 and ours.predicted_s > 0
    assert ours.saved_plan_s > 0 and ours.jit_s > 0  # a saved plan compiled, and jax.jit
    report.write([ours, dp], tmp_path, ["shardc bench --models mlp"], plot_png=False)
    again = harness.run_cell(zm, preset, "data-parallel", "tiny", check=False, time_limit=5.0)
    old, commands = report.load(tmp_path)
    merged = report.merge(old, [again])
    assert [c.method for c in merged] == ["shardc", "data-parallel"]
    assert merged[1] is again and merged[1].matched is None
    # the report is written from the merged cells and every command that made them
    report.write(merged, tmp_path, [*commands, "shardc bench --update"], plot_png=False)
    cells, written = report.load(tmp_path)
    assert [(c.method, c.matched, c.compiled_s) for c in cells] == [
        ("shardc", True, ours.compiled_s), ("data-parallel", None, again.compiled_s)]
    assert written == ["shardc bench --models mlp", "shardc bench --update"]
    row, = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert (row["model"], row["preset"], row["best_expert"]) == ("mlp", "node-8",
                                                                 "data-parallel")
    assert row["ratio"] == pytest.approx(ours.compiled_s / again.compiled_s)
    # a variant of shardc's plan (bench --planning's loop forms) is labelled, not a pricing:
    # it plans with the preset's own, as the default method does
    variant = harness.planned_and_compiled(zm, preset, zm.config("tiny"), 5.0, "shardc-variant")
    assert variant.method == "shardc-variant" and variant.compiled_s is not None
    assert variant.predicted_s == pytest.approx(ours.predicted_s)


def test_cli_plan_prints_and_saves_a_plan(tmp_path, capsys):
    """``shardc plan`` plans a zoo model from abstract shapes and saves a plan that loads."""
    from shardc.cli import main
    from shardc.plan.record import Plan

    out = tmp_path / "plan.json"
    main(["plan", "mlp", "--mesh", "2x4", "--rows", "3", "--out", str(out)])
    text = capsys.readouterr().out
    assert text.startswith("planned in ") and "predicted step:" in text
    plan = Plan.from_json(out.read_text())
    assert plan.predicted.step_time > 0 and plan.solver["status"] in ("optimal", "refined")


def test_planning_report_gives_the_depth_ratio(tmp_path):
    from shardc.bench import planning

    cases = [planning.PlanningCase("gpt", n, False, s, "refined", 1.0, 100 * n, "")
             for n, s in ((12, 2.0), (48, 5.0))]
    gaps = [planning.DescentGap("moe", "node-8", 2.0, 2.5, 2.02)]
    loops = [planning.LoopForms("node-8", 5.1, 5.2, 5.0, 5.0, 1.0, 4.0)]
    frontiers = [planning.FrontierCase("llama", 12, True, 42.0, 9, 0.5, 30.0, 2.0, 10.0, 0.08)]
    md, js = planning.write(cases, tmp_path, "shardc bench --planning", gaps, loops,
                            frontiers)
    assert md.exists()
    data = json.loads(js.read_text())
    assert data["command"] == "shardc bench --planning"
    assert data["frontiers"] == [dataclasses.asdict(frontiers[0])]
    assert [c["plan_s"] for c in data["cases"]] == [2.0, 5.0]
    # planning 48 layers took 2.5x as long as 12
    assert planning.depth_ratios(cases) == data["depth_ratios"] == {"gpt": 2.5}
    gap, = data["descent_gaps"]
    assert gap["gap"] == pytest.approx(0.25) and gap["staged_gap"] == pytest.approx(0.01)
    forms, = data["loop_forms"]
    assert forms["unrolled_compiled_ms"] == 5.0
    assert forms["predicted_ratio"] == pytest.approx(5.1 / 5.0)
    assert forms["compiled_ratio"] == pytest.approx(5.2 / 5.0)
    # a model planned at one depth only has no ratio
    assert planning.depth_ratios(cases[:1]) == {}


@pytest.mark.slow
def test_memory_bound_cells_mark_experts_over_and_shardc_fits():
    """On a device too small for data parallelism (0.6 of its compiled peak), the harness marks
    it as not fitting, the best expert is one that fits, and shardc's plan under the device
    memory fits when compiled. On the preset's own mesh: with the mesh search this tiny
    program's plan on (4, 2) is predicted at 0.99 MB and compiles to 1.55 MB, beyond the
    margin (XLA's buffers hold the gathered stacked weights of both layers and their
    gradients at once); the 1B cells' peaks, mostly the state, are predicted within it."""
    import dataclasses

    preset = PRESETS["node-8"]
    free = dataclasses.replace(ZOO["llama"], name="llama-bound")
    dp = harness.run_cell(free, preset, "data-parallel", "tiny", check=False, time_limit=5.0)
    assert dp.error is None and dp.budget is None and dp.fits is None
    # (at half DP's peak the compile check re-plans 3 times, 40 s, for the same verdicts)
    bound = dataclasses.replace(free, device_memory=dp.peak_memory * 0.6)
    got = {m: harness.run_cell(bound, preset, m, "tiny", check=False, time_limit=5.0,
                               mesh_search=False)
           for m in ("shardc", "data-parallel", "fsdp")}
    for cell in got.values():
        assert cell.error is None, cell.error
        assert cell.budget == bound.device_memory
    assert got["data-parallel"].fits is False and got["fsdp"].fits is True
    assert got["shardc"].fits is True
    row, = report.summary(list(got.values()))
    assert row["best_expert"] == "fsdp" and row["not_fitting"] == {
        "data-parallel": got["data-parallel"].peak_memory}
    assert row["best_expert_peak"] == got["fsdp"].peak_memory <= bound.device_memory
    assert row["shardc_fits"] is True and row["budget"] == bound.device_memory


def test_memory_bound_models_tiny_config_is_checked_elsewhere():
    """The harness skips a memory-bound model's numerics check: its tiny config must be that
    of a model without a bound, whose cells check it."""
    for zm in ZOO.values():
        if zm.device_memory is not None:
            assert any(o.device_memory is None and o.module == zm.module and
                       o.config("tiny") == zm.config("tiny") for o in ZOO.values()), zm.name


def test_pricing_rows_compare_each_plan_with_the_best_expert_under_its_pricing():
    def cell(method, **priced):
        return harness.Cell("m", "p", method, compiled_s=1.0,
                            priced={k.replace("_", "-"): v for k, v in priced.items()})

    cells = [cell("shardc", nccl=[2.0, 1.5], ring=[4.0, 3.0], alpha_beta=[1.0, 0.8]),
             cell("shardc@ring", nccl=[2.5, 2.0], ring=[3.0, 2.5], alpha_beta=[1.2, 1.0]),
             cell("shardc@alpha-beta", nccl=[2.2, 1.6], ring=[5.0, 4.0], alpha_beta=[0.9, 0.7]),
             cell("shardc@ring+overlap", nccl=[2.6, 1.4], ring=[3.2, 1.9],
                  alpha_beta=[1.3, 0.9]),
             cell("dp", nccl=[2.0, 2.0], ring=[3.0, 3.0], alpha_beta=[1.8, 1.8]),
             cell("fsdp", nccl=[3.0, 1.6], ring=[6.0, 2.0], alpha_beta=[1.1, 0.9])]
    rows = {r["pricing"]: r for r in report.pricing_rows(cells)}
    # the default plan is the one made for NCCL's overlapped pricing; none made serially here
    assert rows["nccl"]["serial_expert"] == "dp" and rows["nccl"]["serial_planned_ratio"] is None
    assert rows["nccl"]["serial_default_ratio"] == 1.0
    assert rows["ring"]["serial_planned_ratio"] == 1.0  # shardc@ring 3.0 against dp's 3.0
    assert rows["ring"]["serial_default_ratio"] == 4.0 / 3.0
    assert rows["alpha-beta"]["serial_expert"] == "fsdp"
    assert rows["alpha-beta"]["serial_planned_ratio"] == 0.9 / 1.1
    assert rows["ring"]["overlap_expert"] == "fsdp"  # the best expert overlapped differs
    assert rows["ring"]["overlap_default_ratio"] == 3.0 / 2.0
    # the overlapped columns compare the plan made for overlap: for NCCL's, the default
    assert rows["ring"]["overlap_planned_ratio"] == 1.9 / 2.0
    assert rows["nccl"]["overlap_planned_ratio"] == 1.5 / 1.6
    # the default plan is 4/3 of dp under ring; of the programs no slower than the best
    # expert under NCCL's overlapped pricing (fsdp, 1.6), shardc@ring+overlap is the best
    # there, serially (3.2 against dp's 3.0) and overlapped (1.9 against fsdp's 2.0)
    bounds = {(b["pricing"], b["mode"]): b for b in report.robust_bounds(cells)}
    assert bounds[("ring", "serial")]["bound"] == 3.2 / 3.0
    assert bounds[("ring", "serial")]["bound_method"] == "shardc@ring+overlap"
    assert bounds[("ring", "overlap")]["bound"] == 1.9 / 2.0
    assert ("nccl", "overlap") not in bounds  # the default is the best there
    # a default plan over the device's memory is no bound itself; the programs that fit are
    over = [harness.Cell("m", "p", c.method, compiled_s=1.0, priced=c.priced, budget=1.0,
                         peak_memory=2.0 if c.method == "shardc" else 0.5) for c in cells]
    assert {b["bound_method"] for b in report.robust_bounds(over)} == {"shardc@ring+overlap"}


def test_a_robust_bound_admits_programs_slower_than_the_default_but_not_than_the_best_expert():
    # the default plan (overlap-aware) must be no slower than the best expert under NCCL's
    # overlapped pricing, not than itself: fsdp is no slower than the best expert there
    # (itself, 1.25) and within 1.05 of the best expert serially (dp, 2.0): it bounds the
    # serial row at 2.1 / 2.0, where the default plan is 2.2 / 2.0
    def cell(method, nccl):
        return harness.Cell("m", "p", method, compiled_s=1.0,
                            priced={"nccl": nccl, "ring": nccl, "alpha-beta": nccl})

    cells = [cell("shardc", [2.2, 1.3]), cell("shardc+serial", [1.8, 1.35]),
             cell("dp", [2.0, 1.4]), cell("fsdp", [2.1, 1.25])]
    bounds = {(b["pricing"], b["mode"]): b for b in report.robust_bounds(cells)}
    nccl = bounds[("nccl", "serial")]
    assert nccl["default_ratio"] == 2.2 / 2.0
    assert nccl["bound_method"] == "fsdp" and nccl["bound"] == 2.1 / 2.0
    # the other side: shardc+serial, the fastest there, is 1.35 / 1.25 of fsdp overlapped
    assert nccl["fastest_method"] == "shardc+serial" and nccl["fastest_nccl"] == 1.35 / 1.25
    assert ("nccl", "overlap") not in bounds


def test_the_scale_page_has_the_pipelines_and_the_weak_scaling_efficiency():
    from shardc.bench.scale import ScaleCase, scale_markdown, weak_scaling

    def case(devices, ms, pipeline="", experts=None):
        return ScaleCase(f"node={devices // 8} x gpu=8", devices, 10.0, "refined", ms, 60.0,
                         80.0, experts or {}, pipeline)

    big = case(1024, 2000.0, "gpipe, 8 stages over node, 16 micro-batches",
               {"hsdp": (2100.0, 90.0), "fsdp-x-tp": (2200.0, 70.0)})
    big = dataclasses.replace(big, best_pipeline="gpipe, 8 stages over node: 2000 ms")
    cases = [case(256, 1900.0), case(64, 1800.0), big]
    # weak scaling: fewest devices first, each against the step at 64 devices
    weak = weak_scaling(cases)
    assert [(c.devices, c.pipeline) for c, _ in weak] == [
        (64, ""), (256, ""), (1024, "gpipe, 8 stages over node, 16 micro-batches")]
    assert [e for _, e in weak] == pytest.approx([1.0, 1800 / 1900, 0.9])
    assert weak_scaling([big]) == []  # one size: nothing to scale against
    assert weak_scaling([dataclasses.replace(big, mesh="pod=2 x gpu=512"), big]) == []
    # the page's pipelines: every case with its experts, the cheapest pipeline of each
    text = scale_markdown(cases, "shardc bench --scale")
    assert "gpipe, 8 stages over node: 2000 ms" in text and "## Weak scaling" in text


def test_expert_cells_run_beside_each_other_and_shardc_cells_alone(monkeypatch):
    """The bench runs neighbouring expert cells one per core (their compiles overlap),
    a shardc cell alone (its saved-plan timing wants the machine to itself), and hands
    the cells back in order."""
    import threading
    import time

    import shardc.solve.beside

    monkeypatch.setattr(harness, "cores", lambda: 2)  # as on CI's two cores, here too
    monkeypatch.setattr(shardc.solve.beside, "cores", lambda: 2)
    zm, preset = ZOO["mlp"], PRESETS["node-8"]
    todo = [(zm, preset, m) for m in ("fsdp", "zero1", "shardc", "data-parallel", "hsdp4",
                                       "megatron-tp8")]
    spans, lock = {}, threading.Lock()

    def cell_of(zm, preset, method):
        start = time.perf_counter()
        time.sleep(0.2)
        with lock:
            spans[method] = (start, time.perf_counter())
        return harness.Cell(zm.name, preset.name, method)

    out = list(harness.run_cells(todo, cell_of))
    assert [c.method for _, c in out] == [m for _, _, m in todo]
    assert [item for item, _ in out] == todo

    def overlap(a, b):
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    assert overlap("fsdp", "zero1") and overlap("data-parallel", "hsdp4")
    assert not any(overlap("shardc", m) for m in spans if m != "shardc")
    assert not overlap("hsdp4", "megatron-tp8")  # two at a time on two cores
