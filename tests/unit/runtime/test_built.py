"""pipecut.runtime.built: a built pipeline is one frozen record; re-costing and wrapping return new ones.

The record is built here in one process from the example MLP's plan (three stages; rank 0's
stage only, as ``compile`` builds one rank's share), without a process group: nothing below
sends a tensor.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch

from pipecut.errors import PipelineRuntimeError
from pipecut.ir import Plan
from pipecut.passes.costs.stages import plan_schedule
from pipecut.passes.rewrite.split import split
from pipecut.runtime.built import BuiltPipeline, Groups, parameter_aliases, recosted, replicated
from pipecut.runtime.execution.stage import StageWorker
from pipecut.runtime.grads.data_parallel import Replication
from pipecut.runtime.pipeline import Pipeline
from tests.unit.tiny import mlp_captured, mlp_plan


def _built(plan: Plan | None = None) -> BuiltPipeline:
    plan = plan or mlp_plan()
    captured = mlp_captured()
    program = split(captured.gm, plan)[0]
    worker = StageWorker(program, plan, rank=0, ranks=[0, 1, 2], group=None, device=torch.device("cpu"),
                         loss_fn=None, unflatten_output=captured.unflatten_output,
                         timeout=datetime.timedelta(seconds=10))
    return BuiltPipeline(plan=plan, captured=captured, workers={0: worker}, schedule=plan_schedule(plan), rank=0,
                         ranks=[0, 1, 2], groups=Groups(pipeline=None), aliases=parameter_aliases(captured))


def _cheaper(plan: Plan) -> Plan:
    """``plan`` with every node half as dear: the same stages, other costs (live calibration)."""
    nodes = tuple(dataclasses.replace(n, forward_ms=n.forward_ms / 2, backward_ms=n.backward_ms / 2) for n in plan.nodes)
    return dataclasses.replace(plan, nodes=nodes)


def test_the_record_is_frozen_down_to_its_stage_map() -> None:
    built = _built()
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.plan = mlp_plan(stages=2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        built.workers[1] = built.workers[0]  # type: ignore[index]
    assert isinstance(built.ranks, tuple)


def test_a_pipeline_reads_the_record_and_cannot_be_changed_from_outside() -> None:
    built = _built()
    pipe = Pipeline(built)
    assert pipe.plan is built.plan and pipe.workers is built.workers and pipe.schedule is built.schedule
    assert (pipe.rank, pipe.ranks, pipe.stages) == (0, (0, 1, 2), (0,))
    assert pipe.replication is None and pipe.state_group is None and pipe.dp_group is None
    for name in ("plan", "schedule", "replication", "state_group", "workers"):
        with pytest.raises(AttributeError):
            setattr(pipe, name, None)


def test_recosted_returns_a_new_record_and_keeps_the_first() -> None:
    built = _built()
    plan = _cheaper(built.plan)
    again = recosted(built, plan, plan_schedule(plan), lambda m: plan_schedule(plan), ())
    assert again.plan is plan and again.workers is built.workers
    assert built.plan is not plan and built.schedule_for is None and built.predicted == ()


def test_recosted_refuses_a_plan_of_other_stages() -> None:
    built = _built()
    other = mlp_plan(stages=2)
    with pytest.raises(PipelineRuntimeError, match=r"rank 0: a plan of other stages .*stages \[0\]"):
        recosted(built, other, plan_schedule(other), lambda m: plan_schedule(other), ())


def test_replicated_returns_a_new_record_and_wraps_once() -> None:
    built = _built()
    wrapped = replicated(built, Replication(()), None)
    assert wrapped.replication is not None and built.replication is None
    with pytest.raises(PipelineRuntimeError, match="wrapped for data parallelism already"):
        replicated(wrapped, Replication(()), None)


def test_aliases_give_a_tied_weight_its_first_name() -> None:
    lin = torch.nn.Linear(4, 4, bias=False)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = lin, torch.nn.Linear(4, 4, bias=False)
            self.b.weight = lin.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    from pipecut.capture import capture
    aliases = parameter_aliases(capture(Tied(), (torch.zeros(2, 4),)))
    assert aliases["b.weight"] == aliases["a.weight"] == "a.weight"
