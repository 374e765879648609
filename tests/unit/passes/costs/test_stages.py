"""pipecut.passes.costs.stages: memory of a stage's state, in-flight microbatches, schedule and prediction."""

from __future__ import annotations

import pytest

from pipecut.cluster import Link
from pipecut.core.kinds import DataParallelKind, NodeOp, ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.ir import NodeCost
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import (
    OPTIMIZER_STATE_FACTOR,
    inflight_microbatches,
    plan_schedule,
    predict,
    predicted_timeline,
    replica_sync_ms,
    ring_allreduce_ms,
    stage_costs,
    stage_params,
    state_bytes,
)
from pipecut.schedules.standard import build
from tests.unit.tiny import mlp_plan


def test_state_bytes_replicated_and_sharded():
    assert state_bytes(100) == 100 * (2 + OPTIMIZER_STATE_FACTOR)
    assert state_bytes(100, DataParallelOptions(kind=DataParallelKind.DDP, replicas=4)) == state_bytes(100)
    fsdp = DataParallelOptions(kind=DataParallelKind.FSDP, replicas=4)
    assert state_bytes(100, fsdp) == 200 + 100 * (2 + OPTIMIZER_STATE_FACTOR) // 4


def test_zero1_shards_only_the_optimizer_state():
    """Parameters and gradients whole, AdamW's moments a D-th (rounded up): less than DDP, and
    under pipelining less than FSDP too, whose gathered copies are whole for the whole step."""
    zero = DataParallelOptions(kind=DataParallelKind.ZERO1, replicas=3)
    assert state_bytes(100, zero) == 200 + 67  # ceil(200 / 3)
    fsdp = DataParallelOptions(kind=DataParallelKind.FSDP, replicas=3)
    assert state_bytes(100, zero) < state_bytes(100, fsdp) < state_bytes(100)


def test_replica_sync_of_each_engine():
    """DDP's all-reduce, FSDP's gather and reduce-scatter (the same ring traffic), and ZeRO-1's
    all-reduce plus the broadcast of the updated parameters (half an all-reduce more)."""
    link = Link(bandwidth_bytes_per_ms=10.0, latency_ms=0.5)
    ddp = ring_allreduce_ms(400, 4, link)
    assert ddp == pytest.approx(6 * 0.5 + 6 / 4 * 40)
    assert replica_sync_ms(400, 4, link) == replica_sync_ms(400, 4, link, DataParallelKind.FSDP) == ddp
    assert replica_sync_ms(400, 4, link, DataParallelKind.ZERO1) == pytest.approx(1.5 * ddp)
    assert replica_sync_ms(400, 1, link, DataParallelKind.ZERO1) == 0.0


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches(ScheduleKind.GPIPE, 3, 8) == [8, 8, 8]
    assert inflight_microbatches(ScheduleKind.ONE_F_ONE_B, 3, 8) == [3, 2, 1]
    assert inflight_microbatches(ScheduleKind.ONE_F_ONE_B, 4, 2) == [2, 2, 2, 1]


def test_stage_params_count_each_source_once():
    w = NodeCost(name="w", op=NodeOp.GET_ATTR, target="w", param_bytes=40, parameters=("w",))
    a = NodeCost(name="a", op=NodeOp.CALL_FUNCTION, target="mul", inputs=("w",))
    b = NodeCost(name="b", op=NodeOp.CALL_FUNCTION, target="add", inputs=("w",))
    fc = NodeCost(name="fc", op=NodeOp.CALL_MODULE, target="fc", param_bytes=8, parameters=("fc.weight",))
    by_name = {n.name: n for n in (w, a, b, fc)}
    assert stage_params([a, b, fc], by_name) == (("w", "fc.weight"), 48)
    assert stage_params([], by_name) == ((), 0)


def test_the_plans_prediction_is_reproduced_from_its_own_data():
    plan = mlp_plan()
    predicted = predict(plan.stages, plan.microbatches, plan.nodes, plan.schedule, plan.link)
    assert predicted.step_ms == pytest.approx(plan.predicted.step_ms)
    assert predicted.bottleneck_stage == plan.predicted.bottleneck_stage
    assert 0 <= predicted.bubble_fraction < 1
    schedule = plan_schedule(plan)
    assert len(schedule) == plan.num_ranks
    assert all(len(actions) == 2 * plan.microbatches for actions in schedule)
    timeline = predicted_timeline(plan)
    assert max(end for _, _, end in timeline) == pytest.approx(plan.predicted.step_ms)


def test_stage_costs_and_the_zero_bubble_constraint():
    plan = mlp_plan()
    costs = stage_costs(plan.stages, plan.nodes, plan.link)
    assert costs.forward == tuple(s.forward_ms for s in plan.stages)
    assert len(costs.forward_link) == len(costs.backward_link) == plan.num_stages - 1
    assert all(x > 0 for x in costs.forward_link)  # the cut activations take time to send
    with pytest.raises(ScheduleError, match="zero-bubble runs one stage per rank"):
        build(ScheduleKind.ZERO_BUBBLE, 1, 4, plan.num_stages, costs)


def test_data_parallel_adds_each_ranks_gradient_all_reduce():
    from pipecut.options import DataParallelOptions
    from pipecut.passes.costs.stages import ring_allreduce_ms

    plan = mlp_plan()
    alone = predict(plan.stages, plan.microbatches, plan.nodes, plan.schedule, plan.link)
    dp = DataParallelOptions(kind=DataParallelKind.DDP, replicas=4)
    replicated = predict(plan.stages, plan.microbatches, plan.nodes, plan.schedule, plan.link,
                         data_parallel=dp)
    slowest_reduce = max(ring_allreduce_ms(s.param_bytes, 4, plan.link) for s in plan.stages)
    assert slowest_reduce > 0
    assert alone.step_ms < replicated.step_ms <= alone.step_ms + slowest_reduce + 1e-9
    one = predict(plan.stages, plan.microbatches, plan.nodes, plan.schedule, plan.link,
                  data_parallel=DataParallelOptions(kind=DataParallelKind.DDP, replicas=1))
    assert one.step_ms == alone.step_ms  # one replica reduces nothing


def test_a_stage_no_gradient_leaves_does_all_its_backward_as_weight_work():
    # The first stage's inputs are data: a split backward's I has no input gradient to make
    # there (measured on the GPT demo under zero-bubble: I 1.1 ms, W 102 ms per microbatch).
    plan = mlp_plan(schedule="zero-bubble")
    first, *later = plan.stages
    assert first.weight_ms == pytest.approx(first.backward_ms)
    assert all(0 < s.weight_ms < s.backward_ms for s in later)


def test_a_recomputing_stage_under_a_split_backward_prices_its_weight_pass():
    # The split backward recomputes once, in the input pass, and keeps what the weight pass
    # reads (pipecut.runtime.execution.held_recompute): W is the weights' share of the
    # backward, I the rest plus the recomputed forward (it was priced as W = 0, all in I).
    from pipecut.core.kinds import Recompute
    from pipecut.passes.costs.stages import build_stages
    from pipecut.passes.partition.chain import liveness

    plan = mlp_plan(schedule="zero-bubble")
    live = liveness(plan.nodes)
    bounds = [live.index[s.nodes[0]] for s in plan.stages] + [len(live.units)]

    def stages(recompute: Recompute) -> tuple:
        return build_stages(plan.nodes, live, bounds, devices=plan.devices, link=plan.link, schedule=plan.schedule,
                            microbatches=plan.microbatches, recompute=[recompute] * len(plan.stages)).stages

    for plain, full in zip(stages(Recompute.NONE)[1:], stages(Recompute.FULL)[1:]):
        assert full.weight_ms == pytest.approx(plain.weight_ms) and 0 < full.weight_ms < full.backward_ms
        assert full.backward_ms == pytest.approx(plain.backward_ms + plain.forward_ms)
