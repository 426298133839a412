"""The in-order replay of a GPU-scheduled program (shardc.bench.gpu_report.in_order): a
collective hides only behind the compute XLA placed between its start and its done."""

import pytest

from shardc.bench.gpu_report import in_order

# one 1024^3 matmul (2.147 GFLOP) and a 1M-element add, around one async all-gather
_HLO = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[256,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[256,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  %ags = f32[1024,1024]{1,0} all-gather-start(f32[256,1024]{1,0} %p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %dot = f32[1024,1024]{1,0} dot(f32[1024,1024]{1,0} %p1, f32[1024,1024]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = f32[1024,1024]{1,0} all-gather-done(f32[1024,1024]{1,0} %ags)
  ROOT %add = f32[1024,1024]{1,0} add(f32[1024,1024]{1,0} %agd, f32[1024,1024]{1,0} %dot)
}
"""  # noqa: E501
DOT = 2 * 1024**3 * 1e-12  # seconds at 1e-12 s per FLOP
ADD = 1024**2 * 1e-12


def test_a_collective_shorter_than_the_compute_between_start_and_done_is_hidden():
    r = in_order(_HLO, {("main", "ags"): DOT / 2}, 1e-12)
    assert r["exposed"] == 0.0
    assert r["time"] == pytest.approx(DOT + ADD)
    assert r["comm"] == pytest.approx(DOT / 2)


def test_a_longer_collective_exposes_what_the_compute_between_does_not_cover():
    r = in_order(_HLO, {("main", "ags"): 3 * DOT}, 1e-12)
    assert r["exposed"] == pytest.approx(2 * DOT)
    assert r["time"] == pytest.approx(3 * DOT + ADD)


def test_a_done_placed_right_after_its_start_hides_nothing():
    # the same program with the matmul scheduled after the done: nothing runs beside it
    text = _HLO.replace(
        "  %dot = f32[1024,1024]{1,0} dot(f32[1024,1024]{1,0} %p1, f32[1024,1024]{1,0} %p1), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n", "")
    text = text.replace("  ROOT %add", "  %dot = f32[1024,1024]{1,0} dot(f32[1024,1024]{1,0} "
                        "%p1, f32[1024,1024]{1,0} %p1), lhs_contracting_dims={1}, "
                        "rhs_contracting_dims={0}\n  ROOT %add")
    assert text != _HLO
    r = in_order(text, {("main", "ags"): DOT / 2}, 1e-12)
    assert r["exposed"] == pytest.approx(DOT / 2)
    assert r["time"] == pytest.approx(DOT / 2 + DOT + ADD)


def test_the_kernel_table_reads_the_floor_the_dots_and_the_bandwidth():
    from shardc.bench.gpu_report import _kernels

    info = {"versions": {"device": "GPU X", "jax": "0"}, "repeats": 50, "rows": [
        {"kind": "dot", "dtype": "float32", "m": 128, "k": 128, "n": 128,
         "flops": 2 * 128 ** 3, "bytes": 3 * 4 * 128 ** 2, "s": 5e-6},
        {"kind": "dot", "dtype": "float32", "m": 8192, "k": 8192, "n": 8192,
         "flops": 2 * 8192 ** 3, "bytes": 3 * 4 * 8192 ** 2, "s": 2.5e-3},
        {"kind": "add", "elements": 1024, "flops": 1024, "bytes": 8192, "s": 2.5e-6},
        {"kind": "add", "elements": 2 ** 28, "flops": 2 ** 28, "bytes": 8 * 2 ** 28,
         "s": 5e-4}]}
    text = "\n".join(_kernels(info))
    assert "| dot | float32 | 8192 x 8192 x 8192 | 2500.0 | 439.80 |" in text
    assert "no kernel took less than 2.5 us" in text
    assert "4.29 TB/s on 268,435,456 elements (the GPU X's HBM" in text
    assert "price the largest dots 1.8x too slow" in text
