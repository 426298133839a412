"""Every test sees 8 simulated CPU devices (set before JAX starts its backend), and XLA:CPU
compiles fast (also in the processes a test starts, which inherit the flags): the tests'
programs are tiny, so their compiles, not their runs, take the suite's time.

- ``--xla_backend_optimization_level=0``: no LLVM optimisations; XLA's HLO passes
  (partitioning, combining, buffer assignment) run as they are.
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's older loop-fusion emitters, which
  compile a program in about 40% of the time (fewer, larger loop fusions; a scatter runs
  as a loop). The partitioned program, so every collective a test counts, is the same;
  temporaries move by bytes (a 20 MiB scanned Llama: 192 bytes).
- ``--xla_cpu_parallel_codegen_split_count=1``: the program's LLVM IR compiled as one
  module, not split into modules compiled on a thread each: on the suite's three workers
  sharing two cores the split only adds work. It changes no HLO, so no buffer or
  collective a test reads.

A run's programs are compiled once: JAX's persistent compilation cache, in a directory made
for this run (and removed after it) that its xdist workers and the processes its tests start
share through ``JAX_COMPILATION_CACHE_DIR``; many tests compile the same reference step
(``jax.jit`` of a zoo model), and a fault campaign compiles one program per launch. A cache
set by the caller is used as it is.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"

#: the run's compilation cache, where this process made it (the controller: its xdist
#: workers and the processes tests start inherit the variables and make none)
OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    OWN_CACHE = tempfile.mkdtemp(prefix="shardc-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_unconfigure(config):
    """The run's compilation cache removed by the process that made it."""
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The files holding slow tests first, each file's tests in their own order: xdist's
    ``--dist loadfile`` hands whole files to its workers in this order, so the long files
    start early and the short ones fill the workers' tails."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
