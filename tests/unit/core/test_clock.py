"""core.clock: the median of repeated runs, host clock on CPU and CUDA events on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from pipecut.core.clock import median_ms


def test_median_ignores_one_slow_sample_and_returns_the_last_result() -> None:
    delays = iter([0.0, 0.0, 0.05, 0.0, 0.0])  # one run of five disturbed by 50 ms

    def work() -> int:
        time.sleep(next(delays))
        return 7

    ms, result = median_ms(work, repeats=5)
    assert ms < 25 and result == 7


def test_warmup_runs_are_not_timed() -> None:
    calls = []
    ms, _ = median_ms(lambda: calls.append(time.sleep(0.05 if not calls else 0.0)), repeats=3, warmup=1)
    assert len(calls) == 4 and ms < 25


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats"):
        median_ms(lambda: None, repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_the_kernels_not_the_launch() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    ms, y = median_ms(lambda: x @ x, repeats=3, warmup=1, device=x.device)
    assert ms > 0 and y.shape == x.shape


def test_a_steady_timer_stops_once_the_samples_agree() -> None:
    from pipecut.core.clock import MIN_SAMPLES, Timer

    calls = []
    Timer(repeats=20, steady=0.5).ms(lambda: calls.append(time.sleep(0.01)))
    assert len(calls) == MIN_SAMPLES  # three 10 ms sleeps agree within 50%
    noisy = iter([0.0, 0.03, 0.0, 0.03, 0.0, 0.03])
    calls.clear()
    Timer(repeats=6, steady=0.01).ms(lambda: calls.append(time.sleep(next(noisy))))
    assert len(calls) == 6  # never within 1%: every repeat runs
