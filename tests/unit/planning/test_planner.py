"""pipecut.planning.planner: option parsing, partitioning a cost table into a plan, and the defaults
(microbatches and schedule chosen when left out; a warning when one microbatch cannot pipeline)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import pipecut
from examples import mlp
from pipecut.core.kinds import Partitioner, ScheduleKind
from pipecut.errors import InputError, PartitionError
from pipecut.ir import DeviceSpec
from pipecut.options import IlpSolver
from pipecut.passes.partition.solve import as_devices, as_ilp_solver, as_schedule, partition_costs
from tests.unit.tiny import mlp_plan


def test_option_parsing_accepts_any_case_and_lists_the_choices():
    assert as_schedule("1F1B") is ScheduleKind.ONE_F_ONE_B
    assert as_schedule(ScheduleKind.GPIPE) is ScheduleKind.GPIPE
    with pytest.raises(InputError, match=r"unknown schedule 'pipedream'; choose one of \['gpipe', '1f1b'"):
        as_schedule("pipedream")
    assert as_ilp_solver("CBC") is IlpSolver.CBC
    with pytest.raises(InputError, match=r"unknown ILP solver 'gurobi'; choose one of \['highs', 'cbc'\]"):
        as_ilp_solver("gurobi")


def test_as_devices():
    assert len(as_devices(3)) == 3
    assert as_devices(["cpu", DeviceSpec(name="cuda:1", speed=2.0)]) == (
        DeviceSpec(name="cpu"), DeviceSpec(name="cuda:1", speed=2.0))
    with pytest.raises(InputError, match="devices must be an int, a list of device names or DeviceSpec, got 'cpu'"):
        as_devices("cpu")
    with pytest.raises(InputError, match="got True"):
        as_devices(True)
    with pytest.raises(PartitionError, match="must be at least 1, got 0"):
        as_devices(0)
    with pytest.raises(PartitionError, match="must be at least 1, got 0"):
        as_devices([])


def test_partitioning_the_cost_table_again_gives_the_same_stages():
    plan = mlp_plan()
    again = partition_costs(plan.nodes, devices=list(plan.devices), microbatches=plan.microbatches,
                            batch_size=plan.batch_size, schedule=plan.schedule, link=plan.link,
                            fingerprint=plan.fingerprint, inputs=plan.inputs)
    assert [s.nodes for s in again.stages] == [s.nodes for s in plan.stages]
    assert again.predicted.step_ms == pytest.approx(plan.predicted.step_ms)


def test_the_ilp_agrees_with_the_dp_and_memory_limits_bring_recompute_or_an_error():
    plan = mlp_plan()
    common = dict(microbatches=plan.microbatches, batch_size=plan.batch_size, schedule=plan.schedule,
                  link=plan.link, inputs=plan.inputs)
    dp = partition_costs(
        plan.nodes, devices=3, partition=pipecut.PartitionOptions(partitioner=Partitioner.DP),
        **common,
    )
    # The solver's limit is wall-clock: under another process's load the default 5 s once ran
    # out before HiGHS proved its optimum. This compares optima, so it waits as long as it takes.
    ilp = partition_costs(
        plan.nodes, devices=3,
        partition=pipecut.PartitionOptions(partitioner=Partitioner.ILP, ilp_time_limit=600.0),
        **common,
    )
    assert ilp.solver.optimal
    assert ilp.predicted.step_ms == pytest.approx(dp.predicted.step_ms, rel=1e-6)
    need = max(s.peak_memory_bytes for s in dp.stages)
    capped = [DeviceSpec(name="cpu", memory_bytes=need)] * 3
    fitted = partition_costs(plan.nodes, devices=capped, **common)
    assert all(s.peak_memory_bytes <= need for s in fitted.stages)
    assert fitted.solver.method is Partitioner.ILP  # a memory limit needs the ILP
    tiny = [DeviceSpec(name="cpu", memory_bytes=1000)] * 3
    with pytest.raises(PartitionError, match="no split of 10 nodes into 3 stages fits in the device memory"):
        partition_costs(plan.nodes, devices=tiny, **common)
    with pytest.raises(PartitionError, match=r"fits .* without recompute; .* or allow recompute"):
        partition_costs(
            plan.nodes, devices=tiny, partition=pipecut.PartitionOptions(recompute="none"), **common,
        )


def test_plan_without_microbatches_or_schedule_chooses_them_and_says_so(caplog: Any) -> None:
    model, inputs, loss_fn, target = mlp.build(8, width=16, depth=4)
    with caplog.at_level(logging.WARNING, logger="pipecut"):
        chosen = pipecut.plan(
            model, inputs, 2, loss_fn=loss_fn, target=target,
            measure=pipecut.MeasureOptions(repeats=1, warmup=0),
        )
    assert len(chosen.candidates) > 1  # "auto" weighed several (microbatches, schedule) pairs
    assert (chosen.microbatches, chosen.schedule) in {(c.microbatches, c.schedule) for c in chosen.candidates}
    text = pipecut.summary(chosen)
    assert f"chosen by the planner: {chosen.microbatches} microbatches, {chosen.schedule.value}" in text
    if chosen.microbatches > 1:
        assert not caplog.records

    with caplog.at_level(logging.WARNING, logger="pipecut"):
        one = pipecut.plan(
            model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
            measure=pipecut.MeasureOptions(repeats=1, warmup=0),
        )
    assert not one.candidates
    warned = [r.getMessage() for r in caplog.records]
    assert any("1 microbatch on 2 ranks: the stages run one after another" in m for m in warned), warned
    assert "warning: 1 microbatch on 2 ranks" in pipecut.summary(one)


def test_tensor_parallel_is_threaded_to_the_cluster_planner_and_refused_without_a_cluster(monkeypatch):
    import pipecut.planning.cluster.plan as clusters

    model, inputs, _, _ = mlp.build(batch_size=8, width=32, depth=2)
    with pytest.raises(InputError, match=r"tensor_parallel=2 without a cluster: .*DeviceMesh's 'tp' dimension"):
        pipecut.plan(model, inputs, 2, tensor_parallel=2, microbatches=2, schedule="1f1b")
    with pytest.raises(InputError, match="a group size"):
        pipecut.plan(model, inputs, 2, tensor_parallel="two", microbatches=2, schedule="1f1b")
    asked: dict[str, Any] = {}

    def fake(model: Any, inputs: Any, cluster: Any, options: pipecut.Options, **kwargs: Any) -> Any:
        asked["tensor_parallel"] = options.tensor_parallel.size or "auto"
        return mlp_plan()

    monkeypatch.setattr(clusters, "plan_asked_cluster", fake)
    pipecut.plan(model, inputs, cluster="1x8xH100-SXM", tensor_parallel=4, microbatches=2)
    assert asked["tensor_parallel"] == 4
    pipecut.plan(model, inputs, cluster="1x8xH100-SXM", microbatches=2)
    assert asked["tensor_parallel"] == "auto"
    # one type for compile and plan: the options, whose size None is "auto" for a cluster
    split = {"layers.*.up": "column", "layers.*.down": "row"}
    got = pipecut.plan(model, inputs, cluster="1x8xH100-SXM", microbatches=2,
                       tensor_parallel=pipecut.TensorParallelOptions(size=2, plan=split))
    assert asked["tensor_parallel"] == 2
    assert got.options.tensor_parallel == pipecut.TensorParallelOptions(size=2, plan=split)
    pipecut.plan(model, inputs, cluster="1x8xH100-SXM", microbatches=2,
                 tensor_parallel=pipecut.TensorParallelOptions(plan=split))
    assert asked["tensor_parallel"] == "auto"
