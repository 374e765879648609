"""Data parallelism without processes: which backward reduces, and the planner's memory model."""

from __future__ import annotations

import pytest

import pipecut
from benchmarks.synthetic import transformer_costs
from pipecut.core.kinds import DataParallelKind, Partitioner, ScheduleKind
from pipecut.errors import InputError, PartitionError
from pipecut.ir import DeviceSpec
from pipecut.parallel import DataParallel, as_data_parallel
from pipecut.passes.costs.stages import OPTIMIZER_STATE_FACTOR, state_bytes
from pipecut.passes.partition.memory_floor import min_peak_memory
from pipecut.passes.partition.problem import formulate
from pipecut.passes.partition.solve import DEFAULT_LINK, partition_costs
from pipecut.runtime.grads.data_parallel import last_backwards
from pipecut.schedules.standard import gpipe, interleaved_1f1b, one_f_one_b


def test_the_last_backward_is_the_schedules_not_the_last_microbatch() -> None:
    # GPipe runs backwards in reverse: the last one is microbatch 0 on every stage.
    assert [last_backwards(r) for r in gpipe(3, 4)] == [{0: 0}, {1: 0}, {2: 0}]
    # 1F1B interleaves later forwards with earlier backwards; backwards run in order.
    assert [last_backwards(r) for r in one_f_one_b(3, 4)] == [{0: 3}, {1: 3}, {2: 3}]
    # Interleaved: each rank holds two stages, each with its own last backward.
    assert [last_backwards(r) for r in interleaved_1f1b(2, 2, 4)] == [{0: 3, 2: 3}, {1: 3, 3: 3}]


def test_data_parallel_option_parses_and_refuses_unknown_names() -> None:
    assert as_data_parallel("FSDP") is DataParallelKind.FSDP
    assert as_data_parallel(DataParallelKind.DDP) is DataParallelKind.DDP
    with pytest.raises(InputError, match=r"unknown data_parallel 'zero2'; choose one of \['ddp', 'fsdp'\]"):
        as_data_parallel("zero2")
    with pytest.raises(InputError, match="at least 1 replica, got 0"):
        DataParallel(kind=DataParallelKind.DDP, replicas=0)


def test_state_bytes_replicated_and_sharded() -> None:
    p = 1000
    full = p * (2 + OPTIMIZER_STATE_FACTOR)  # parameters, gradients, two AdamW moments
    assert state_bytes(p) == full
    assert state_bytes(p, DataParallel(kind=DataParallelKind.DDP, replicas=4)) == full
    # FSDP, one unit per stage: gathered parameters and unsharded gradients for the step, plus
    # a quarter of parameters, gradients and optimizer state.
    assert state_bytes(p, DataParallel(kind=DataParallelKind.FSDP, replicas=4)) == 2 * p + full // 4
    assert state_bytes(p, DataParallel(kind=DataParallelKind.FSDP, replicas=8)) == 2 * p + full // 8


@pytest.mark.parametrize("partitioner", [Partitioner.DP, Partitioner.ILP])
def test_plan_memory_follows_the_data_parallel_option(partitioner: Partitioner) -> None:
    nodes = transformer_costs(4, nodes_per_layer=40)
    plans = {
        kind: partition_costs(
            nodes, devices=[DeviceSpec(name="d")] * 2, microbatches=4, batch_size=8,
            schedule="1f1b", data_parallel=DataParallel(kind=kind, replicas=8),
            partition=pipecut.PartitionOptions(partitioner=partitioner),
        )
        for kind in DataParallelKind
    }
    ddp, fsdp = plans[DataParallelKind.DDP], plans[DataParallelKind.FSDP]
    assert [s.nodes for s in ddp.stages] == [s.nodes for s in fsdp.stages]  # time decides cuts
    for a, b in zip(ddp.stages, fsdp.stages):
        assert a.param_bytes > 0
        saved = a.param_bytes * (2 + OPTIMIZER_STATE_FACTOR) - state_bytes(
            a.param_bytes, DataParallel(kind=DataParallelKind.FSDP, replicas=8))
        assert a.peak_memory_bytes - b.peak_memory_bytes == saved > 0


def test_a_memory_limit_that_only_fsdp_meets() -> None:
    nodes = transformer_costs(4, nodes_per_layer=40)
    need = {}
    for kind in DataParallelKind:
        form = formulate(nodes, devices=[DeviceSpec(name="d")] * 2, link=DEFAULT_LINK,
                         schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4, recompute=False,
                         data_parallel=DataParallel(kind=kind, replicas=8))
        need[kind] = min_peak_memory(form.problem)[0]
    assert need[DataParallelKind.FSDP] < need[DataParallelKind.DDP]
    cap = int((need[DataParallelKind.FSDP] + need[DataParallelKind.DDP]) / 2)
    devices = [DeviceSpec(name=f"d{i}", memory_bytes=cap) for i in range(2)]

    def plan(kind: DataParallelKind):
        return partition_costs(
            nodes, devices=devices, microbatches=4, batch_size=8, schedule="1f1b",
            data_parallel=DataParallel(kind=kind, replicas=8),
            partition=pipecut.PartitionOptions(recompute="none"),
        )

    assert all(s.peak_memory_bytes <= cap for s in plan(DataParallelKind.FSDP).stages)
    with pytest.raises(PartitionError):
        plan(DataParallelKind.DDP)
