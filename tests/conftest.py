"""Every test sees 8 simulated CPU devices (set before JAX starts its backend), and XLA:CPU
compiles fast (also in the processes a test starts, which inherit the flags): the tests'
programs are tiny, so their compiles, not their runs, take the suite's time.

- ``--xla_backend_optimization_level=0``: no LLVM optimisations; XLA's HLO passes
  (partitioning, combining, buffer assignment) run as they are.
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's older loop-fusion emitters, which
  compile a program in about 40% of the time (fewer, larger loop fusions; a scatter runs
  as a loop). The partitioned program, so every collective a test counts, is the same;
  temporaries move by bytes (a 20 MiB scanned Llama: 192 bytes).
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """The files holding slow tests first, each file's tests in their own order: xdist's
    ``--dist loadfile`` hands whole files to its workers in this order, so the long files
    start early and the short ones fill the workers' tails."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
