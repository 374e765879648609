"""Building this rank's pipeline from a plan: the steps of ``pipecut.compile``.

:mod:`~pipecut.build.context` (where this rank sits: process group, device, layout, link),
:mod:`~pipecut.build.choice` (which plan runs: replayed, or planned on rank 0, checked against
the graph and the group), :mod:`~pipecut.build.workers` (the stages of this rank with their
weights, synchronised with rank 0's), :mod:`~pipecut.build.layout`, :mod:`~pipecut.build.replay`
and :mod:`~pipecut.build.resolve`.
"""

__all__: list[str] = []
