"""Host memory that a CPU rank frees goes back to the system, so peak RSS follows live tensors.

glibc serves an allocation of at least its mmap threshold (128 KiB at start) with its own
mapping, returned to the system when freed, but it raises the threshold to the size of every
such block freed ("dynamic threshold"). A pipeline stage frees a weight-sized gradient
temporary per layer and microbatch (autograd adds it into ``.grad``), so after the first step
those blocks come from the heap instead, and the heap keeps what is freed: measured on the
512 MiB memory benchmark at K = 4, every rank's peak RSS grew 0.74–1.07× the model's bytes
instead of 0.67–0.70× (``benchmarks/MEMORY.md``). Fixing the threshold (``mallopt``), which
is what glibc's ``MALLOC_MMAP_THRESHOLD_`` environment variable does at start-up, keeps it
where it is: every block of 1 MiB or more is mapped and unmapped. The price: every such block
is fresh pages the kernel must zero, and the same benchmark's steps took 1.5× as long, so it
is a choice (``compile(..., lean_host_memory=True)``), not the default.

:func:`return_large_frees` does nothing where the C library is not glibc, where the user set
``MALLOC_MMAP_THRESHOLD_`` (their choice stands) or where ``PIPECUT_KEEP_MALLOC=1`` asks
pipecut to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["M_MMAP_THRESHOLD", "THRESHOLD_BYTES", "return_large_frees"]

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``malloc.h``)."""

THRESHOLD_BYTES = 1 << 20
"""Blocks of this size or more are mapped on their own and returned when freed."""


def return_large_frees(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; True if it was set."""
    if os.environ.get("PIPECUT_KEEP_MALLOC") == "1" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))

