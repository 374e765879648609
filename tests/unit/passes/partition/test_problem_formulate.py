"""pipecut.passes.partition.problem: a plan's cost table as the partitioning problem."""

from __future__ import annotations

import pytest

from pipecut.cluster import Link
from pipecut.core.kinds import DataParallelKind, NodeOp, ScheduleKind
from pipecut.ir import DeviceSpec, NodeCost
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import inflight_microbatches, state_bytes
from pipecut.passes.partition.problem import evaluate, formulate, unit_fixed_bytes
from tests.unit.tiny import mlp_plan


def test_units_costs_and_devices_come_from_the_cost_table():
    plan = mlp_plan()
    devices = (DeviceSpec(name="a", memory_bytes=10**9, speed=1.0), DeviceSpec(name="b", speed=2.0))
    f = formulate(plan.nodes, devices=devices, link=plan.link, schedule=ScheduleKind.GPIPE,
                  microbatches=4, recompute=True)
    p = f.problem
    by_name = {n.name: n for n in plan.nodes}
    assert p.names == f.live.units and len(f.modules) == p.units
    assert all(by_name[u].op is not NodeOp.PLACEHOLDER for u in p.names)
    assert p.compute_ms == tuple(by_name[u].forward_ms + by_name[u].backward_ms for u in p.names)
    assert p.activation_bytes == tuple(by_name[u].kept_bytes for u in p.names)  # measured, else output
    assert p.speeds == (1.0, 2.0) and p.capacities == (10**9, None) and p.recompute
    assert p.inflight == tuple(inflight_microbatches(ScheduleKind.GPIPE, 2, 4)) == (4, 4)
    assert sum(p.fixed_bytes) >= state_bytes(sum(n.param_bytes for n in plan.nodes))
    assert evaluate(p, (0, p.units // 2, p.units)).fits


def test_unit_fixed_bytes_counts_the_attributes_it_reads_and_shards_with_fsdp():
    w = NodeCost(name="w", op=NodeOp.GET_ATTR, target="w", param_bytes=400)
    mm = NodeCost(name="mm", op=NodeOp.CALL_FUNCTION, target="mm", inputs=("x", "w"), param_bytes=0)
    x = NodeCost(name="x", op=NodeOp.PLACEHOLDER, target="x")
    by_name = {n.name: n for n in (w, mm, x)}
    assert unit_fixed_bytes(mm, by_name) == state_bytes(400)
    fsdp = DataParallelOptions(kind=DataParallelKind.FSDP, replicas=4)
    assert unit_fixed_bytes(mm, by_name, fsdp) == state_bytes(400, fsdp) < state_bytes(400)


def test_a_slow_link_makes_cuts_cost_time():
    plan = mlp_plan()
    fast = formulate(plan.nodes, devices=(DeviceSpec(name="a"),) * 2, link=Link(bandwidth_bytes_per_ms=1e12),
                     schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4, recompute=False).problem
    slow = formulate(plan.nodes, devices=(DeviceSpec(name="a"),) * 2, link=Link(bandwidth_bytes_per_ms=1.0),
                     schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4, recompute=False).problem
    b = fast.allowed_cuts()[0]
    assert slow.boundary_ms[b] > fast.boundary_ms[b] * 1000
    assert fast.boundary_ms[b] == pytest.approx(0.0, abs=1e-3)
