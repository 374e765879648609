"""Data parallelism without processes: which backward reduces, and the planner's memory model."""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from benchmarks.synthetic import transformer_costs
from pipecut.core.kinds import DataParallelKind, Partitioner, ScheduleKind
from pipecut.errors import InputError, PartitionError, PlanError
from pipecut.ir import DeviceSpec
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import OPTIMIZER_STATE_FACTOR, state_bytes
from pipecut.passes.partition.memory_floor import min_peak_memory
from pipecut.passes.partition.problem import formulate
from pipecut.passes.partition.solve import DEFAULT_LINK, partition_costs
from pipecut.runtime.grads.data_parallel import last_backwards
from pipecut.schedules.standard import gpipe, interleaved_1f1b, one_f_one_b
from tests.browser.plans import synthetic_nodes


def test_the_last_backward_is_the_schedules_not_the_last_microbatch() -> None:
    # GPipe runs backwards in reverse: the last one is microbatch 0 on every stage.
    assert [last_backwards(r) for r in gpipe(3, 4)] == [{0: 0}, {1: 0}, {2: 0}]
    # 1F1B interleaves later forwards with earlier backwards; backwards run in order.
    assert [last_backwards(r) for r in one_f_one_b(3, 4)] == [{0: 3}, {1: 3}, {2: 3}]
    # Interleaved: each rank holds two stages, each with its own last backward.
    assert [last_backwards(r) for r in interleaved_1f1b(2, 2, 4)] == [{0: 3, 2: 3}, {1: 3, 3: 3}]


def test_data_parallel_option_parses_and_refuses_unknown_names() -> None:
    assert DataParallelOptions(kind="FSDP").kind is DataParallelKind.FSDP
    assert DataParallelOptions(kind=DataParallelKind.DDP).kind is DataParallelKind.DDP
    with pytest.raises(InputError, match=r"unknown data_parallel 'zero2'; choose one of \['ddp', 'zero1', 'fsdp', 'auto'\]"):
        DataParallelOptions(kind="zero2")
    with pytest.raises(InputError, match=r"DataParallelOptions\(replicas=0\): at least 1"):
        DataParallelOptions(kind=DataParallelKind.DDP, replicas=0)


def test_resolved_data_parallel_fixes_kind_and_replicas_and_plans_refuse_others() -> None:
    dp = DataParallelOptions.resolved("fsdp", 2)
    assert dp.is_resolved and dp.resolved_kind is DataParallelKind.FSDP and dp.resolved_replicas == 2
    assert not DataParallelOptions(kind="auto").is_resolved
    with pytest.raises(InputError, match="not 'auto'"):
        DataParallelOptions.resolved("auto", 2)
    with pytest.raises(InputError, match="not resolved"):
        _ = DataParallelOptions(kind="ddp").resolved_replicas
    plan = pipecut.partition_costs(synthetic_nodes(2), devices=2, microbatches=2, batch_size=4,
                                   schedule="1f1b", data_parallel=dp)
    with pytest.raises(PlanError, match="must name its engine and replicas"):
        dataclasses.replace(plan, data_parallel=DataParallelOptions(kind="ddp"))


def test_state_bytes_replicated_and_sharded() -> None:
    p = 1000
    full = p * (2 + OPTIMIZER_STATE_FACTOR)  # parameters, gradients, two AdamW moments
    assert state_bytes(p) == full
    assert state_bytes(p, DataParallelOptions(kind=DataParallelKind.DDP, replicas=4)) == full
    # FSDP, one unit per stage: gathered parameters and unsharded gradients for the step, plus
    # a quarter of parameters, gradients and optimizer state.
    assert state_bytes(p, DataParallelOptions(kind=DataParallelKind.FSDP, replicas=4)) == 2 * p + full // 4
    assert state_bytes(p, DataParallelOptions(kind=DataParallelKind.FSDP, replicas=8)) == 2 * p + full // 8


@pytest.mark.parametrize("partitioner", [Partitioner.DP, Partitioner.ILP])
def test_plan_memory_follows_the_data_parallel_option(partitioner: Partitioner) -> None:
    nodes = transformer_costs(4, nodes_per_layer=40)
    plans = {
        kind: partition_costs(
            nodes, devices=[DeviceSpec(name="d")] * 2, microbatches=4, batch_size=8,
            schedule="1f1b", data_parallel=DataParallelOptions(kind=kind, replicas=8),
            partition=pipecut.PartitionOptions(partitioner=partitioner),
        )
        for kind in DataParallelKind
    }
    ddp, fsdp = plans[DataParallelKind.DDP], plans[DataParallelKind.FSDP]
    assert [s.nodes for s in ddp.stages] == [s.nodes for s in fsdp.stages]  # time decides cuts
    for a, b in zip(ddp.stages, fsdp.stages):
        assert a.param_bytes > 0
        saved = a.param_bytes * (2 + OPTIMIZER_STATE_FACTOR) - state_bytes(
            a.param_bytes, DataParallelOptions(kind=DataParallelKind.FSDP, replicas=8))
        assert a.peak_memory_bytes - b.peak_memory_bytes == saved > 0


def test_a_memory_limit_that_only_fsdp_meets() -> None:
    nodes = transformer_costs(4, nodes_per_layer=40)
    need = {}
    for kind in DataParallelKind:
        form = formulate(nodes, devices=[DeviceSpec(name="d")] * 2, link=DEFAULT_LINK,
                         schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4, recompute=False,
                         data_parallel=DataParallelOptions(kind=kind, replicas=8))
        need[kind] = min_peak_memory(form.problem)[0]
    assert need[DataParallelKind.FSDP] < need[DataParallelKind.DDP]
    cap = int((need[DataParallelKind.FSDP] + need[DataParallelKind.DDP]) / 2)
    devices = [DeviceSpec(name=f"d{i}", memory_bytes=cap) for i in range(2)]

    def plan(kind: DataParallelKind):
        return partition_costs(
            nodes, devices=devices, microbatches=4, batch_size=8, schedule="1f1b",
            data_parallel=DataParallelOptions(kind=kind, replicas=8),
            partition=pipecut.PartitionOptions(recompute="none"),
        )

    assert all(s.peak_memory_bytes <= cap for s in plan(DataParallelKind.FSDP).stages)
    with pytest.raises(PartitionError):
        plan(DataParallelKind.DDP)


def test_a_split_backward_refused_for_fsdp2_names_a_default_engine_and_schedule_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without FSDP2's post-backward (faked here: the supported range has it), the
    refusal names the engine and the schedule as asked, or says where each came from: the engine
    given as a default (``engine_origin``), the schedule read from what the plan records; and
    what to pass instead (DDP is FSDP2's replicate over tensor-parallel stages: not offered there)."""
    from pipecut.runtime.grads import data_parallel
    from tests.unit.tiny import mlp_plan

    monkeypatch.setattr(data_parallel, "fsdp_post_backward", lambda: None)
    asked = mlp_plan(2, 4, "zero-bubble")
    assert asked.options is not None and asked.options.schedule is ScheduleKind.ZERO_BUBBLE
    with pytest.raises(PlanError, match=r"^data_parallel='fsdp' with the zero-bubble schedule needs FSDP2's post-backward"
                                        r".*; use schedule='1f1b', or data_parallel='ddp', or a torch in"):
        data_parallel.check_supported(asked, DataParallelKind.FSDP)
    chosen = dataclasses.replace(asked, options=dataclasses.replace(asked.options, schedule="auto"))
    with pytest.raises(PlanError, match=r"^data_parallel='fsdp' \(the default for a mesh with a 'dp' dimension and tensor "
                                        r"parallelism\) with the zero-bubble schedule \(chosen by schedule='auto'\) needs "
                                        r".*; use schedule='1f1b', or a torch in"):
        data_parallel.check_supported(chosen, DataParallelKind.FSDP, True,
                                      engine_origin="the default for a mesh with a 'dp' dimension and tensor parallelism")
    data_parallel.check_supported(asked, DataParallelKind.DDP)  # DDP's reducer runs in the weight pass
