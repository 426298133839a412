"""GPU devices this machine does not have: XLA's GPU compiler, ahead of time, on any machine.

JAX's CUDA PJRT plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` from PyPI, at the
installed jax's version) describes a topology of GPUs it is told about
(``jax.experimental.topologies.get_topology_desc`` with a ``target_config``): its devices
make a :class:`jax.sharding.Mesh`, and ``jax.jit(f).lower(abstract args).compile()`` on it
runs XLA's whole GPU pipeline (SPMD partitioning, the collective combiners, the
latency-hiding scheduler, fusion, PTX and cubin generation) with no GPU and no CUDA driver.
The PTX-to-cubin step needs ``ptxas``: a CUDA toolkit's (``/usr/local/cuda/bin``, ``PATH``)
or ``nvidia-cuda-nvcc-cu12``'s from PyPI; without one the compile fails with "No PTX
compilation provider is available". The compiled program cannot run; its text
(``.as_text()``) is what XLA:GPU would run on those GPUs. Measured on a CPU-only machine
with jax 0.10.2: the GPT bench model's FSDP step compiled this way has the collectives of
the same step compiled on a GPU machine (20: 14 all-gather, 3 reduce-scatter, 2
all-to-all, 1 all-reduce; XLA:CPU emits 190).

The plugin's start-up checks the installed CUDA libraries and, finding none, refuses to
register itself; :func:`gpu_devices` skips that check (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``)
while it registers the plugin, and registers it again when JAX had already refused it.
JAX's own backends are unchanged: without a visible GPU, ``jax.devices()`` stays the CPU's.

References:
  JAX ``jax/experimental/topologies.py`` (``get_topology_desc``) and ``jax/_src/
    xla_bridge.py`` (``make_pjrt_topology``; plugins are discovered once per process;
    ``register_plugin`` registers a topology factory);
  JAX ``jax_plugins/xla_cuda12/__init__.py`` (``initialize``; the version check and its
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` escape);
  XLA ``xla/stream_executor/device_description.proto`` (``GpuTargetConfigProto``): the
    fields of :data:`H100_TARGET`; the values are an H100 SXM5 80 GB's CUDA device
    properties (NVIDIA H100 datasheet; CUDA programming guide, compute capability 9.0
    limits).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from contextlib import contextmanager

from shardc.errors import BenchError, OptionsError

__all__ = ["H100_TARGET", "PLUGINS", "gpu_devices", "install_hint", "plugin"]

#: an H100 SXM5 80 GB as XLA's GPU compiler describes its target (References)
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 13 }
platform_name: "CUDA"
dnn_version_info { major: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
#: the CUDA plugins' modules, in the order they are used when several are installed
PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def plugin() -> str | None:
    """The module of the installed CUDA plugin (:data:`PLUGINS`), or None."""
    for name in PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ImportError:  # no jax_plugins namespace at all
            return None
    return None


def install_hint() -> str:
    """The command that installs the CUDA plugin matching the installed jax, with ``ptxas``
    (``nvidia-cuda-nvcc-cu12``; not needed beside a CUDA toolkit)."""
    import jax

    v = jax.__version__
    return f"pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12"


@contextmanager
def _skipping_cuda_check():
    old = os.environ.get(_SKIP_CHECK)
    os.environ[_SKIP_CHECK] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[_SKIP_CHECK]
        else:
            os.environ[_SKIP_CHECK] = old


def gpu_devices(hosts: int = 1, per_host: int = 8, target: str = H100_TARGET) -> list:
    """``hosts * per_host`` GPU devices described by ``target`` (an H100 by default), in
    one slice of ``hosts`` hosts, for ahead-of-time compiles (module doc). Raises a
    RuntimeError naming the install when the CUDA plugin is absent."""
    if hosts < 1 or per_host < 1:
        raise OptionsError(f"gpu_devices: hosts={hosts}, per_host={per_host}; both must be >= 1")
    name = plugin()
    if name is None:
        raise BenchError("compiling for GPUs on this machine needs JAX's CUDA plugin and "
                         "ptxas (no GPU or CUDA driver): " + install_hint())
    from jax.experimental import topologies

    def describe():
        return topologies.get_topology_desc(f"gpu-{hosts}x{per_host}", "cuda",
                                            target_config=target,
                                            topology=f"1x{hosts}x{per_host}")

    with _skipping_cuda_check():
        try:
            topology = describe()
        except NotImplementedError:
            # JAX discovered its plugins earlier and the CUDA plugin, checking for CUDA
            # libraries, did not register: register it now, past that check
            importlib.import_module(name).initialize()
            topology = describe()
    return list(topology.devices)
