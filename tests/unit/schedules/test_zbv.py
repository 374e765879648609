"""ZBV: two stages per rank on a V (rank r runs stages r and 2K - 1 - r), backward split in I and
W. The placement has one home (``rank_of``); the order is valid, deadlock-free, keeps no more
microbatches alive than the memory model charges for, and beats the one-stage-per-rank
schedules on balanced costs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecut
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import InputError, PartitionError, PlanError, ScheduleError
from pipecut.ir import DeviceSpec
from pipecut.passes.costs.stages import inflight_microbatches, plan_costs, stage_costs
from pipecut.passes.partition.solve import partition_costs
from pipecut.report.gantt import predicted_spans
from pipecut.runtime.comm.p2p import Wiring, receives, sends
from pipecut.schedules.format import (
    ActionKind,
    Placement,
    format_schedule,
    rank_of,
    stages_on,
    validate,
)
from pipecut.schedules.simulate import StageCosts, simulate
from pipecut.schedules.standard import build, unit_costs
from pipecut.schedules.zbv import zbv, zbv_inflight
from tests.unit.tiny import mlp_plan

ZBV = ScheduleKind.ZBV


def test_rank_of_is_a_loop_or_a_v() -> None:
    assert [rank_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [rank_of(s, 4, Placement.V) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stages_on(r, 3, 6, Placement.V) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert [stages_on(r, 2, 6) for r in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert ZBV.placement is Placement.V and ScheduleKind.INTERLEAVED_1F1B.placement is Placement.LOOP


def test_validate_checks_the_placement() -> None:
    schedule = build(ZBV, 2, 2)
    validate(schedule, 2, Placement.V)
    with pytest.raises(ScheduleError, match=r"rank 0 holds action 3F0 of stage 3, which runs on rank 1 \(loop"):
        validate(schedule, 2)


@settings(max_examples=120, deadline=None)
@given(k=st.integers(1, 5), m=st.integers(1, 10), data=st.data())
def test_any_costs_give_a_valid_order_within_the_memory_model(k: int, m: int, data: st.DataObject) -> None:
    n = 2 * k
    times = st.floats(0.0, 5.0, allow_nan=False)
    f = data.draw(st.lists(times, min_size=n, max_size=n))
    w = data.draw(st.lists(times, min_size=n, max_size=n))
    b = [wi + x for wi, x in zip(w, data.draw(st.lists(times, min_size=n, max_size=n)))]
    links = data.draw(st.lists(times, min_size=n - 1, max_size=n - 1))
    schedule = zbv(k, m, f, b, w, links, links)
    validate(schedule, m, Placement.V)
    assert all(a.kind is not ActionKind.BACKWARD for rank in schedule for a in rank)
    assert simulate(schedule, f, b, links, links, w) >= 0  # raises on a deadlock
    limit = inflight_microbatches(ZBV, n, m)
    assert zbv_inflight(n, m) == limit  # what the plan's memory charges for
    for rank in schedule:
        alive = dict.fromkeys(range(n), 0)
        for a in rank:
            alive[a.stage] += {ActionKind.FORWARD: 1, ActionKind.WEIGHT: -1}.get(a.kind, 0)
            assert alive[a.stage] <= limit[a.stage], (a, format_schedule(schedule))


@pytest.mark.parametrize(("k", "m", "want", "zero_bubble", "one_f_one_b"), [(2, 8, 49, 52, 54), (4, 8, 51, 60, 66)])
def test_balanced_stages_beat_one_stage_per_rank(k: int, m: int, want: float, zero_bubble: float,
                                                 one_f_one_b: float) -> None:
    """F = I = W = 1 per half stage against the same work cut into K stages (F = I = W = 2)."""
    c = unit_costs(2 * k)
    assert simulate(build(ZBV, k, m), c.forward, c.backward, weight_ms=c.weight) == want
    assert simulate(build(ScheduleKind.ZERO_BUBBLE, k, m), [2] * k, [4] * k, weight_ms=[2] * k) == zero_bubble
    assert simulate(build(ScheduleKind.ONE_F_ONE_B, k, m), [2] * k, [4] * k) == one_f_one_b
    assert want < zero_bubble < one_f_one_b and want - 6 * m <= k  # no bubble at all: 6M


def test_build_runs_two_stages_per_rank_and_refuses_other_counts() -> None:
    assert build(ZBV, 3, 4) == build(ZBV, 3, 4, 2) == build(ZBV, 3, 4, 2, unit_costs(6))
    with pytest.raises(ScheduleError, match="zbv runs 2 stages per rank, not 3"):
        build(ZBV, 3, 4, 3)
    skewed = dataclasses.replace(unit_costs(4), forward=(1.0, 1.0, 1.0, 4.0))
    assert build(ZBV, 2, 6, costs=skewed) != build(ZBV, 2, 6)  # list scheduled on the costs


def test_the_middle_of_the_v_is_one_rank() -> None:
    w = Wiring.uniform(3, 6, placement=Placement.V)
    assert [t.peer for t in sends(build(ZBV, 3, 1)[2][0], w)] == [2]  # 2F0 -> 3F0 on rank 2 itself
    fwd = next(a for a in build(ZBV, 3, 1)[0] if a.kind is ActionKind.FORWARD and a.stage == 5)
    assert [t.peer for t in receives(fwd, w)] == [1]  # the last stage, on rank 0, hears from rank 1


def test_a_plan_lays_its_stages_on_a_v() -> None:
    plan = mlp_plan(2, 4, "zbv")
    assert (plan.num_stages, plan.num_ranks, plan.stages_per_rank) == (4, 2, 2)
    assert [plan.rank_of(s) for s in range(4)] == [0, 1, 1, 0] and plan.stages_on(0) == (0, 3)
    assert {s.rank for s in predicted_spans(plan) if s.action.startswith("3")} == {0}
    with pytest.raises(PlanError, match="schedule zbv runs 2 stages per rank, the plan has 1"):
        dataclasses.replace(plan, stages=plan.stages[:2], devices=plan.devices[:2], stages_per_rank=1)
    with pytest.raises(InputError, match="stages_per_rank=3: zbv runs 2 stages per rank"):
        partition_costs(plan.nodes, devices=2, microbatches=4, batch_size=8, schedule="zbv", stages_per_rank=3)


def test_costs_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ScheduleError, match="zbv on 2 ranks runs 4 stages; got costs for 2"):
        zbv(2, 4, [1, 1], [2, 2], [1, 1])
    costs = StageCosts(forward=(1.0,) * 4, backward=(2.0,) * 4, weight=(1.0,) * 4,
                       forward_link=(0.0,) * 3, backward_link=(0.0,) * 3)
    assert build(ZBV, 2, 4, costs=costs) == build(ZBV, 2, 4)


def test_the_turn_of_the_v_costs_no_transfer() -> None:
    plan = mlp_plan(2, 4, "zbv")
    costs = plan_costs(plan)
    assert costs.forward_link[1] == costs.backward_link[1] == 0.0  # stages 1 and 2: both on rank 1
    assert costs.forward_link[0] > 0 and costs.forward_link[2] > 0  # the other cuts cross ranks
    loop = stage_costs(plan.stages, plan.nodes, plan.link)  # without the ranks: every cut is sent
    assert loop.forward_link[1] > 0


def test_two_stages_on_a_rank_must_fit_its_memory_together() -> None:
    plan = mlp_plan(2, 4, "zbv")
    need = [sum(plan.stages[s].peak_memory_bytes for s in plan.stages_on(r)) for r in range(2)]
    biggest = max(st.peak_memory_bytes for st in plan.stages)
    room = max(biggest, min(need))  # every stage fits alone, but not both of the rank needing more
    devices = [DeviceSpec(name="cpu", memory_bytes=room)] * 2
    assert max(need) > room
    with pytest.raises(PartitionError, match=r"rank \d \(cpu\) runs stages \[\d, \d\] of the zbv schedule"):
        partition_costs(
            plan.nodes, devices=devices, microbatches=4, batch_size=8, schedule="zbv",
            partition=pipecut.PartitionOptions(recompute="none"),
        )
    fits = [DeviceSpec(name="cpu", memory_bytes=max(need))] * 2
    assert partition_costs(
        plan.nodes, devices=fits, microbatches=4, batch_size=8, schedule="zbv",
        partition=pipecut.PartitionOptions(recompute="none"),
    ).num_stages == 4


def test_data_parallel_runs_the_split_backward() -> None:
    """DDP and FSDP2 reduce after the last weight pass (tests/multiprocess/test_zero_bubble_replicas.py):
    nothing is refused on a torch in the supported range."""
    from pipecut.core.kinds import DataParallelKind
    from pipecut.runtime.grads.data_parallel import check_supported

    for kind in (DataParallelKind.DDP, DataParallelKind.FSDP):
        for tensor_parallel in (False, True):
            check_supported(mlp_plan(2, 4, "zbv"), kind, tensor_parallel)
