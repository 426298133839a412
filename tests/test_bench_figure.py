"""The bench report's figure and its legend of method names, and the report made again from
the committed results without measuring."""

import shutil
from pathlib import Path

import pytest

from shardc.bench import harness, legend, report
from shardc.bench.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]


def test_every_method_the_bench_runs_has_a_legend_entry():
    """Every name the harness builds, for every zoo model on its presets and on both
    preset shapes, is of a legend pattern: a new expert form needs a line there."""
    methods = {m for _, _, m in harness.cells(list(ZOO), None)}
    methods |= {m for _, _, m in harness.cells(list(ZOO), ["node-8", "2nodes-2x8"])}
    assert {m for m in methods if legend.describe(m) is None} == set()
    assert legend.describe("megatron-tp8-sp") == ("`megatron-tpN`", ["`-sp`"])
    assert legend.describe("fsdp-node-vp") == (
        "`data-parallel-node`, `fsdp-node`, `expert-parallel-node`", ["`-vp`"])
    assert legend.describe("zero1-shard4")[0] == "`zero1-shardN`"
    assert legend.describe("gpipe4-x-tp8")[0].startswith("`gpipeS-x-dpK`")
    assert legend.describe("shardc@ring+overlap")[0] == "`shardc@M`, `shardc@M+overlap`"
    assert legend.describe("my-own-plan") is None


def test_legend_lists_only_the_patterns_used():
    text = "\n".join(legend.markdown(["shardc", "hsdp4-vp", "zero1", "odd-one"]))
    assert "`hsdpN`" in text and "`zero1`" in text and "*form*`-vp`" in text
    assert "`megatron-tpN`" not in text and "*form*`-sp`" not in text
    assert "`odd-one` | (no pattern)" in text


def _cell(model, method, **priced):
    return harness.Cell(model, "node-8", method, compiled_s=priced["nccl"][0],
                        compiled_overlap_s=priced["nccl"][1],
                        priced={k.replace("_", "-"): v for k, v in priced.items()})


def test_figure_has_a_panel_per_pricing_and_mode_with_shardc_over_the_best_expert():
    cells = [_cell("a", "shardc", nccl=[2.0, 1.5], ring=[4.0, 3.0], alpha_beta=[1.0, 0.8]),
             _cell("a", "shardc+serial", nccl=[1.8, 1.6], ring=[4.0, 3.0],
                   alpha_beta=[1.0, 0.8]),
             _cell("a", "shardc@ring", nccl=[2.5, 2.0], ring=[3.0, 2.5], alpha_beta=[1.2, 1.0]),
             _cell("a", "dp", nccl=[2.0, 2.0], ring=[3.0, 3.0], alpha_beta=[1.8, 1.8]),
             _cell("a", "fsdp", nccl=[3.0, 1.6], ring=[6.0, 2.0], alpha_beta=[1.1, 0.9]),
             _cell("b", "shardc", nccl=[1.0, 1.0], ring=[1.0, 1.0], alpha_beta=[1.0, 1.0]),
             _cell("b", "dp", nccl=[2.0, 2.0], ring=[2.0, 2.0], alpha_beta=[2.0, 2.0])]
    labels, panels = report.figure_panels(cells)
    assert labels == ["a  node-8", "b  node-8"]
    titles = [p["title"] for p in panels]
    assert titles == [f"{p}, {m}" for p in harness.PRICINGS for m in ("serial", "overlapped")]
    got = {p["title"]: p for p in panels}
    assert got["nccl, serial"]["planned"] == [1.8 / 2.0, None]  # shardc+serial over dp
    assert got["nccl, serial"]["default"] == [2.0 / 2.0, 0.5]
    assert got["nccl, overlapped"]["planned"] == [1.5 / 1.6, 0.5]  # the default, over fsdp
    assert got["ring, serial"]["planned"] == [3.0 / 3.0, None]  # shardc@ring over dp
    assert got["ring, overlapped"]["default"] == [3.0 / 2.0, 0.5]


def test_figure_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    cells, _ = report.load(ROOT / "docs" / "benchmarks")
    report.plot(cells, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.plot([harness.Cell("a", "node-8", "shardc")], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()  # no ratio, no figure


def test_committed_report_is_the_committed_results_written_again(tmp_path):
    """``python -m shardc.bench.report`` writes the page from ``results.json`` alone, and the
    committed page is what it writes (a change to the report is followed by a rewrite)."""
    pytest.importorskip("matplotlib")
    committed = ROOT / "docs" / "benchmarks"
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    written = report.rewrite(tmp_path)
    assert {p.name for p in written} == {"results.md", "results.json", "results.png"}
    assert (tmp_path / "results.md").read_text() == (committed / "results.md").read_text()
    assert "## Method names" in (tmp_path / "results.md").read_text()
    with pytest.raises(FileNotFoundError):
        report.rewrite(tmp_path / "empty")
