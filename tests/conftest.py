"""Every test sees 8 simulated CPU devices (set before JAX starts its backend), and XLA:CPU
compiles without LLVM's optimisations (``--xla_backend_optimization_level=0``, also in
the processes a test starts, which inherit the flags): the tests' programs are tiny, so
their compiles, not their runs, take the suite's time; the flag leaves XLA's HLO passes
(partitioning, combining, buffer assignment) and so every collective and byte a test
counts as they are."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """The files holding slow tests first, each file's tests in their own order: xdist's
    ``--dist loadfile`` hands whole files to its workers in this order, so the long files
    start early and the short ones fill the workers' tails."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
