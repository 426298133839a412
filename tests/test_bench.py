"""``shardc bench``'s harness and report on the tiny MLP (the full matrix runs in the bench)."""

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardc.bench import harness, report
from shardc.bench.experts import batch_specs, compile_expert, experts_for
from shardc.bench.zoo import PRESETS, ZOO


def test_cells_filter_by_method():
    every = harness.cells(["mlp"], ["node-8", "node-2x4"])
    assert {m for _, _, m in every} == {"shardc", "data-parallel", "fsdp", "megatron-tp",
                                       "dp-x-tp", "fsdp-x-tp"}
    only = harness.cells(["mlp"], ["node-8", "node-2x4"], ["shardc"])
    assert [(z.name, p.name, m) for z, p, m in only] == [("mlp", "node-8", "shardc"),
                                                         ("mlp", "node-2x4", "shardc")]


def test_feed_is_the_batch_shard_per_device():
    zm, preset = ZOO["mlp"], PRESETS["node-8"]
    mod, mesh = zm.load(), harness.make_mesh(preset)
    cfg = zm.config("tiny")
    state, batch = mod.abstract_args(cfg)
    full = sum(np.dtype(x.dtype).itemsize * np.prod(x.shape) for x in jax.tree.leaves(batch))
    feeds = {}
    for expert in experts_for(mesh):
        _, lowered = compile_expert(mod.build_step(cfg), state, batch, mesh, expert,
                                    mod.param_axes)
        feeds[expert.name] = harness.feed_seconds(lowered.compile(), batch, preset.cluster)
        # the compiled input shardings are the expert's batch specs
        specs = jax.tree.leaves(batch_specs(batch, mesh, expert))
        expect = sum(np.dtype(x.dtype).itemsize *
                     np.prod(NamedSharding(mesh, s).shard_shape(x.shape))
                     for s, x in zip(specs, jax.tree.leaves(batch), strict=True))
        assert np.isclose(feeds[expert.name] * preset.cluster.host_bandwidth, expect)
        assert np.isclose(feeds[expert.name],
                          harness.spec_feed_seconds(zm, preset, expert, "tiny"))
    host = preset.cluster.host_bandwidth
    assert np.isclose(feeds["megatron-tp"], full / host)  # replicated batch: all of it
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
    assert ours.plan_s > 0 and ours.predicted_s > 0
    assert ours.saved_plan_s > 0 and ours.jit_s > 0  # a saved plan compiled, and jax.jit
    report.write([ours, dp], tmp_path, ["shardc bench --models mlp"], plot_png=False)
    again = harness.run_cell(zm, preset, "data-parallel", "tiny", check=False, time_limit=5.0)
    old, commands = report.load(tmp_path)
    merged = report.merge(old, [again])
    assert [c.method for c in merged] == ["shardc", "data-parallel"]
    assert merged[1] is again and merged[1].matched is None
    md = report.markdown(merged, [*commands, "shardc bench --update"])
    assert "| mlp | node-8 | data-parallel |" in md and "shardc bench --update" in md
