"""pipecut.capture.agree: a rank captures the graph its plan names, whichever shapes mode of
torch.export gave it on rank 0 (a time limit can run out on one rank and not another)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from pipecut.capture import capture, fingerprint
from pipecut.capture.agree import capture_for_plan, static_plan
from pipecut.core.kinds import CaptureMethod
from pipecut.core.program import Shapes
from pipecut.errors import CaptureError
from pipecut.ir import Plan
from tests.unit.capture.test_bound import Net, _spin

EXPORT = CaptureMethod.EXPORT


class Sized(Net):
    """Reads its batch size: the symbolic graph has a ``sym_size`` node, the static one a 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(x.shape[0], -1))


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return (torch.randn(8, 8),)


def _plan(**capture_options: Any) -> Plan:
    torch.manual_seed(0)
    (x,) = _inputs()
    return pipecut.plan(Sized(), (x,), devices=2, loss_fn=torch.nn.functional.mse_loss, target=torch.randn(8, 4),
                        microbatches=2, capture=pipecut.CaptureOptions(method="export", **capture_options),
                        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False))


@pytest.fixture(scope="module")
def symbolic() -> Plan:
    return _plan()


@pytest.fixture(scope="module")
def static() -> Plan:
    return _plan(dynamic_shapes=False)


def _first() -> tuple[torch.Tensor, ...]:
    return (_inputs()[0][:4],)


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record torch.export's calls (symbolic or not); ``exports.append(None)`` first makes the
    symbolic ones never finish."""
    real = torch.export.export
    calls: list[Any] = []

    def export(*args: Any, dynamic_shapes: Any = None, **kwargs: Any) -> Any:
        slow = None in calls
        calls.append(dynamic_shapes is not None)
        if dynamic_shapes is not None and slow:
            _spin()
        return real(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    return calls


def test_the_two_modes_give_different_graphs_and_plans_say_which(symbolic: Plan, static: Plan) -> None:
    assert symbolic.fingerprint != static.fingerprint
    assert static_plan(static) and not static_plan(symbolic)


def test_a_rank_whose_capture_differs_from_rank_0s_takes_the_other_mode(symbolic: Plan, static: Plan) -> None:
    model = Sized()
    mine = capture(model, _first(), method=EXPORT)  # symbolic here, static on rank 0 (its limit ran out)
    got = capture_for_plan(model, _first(), static, pipecut.CaptureOptions(), method=EXPORT, got=mine)
    assert got.shapes is Shapes.STATIC and fingerprint(got.gm) == static.fingerprint
    mine = capture(model, _first(), method=EXPORT, dynamic_shapes=False)  # the reverse
    got = capture_for_plan(model, _first(), symbolic, pipecut.CaptureOptions(), method=EXPORT, got=mine)
    assert got.shapes is Shapes.SYMBOLIC and fingerprint(got.gm) == symbolic.fingerprint
    assert capture_for_plan(model, _first(), symbolic, pipecut.CaptureOptions(), got=got) is got  # it matches


def test_a_static_plan_is_captured_static_first_without_waiting(static: Plan, exports: list[Any]) -> None:
    exports.append(None)  # a symbolic export would never finish
    got = capture_for_plan(Sized(), _first(), static, pipecut.CaptureOptions(), method=EXPORT)
    assert exports == [None, False] and fingerprint(got.gm) == static.fingerprint


def test_a_symbolic_plan_this_rank_cannot_export_in_time_is_refused(symbolic: Plan, exports: list[Any]) -> None:
    exports.append(None)
    """It waits REPLAY_SLACK times the limit (the planning rank's export finished within it:
    a loaded rank is slower, not stuck), then refuses with the fix."""
    with pytest.raises(CaptureError, match=r"ran past 2 s \(10 x CaptureOptions\(time_limit=0.2\)\); plan and "
                                           r"compile with CaptureOptions\(dynamic_shapes=False\)"):
        capture_for_plan(Sized(), _first(), symbolic, pipecut.CaptureOptions(time_limit=0.2), method=EXPORT)


def test_another_models_plan_gives_the_first_capture_back_for_the_fingerprint_check(symbolic: Plan) -> None:
    class Other(Sized):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    got = capture_for_plan(Other(), _first(), symbolic, pipecut.CaptureOptions(), method=EXPORT)
    assert got.shapes is Shapes.SYMBOLIC and fingerprint(got.gm) != symbolic.fingerprint
