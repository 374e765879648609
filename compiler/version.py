"""The one place the version is written: pyproject.toml reads it (``dynamic = ["version"]``),
:mod:`pipecut` re-exports it, and plans record it (a module of its own, so the planner can read
it without importing :mod:`pipecut`, which imports the planner)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
