"""``shardc bench --compiler gpu``: cells compiled by XLA:GPU for H100s this machine does not
have (shardc.bench.deviceless). The compiles need JAX's CUDA plugin and are skipped without
it; the FLOPs stand-in for a missing ``cost_analysis``, the presets' hosts, the report's
note and the error naming the install are checked everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.bench import deviceless, harness, report
from shardc.bench.zoo import PRESETS, ZOO
from shardc.cli import bench as cli_bench
from shardc.cost.combine import XLA_GPU, combiner_for
from shardc.inspect.hlo import collectives, price_all
from shardc.inspect.schedule import replay_flops

needs_plugin = pytest.mark.skipif(
    deviceless.plugin() is None,
    reason="JAX's CUDA plugin is not installed (" + deviceless.install_hint() + ")")


def test_presets_know_their_hosts():
    assert {n: p.hosts for n, p in PRESETS.items()} == {
        "node-8": 1, "node-2x4": 1, "2nodes-2x8": 2, "4nodes-eth": 4}
    for p in PRESETS.values():  # eight GPUs a host, as the clusters' NVLink domains
        assert p.devices == 8 * p.hosts, p.name


class _NoAnalysis:
    """A compiled program as an ahead-of-time GPU compile gives it: no cost_analysis."""

    def __init__(self, compiled):
        self.compiled = compiled

    def as_text(self):
        return self.compiled.as_text()

    def cost_analysis(self):
        return None

    def memory_analysis(self):
        return self.compiled.memory_analysis()


def test_replay_flops_stand_in_for_a_missing_cost_analysis():
    mesh = jax.make_mesh((8,), ("gpu",), axis_types=(AxisType.Auto,))

    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    args = (jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((1024, 512), jnp.float32,
                                 sharding=NamedSharding(mesh, P("gpu"))))
    compiled = jax.jit(step).lower(*args).compile()
    cluster = PRESETS["node-8"].cluster
    analysed, = price_all(compiled, mesh, [cluster])
    replayed, = price_all(_NoAnalysis(compiled), mesh, [cluster])
    assert replayed.flops == replay_flops(compiled.as_text(), collectives(compiled, mesh))
    # two matmuls of 128x512x512 per device, forward and backward: 2 * 2 * 128 * 512^2
    matmuls = 2 * 2 * 128 * 512 * 512
    assert matmuls <= replayed.flops <= 1.1 * matmuls
    assert replayed.flops == pytest.approx(analysed.flops, rel=0.1)
    assert replayed.compute_time > 0 and replayed.comm_time == analysed.comm_time


def test_gpu_compiler_without_the_plugin_names_the_install(monkeypatch):
    monkeypatch.setattr(deviceless, "PLUGINS", ("jax_plugins.no_such_plugin",))
    with pytest.raises(SystemExit, match=r"pip install jax-cuda12-plugin==" +
                       jax.__version__.replace(".", r"\.")):
        cli_bench._needs_gpu_compiler("gpu")
    cli_bench._needs_gpu_compiler("cpu")  # XLA:CPU needs nothing more


def test_gpu_results_have_their_own_folder_and_note():
    assert cli_bench._bench_folder(True, "cpu") == "docs/benchmarks/quick"
    assert cli_bench._bench_folder(False, "cpu") == "docs/benchmarks/cpu-compiled"
    assert cli_bench._bench_folder(True, "gpu") == "docs/benchmarks/gpu-compiled/quick"
    assert cli_bench._bench_folder(False, "gpu") == "docs/benchmarks"  # the headline
    cpu = harness.Cell("mlp", "node-8", "fsdp", compiled_s=1e-3)
    gpu = harness.Cell("mlp", "node-8", "fsdp", compiled_s=1e-3, compiler="gpu")
    assert "Compiled by XLA:GPU" not in report.markdown([cpu], ["c"])
    assert "Compiled by XLA:GPU" in report.markdown([gpu], ["c"])
    with pytest.raises(ValueError, match="choose one of"):
        harness.make_mesh(PRESETS["node-8"], "tpu")


def test_update_refuses_to_mix_compilers(tmp_path):
    report.write([harness.Cell("mlp", "node-8", "fsdp", compiled_s=1e-3)], tmp_path, ["c"],
                 plot_png=False)
    assert len(cli_bench._kept_cells(tmp_path, "cpu")[0]) == 1
    with pytest.raises(SystemExit, match="another compiler"):
        cli_bench._kept_cells(tmp_path, "gpu")


@needs_plugin
def test_gpu_meshes_span_the_presets_hosts():
    mesh = harness.make_mesh(PRESETS["2nodes-2x8"], "gpu")
    assert mesh.devices.shape == (2, 8)
    assert {d.platform for d in mesh.devices.flat} == {"gpu"}
    # which shardc reads as XLA:GPU's, and plans with its combiner
    assert combiner_for(mesh.devices.flat[0].platform) is XLA_GPU
    # the first mesh axis crosses the hosts, the second stays in one
    assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]


@needs_plugin
def test_gpu_cells_price_what_xla_gpu_compiled():
    zm, preset = ZOO["mlp"], PRESETS["node-8"]
    cells = {m: harness.run_cell(zm, preset, m, "quick", check=m == "shardc", time_limit=5.0,
                                 compiler=c)
             for m, c in (("shardc", "gpu"), ("fsdp", "gpu"))}
    cpu_fsdp = harness.run_cell(zm, preset, "fsdp", "quick", check=False, time_limit=5.0)
    for cell in cells.values():
        assert cell.error is None, cell.error
        assert cell.compiler == "gpu"
        assert cell.compiled_compute_s > 0  # the replay's FLOPs: no cost_analysis here
        assert cell.peak_memory and cell.compiled_feed_s > 0
    ours, fsdp = cells["shardc"], cells["fsdp"]
    assert ours.matched is True  # checked on the CPU devices
    assert ours.planned_counts == ours.collectives  # planned with XLA:GPU's combiner
    # XLA:GPU's combiner merges the per-layer gathers XLA:CPU leaves apart
    assert fsdp.collectives["all-gather"] < cpu_fsdp.collectives["all-gather"]
    assert np.isclose(fsdp.compiled_compute_s, cpu_fsdp.compiled_compute_s, rtol=0.1)
