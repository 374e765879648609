"""Memory: what a stage keeps for backward, what a device has free, what the host gives back.

:mod:`~pipecut.runtime.memory.activations` (activation bytes measured as a stage runs),
:mod:`~pipecut.runtime.memory.capacity` (each rank's free device memory as the plan's capacity)
and :mod:`~pipecut.runtime.memory.allocator` (glibc's mmap threshold fixed on request).
"""

__all__: list[str] = []
