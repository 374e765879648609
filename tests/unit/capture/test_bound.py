"""pipecut.capture.bound, and capture's time limit: a symbolic-shape export that runs past it
falls back to static shapes, and the plan then accepts (and every step checks) only those.

Issue 27: a transformers Swin at one sample per microbatch never finished ``compile`` in 10
minutes, in sympy under torch.export's ``_reshape_view_helper`` (symbolic image height and
width through the window partitions). These tests stand a slow export in with a Python loop
that never ends (a stand-in for sympy), so they are fast and do not depend on timing beyond
"it finishes"; tests/multiprocess/test_capture_swin.py runs the Swin itself.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pipecut
from pipecut.capture import capture
from pipecut.capture.bound import Expired, can_bound, check_unchanged, time_bound, torch_state
from pipecut.core.kinds import CaptureMethod
from pipecut.core.program import Shapes
from pipecut.core.shapes import check_microbatch
from pipecut.errors import CaptureError, InputError
from pipecut.options import UNBOUNDED
from pipecut.planning.autoplan import accepts


def _spin() -> None:
    """Pure Python that never returns, as sympy simplifying a shape expression seems to."""
    while True:
        pass


@pytest.fixture
def outer_timer() -> Iterator[None]:
    """pytest-timeout arms SIGALRM around each test: put its handler and timer back after a
    test that arms its own."""
    handler = signal.getsignal(signal.SIGALRM)
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, delay, interval)


def test_a_bound_interrupts_pure_python_and_puts_the_signal_back() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(Expired, match=r"no result after 0\.05 s"), time_bound(0.05) as bound:
        assert bound.armed
        _spin()
    assert signal.getsignal(signal.SIGALRM) is handler
    with time_bound(5.0) as bound:  # a block that ends in time is left alone
        assert bound.armed
    with time_bound(math.inf) as bound:  # "unbounded": a deadline never due
        assert not bound.armed


def test_off_the_main_thread_nothing_is_armed() -> None:
    seen: list[Any] = []

    def run() -> None:
        seen.append(can_bound())
        with time_bound(0.01) as bound:
            time.sleep(0.05)  # past the bound: nothing interrupts it
            seen.append(bound.armed)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [False, False]
    assert can_bound()


def test_not_inside_an_exit_the_signal_waits_until_it_is_done() -> None:
    """Raising inside a context manager's __exit__ (or an import) could leave global state half
    put back; the handler waits until the block is out of it."""
    done: list[bool] = []

    class SlowExit:
        def __enter__(self) -> SlowExit:
            return self

        def __exit__(self, *exc: object) -> None:
            start = time.monotonic()
            while time.monotonic() - start < 0.3:  # the bound runs out in here
                pass
            done.append(True)

    with pytest.raises(Expired), time_bound(0.02):
        with SlowExit():
            pass
        _spin()
    assert done == [True]


def _code_at(path: str) -> Any:
    """A function that spins for ``seconds`` and records that it finished, compiled as if it
    lived at ``path`` (the handler decides by the running code's file)."""
    source = ("import time\n"
              "def spin(seconds, done):\n"
              "    start = time.monotonic()\n"
              "    while time.monotonic() - start < seconds:\n"
              "        pass\n"
              "    done.append(True)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, path, "exec"), namespace)  # a fixed source, compiled for its file name
    return namespace["spin"]


def test_inside_torch_the_signal_waits_for_sympy_the_shape_env_or_the_models_code() -> None:
    """torch's dispatcher calls some of its Python from C++ frames an exception must not cross
    (the process aborted with ``terminate ... pybind11::error_already_set``): there the handler
    waits; in torch's sympy helpers and in code outside torch it raises at once."""
    done: list[bool] = []
    with pytest.raises(Expired), time_bound(0.02):
        _code_at("/site-packages/torch/_library/simple_registry.py")(0.3, done)
        _spin()
    assert done == [True]
    done.clear()
    with pytest.raises(Expired), time_bound(0.02):
        _code_at("/site-packages/torch/utils/_sympy/functions.py")(30.0, done)
    assert done == []


def test_an_outer_timer_still_fires_and_gets_its_time_back(outer_timer: None) -> None:
    class Outer(Exception):
        pass

    def outer_handler(signum: int, frame: object) -> None:
        raise Outer

    signal.signal(signal.SIGALRM, outer_handler)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    with pytest.raises(Outer), time_bound(10.0):  # due first: the outer handler runs, as it would have
        _spin()
    assert signal.getsignal(signal.SIGALRM) is outer_handler
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    with pytest.raises(Expired), time_bound(0.02):  # ours first: the outer timer keeps the rest of its time
        _spin()
    remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 0 < remaining <= 30.0
    assert signal.getsignal(signal.SIGALRM) is outer_handler


def test_a_changed_torch_state_is_refused() -> None:
    before = torch_state()
    check_unchanged(before, "Net")
    with torch.no_grad(), pytest.raises(CaptureError, match=r"left torch's state changed \(grad enabled\)"):
        check_unchanged(before, "Net")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture
def slow_symbolic_export(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """torch.export that never finishes with symbolic shapes (and works without): the calls'
    ``dynamic_shapes is not None`` in order."""
    real = torch.export.export
    calls: list[bool] = []

    def export(*args: Any, dynamic_shapes: Any = None, **kwargs: Any) -> Any:
        calls.append(dynamic_shapes is not None)
        if dynamic_shapes is not None:
            _spin()
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    return calls


def test_an_export_past_its_time_limit_falls_back_to_static_shapes(
    slow_symbolic_export: list[bool], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="pipecut"):
        cap = capture(model, (x,), method=CaptureMethod.EXPORT, time_limit=0.2)
    assert slow_symbolic_export == [True, False]
    assert cap.shapes is Shapes.TIMED_OUT and cap.static_shapes
    assert "ran past 0.2 s (CaptureOptions.time_limit); exporting at the example's shapes" in caplog.text
    torch.testing.assert_close(cap.gm(x), model(x), rtol=0, atol=0)
    assert accepts(cap, [x]) and not accepts(cap, [x[:2]])  # static: the example's shape only


def test_capture_asked_for_static_shapes_does_not_try_symbolic_ones(slow_symbolic_export: list[bool]) -> None:
    cap = capture(Net(), (torch.randn(4, 8),), method=CaptureMethod.EXPORT, dynamic_shapes=False)
    assert slow_symbolic_export == [False] and cap.shapes is Shapes.STATIC


def test_without_a_fallback_symbolic_shapes_are_kept() -> None:
    cap = capture(Net(), (torch.randn(4, 8),), method=CaptureMethod.EXPORT, time_limit=60.0)
    assert cap.shapes is Shapes.SYMBOLIC and not cap.static_shapes
    assert accepts(cap, [torch.randn(2, 8)])


def test_a_plan_captured_after_the_time_limit_accepts_only_its_shapes_and_steps_check_them(
    slow_symbolic_export: list[bool],
) -> None:
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 8), torch.randn(8, 4)
    options = pipecut.CaptureOptions(method="export", time_limit=0.2)
    plan = pipecut.plan(model, (x,), devices=2, loss_fn=torch.nn.functional.mse_loss, target=y,
                        microbatches=2, capture=options, measure=pipecut.MeasureOptions(repeats=1, warmup=0))
    assert plan.capture is CaptureMethod.EXPORT
    assert [(s.min_shape, s.max_shape) for s in plan.accepts] == [((4, 8), (4, 8))]
    check_microbatch(plan, plan.inputs, [x[:4]])
    with pytest.raises(InputError, match=r"This plan accepts microbatches of x: float32 \[4, 8\]"):
        check_microbatch(plan, plan.inputs, [x[:3]])


@pytest.mark.parametrize("bad", [0, -1.0, "60", True, math.inf, math.nan])
def test_a_time_limit_must_be_positive_seconds_or_unbounded(bad: Any) -> None:
    with pytest.raises(InputError, match=r"CaptureOptions\(time_limit=.*\): give seconds > 0, or 'unbounded'"):
        pipecut.CaptureOptions(time_limit=bad)
    assert pipecut.CaptureOptions(time_limit=UNBOUNDED).time_limit == "unbounded"
    assert pipecut.CaptureOptions(time_limit=5).time_limit == 5.0


def test_none_is_not_a_time_limit() -> None:
    """None in the options only ever means "not given": no bound is asked for by name."""
    with pytest.raises(InputError, match=r"CaptureOptions\(time_limit=None\): give seconds > 0, or 'unbounded' "
                                         r"for no bound"):
        pipecut.CaptureOptions(time_limit=None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"time_limit=None\): give seconds > 0, or 'unbounded'"):
        capture(torch.nn.Linear(2, 2), (torch.randn(1, 2),), time_limit=None)  # type: ignore[arg-type]


def test_auto_planning_waits_for_the_symbolic_export_once(slow_symbolic_export: list[bool]) -> None:
    """microbatches="auto" captures at several sizes: after one export ran past its limit, the
    others are exported at static shapes straight away."""
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 8), torch.randn(8, 4)
    plan = pipecut.plan(model, (x,), devices=2, loss_fn=torch.nn.functional.mse_loss, target=y,
                        capture=pipecut.CaptureOptions(method="export", time_limit=0.2),
                        measure=pipecut.MeasureOptions(repeats=1, warmup=0))
    assert slow_symbolic_export.count(True) == 1 and slow_symbolic_export.count(False) >= 2
    assert [s.min_shape == s.max_shape for s in plan.accepts] == [True]
