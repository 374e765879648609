"""Fail fast: a rank that fails tears its process groups down so no other rank waits.

The failing rank records why in the rendezvous store, then destroys its process groups; its
neighbours' pending receives fail at once ("connection closed"), they do the same, and the
failure travels down the pipeline in milliseconds instead of a timeout. Each rank's error names
the rank that failed first and its reason when the store has it. A rank that is killed outright
records nothing; its neighbours still fail at once and name it as the peer that went away.
A rank that hangs is caught by the deadline every receive and collective has.
"""

from __future__ import annotations

import contextlib
import logging

import torch.distributed as dist

from pipecut.core.torch_private import default_store
from pipecut.errors import PipelineRuntimeError

__all__ = ["FAILURE_KEY", "abort", "first_failure"]

FAILURE_KEY = "pipecut/failed"
log = logging.getLogger("pipecut")


def _store() -> dist.Store | None:
    return default_store()  # None without one: errors still name the peer rank


def first_failure(store: dist.Store | None) -> str | None:
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        return None
    return None


def abort(rank: int, error: BaseException) -> BaseException:
    """Record the failure, tear the groups down, and return the error to raise on this rank."""
    store = _store()
    earlier = first_failure(store)
    if earlier is None and store is not None and not isinstance(error, PipelineRuntimeError):
        with contextlib.suppress(Exception):
            store.set(FAILURE_KEY, f"rank {rank}: {type(error).__name__}: {error}")
    log.error("rank %d failed: %s: %s; tearing down the pipeline", rank, type(error).__name__, error)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if earlier is not None and isinstance(error, PipelineRuntimeError):
        return PipelineRuntimeError(f"rank {rank} stopped because {earlier}")
    return error
