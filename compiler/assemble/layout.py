"""Where each rank sits: its pipeline and replica groups, and the mesh ``data_parallel="auto"`` builds.

``compile`` takes ``devices`` as a stage count, a list of devices or a DeviceMesh with a "pp"
dimension and maybe "dp" and "tp" ones;
:func:`layout_of` turns each into the groups this rank talks to, :func:`replication_of` into the
plan's data parallelism, and :func:`auto_layout` lets rank 0 choose D replicas × K stages and
builds that mesh on every rank. :func:`plan_from_rank0` is how every rank gets rank 0's plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.kinds import DataParallelKind, ScheduleKind
from pipecut.core.program import Inputs
from pipecut.errors import InputError, PipelineRuntimeError, PlanError
from pipecut.ir import Plan
from pipecut.options import AUTO, DataParallelOptions, RuntimeOptions, ScheduleOptions
from pipecut.passes.partition.solve import DEFAULT_LINK, as_devices
from pipecut.planning.asked import NO_REPLICAS
from pipecut.planning.planner import plan_asked
from pipecut.planning.request import Request
from pipecut.runtime.comm.launch import local_device
from pipecut.runtime.comm.linkprobe import measure_link
from pipecut.runtime.comm.teardown import close_at_exit, open_default_group

__all__ = ["Auto", "RankGroups", "auto_layout", "layout_of", "plan_from_rank0", "replication_of"]


@dataclass(frozen=True)
class RankGroups:
    """Where this rank sits: its pipeline group and, with data parallelism, its replica group;
    with tensor parallelism, the group that splits its stages' layers."""

    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    dp_mesh: Any
    """The 1-D "dp" DeviceMesh (FSDP2 takes a mesh), or None."""
    replicas: tuple[tuple[int, ...], ...]
    """Global ranks of every pipeline, stage-rank order; this rank's included. With a "tp"
    dimension each tensor-parallel position has its own pipeline: rank i of a stage's group
    sends to rank i of the next stage's group, whole values, each used by its receiver."""
    devices: Any
    tp_mesh: Any = None
    """The 1-D "tp" DeviceMesh over which this rank's stages split their layers, or None."""
    copies: tuple[tuple[int, ...], ...] = ()
    """Global ranks that hold one whole copy of the model between them (every stage and every
    tensor-parallel shard), one tuple per data-parallel replica; empty: ``replicas``."""

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.tp_mesh is None else int(self.tp_mesh.size())


def layout_of(devices: Any) -> RankGroups:
    """From an int, a list of devices, a DeviceMesh with a "pp" (and maybe "dp" and "tp")
    dimension, or None (one stage per rank of the default group)."""
    names = getattr(devices, "mesh_dim_names", None)
    if names is None:
        world = dist.get_world_size()
        return RankGroups(None, None, None, (tuple(range(world)),), world if devices is None else devices)
    if "pp" not in names or not set(names) <= {"dp", "pp", "tp"} or len(set(names)) != len(names):
        raise InputError(
            f"the DeviceMesh needs a 'pp' dimension and maybe 'dp' and 'tp' ones, e.g. ('dp', 'pp', 'tp'), "
            f"('pp', 'tp'), ('dp', 'pp') or ('pp',); it has {names}")
    pp = devices.get_group("pp")
    dp = devices.get_group("dp") if "dp" in names else None
    dp_mesh = devices["dp"] if "dp" in names else None
    tp_mesh = devices["tp"] if "tp" in names else None
    mesh = devices.mesh.movedim(names.index("pp"), -1)
    replicas = tuple(tuple(int(r) for r in row) for row in mesh.reshape(-1, mesh.shape[-1]).tolist())
    by_replica = devices.mesh.movedim(names.index("dp"), 0) if "dp" in names else devices.mesh.unsqueeze(0)
    copies = tuple(tuple(int(r) for r in row) for row in by_replica.reshape(by_replica.shape[0], -1).tolist())
    return RankGroups(pp, dp, dp_mesh, replicas, dist.get_world_size(pp), tp_mesh, copies)


def replication_of(layout: RankGroups, kind: DataParallelKind | Literal["auto", "none"]) -> DataParallelOptions | None:
    """The replicas' engine, as :func:`pipecut.planning.asked.resolve` resolved it from what was
    asked and the mesh, with their count from the mesh's "dp" group; None for
    :data:`~pipecut.planning.asked.NO_REPLICAS`."""
    if kind == NO_REPLICAS:
        return None
    assert layout.dp_group is not None and kind != AUTO, "resolve refuses replicas without a 'dp' dimension"
    return DataParallelOptions.resolved(kind, dist.get_world_size(layout.dp_group))


@dataclass(frozen=True)
class Auto:
    plan: Plan
    mesh: Any
    """The ("dp", "pp") DeviceMesh of the chosen D × K, or None for one replica."""
    kind: DataParallelKind


def auto_layout(request: Request) -> tuple[Auto, tuple[Inputs, Any]]:
    """data_parallel="auto": rank 0 chooses D × K for every rank of the default group (or the
    given plan's), all ranks build the mesh, and each takes its replica's share of the batch."""
    device = local_device()
    open_default_group(request.wait, device)
    world = dist.get_world_size()
    devices, options = request.devices, request.options
    if devices is not None and (isinstance(devices, bool) or devices != world):
        raise InputError(
            f"data_parallel='auto' spreads the model over every rank of the process group "
            f"({world}); pass devices=None or devices={world}, or pass a ('dp', 'pp') "
            f"DeviceMesh with data_parallel='ddp' or 'fsdp' to choose the layout yourself"
        )
    if AUTO in (options.microbatches, options.schedule) or options.scheduling.stages_per_rank not in (None, 1):
        raise InputError(
            "data_parallel='auto' needs microbatches and schedule as values, not 'auto', and "
            "one stage per rank (stages_per_rank=1)"
        )
    chosen = request.given
    if chosen is None:
        link = options.measure.fixed_link  # given or estimated: not measured
        used = link or measure_link(list(range(world)), dist.get_rank(), None, device) or DEFAULT_LINK
        measure = dataclasses.replace(options.measure, link=used,  # by default where the stages run
                                      device=options.measure.device or str(device))
        planning = dataclasses.replace(request.with_options(
            microbatches=options.microbatches if options.microbatches is not None else 1,
            schedule=options.schedule if options.schedule is not None else ScheduleKind.GPIPE,
            measure=measure, scheduling=ScheduleOptions(), data_parallel=DataParallelOptions(kind=AUTO),
            runtime=RuntimeOptions(),
        ), specs=as_devices(world))
        chosen = plan_from_rank0(  # the plan records what compile was asked
            lambda: dataclasses.replace(plan_asked(planning), options=request.options))
    dp = chosen.data_parallel
    d = dp.resolved_replicas if dp is not None else 1
    if d * chosen.num_ranks != world:
        raise PlanError(
            f"the plan is for {d} replicas x {chosen.num_ranks} ranks, but the process group has "
            f"{world} ranks; launch with --nproc_per_node={d * chosen.num_ranks} or re-plan"
        )
    kind = dp.resolved_kind if dp is not None else DataParallelKind.DDP
    if d == 1:
        return Auto(chosen, None, kind), (request.example_inputs, request.target)
    mesh = init_device_mesh(device.type, (d, chosen.num_ranks), mesh_dim_names=("dp", "pp"))
    close_at_exit([mesh.get_group("dp"), mesh.get_group("pp")])
    replica = mesh.get_local_rank("dp")
    size, _ = first_microbatch(request.example_inputs, 1)
    share = split_microbatches(request.example_inputs, d, size, "example_inputs")[replica]
    share_target = split_microbatches(request.target, d, size, "target")[replica] if request.target is not None else None
    return Auto(chosen, mesh, kind), (share, share_target)


def plan_from_rank0(make: Callable[[], Plan]) -> Plan:
    """Global rank 0 runs ``make``; every rank gets its plan, or its error."""
    payload: list[Any] = [None]
    error: BaseException | None = None
    made: Plan | None = None
    if dist.get_rank() == 0:
        try:
            made = make()
            payload = [("ok", made.to_json())]
        except Exception as e:  # every rank must learn of it, or they wait forever
            error = e
            payload = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(payload, src=0)
    status, text = payload[0]
    if error is not None:
        raise error
    if status != "ok":
        raise PipelineRuntimeError(f"rank {dist.get_rank()}: rank 0 failed to plan: {text}")
    return made if made is not None else Plan.from_json(text)
