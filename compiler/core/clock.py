"""One way to time a piece of work: the median of repeated runs, in milliseconds.

On the CPU, ``time.perf_counter`` around each call. On CUDA, work is asynchronous: the host's
clock would measure kernel launches, not kernels, so each call is bracketed by two CUDA events
on the current stream and timed by ``Event.elapsed_time`` once the end event has completed (the
GPU's own clock, every kernel the call queued included). The median, not the mean, so that a
sample disturbed by another process does not move the result; with ``steady``, sampling stops
early once :data:`MIN_SAMPLES` samples lie within that fraction of their median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MIN_SAMPLES", "Timer", "median_ms"]

MIN_SAMPLES = 3
"""The fewest samples a ``steady`` timer stops at."""


@dataclass(frozen=True)
class Timer:
    """How to time: ``repeats`` timed runs after ``warmup`` untimed ones, on ``device``'s clock
    (CUDA events for a CUDA device, the host clock otherwise)."""

    repeats: int
    warmup: int = 0
    device: torch.device | None = None
    steady: float | None = None
    """Stop once :data:`MIN_SAMPLES` or more samples lie within this fraction of their median."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")

    def sampled(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """The median time of ``fn()`` in ms, and the last run's result."""
        result = None
        for _ in range(self.warmup):
            result = fn()
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        samples: list[float] = []
        for _ in range(self.repeats):
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
            if self.steady is not None and len(samples) >= MIN_SAMPLES:
                median = statistics.median(samples)
                if max(samples) - min(samples) <= self.steady * median:
                    break
        return statistics.median(samples), result

    def ms(self, fn: Callable[[], Any]) -> float:
        """The median time of ``fn()`` in ms."""
        return self.sampled(fn)[0]


def median_ms(
    fn: Callable[[], Any], repeats: int, warmup: int = 0, device: torch.device | None = None
) -> tuple[float, Any]:
    """Median time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones, and the last
    run's result (:class:`Timer` without early stopping)."""
    return Timer(repeats, warmup, device).sampled(fn)
