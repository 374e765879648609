"""Calibration on the running pipeline re-plans from real stage times and leaves the model as it was."""

from __future__ import annotations

import dataclasses
import unittest.mock
from typing import Any

import pytest
import torch

import pipecut
import pipecut.api
import pipecut.planning.planner
from examples import mlp, resnet
from pipecut.cluster import Link
from pipecut.ir import NodeCost
from pipecut.passes.costs.stages import plan_schedule
from pipecut.passes.partition.chain import is_unit
from tests.harness import run_ranks
from tests.reference import assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist

FAST = Link(bandwidth_bytes_per_ms=1e9, name="given: messages cost nothing")


def _paced(measure: Any, slower: float) -> Any:
    """``measure_stages`` whose second call reports a step ``slower`` times the first's."""
    steps: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        times = measure(*args, **kwargs)
        if steps:
            times = dataclasses.replace(times, step_ms=steps[0] * slower)
        steps.append(times.step_ms)
        return times

    return timed


def _heavy_last(measure: Any, orders: list[Any]) -> Any:
    """``measure_stages`` that reports every stage at 1 ms forward and 2 ms backward but the
    last, at 8x that, and a step of 1 ms (shorter than any simulated step: the fitted message
    latency is 0), whatever they measured; notes the order each pipeline it times runs in
    ``orders``. Calibration then moves the split off the last stage on every run."""

    def timed(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        orders.append(pipe.schedule)
        stages = ((1.0, 2.0),) * (len(pipe.plan.stages) - 1) + ((8.0, 16.0),)
        return dataclasses.replace(measure(pipe, *args, **kwargs), stages=stages, step_ms=1.0)

    return timed


def _counted(profile_at: Any) -> Any:
    """The planner's node profile with every operation set to 1 ms forward, 2 ms backward."""

    def fixed(*args: Any, **kwargs: Any) -> tuple[NodeCost, ...]:
        return tuple(dataclasses.replace(n, forward_ms=1.0, backward_ms=2.0) if is_unit(n) else n
                     for n in profile_at(*args, **kwargs))

    return fixed


def _calibrated(rank: int, world: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = resnet.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4,
        measure=pipecut.MeasureOptions(calibration_steps=1),
        runtime=pipecut.RuntimeOptions(timeout=120),
    )
    untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    no_grads = all(p.grad is None for p in model.parameters())
    loss = pipe.step(inputs, target)
    out = {"untouched": untouched, "no_grads": no_grads, "detail": pipe.plan.solver.detail,
           "loss": loss, "grads": pipeline_grads(model, pipe), "link": pipe.plan.link,
           "profiled_on": pipe.plan.profiled_on}
    # A split that moves after calibration builds the pipeline again (the first build freed),
    # and is timed again: kept where it steps as fast as the first split, given up for the first
    # (built a third time) where it steps slower. The stages' times and the moved split's step
    # are set here (the last stage 8x the other), so that the split moves, and which of the two
    # happens, do not depend on the machine's load.
    for name, slower in (("rebuilt", 1.0), ("reverted", 2.0)):
        model, inputs, loss_fn, target = resnet.build()  # fresh: the first pipeline's step left gradients
        timed = _paced(_heavy_last(pipecut.api.measure_stages, []), slower)
        with unittest.mock.patch.object(pipecut.api, "measure_stages", timed):
            rebuilt = pipecut.compile(
                model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4,
                measure=pipecut.MeasureOptions(calibration_steps=1),
                runtime=pipecut.RuntimeOptions(timeout=120),
            )
        out[name] = {"loss": rebuilt.step(inputs, target), "grads": pipeline_grads(model, rebuilt),
                     "detail": rebuilt.plan.solver.detail}
    # A build kept with calibrated costs runs the order those costs give (a ZBV order is list
    # scheduled on them), which is the order its plan replays. Nothing here reads a clock: the
    # nodes profile at set costs, the link is given, and the running stages report set times,
    # the last stage 8x each of the others. So the split moves off the last stage (built
    # again, timed again and kept: the same step), and the kept build's costs give another
    # order than the one it was built with, on every run (checked below).
    model, inputs, loss_fn, target = mlp.build(batch_size=8, depth=4)
    orders: list[Any] = []
    heavy_last = _heavy_last(pipecut.api.measure_stages, orders)
    with unittest.mock.patch.object(pipecut.api, "measure_stages", heavy_last), \
            unittest.mock.patch.object(pipecut.planning.planner, "profile_at", _counted(pipecut.planning.planner.profile_at)):
        kept = pipecut.compile(model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4, schedule="zbv",
                               measure=pipecut.MeasureOptions(calibrate=False, calibration_steps=1, link=FAST),
                               runtime=pipecut.RuntimeOptions(timeout=120))
    out["kept"] = {"loss": kept.step(inputs, target), "grads": pipeline_grads(model, kept),
                   "runs": kept.schedule == plan_schedule(kept.plan), "moved": orders[-1] != plan_schedule(kept.plan),
                   "builds": len(orders)}
    # The planner chooses microbatches and schedule; the link is measured at compile.
    model, inputs, loss_fn, target = mlp.build(batch_size=8, depth=4)
    auto = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches="auto",
        schedule="auto", measure=pipecut.MeasureOptions(calibration_steps=0),
        runtime=pipecut.RuntimeOptions(timeout=120),
    )
    out["auto"] = {"loss": auto.step(inputs, target), "grads": pipeline_grads(model, auto),
                   "plan": auto.plan.to_json()}
    return out


@pytest.mark.timeout(300)
def test_live_calibration_keeps_the_model_and_parity() -> None:
    results = run_ranks(_calibrated, 2, timeout=280)
    for r in results:
        assert r["untouched"] and r["no_grads"]  # BatchNorm statistics and .grad restored
        assert "calibrated on the running pipeline" in r["detail"]
    ref_loss, ref_grads = reference(resnet.build, 4, per_microbatch=True)
    assert_parity(ref_loss, ref_grads, results)
    assert all("calibrated on the running pipeline" in r["rebuilt"]["detail"] for r in results)
    # ... and the moved split is timed again, its prediction made from its own stages' times
    assert all("moved split measured again" in r["rebuilt"]["detail"] for r in results)
    assert_parity(ref_loss, ref_grads, [r["rebuilt"] for r in results])
    # ... or, measured slower than the first split, given up for it (and built again)
    for r in results:
        assert "measured again" not in r["reverted"]["detail"], r["reverted"]["detail"]
        assert "this split kept" in r["reverted"]["detail"] and "calibrated on the running" in r["reverted"]["detail"]
    assert_parity(ref_loss, ref_grads, [r["reverted"] for r in results])
    assert results[0]["link"].measured and results[0]["link"] == results[1]["link"]
    assert results[0]["profiled_on"] == results[1]["profiled_on"] == "cpu"  # rank 0's own device
    for r in results:
        assert r["kept"]["builds"] == 2 and r["kept"]["moved"]  # another order than the kept build's first
        assert r["kept"]["runs"]  # ... and the pipeline runs it
    ref_loss, ref_grads = reference(lambda: mlp.build(batch_size=8, depth=4), 4, False)
    assert_parity(ref_loss, ref_grads, [r["kept"] for r in results])
    plan = pipecut.Plan.from_json(results[0]["auto"]["plan"])
    chosen = [c for c in plan.candidates if c.note == "chosen"]
    assert len(plan.candidates) == 12 and len(chosen) == 1  # M in {2, 4, 8} x four schedules (ZBV too)
    assert (chosen[0].microbatches, chosen[0].schedule) == (plan.microbatches, plan.schedule)
    ref_loss, ref_grads = reference(lambda: mlp.build(batch_size=8, depth=4), plan.microbatches, False)
    assert_parity(ref_loss, ref_grads, [r["auto"] for r in results])
