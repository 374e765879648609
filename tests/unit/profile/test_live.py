"""Recalibration from running stage times: re-partitions, or keeps a split it is told to keep."""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from examples import mlp
from pipecut.profile.live import LiveTimes, fit_latency, recalibrate


def test_recalibrate_moves_the_split_unless_told_to_keep_it() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=4, depth=6)
    plan = pipecut.plan(  # counted costs: the same plan under any load (a timed one failed once under load)
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2, schedule="1f1b",
        measure=pipecut.MeasureOptions(estimate="A100-80GB", calibrate=False),
    )
    # Stage 0 ran four times slower than its costs said: a free re-plan moves work off it.
    times = [(4 * plan.stages[0].forward_ms, 4 * plan.stages[0].backward_ms),
             (plan.stages[1].forward_ms, plan.stages[1].backward_ms)]
    moved = recalibrate(plan, times)
    assert len(moved.stages[0].nodes) < len(plan.stages[0].nodes)
    kept = recalibrate(plan, times, keep_split=True)
    assert kept.runs_like(plan) and "measured again" not in kept.solver.detail
    again = recalibrate(plan, times, moved=True)  # a moved split, timed on its own build
    assert again.runs_like(plan) and "the moved split measured again" in again.solver.detail
    # The kept split's prediction is made from the measured stage times.
    assert kept.stages[0].forward_ms == pytest.approx(times[0][0])
    assert kept.stages[0].backward_ms == pytest.approx(times[0][1])
    assert kept.predicted.step_ms > plan.predicted.step_ms


def test_the_message_latency_is_fitted_to_the_measured_step() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=4, depth=6)
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2, schedule="1f1b",
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
    )
    plan = dataclasses.replace(plan, link=dataclasses.replace(plan.link, latency_ms=0.0))
    assert fit_latency(plan, plan.nodes, 0.5 * plan.predicted.step_ms).latency_ms == 0.0  # no lower
    slower = plan.predicted.step_ms + 5.0
    link = fit_latency(plan, plan.nodes, slower)
    assert link.latency_ms > 0 and link.measured
    times = LiveTimes(stages=tuple((s.forward_ms, s.backward_ms) for s in plan.stages), step_ms=slower)
    again = recalibrate(plan, times, keep_split=True)
    assert again.link == link and "latency fitted" in again.solver.detail
    assert again.predicted.step_ms == pytest.approx(slower, rel=1e-3)
    # Measured again, faster: the latency comes down.
    faster = LiveTimes(stages=times.stages, step_ms=plan.predicted.step_ms + 1.0)
    assert 0 < recalibrate(again, faster, keep_split=True).link.latency_ms < link.latency_ms
