"""pipecut.assemble.choice without processes: the refusals of compile's plan-checking step. The
capture, plan and broadcast step itself runs across processes (tests/multiprocess/test_parity.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipecut.assemble.choice import refuse_tensor_parallel, runnable_schedule
from pipecut.assemble.context import Place
from pipecut.assemble.layout import RankGroups
from pipecut.cluster import ClusterPlacement, Layout
from pipecut.errors import PlanError
from pipecut.options import DataParallelOptions, TensorParallelOptions
from pipecut.passes.partition.solve import DEFAULT_LINK
from tests.unit.tiny import mlp_plan


def test_a_cluster_plans_tensor_groups_are_named_as_autos_choice_where_it_chose_them() -> None:
    """plan(cluster=...) weighs T by default (tensor_parallel="auto"): the refusal says so; a T
    the user fixed is named as theirs."""
    plan = mlp_plan(3)
    assert plan.options is not None and plan.options.tensor_parallel.size is None  # plan()'s "auto"
    split = dataclasses.replace(plan, placement=ClusterPlacement(
        layout=Layout.STAGES_INSIDE_NODES, replicas=1, stages=3, tensor_parallel=2))
    with pytest.raises(PlanError, match=r"groups of 2 GPUs \(placement.tensor_parallel=2, chosen by tensor_parallel='auto', "
                                        r"plan\(\)'s default\), which pipecut.compile does not replay; re-plan with "
                                        r"tensor_parallel=1"):
        refuse_tensor_parallel(split)
    asked = dataclasses.replace(split, options=dataclasses.replace(
        plan.options, tensor_parallel=TensorParallelOptions(size=2)))
    with pytest.raises(PlanError, match=r"groups of 2 GPUs \(placement.tensor_parallel=2\), which pipecut.compile"):
        refuse_tensor_parallel(asked)
    refuse_tensor_parallel(plan)  # no placement: a pipeline's plan


def _place(engine_origin: str) -> Place:
    return Place(device=torch.device("cpu"), layout=RankGroups(None, None, None, ((0, 1), (2, 3)), 2), rank=0,
                 ranks=(0, 1), specs=(), link=DEFAULT_LINK, replication=DataParallelOptions.resolved("fsdp", 2),
                 engine_origin=engine_origin)


def test_the_schedule_check_names_the_engine_as_the_place_says_it_was_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """runnable_schedule hands check_supported where the replicas' engine came from (FSDP2's
    post-backward faked missing: the supported range has it)."""
    from pipecut.runtime.grads import data_parallel

    monkeypatch.setattr(data_parallel, "fsdp_post_backward", lambda: None)
    plan = mlp_plan(2, 4, "zero-bubble")
    with pytest.raises(PlanError, match=r"^data_parallel='fsdp' \(chosen by data_parallel='auto'\) with the zero-bubble "
                                        r"schedule needs"):
        runnable_schedule(plan, _place("chosen by data_parallel='auto'"))
    with pytest.raises(PlanError, match=r"^data_parallel='fsdp' with the zero-bubble schedule needs"):
        runnable_schedule(plan, _place(""))
    monkeypatch.undo()
    assert len(runnable_schedule(plan, _place(""))) == 2  # one action list per rank
