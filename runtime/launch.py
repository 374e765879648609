"""Process-group set-up: backend and device per rank, with a timeout on everything."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from pipecut.errors import PipelineRuntimeError

__all__ = ["backend_for", "ensure_process_group", "local_device"]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present (untested here: no GPU), else the CPU."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def ensure_process_group(timeout: datetime.timedelta) -> None:
    """Initialise the default group from torchrun's environment if the user has not."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise PipelineRuntimeError(
            "torch.distributed is not initialised and RANK/WORLD_SIZE are not set: launch the "
            "script with `torchrun --nproc_per_node=K script.py`, or call "
            "torch.distributed.init_process_group(...) before pipecut.compile"
        )
    dist.init_process_group(backend=backend_for(local_device().type), timeout=timeout)
