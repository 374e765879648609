"""pipecut.assemble.resolve: wire specs and schedules for microbatches other than the planned one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipecut.assemble.resolve import WireSpecs, schedules
from pipecut.core.kinds import ScheduleKind
from pipecut.core.shapes import AutocastState, signature
from pipecut.errors import InputError
from pipecut.passes.costs.stages import plan_schedule
from pipecut.schedules.format import validate
from tests.unit.tiny import mlp_captured, mlp_plan

OFF = AutocastState("", False, "")


def test_the_planned_signature_uses_the_plans_own_rows():
    plan = mlp_plan()
    specs = WireSpecs(mlp_captured().gm, plan, torch.device("cpu"))
    x = torch.zeros(2, 32)
    assert specs(signature([x], OFF), [x]) is None


def test_a_smaller_microbatch_gets_propagated_specs_of_every_cut_value():
    plan = mlp_plan()
    specs = WireSpecs(mlp_captured().gm, plan, torch.device("cpu"))
    x = torch.zeros(1, 32)
    got = specs(signature([x], OFF), [x])
    cut = {n for s in plan.stages for n in (*s.inputs, *s.outputs)}
    assert got is not None and set(got) == cut
    for name, row in got.items():
        planned = plan.node(name).leaves[0]
        assert row.leaves[0].shape == (1, *planned.shape[1:])
    assert specs(signature([x], OFF), [x]) is got  # cached


def test_a_microbatch_that_cannot_run_is_refused_with_the_accepted_shapes():
    specs = WireSpecs(mlp_captured().gm, mlp_plan(), torch.device("cpu"))
    x = torch.zeros(2, 31)
    with pytest.raises(InputError, match=r"do not run through the captured graph: .*This plan accepts x: float32 \[1\.\.2, 32\]"):
        specs(signature([x], OFF), [x])


def test_schedules_per_microbatch_count():
    plan = mlp_plan()
    schedule_for = schedules(plan)
    assert schedule_for(plan.microbatches) == plan_schedule(plan)
    assert schedule_for(2) is schedule_for(2)
    validate(schedule_for(2), 2)
    assert all(len(rank) == 4 for rank in schedule_for(2))
    interleaved = dataclasses.replace(mlp_plan(4), schedule=ScheduleKind.INTERLEAVED_1F1B, stages_per_rank=2)
    assert interleaved.num_ranks == 2
    validate(schedules(interleaved)(2), 2)
    with pytest.raises(InputError, match=r"a batch that splits into 3 microbatches cannot run the interleaved-1f1b "
                                         "schedule: .*; pass a batch of at least 4 samples or drop the last batch"):
        schedules(interleaved)(3)


def test_a_schedule_the_planner_chose_is_named_as_its_choice() -> None:
    """The schedule named in a refusal is said to be "auto"'s choice where the plan records that
    it was not asked for by name (the asked case is above)."""
    plan = mlp_plan(4)
    assert plan.options is not None
    interleaved = dataclasses.replace(plan, schedule=ScheduleKind.INTERLEAVED_1F1B, stages_per_rank=2,
                                      options=dataclasses.replace(plan.options, schedule="auto"))
    with pytest.raises(InputError, match=r"cannot run the interleaved-1f1b schedule \(chosen by schedule='auto'\): .*; "
                                         "pass a batch of at least 4 samples"):
        schedules(interleaved)(3)
