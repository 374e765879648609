"""Choosing microbatches and schedule: candidates, cost interpolation, the recorded choice."""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from examples import mlp
from pipecut.core.kinds import LeafKind, NodeOp, ScheduleKind
from pipecut.ir import Leaf, NodeCost
from pipecut.passes.costs.microbatching import candidate_microbatches, costs_at


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
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches="auto", schedule="auto",
        measure=pipecut.MeasureOptions(calibrate=False, repeats=1, warmup=0),
    )
    pairs = {(c.microbatches, c.schedule) for c in plan.candidates}
    assert pairs == {(m, k) for m in (2, 4, 8) for k in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B,
                                                          ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)}
    chosen = [c for c in plan.candidates if c.note == "chosen"]
    assert len(chosen) == 1 and (chosen[0].microbatches, chosen[0].schedule) == (plan.microbatches, plan.schedule)
    best = min(c.step_ms for c in plan.candidates if c.step_ms is not None)
    assert chosen[0].step_ms <= best * 1.01
    assert pipecut.Plan.from_json(plan.to_json()) == plan  # candidates round-trip
    fixed = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4, schedule="auto",
        measure=pipecut.MeasureOptions(calibrate=False, repeats=1, warmup=0),
    )
    assert fixed.microbatches == 4 and {c.microbatches for c in fixed.candidates} == {4}


def test_an_interpolated_table_takes_the_values_of_its_own_size() -> None:
    """Regression: compile() with microbatches left out chose M = 4 (microbatches of 4) for the
    GPT example after profiling sizes 1 and 8; the interpolated table kept size 1's Python
    numbers, and stage 0 failed at run time:
    ``PipelineRuntimeError: stage 0: value size_4 is 4, the wire spec fixed it to 2``."""
    from examples import gpt
    from pipecut.capture import capture
    from pipecut.capture.modes import describe_graph
    from pipecut.core.batching import first_microbatch
    from pipecut.passes.costs.microbatching import with_structure

    model, inputs, _, _ = gpt.build(8, vocab=32, dim=16, heads=2, layers=1, seq=8)
    captured = capture(model, first_microbatch(inputs, 8)[1])  # symbolic_trace: any size

    def at(size: int) -> tuple:
        return describe_graph(captured, captured.flatten_inputs(first_microbatch(inputs, 8 // size)[1]))

    lo, hi, mid = at(1), at(8), at(4)
    numbers = [n.name for n in mid if any(x.kind is LeafKind.CONSTANT and (x.value or {}).get("t") == "int"
                                          for x in n.leaves)]
    assert numbers, "the GPT example sends sizes as Python numbers"
    interpolated = costs_at(lo, hi, 1, 8, 4)
    assert [n.leaves for n in interpolated if n.name in numbers] != [n.leaves for n in mid if n.name in numbers]
    fixed = with_structure(interpolated, mid)
    assert [n.leaves for n in fixed] == [n.leaves for n in mid]
    assert [(n.forward_ms, n.output_bytes) for n in fixed] == [(n.forward_ms, n.output_bytes) for n in interpolated]
