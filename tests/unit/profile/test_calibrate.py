"""Calibration: stage timings leave the model as it was, and calibrated costs add up to them."""

from __future__ import annotations

import pytest
import torch

import pipecut
from examples import resnet
from pipecut.capture import capture
from pipecut.profile.calibrate import calibrate, stage_times


def test_stage_timing_leaves_the_model_untouched_and_calibration_matches_it() -> None:
    model, inputs, loss_fn, target = resnet.build(batch_size=4)
    plan = pipecut.plan(
        model, inputs, 3, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
    )
    assert "calibrated" not in plan.solver.detail
    before = {k: v.clone() for k, v in model.state_dict().items()}  # BatchNorm statistics too
    rng = torch.get_rng_state()
    cap = capture(model, (inputs[0][:2],))
    times = stage_times(cap, plan, cap.flatten_inputs((inputs[0][:2],)), loss_fn, target[:2], repeats=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(times) == 3 and all(f > 0 and b > 0 for f, b in times)

    nodes = calibrate(plan.nodes, plan, times)
    by_name = {n.name: n for n in nodes}
    for stage, (forward_ms, backward_ms) in zip(plan.stages, times):
        assert sum(by_name[n].forward_ms for n in stage.nodes) == pytest.approx(forward_ms)
        assert sum(by_name[n].backward_ms for n in stage.nodes) == pytest.approx(backward_ms)
    local = [n for n in nodes if n.name not in plan.stage_of()]  # placeholders, parameters
    assert all(n == plan.node(n.name) for n in local)


def test_plan_calibrates_by_default() -> None:
    model, inputs, loss_fn, target = resnet.build(batch_size=4)
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    assert "calibrated on whole stages" in plan.solver.detail
