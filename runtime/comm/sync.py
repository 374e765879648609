"""Every rank starts from global rank 0's weights, as DistributedDataParallel does at construction.

Each rank builds the model itself, so a script that seeds its ranks differently (or not at all)
would train K different halves of K different models: two copies of a tied weight that never
agree, a pipeline matching no plain model. :func:`sync_from_rank0` makes every stage's
parameters and buffers equal to global rank 0's copy of them. Rank 0 holds the whole model, so it
sends each other rank (every rank of every data-parallel replica) the tensors of that rank's
stages, point to point: the tensors of one dtype flattened into buckets of at most
:data:`BUCKET_BYTES`, one bucket at a time, so that rank 0 never holds more than one bucket
beyond its own stage (on its GPU, with NCCL).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from pipecut.errors import PipelineRuntimeError

__all__ = ["wait_for"]

BUCKET_BYTES = 256 << 20
"""Largest flattened message (a single larger tensor travels alone)."""


def stage_state(modules: Sequence[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of a rank's stage modules, each name once, in a fixed order:
    rank 0 lists a rank's tensors exactly as that rank lists its own."""
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]:
            out.setdefault(name, t)
    return list(out.items())


def _buckets(tensors: Sequence[torch.Tensor], limit: int | None = None) -> list[list[int]]:
    """Indices of the tensors grouped by dtype (in order of first appearance), each group cut
    into runs of at most ``limit`` bytes (:data:`BUCKET_BYTES`). Sender and receiver compute
    the same buckets."""
    limit = BUCKET_BYTES if limit is None else limit
    groups: dict[torch.dtype, list[list[int]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for i, t in enumerate(tensors):
        runs = groups.setdefault(t.dtype, [[]])
        nbytes = t.numel() * t.element_size()
        if runs[-1] and sizes[t.dtype] + nbytes > limit:
            runs.append([])
            sizes[t.dtype] = 0
        runs[-1].append(i)
        sizes[t.dtype] = sizes.get(t.dtype, 0) + nbytes
    return [run for runs in groups.values() for run in runs]


def wait_for(works: Sequence[dist.Work], what: str, timeout: datetime.timedelta) -> None:
    """Wait for ``works`` at most ``timeout`` each; a PipelineRuntimeError naming ``what`` else."""
    for w in works:
        try:
            w.wait(timeout)
        except Exception as e:
            raise PipelineRuntimeError(
                f"rank {dist.get_rank()}: {what} timed out or failed after at most "
                f"{timeout.total_seconds():.0f} s: {e}"
            ) from e


def sync_from_rank0(
    mine: Sequence[torch.Tensor],
    sources: Mapping[int, Sequence[torch.Tensor]],
    device: torch.device,
    timeout: datetime.timedelta,
) -> None:
    """Copy global rank 0's values into ``mine`` on every other rank. Collective (default group).

    ``mine``: this rank's stage tensors, as :func:`stage_state` lists them. ``sources`` (global
    rank 0 only; ignored elsewhere): for every other global rank, rank 0's copy of that rank's
    tensors in the same order. On the meta device rank 0 has no values to send (its weights are
    loaded per stage): then nothing is sent, which rank 0 tells every rank first.
    """
    me = dist.get_rank()
    flag = [me == 0 and any(t.is_meta for ts in sources.values() for t in ts)]
    dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        return
    if me == 0:
        for dst in sorted(sources):
            tensors = list(sources[dst])
            for b, idx in enumerate(_buckets(tensors)):
                flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in idx])
                op = dist.P2POp(dist.isend, flat, dst, tag=b)
                wait_for(dist.batch_isend_irecv([op]), f"sending rank {dst} its stage weights", timeout)
        return
    for b, idx in enumerate(_buckets(mine)):
        flat = torch.empty(sum(mine[i].numel() for i in idx), dtype=mine[idx[0]].dtype, device=device)
        op = dist.P2POp(dist.irecv, flat, 0, tag=b)
        wait_for(dist.batch_isend_irecv([op]), "receiving its stage weights from rank 0", timeout)
        with torch.no_grad():
            offset = 0
            for i in idx:
                t = mine[i]
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
