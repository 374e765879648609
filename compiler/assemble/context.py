"""Where this rank sits (:class:`Place`), for what ``compile`` was asked (a
:class:`~pipecut.planning.request.Request`).

:func:`connect` is compile's first step on every rank: join (or start) the process group on
this rank's device, read the layout of the request's ``devices`` (a stage count, device names
or a ("dp", "pp") DeviceMesh), and measure the link between neighbours unless a plan or the
options give it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecut.assemble.layout import RankGroups, layout_of, replication_of
from pipecut.cluster import Link
from pipecut.errors import InputError
from pipecut.ir import DeviceSpec
from pipecut.options import DataParallelOptions
from pipecut.passes.partition.solve import as_devices
from pipecut.planning.asked import Resolved
from pipecut.planning.request import Request
from pipecut.runtime.comm.launch import local_device
from pipecut.runtime.comm.linkprobe import measure_link
from pipecut.runtime.comm.teardown import open_default_group
from pipecut.runtime.grads.data_parallel import fsdp2_engine
from pipecut.runtime.memory.allocator import return_large_frees
from pipecut.runtime.memory.capacity import gathered_free_bytes, with_capacities

__all__ = ["Place", "connect"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Place:
    """Where this rank sits: its device, its pipeline's group and ranks, the devices and link."""

    device: torch.device
    layout: RankGroups
    rank: int
    """This rank's index in its pipeline (its position, stage order)."""
    ranks: tuple[int, ...]
    """The global rank of every position of this rank's pipeline."""
    specs: tuple[DeviceSpec, ...]
    link: Link
    replication: DataParallelOptions | None
    engine_origin: str = ""
    """Where the replicas' engine came from when the user did not name it, as a refusal says
    after ``data_parallel='fsdp'``: "the default for a mesh with a 'dp' dimension", "chosen by
    data_parallel='auto'"; empty where it was asked."""

    @property
    def group(self) -> Any:
        return self.layout.pp_group

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def tensor_parallel(self) -> bool:
        """Whether this rank's stages are split over a tensor-parallel group."""
        return self.layout.tp_mesh is not None

    @property
    def on_fsdp2(self) -> bool:
        """Whether the replicas are kept in step by FSDP2's engine (``fully_shard``, or
        ``replicate`` over tensor-parallel stages), which swaps the stages' parameter slots."""
        return self.replication is not None and fsdp2_engine(self.replication.resolved_kind, self.tensor_parallel)


def connect(request: Request, settings: Resolved) -> Place:
    """Join the process group on this rank's device and read where this rank sits. Collective:
    every rank calls it (NCCL needs the device chosen before any collective)."""
    device = local_device()
    open_default_group(request.wait, device)  # closed at exit if opened here (pipecut.runtime.comm.teardown)
    if request.options.runtime.lean_host_memory and device.type == "cpu" and not return_large_frees():
        warnings.warn("lean_host_memory: the allocator was left as it is (not glibc, or "
                      "MALLOC_MMAP_THRESHOLD_ or PIPECUT_KEEP_MALLOC=1 set)", stacklevel=3)
    layout = layout_of(request.devices)
    replication = replication_of(layout, settings.data_parallel)
    engine = request.whence("data_parallel") or settings.origin("data_parallel")
    asked = request.options.data_parallel.replicas
    if asked is not None and (replication.replicas if replication else 1) != asked:
        raise InputError(
            f"DataParallelOptions(replicas={asked}) but the devices give "
            f"{replication.replicas if replication else 1} replica(s) (the mesh's 'dp' dimension); "
            f"compile reads the replicas from the mesh: leave replicas out or match it")
    group = layout.pp_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ranks = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(world))
    specs = as_devices(layout.devices)
    if len(specs) != world:
        raise InputError(
            f"{len(specs)} devices (stages) asked for, but the pipeline process group has "
            f"{world} ranks; launch with --nproc_per_node={len(specs)} or pass devices={world}"
        )
    if device.type == "cuda":  # free memory as capacity; CPU ranks share the host: no limit read
        specs = with_capacities(specs, gathered_free_bytes(device, group))
    link = settings.link
    if request.given is None:  # planned here: the link given or estimated, else measured (the same on every rank)
        link = request.options.measure.fixed_link or measure_link(list(ranks), rank, group, device) or settings.link
    return Place(device=device, layout=layout, rank=rank, ranks=ranks, specs=tuple(specs), link=link,
                 replication=replication, engine_origin=engine if replication is not None else "")
