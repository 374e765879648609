"""Calibration on the running pipeline re-plans from real stage times and leaves the model as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from examples import resnet
from tests.harness import run_ranks
from tests.reference import assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


def _calibrated(rank: int, world: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = resnet.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = pipecut.compile(model, world, example_inputs=inputs, loss_fn=loss_fn, target=target,
                           microbatches=4, calibration_steps=1, timeout=120)
    untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    no_grads = all(p.grad is None for p in model.parameters())
    loss = pipe.step(inputs, target)
    return {"untouched": untouched, "no_grads": no_grads, "detail": pipe.plan.solver.detail,
            "loss": loss, "grads": pipeline_grads(model, pipe)}


@pytest.mark.timeout(300)
def test_live_calibration_keeps_the_model_and_parity() -> None:
    results = run_ranks(_calibrated, 2, timeout=280)
    for r in results:
        assert r["untouched"] and r["no_grads"]  # BatchNorm statistics and .grad restored
        assert "calibrated on the running pipeline" in r["detail"]
    ref_loss, ref_grads = reference(resnet.build, 4, per_microbatch=True)
    assert_parity(ref_loss, ref_grads, results)
