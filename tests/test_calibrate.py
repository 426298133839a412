"""Cluster.calibrate: α-β fits per mesh axis from timed collectives, FLOP/s from a matmul,
and the Cluster JSON the CLI writes and ``shardc plan --cluster`` reads."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import shardc
from shardc.cost.calibrate import WIRE_FACTOR, CalibrateOptions, CalibrationError, Sample, _fit

# few sizes and runs: the whole file runs in seconds on 8 CPU devices
QUICK = CalibrateOptions(sizes=(1 << 10, 1 << 15, 1 << 19), reps=3, chain=4, matmul_size=256)


def test_calibrate_fits_every_axis():
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    cluster, cal = shardc.Cluster.calibrate(mesh, QUICK)
    assert [f.axis for f in cal.axes] == ["node", "gpu"]
    for f in cal.axes:
        assert f.size == mesh.shape[f.axis]
        assert f.latency > 0 and f.bandwidth > 0
        assert cluster.latency(f.axis) == f.latency and cluster.bandwidth(f.axis) == f.bandwidth
        assert f.model == cluster.collective_model
        # every collective at every size was timed, its wire bytes per the ring model
        assert sorted((s.kind, s.message) for s in f.samples) == sorted(
            (k, m) for k in WIRE_FACTOR for m in QUICK.sizes)
        for s in f.samples:
            assert s.seconds > 0
            assert s.wire == pytest.approx(WIRE_FACTOR[s.kind](f.size) * s.message)
        # the reported residuals are those of the fitted line, and the fit beats the mean
        fitted = np.array([f.fitted(s) for s in f.samples])
        times = np.array([s.seconds for s in f.samples])
        np.testing.assert_allclose(f.residuals, (times - fitted) / times, rtol=1e-9)
        # (how well a line fits the timings depends on the machine's load: beside another
        # test process the fit can be worse than the mean, r2 < 0)
        assert f.r2 <= 1
    assert cluster.device_flops == cal.matmul_flops > 0 and cluster.utilization == 1.0
    cluster.check_axes(mesh.axis_names)
    assert "node" in cal.report() and "R²" in cal.report()
    assert shardc.Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    # the calibrated cluster plans a step
    step_fn = lambda w, x: (x @ w).sum()
    step = shardc.auto_shard(jax.grad(step_fn), mesh=mesh, cluster=cluster, time_limit=1.0)
    plan = step.plan(jax.ShapeDtypeStruct((64, 64), np.float32),
                     jax.ShapeDtypeStruct((32, 64), np.float32))
    assert plan.cluster == cluster and plan.predicted.step_time > 0


def test_fit_recovers_alpha_and_beta():
    alpha, bw, n = 20e-6, 5e9, 4
    samples = [Sample(k, m, WIRE_FACTOR[k](n) * m, alpha + WIRE_FACTOR[k](n) * m / bw)
               for k in WIRE_FACTOR for m in (1 << 10, 1 << 16, 1 << 20)]
    f = _fit("gpu", n, samples)
    assert f.latency == pytest.approx(alpha, rel=1e-9) and f.bandwidth == pytest.approx(bw)
    assert f.r2 == pytest.approx(1.0) and f.max_residual < 1e-9


def test_fit_recovers_a_latency_per_ring_step_and_calibrate_keeps_the_better_model():
    # timings made by the ring model (NCCL's base, then a latency per ring step): the ring
    # fit recovers its latency and bandwidth exactly, and fits them better than one α
    from shardc.cost.calibrate import _latency

    lam, bw, n = 4e-6, 5e9, 8
    samples = [Sample(k, m, WIRE_FACTOR[k](n) * m,
                      _latency("ring", k, n, lam) + WIRE_FACTOR[k](n) * m / bw)
               for k in WIRE_FACTOR for m in (1 << 10, 1 << 16, 1 << 20)]
    ring, ab = _fit("gpu", n, samples, "ring"), _fit("gpu", n, samples, "alpha-beta")
    assert ring.latency == pytest.approx(lam, rel=1e-9)
    assert ring.bandwidth == pytest.approx(bw)
    assert ring.max_residual < 1e-9 < ab.max_residual
    assert ring.weighted_sse < ab.weighted_sse
    # and priced by the planner's own ring model, the fitted cluster gives those times
    cluster = shardc.Cluster(axis_bandwidth={"gpu": bw}, axis_latency={"gpu": lam},
                             collective_model="ring", axis_link={"gpu": "nvlink"})
    for s in samples[::3]:
        kind = s.kind
        nbytes = s.message * (n if kind == "all-gather" else 1)  # NCCL's buffer
        assert cluster.collective_seconds(kind, [("gpu", n)], nbytes) == pytest.approx(
            s.seconds, rel=1e-6), kind


def test_fit_refuses_flat_times():
    samples = [Sample("all-reduce", m, float(m), 1e-4) for m in (1024, 2048, 4096)]
    with pytest.raises(CalibrationError, match="larger sizes"):
        _fit("node", 2, samples)


def test_options_are_checked():
    with pytest.raises(ValueError, match="two distinct"):
        CalibrateOptions(sizes=(1024,))
    with pytest.raises(ValueError, match="reps"):
        CalibrateOptions(reps=0)


def test_cli_calibrate_writes_a_cluster_plan_reads(tmp_path, capsys):
    from shardc.cli import main

    out, report = tmp_path / "cluster.json", tmp_path / "fit.json"
    main(["calibrate", "--mesh", "2x4", "--axes", "node,gpu", "--out", str(out), "--report",
          str(report), "--sizes", "1024", "32768", "524288", "--reps", "2", "--chain", "4",
          "--matmul-size", "256"])
    text = capsys.readouterr().out
    assert "cluster saved to" in text and "R²" in text
    cluster = shardc.Cluster.from_json(json.loads(out.read_text()))
    assert set(cluster.axis_latency) == {"node", "gpu"} == set(cluster.axis_bandwidth)
    fit = json.loads(report.read_text())
    assert fit["cluster"] == cluster.to_json() and [a["axis"] for a in fit["axes"]] == [
        "node", "gpu"]
    plan_out = tmp_path / "plan.json"
    main(["plan", "mlp", "--tiny", "--mesh", "2x4", "--axes", "node,gpu", "--cluster",
          str(out), "--rows", "3", "--out", str(plan_out)])
    assert shardc.Plan.from_json(plan_out.read_text()).cluster == cluster


def test_cli_cluster_errors_are_one_line(tmp_path, capsys):
    from shardc.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"axis_latency": {"node": -1.0}}))
    wrong_axes = tmp_path / "x.json"
    wrong_axes.write_text(json.dumps(shardc.Cluster.nvlink_node(("x",)).to_json()))
    for argv in (["plan", "mlp", "--cluster", str(tmp_path / "missing.json")],
                 ["plan", "mlp", "--cluster", str(bad)],
                 ["plan", "mlp", "--tiny", "--cluster", str(wrong_axes)],
                 ["calibrate", "--mesh", "2x4"],
                 ["calibrate", "--out", "c.json", "--sizes", "1024"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        # argparse prints its line and exits 2; the others exit with their line as the code
        err = capsys.readouterr().err.strip().splitlines() or [str(exc.value.code)]
        assert "Traceback" not in "".join(err) and err[-1].startswith("shardc"), (argv, err)
        assert len(err[-1].splitlines()) == 1
