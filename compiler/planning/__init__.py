"""Planning: from a model (or a cost table) to a :class:`~pipecut.ir.Plan`.

The steps, each in its own module: :mod:`~pipecut.planning.planner` (``pipecut.plan``: capture,
measure, partition, calibrate; the partition itself is the pass
:func:`pipecut.passes.partition.solve.partition_costs`),
:mod:`~pipecut.planning.autoplan` (microbatches and schedule chosen by predicted step),
:mod:`~pipecut.planning.heavy` (heavy nodes in row pieces), :mod:`~pipecut.planning.replicas`
(D replicas × K stages) and :mod:`~pipecut.planning.cluster` (a cluster that is not here: one package, read top to bottom).
Each reads one :class:`~pipecut.planning.request.Request`: what ``plan`` or ``compile`` was
asked.
"""

__all__: list[str] = []
