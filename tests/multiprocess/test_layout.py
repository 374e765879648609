"""pipecut.assemble.layout: the groups each rank talks to, from an int, a device list or a DeviceMesh."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipecut.assemble.layout import layout_of, plan_from_rank0, replication_of
from pipecut.core.kinds import DataParallelKind
from pipecut.errors import InputError, PipelineRuntimeError
from pipecut.options import DataParallelOptions, Options
from pipecut.planning.asked import NO_REPLICAS, Context, resolve
from tests.harness import run_ranks
from tests.unit.tiny import mlp_plan

pytestmark = pytest.mark.dist


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    flat = layout_of(None)  # one stage per rank of the default group
    out["flat"] = (flat.replicas, flat.devices, flat.pp_group is None, replication_of(flat, NO_REPLICAS))
    try:
        resolve(Options(data_parallel=DataParallelOptions(kind="ddp")), Context.COMPILE, devices=None)
    except InputError as e:
        out["ddp_without_replicas"] = str(e)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    grid = layout_of(mesh)
    dp = replication_of(grid, DataParallelKind.FSDP)
    out["mesh"] = (grid.replicas, grid.devices, dp.kind, dp.replicas,
                   dist.get_world_size(grid.pp_group), dist.get_world_size(grid.dp_group))
    plan = mlp_plan()  # profiled on each rank: rank 0's is the one every rank must get
    out["plan"] = plan_from_rank0(lambda: plan).to_json()

    def fail() -> Any:
        raise ValueError("no plan for you")

    try:
        plan_from_rank0(fail)
    except (ValueError, PipelineRuntimeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(120)
def test_layouts_and_the_plan_from_rank0() -> None:
    results = run_ranks(_scenarios, 4, timeout=100)
    assert len({r["plan"] for r in results}) == 1  # every rank holds rank 0's plan
    for rank, r in enumerate(results):
        assert r["flat"] == (((0, 1, 2, 3),), 4, True, None)
        assert "needs replicas" in r["ddp_without_replicas"]
        assert r["mesh"] == (((0, 1), (2, 3)), 2, DataParallelKind.FSDP, 2, 2, 2)
        if rank == 0:
            assert r["error"] == "ValueError: no plan for you"  # rank 0 raises its own error
        else:  # the others learn of it instead of waiting for a plan that never comes
            assert r["error"].startswith("PipelineRuntimeError: rank") and "no plan for you" in r["error"]
