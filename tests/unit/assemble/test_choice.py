"""pipecut.assemble.choice without processes: the refusals of compile's plan-checking step. The
capture, plan and broadcast step itself runs across processes (tests/multiprocess/test_parity.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipecut.assemble.choice import check_tensor_group, runnable_schedule
from pipecut.assemble.context import Place
from pipecut.assemble.layout import RankGroups
from pipecut.cluster import ClusterPlacement, Layout
from pipecut.errors import PlanError
from pipecut.options import DataParallelOptions, TensorParallelOptions
from pipecut.passes.partition.solve import DEFAULT_LINK
from tests.unit.tiny import Mesh, mlp_plan


def test_a_cluster_plans_tensor_groups_need_a_tp_dimension_of_their_size() -> None:
    """A cluster plan split over T GPUs (plan(cluster=...) weighs T by default) replays over a
    ("dp", "pp", "tp") mesh of (D, K, T); other devices are refused, naming the mesh to make, and
    T as auto's choice where it chose it, the user's where they fixed it."""
    plan = mlp_plan(3)
    assert plan.options is not None and plan.options.tensor_parallel.size is None  # plan()'s "auto"
    split = dataclasses.replace(plan, placement=ClusterPlacement(
        layout=Layout.STAGES_INSIDE_NODES, replicas=1, stages=3, tensor_parallel=2))
    with pytest.raises(PlanError, match=r"groups of 2 GPUs \(placement.tensor_parallel=2, chosen by tensor_parallel='auto', "
                                        r"plan\(\)'s default\), but the devices have no 'tp' dimension; compile it over "
                                        r"init_device_mesh\(..., \(1, 3, 2\), mesh_dim_names=\('dp', 'pp', 'tp'\)\)"):
        check_tensor_group(split, 6)
    asked = dataclasses.replace(split, options=dataclasses.replace(
        plan.options, tensor_parallel=TensorParallelOptions(size=2)))
    with pytest.raises(PlanError, match=r"groups of 2 GPUs \(placement.tensor_parallel=2\), but the devices have a "
                                        r"'tp' dimension of 4"):
        check_tensor_group(asked, Mesh(pp=3, tp=4))
    check_tensor_group(split, Mesh(dp=1, pp=3, tp=2))
    check_tensor_group(plan, 3)  # no placement: a pipeline's plan
    check_tensor_group(plan, Mesh(pp=3, tp=2))  # a pipeline's plan, split over the mesh's tensor groups at build


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
