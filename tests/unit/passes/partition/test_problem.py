"""pipecut.passes.partition.problem: the partitioning problem as numbers, and its exact cost model."""

from __future__ import annotations

import math

import pytest

from pipecut.core.kinds import Recompute
from pipecut.passes.partition.problem import Problem, best_stage, evaluate, stage_options


def problem(**overrides) -> Problem:
    base = dict(
        compute_ms=(3.0, 2.0, 4.0, 1.0), forward_ms=(1.0, 1.0, 2.0, 0.5),
        boundary_ms=(0.0, 0.5, math.inf, 0.25, 0.0), input_bytes=(0, 10, 20, 30, 0),
        fixed_bytes=(100, 0, 50, 0), activation_bytes=(5, 6, 7, 8),
        speeds=(1.0, 2.0), capacities=(None, None), inflight=(2, 1),
    )
    return Problem(**(base | overrides))


def test_stage_time_and_memory_follow_the_documented_model():
    p = problem(recompute=True)
    plain, recompute = stage_options(p, 1, 1, 4)  # units 1..3 on the speed-2 device
    assert plain.time_ms == pytest.approx((2 + 4 + 1) / 2 + 0.5 + 0.0)
    assert plain.memory_bytes == 50 + 1 * (10 + 6 + 7 + 8)
    assert recompute.recompute is Recompute.FULL
    assert recompute.time_ms == pytest.approx(plain.time_ms + (1 + 2 + 0.5) / 2)
    assert recompute.memory_bytes == 50 + 1 * 10
    assert len(stage_options(problem(), 1, 1, 4)) == 1  # recompute not allowed


def test_best_stage_picks_the_fastest_that_fits_else_the_smallest():
    p = problem(recompute=True, capacities=(None, 70))
    assert best_stage(p, 1, 1, 4).recompute is Recompute.FULL  # 81 bytes plain does not fit
    tight = problem(recompute=True, capacities=(None, 10))
    chosen = best_stage(tight, 1, 1, 4)
    assert not chosen.fits and chosen.recompute is Recompute.FULL  # least memory
    assert best_stage(problem(recompute=True), 1, 1, 4).recompute is Recompute.NONE


def test_selective_recompute_frees_the_cheapest_blocks_first_and_only_when_needed():
    # Stage 1 holds units 1..3 = blocks [1, 3) and [3, 4). Recomputing [1, 3) frees 6 + 7 bytes
    # for 1 + 2 ms of forward; [3, 4) would free its 8 bytes but keep its 30-byte input: nothing.
    p = problem(recompute=True, block_cuts=(3,), capacities=(None, 70))  # plain needs 81
    plain, some, whole = stage_options(p, 1, 1, 4)
    assert some.recompute is Recompute.SELECTIVE and some.recomputed == ((1, 3),) and some.fits
    assert some.memory_bytes == 81 - 13
    assert some.time_ms == pytest.approx(plain.time_ms + (1 + 2) / 2)
    assert whole.recompute is Recompute.FULL and whole.time_ms > some.time_ms
    assert best_stage(p, 1, 1, 4) == some
    # 60 bytes: the blocks cannot free enough, only the whole stage can.
    tight = problem(recompute=True, block_cuts=(3,), capacities=(None, 60))
    assert [o.recompute for o in stage_options(tight, 1, 1, 4)] == [Recompute.NONE, Recompute.FULL]
    # Fits without recompute, or no blocks: no selective option.
    assert Recompute.SELECTIVE not in {o.recompute for o in stage_options(problem(recompute=True, block_cuts=(3,)), 1, 1, 4)}
    assert Recompute.SELECTIVE not in {o.recompute for o in stage_options(problem(recompute=True, capacities=(None, 70)), 1, 1, 4)}
    # Evaluating a split with SELECTIVE asked for gives its blocks.
    assert evaluate(p, (0, 1, 4), [Recompute.NONE, Recompute.SELECTIVE]).stages[1].recomputed == ((1, 3),)


def test_evaluate_scores_a_split_and_refuses_bad_bounds():
    p = problem()
    e = evaluate(p, (0, 1, 4))
    assert e.stage_ms == pytest.approx((3.0 + 0.5, 7.0 / 2 + 0.5))
    assert e.bottleneck_ms == pytest.approx(4.0) and e.fits
    assert evaluate(p, (0, 2, 4)).bottleneck_ms == math.inf  # a value that cannot cross
    assert e.recompute == (Recompute.NONE, Recompute.NONE)
    with pytest.raises(ValueError, match=r"bounds \(0, 4\) must run from 0 to 4 in 2 stages"):
        evaluate(p, (0, 4))
    with pytest.raises(ValueError, match="must increase strictly"):
        evaluate(p, (0, 0, 4))
    with pytest.raises(ValueError, match="stage 0: recompute full is not allowed"):
        evaluate(p, (0, 1, 4), (Recompute.FULL, Recompute.NONE))


def test_properties_and_array_checks():
    p = problem()
    assert p.units == 4 and p.stages == 2
    assert p.allowed_cuts() == (1, 3)  # a value that cannot cross at 2
    assert p.constrained and not problem(speeds=(1.0, 1.0)).constrained  # unequal speeds
    assert problem(speeds=(1.0, 1.0), capacities=(None, 5)).constrained
    assert problem(speeds=(1.0, 1.0), recompute=True).constrained
    with pytest.raises(ValueError, match="4 units needs 4 entries in every per-unit array"):
        problem(forward_ms=(1.0,))
    with pytest.raises(ValueError, match="needs 5 entries per cut array"):
        problem(input_bytes=(0,))
    with pytest.raises(ValueError, match="2 stages need 2 capacities and 2 inflight"):
        problem(inflight=(1,))


def test_a_stage_without_a_parameter_does_not_fit_when_asked():
    p = problem(speeds=(1.0, 1.0), holds_params=(True, False, False, False))
    assert not evaluate(p, (0, 1, 4)).fits
    assert evaluate(problem(speeds=(1.0, 1.0), holds_params=(True, False, False, True)), (0, 1, 4)).fits
