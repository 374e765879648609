"""pipecut.core.shapes: which microbatch shapes a plan accepts, and how a batch splits."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from pipecut.core.kinds import ScheduleKind
from pipecut.core.shapes import (
    AutocastState,
    accepted,
    check_microbatch,
    describe_accepted,
    loss_weights,
    microbatch_sizes,
    planned_signature,
    signature,
)
from pipecut.errors import InputError
from pipecut.ir import InputShape
from tests.unit.tiny import mlp_plan

OFF = AutocastState("", False, "")


def test_planned_signature_is_the_signature_of_a_planned_microbatch():
    plan = mlp_plan()  # batch 8 in 4 microbatches of 2 x 32
    assert planned_signature(plan) == signature([torch.zeros(2, 32)], OFF)
    assert planned_signature(plan) != signature([torch.zeros(1, 32)], OFF)
    assert signature([3], OFF) == signature([3], OFF) != signature([4], OFF)
    assert str(AutocastState("cuda", True, "bfloat16")) == "autocast cuda bfloat16"
    assert str(OFF) == "no autocast" and AutocastState.current("cpu") == OFF


def test_accepted_shapes_and_their_description():
    plan = mlp_plan()
    assert accepted(plan) == plan.accepts
    assert describe_accepted(accepted(plan)) == "x: float32 [1..2, 32]"
    old = dataclasses.replace(plan, accepts=())  # plans made before accepts: the planned shapes
    assert accepted(old) == (InputShape(name="x", dtype="float32", min_shape=(2, 32), max_shape=(2, 32)),)


def test_check_microbatch_refuses_what_the_plan_was_not_made_for():
    plan = mlp_plan()
    check_microbatch(plan, ["x"], [torch.zeros(1, 32)])
    with pytest.raises(InputError, match=r"input 'x' has microbatch shape \(3, 32\)\. This plan accepts "
                                         r"microbatches of x: float32 \[1\.\.2, 32\] \(batch up to 8 in 4"):
        check_microbatch(plan, ["x"], [torch.zeros(3, 32)])
    with pytest.raises(InputError, match="input 'x' has dtype float64, the plan has float32"):
        check_microbatch(plan, ["x"], [torch.zeros(2, 32, dtype=torch.float64)])
    with pytest.raises(InputError, match="input 'x' is int, the plan has a tensor"):
        check_microbatch(plan, ["x"], [3])


def test_symbols_tie_dimensions_of_different_inputs():
    plan = dataclasses.replace(mlp_plan(), accepts=(
        InputShape(name="ids", dtype="int64", min_shape=(1, 1), max_shape=(2, 16), symbols=("", "s")),
        InputShape(name="mask", dtype="int64", min_shape=(1, 1), max_shape=(2, 16), symbols=("", "s")),
    ))
    ids = torch.zeros(2, 8, dtype=torch.int64)
    check_microbatch(plan, ["ids", "mask"], [ids, ids])
    with pytest.raises(InputError, match="input 'mask' has size 9 where 'ids' has 8; the captured graph assumes they are equal"):
        check_microbatch(plan, ["ids", "mask"], [ids, torch.zeros(2, 9, dtype=torch.int64)])


def test_microbatch_sizes_for_full_and_smaller_batches():
    plan = mlp_plan()
    assert microbatch_sizes(8, plan) == (2, 2, 2, 2)
    assert microbatch_sizes(7, plan) == (2, 2, 2, 1)
    assert microbatch_sizes(3, plan) == (1, 1, 1)  # fewer samples than microbatches
    with pytest.raises(InputError, match="the batch has 9 samples, more than the planned 8"):
        microbatch_sizes(9, plan)
    interleaved = dataclasses.replace(plan, schedule=ScheduleKind.INTERLEAVED_1F1B)
    # One stage per rank is plain 1F1B: 2 microbatches on 3 ranks run (with several stages per
    # rank, a multiple of the ranks is needed: tests/unit/passes/rewrite/test_propagate.py).
    assert microbatch_sizes(2, interleaved) == (1, 1)


def test_loss_weights_are_exact_fractions_summing_to_one():
    assert loss_weights([2, 2, 2, 1]) == (Fraction(2, 7),) * 3 + (Fraction(1, 7),)
    assert sum(loss_weights([3, 5, 1])) == 1
