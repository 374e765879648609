"""Process-group set-up: the device first, then the group, with a timeout on everything.

NCCL needs each rank's device chosen before its first collective (else ranks can pile onto
GPU 0 or hang), so the device is settled first and handed to ``init_process_group`` as
``device_id``, which also creates the NCCL communicator at once. The default group gets both
backends, ``cpu:gloo,cuda:nccl``, so CPU objects (plans broadcast as pickles) and CUDA tensors
each go over the backend that suits them.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from pipecut.errors import PipelineRuntimeError

__all__ = ["backend_for", "ensure_process_group", "local_device"]


def backend_for(device_type: str) -> str:
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def local_device() -> torch.device:
    """This rank's device, made current: the CPU without CUDA; else, in order, the device the
    process group is bound to, one the user selected with ``torch.cuda.set_device`` (a current
    device other than 0 once CUDA is initialised: selecting device 0 itself cannot be told
    apart from never selecting one), or ``cuda:LOCAL_RANK`` (the current device when LOCAL_RANK
    is out of range, e.g. one visible GPU per process)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    bound = getattr(dist.group.WORLD, "bound_device_id", None) if dist.is_initialized() else None
    if bound is not None and bound.type == "cuda":
        index = bound.index if bound.index is not None else torch.cuda.current_device()
    elif torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        index = torch.cuda.current_device()
    else:
        index = int(os.environ.get("LOCAL_RANK", "0"))
        if index >= torch.cuda.device_count():
            index = torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def ensure_process_group(timeout: datetime.timedelta, device: torch.device) -> None:
    """Initialise the default group from torchrun's environment if the user has not."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise PipelineRuntimeError(
            "torch.distributed is not initialised and RANK/WORLD_SIZE are not set: launch the "
            "script with `torchrun --nproc_per_node=K script.py`, or call "
            "torch.distributed.init_process_group(...) before pipecut.compile"
        )
    dist.init_process_group(
        backend=backend_for(device.type), timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def ready_for_p2p(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """A barrier over the pipeline group: NCCL wants every rank in a group's first call, and
    the first ``batch_isend_irecv`` involves only neighbours."""
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
