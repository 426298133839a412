"""shardc's version: the one place it is written (pyproject.toml reads it; the plan cache
keys plans by it)."""

__version__ = "0.1.0"
