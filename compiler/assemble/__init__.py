"""Building this rank's pipeline from a plan: the steps of ``pipecut.compile``.

:mod:`~pipecut.assemble.context` (where this rank sits: process group, device, layout, link),
:mod:`~pipecut.assemble.choice` (which plan runs: replayed, or planned on rank 0, checked against
the graph and the group), :mod:`~pipecut.assemble.workers` (the stages of this rank with their
weights, synchronised with rank 0's), :mod:`~pipecut.assemble.layout`, :mod:`~pipecut.assemble.replay`
and :mod:`~pipecut.assemble.resolve`.
"""

__all__: list[str] = []
