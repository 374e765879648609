"""Choosing microbatches and schedule: candidates, cost interpolation, the recorded choice."""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from examples import mlp
from pipecut.passes.microbatching import candidate_microbatches, costs_at
from pipecut.plan import Leaf, LeafKind, NodeCost, NodeOp, ScheduleKind


def test_candidates_are_divisors_between_ranks_and_four_per_rank() -> None:
    assert candidate_microbatches(16, 2, ScheduleKind.ONE_F_ONE_B) == (2, 4, 8)
    assert candidate_microbatches(12, 2, ScheduleKind.GPIPE) == (2, 3, 4, 6)
    assert candidate_microbatches(12, 4, ScheduleKind.INTERLEAVED_1F1B) == (4, 12)
    assert candidate_microbatches(3, 4, ScheduleKind.GPIPE) == (3,)  # fewer samples than ranks


def _row(name: str, ms: float, shape: tuple[int, ...]) -> NodeCost:
    leaf = Leaf(kind=LeafKind.TENSOR, shape=shape, dtype="float32")
    return NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target="f", forward_ms=ms, backward_ms=2 * ms,
                    output_bytes=4 * shape[0] * shape[1], leaves=(leaf,), shape=shape)


def test_costs_are_affine_in_the_microbatch_and_only_changing_dims_scale() -> None:
    small = (_row("a", 1.0, (2, 8)), _row("b", 5.0, (3, 8)))
    large = (_row("a", 3.0, (8, 8)), _row("b", 5.0, (3, 8)))
    at4 = costs_at(small, large, 2, 8, 4)
    # a: 1 ms at 2, 3 ms at 8 -> fixed 1/3 ms plus 1/3 ms per sample -> 5/3 ms at 4.
    assert at4[0].forward_ms == pytest.approx(5 / 3) and at4[0].backward_ms == pytest.approx(10 / 3)
    assert at4[0].leaves[0].shape == (4, 8) and at4[0].output_bytes == 2 * small[0].output_bytes
    assert at4[1].forward_ms == 5.0 and at4[1].leaves[0].shape == (3, 8)  # independent of the batch
    with pytest.raises(ValueError, match="different graphs"):
        costs_at(small, large[:1], 2, 8, 4)
    # Saved bytes are affine too; unmeasured on either side stays unmeasured.
    kept = costs_at(tuple(dataclasses.replace(r, saved_bytes=b) for r, b in zip(small, (16, 0))),
                    tuple(dataclasses.replace(r, saved_bytes=b) for r, b in zip(large, (64, 0))), 2, 8, 4)
    assert [r.saved_bytes for r in kept] == [32, 0] and at4[0].saved_bytes is None


def test_auto_picks_the_fastest_predicted_pair_and_records_every_candidate() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=8, depth=4)
    plan = pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches="auto",
                        schedule="auto", calibrate=False, repeats=1, warmup=0)
    pairs = {(c.microbatches, c.schedule) for c in plan.candidates}
    assert pairs == {(m, k) for m in (2, 4, 8) for k in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B,
                                                          ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)}
    chosen = [c for c in plan.candidates if c.note == "chosen"]
    assert len(chosen) == 1 and (chosen[0].microbatches, chosen[0].schedule) == (plan.microbatches, plan.schedule)
    best = min(c.step_ms for c in plan.candidates if c.step_ms is not None)
    assert chosen[0].step_ms <= best * 1.01
    assert pipecut.Plan.from_json(plan.to_json()) == plan  # candidates round-trip
    fixed = pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4,
                         schedule="auto", calibrate=False, repeats=1, warmup=0)
    assert fixed.microbatches == 4 and {c.microbatches for c in fixed.candidates} == {4}
