"""core.clock: the median of repeated runs, host clock on CPU and CUDA events on a GPU.

The CPU tests run on a fake host clock that only the work advances (:class:`FakeClock`): what
they check is the arithmetic of sampling, which must not depend on how loaded the machine is
(three real 10 ms sleeps once took 10 to 40 ms under another process's load, and a test failed).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import pipecut.core.clock as clock
from pipecut.core.clock import median_ms

pytestmark = pytest.mark.clock  # --jitter-clock would scale the times these tests check


class FakeClock:
    """``time.perf_counter`` for :mod:`pipecut.core.clock`: seconds that pass only in ``sleep``."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_median_ignores_one_slow_sample_and_returns_the_last_result(fake: FakeClock) -> None:
    delays = iter([0.001, 0.001, 0.05, 0.001, 0.001])  # one run of five disturbed by 50 ms

    def work() -> int:
        fake.sleep(next(delays))
        return 7

    ms, result = median_ms(work, repeats=5)
    assert ms == pytest.approx(1.0) and result == 7


def test_warmup_runs_are_not_timed(fake: FakeClock) -> None:
    calls: list[Any] = []
    ms, _ = median_ms(lambda: calls.append(fake.sleep(0.05 if not calls else 0.002)), repeats=3, warmup=1)
    assert len(calls) == 4 and ms == pytest.approx(2.0)


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats"):
        median_ms(lambda: None, repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_the_kernels_not_the_launch() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    ms, y = median_ms(lambda: x @ x, repeats=3, warmup=1, device=x.device)
    assert ms > 0 and y.shape == x.shape


def test_a_steady_timer_stops_once_the_samples_agree(fake: FakeClock) -> None:
    from pipecut.core.clock import MIN_SAMPLES, Timer

    calls: list[Any] = []
    Timer(repeats=20, steady=0.5).ms(lambda: calls.append(fake.sleep(0.01)))
    assert len(calls) == MIN_SAMPLES  # three 10 ms runs agree within 50%
    noisy = iter([0.001, 0.03, 0.001, 0.03, 0.001, 0.03])
    calls.clear()
    Timer(repeats=6, steady=0.01).ms(lambda: calls.append(fake.sleep(next(noisy))))
    assert len(calls) == 6  # never within 1%: every repeat runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_time_excludes_the_hosts_dispatch_before_the_kernel() -> None:
    import time

    x = torch.zeros(1024, device="cuda")

    def slow_host_small_kernel() -> torch.Tensor:
        time.sleep(0.005)  # 5 ms of host work before a kernel of a few microseconds
        return x.add_(1)

    ms = median_ms(slow_host_small_kernel, repeats=3, warmup=1, device=x.device)[0]
    assert ms < 1.0, f"{ms:.3f} ms: the events timed the host's 5 ms, not the kernel"
