"""Planning leaves the user's model and inputs as they were; state a graph cannot repeat is refused."""

from __future__ import annotations

import functools

import pytest
import torch

import pipecut
from examples import gpt, resnet
from pipecut.capture import capture
from pipecut.core.kinds import CaptureMethod
from pipecut.errors import CaptureError
from tests.stateful import (
    CountsCalls,
    CountsInPython,
    WritesInput,
    WritesInputAfterItem,
    assert_unchanged,
    counts_calls,
    snapshot,
)

FACTORIES = {
    "counts_calls": counts_calls,  # buffer reassigned in forward: torch.export
    "resnet": functools.partial(resnet.build, batch_size=4),  # BatchNorm statistics
    "gpt": functools.partial(gpt.build, vocab=64, dim=16, heads=2, layers=2, seq=8, batch_size=4),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_plan_leaves_model_and_inputs_unchanged(name: str) -> None:
    model, inputs, loss_fn, target = FACTORIES[name]()
    before = snapshot(model, inputs)
    rng = torch.get_rng_state()
    plan = pipecut.plan(
        model, inputs, devices=2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    assert plan.num_stages == 2
    assert_unchanged(before, model, inputs)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_buffer_reassigned_in_forward_is_captured_by_export_and_put_back() -> None:
    model = CountsCalls()
    calls = model.calls
    x = torch.randn(2, 8)
    cap = capture(model, (x,))
    assert cap.method is CaptureMethod.EXPORT
    assert model.calls is calls and isinstance(calls, torch.Tensor) and calls.item() == 0
    assert cap.gm.get_buffer("calls") is calls
    with pytest.raises(CaptureError, match=r"reassigns \['calls'\].*symbolic_trace graph does not record"):
        capture(model, (x,), method=CaptureMethod.SYMBOLIC_TRACE)
    assert model.calls is calls


def test_a_python_counter_in_forward_is_refused() -> None:
    model = CountsInPython()
    for method in ("auto", CaptureMethod.SYMBOLIC_TRACE):  # (torch.export restores it unseen)
        with pytest.raises(CaptureError, match=r"changes the Python attribute\(s\) \['steps \(0 -> 1\)'\].*register_buffer"):
            capture(model, (torch.randn(2, 8),), method=method)
        assert model.steps == 0


@pytest.mark.parametrize("method", [CaptureMethod.SYMBOLIC_TRACE, CaptureMethod.EXPORT])
@pytest.mark.parametrize("model", [WritesInput(), WritesInput(view=True), WritesInputAfterItem()],
                         ids=["direct", "view", "after-item"])
def test_a_write_into_an_input_is_refused(model: torch.nn.Module, method: CaptureMethod) -> None:
    if isinstance(model, WritesInputAfterItem) and method is CaptureMethod.EXPORT:
        pytest.skip("torch.export cannot capture .item() used as a Python number")
    x = torch.randn(2, 8)
    before = snapshot(model, (x,))
    with pytest.raises(CaptureError, match=r"node 'mul_.*writes in place into the model input 'x'.*clone"):
        capture(model, (x,), method=method)
    assert_unchanged(before, model, (x,))


def test_plan_refuses_a_model_writing_into_its_input_without_touching_it() -> None:
    model = WritesInput()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    before = snapshot(model, (x,))
    with pytest.raises(CaptureError, match="model input 'x'"):
        pipecut.plan(model, (x,), devices=2, loss_fn=torch.nn.functional.mse_loss, target=y)
    assert_unchanged(before, model, (x,))
