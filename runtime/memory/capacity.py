"""Each rank's free device memory, read from the hardware, as the planner's capacity.

On CUDA, ``torch.cuda.mem_get_info`` gives the free bytes of the rank's device (after the
CUDA context and whatever the process already holds); every rank of the pipeline reads its own
and all of them learn all of it, so the plan that rank 0 makes limits each stage by the device
it will run on. A capacity the user gave (``DeviceSpec(memory_bytes=...)``) is kept. On CPU no
limit is read: host memory is shared between the ranks of a machine, and its free bytes say
little about what one rank may use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipecut.ir import DeviceSpec

__all__ = ["free_bytes", "gathered_free_bytes", "with_capacities"]


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes on CUDA; None elsewhere (no limit known)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def gathered_free_bytes(device: torch.device, group: dist.ProcessGroup | None) -> list[int | None]:
    """Every pipeline rank's :func:`free_bytes`, in pipeline rank order, on every rank."""
    found: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, free_bytes(device), group=group)
    return found


def with_capacities(specs: Sequence[DeviceSpec], free: Sequence[int | None]) -> tuple[DeviceSpec, ...]:
    """``specs`` with each unset capacity filled from ``free`` (stage s runs on rank
    ``s % len(free)``); capacities the user set, and ranks with no reading, stay as they are."""
    return tuple(
        dataclasses.replace(spec, memory_bytes=free[s % len(free)])
        if spec.memory_bytes is None and free and free[s % len(free)] is not None else spec
        for s, spec in enumerate(specs)
    )
