"""Partitioning, in one package: a cost table in, a plan out.

:mod:`~pipecut.passes.partition.solve` (``partition_costs``: picks the exact DP or the ILP, or
scores a given split) over :mod:`~pipecut.passes.partition.problem` (the cost table as a chain
problem), :mod:`~pipecut.passes.partition.chain`, :mod:`~pipecut.passes.partition.coarsen`,
the solvers (:mod:`~pipecut.passes.partition.memory_dp`, :mod:`~pipecut.passes.partition.ilp`,
:mod:`~pipecut.passes.partition.memory_partition`), and their helpers (``holders``,
``memory_floor``, ``pinned``, ``refine``).
"""

__all__: list[str] = []
