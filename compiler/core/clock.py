"""One way to time a piece of work: the median of repeated runs, in milliseconds.

On the CPU, ``time.perf_counter`` around each call. On CUDA, work is asynchronous: the host's
clock would measure kernel launches, not kernels, so each call is bracketed by two CUDA events
on the current stream and timed by ``Event.elapsed_time`` once the end event has completed (the
GPU's own clock, every kernel the call queued included). The median, not the mean, so that a
sample disturbed by another process does not move the result.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["median_ms"]


def median_ms(
    fn: Callable[[], Any], repeats: int, warmup: int = 0, device: torch.device | None = None
) -> tuple[float, Any]:
    """Median time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones, and the last
    run's result; CUDA events when ``device`` is a CUDA device, the host clock otherwise."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    result = None
    for _ in range(warmup):
        result = fn()
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            result = fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples), result
