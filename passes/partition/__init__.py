"""Partitioners: a cost table as a chain problem, and the solvers that cut it into stages."""

__all__: list[str] = []
