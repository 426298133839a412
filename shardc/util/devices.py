"""Simulated CPU devices, set before JAX starts its backend (the commands, the benchmark's
workers and its GPU report use them)."""

from __future__ import annotations

import os

__all__ = ["force_cpu_devices"]


def force_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices; must run before JAX initialises its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    jax.config.update("jax_num_cpu_devices", n)
