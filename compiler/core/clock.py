"""One way to time a piece of work: the median of repeated runs, in milliseconds.

On the CPU, ``time.perf_counter`` around each call. On CUDA, work is asynchronous: the host's
clock would measure kernel launches, not kernels, so each call is bracketed by two CUDA events
on the current stream and timed by ``Event.elapsed_time`` once the end event has completed (the
GPU's own clock, every kernel the call queued included). Before the start event the GPU is given
a busy-wait (``torch.cuda._sleep``: :func:`pipecut.core.torch_private.cuda_sleep`) a little
longer than the host took to queue the call last time, so that every kernel is queued before the
start event fires: the events then bracket the kernels, not the host's dispatch between them. Without it a small node's time on an H200 was
mostly the interpreter's and autograd's host work (a 4-layer Llama's node times summed to 59 ms,
2.6 times its 22.5 ms step; benchmarks/gpu_costs.py); a stage that is bound by the host in a
real step is corrected by calibration (whole stages timed). The median, not the mean, so that a
sample disturbed by another process does not move the result; with ``steady``, sampling stops
early once :data:`MIN_SAMPLES` samples lie within that fraction of their median.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipecut.core.torch_private import cuda_sleep

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
        host_ms = COVER_FIRST_MS
        for _ in range(self.warmup):
            begin = time.perf_counter()
            result = fn()
            host_ms = (time.perf_counter() - begin) * 1e3
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        samples: list[float] = []
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _busy_wait(self.device, 2 * host_ms + COVER_MARGIN_MS)  # type: ignore[arg-type]
                start.record()
                begin = time.perf_counter()
                result = fn()
                host_ms = (time.perf_counter() - begin) * 1e3
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


COVER_FIRST_MS = 1.0
"""The busy-wait before the first timed CUDA call when no warm-up run told the host's time."""
COVER_MARGIN_MS = 0.05
"""Added to twice the host's last queueing time: the busy-wait outlasts the host's dispatch."""


def _busy_wait(device: torch.device, ms: float) -> None:
    """Queue about ``ms`` of GPU busy-waiting on ``device``'s current stream (nothing where this
    torch has no busy-wait kernel)."""
    sleep = cuda_sleep()
    if sleep is not None:
        sleep(int(ms * _cycles_per_ms(sleep, torch.device(device).index or 0)))


@functools.cache
def _cycles_per_ms(sleep: Callable[[int], None], index: int) -> float:
    """Cycles of the busy-wait ``sleep`` per millisecond on GPU ``index``, timed once by events
    (a cache of the hardware's clock, not state)."""
    with torch.cuda.device(index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        sleep(cycles // 10)  # the first call loads the kernel
        start.record()
        sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)


def median_ms(
    fn: Callable[[], Any], repeats: int, warmup: int = 0, device: torch.device | None = None
) -> tuple[float, Any]:
    """Median time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones, and the last
    run's result (:class:`Timer` without early stopping)."""
    return Timer(repeats, warmup, device).sampled(fn)
