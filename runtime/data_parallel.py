"""Pipeline × data parallelism with the engines users trust: DDP or FSDP2 on each stage module.

Every stage module is wrapped over its replica group (the mesh's "dp" dimension): the ranks
holding the same stage in the D pipeline replicas. Within a step a stage runs M microbatch
forwards and backwards; gradients must be reduced once, overlapped with the backward that
comes last, and never on earlier ones. Which backward is last is a fact of the schedule, not of
microbatch numbers: in 1F1B forwards of later microbatches interleave with backwards of earlier
ones and the last backward is that of microbatch M − 1; GPipe runs backwards in reverse, so its
last is microbatch 0. :func:`last_backwards` reads it off the rank's action list.

- **DDP**: every forward runs under ``no_sync()``, so no forward arms the reducer; just before
  the stage's last backward the reducer is armed (``reducer.prepare_for_backward``, as
  ``torch.distributed.pipelining`` does), and that backward's autograd hooks all-reduce the
  accumulated gradients bucket by bucket while the backward still runs. The reducer waits for
  its buckets at the end of that backward, so averaged gradients are in ``.grad`` when it
  returns.
- **FSDP2**: ``fully_shard`` with ``reshard_after_forward=False`` (the parameters are gathered
  once and stay gathered across the step's microbatches); before each backward the module is
  told whether it is the last one (``set_requires_gradient_sync``, ``set_is_last_backward``,
  ``set_reshard_after_backward``): earlier backwards accumulate unsharded gradients, the last
  one reduce-scatters them and frees the gathered parameters. ``.grad`` of each parameter is
  then this rank's shard (a DTensor), and an optimizer over ``pipe.parameters()`` keeps
  only its shard of the state.

Under ``pipe.no_sync()`` (gradient accumulation) no backward of the step is the last one:
gradients accumulate locally, and the next step outside it reduces everything at once, as
DDP's own ``no_sync`` does.

Both average over replicas, as DDP does. Tied weights (one parameter on two stages of a
replica) are summed over their stages afterwards (``pipecut.runtime.tied``); the two reductions
are linear and act on different groups, so their order does not change the result, but the
tied sum must follow the replica average because only then are the gradients complete.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipecut.core.schedule import Action, ActionKind
from pipecut.errors import PlanError
from pipecut.parallel import DataParallelKind
from pipecut.plan import Plan, Recompute
from pipecut.runtime.stage import StageWorker

__all__: list[str] = []

_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def last_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage in ``actions``, the microbatch of its last backward action.

    >>> from pipecut.core.schedule import gpipe, one_f_one_b
    >>> last_backwards(gpipe(2, 4)[0]), last_backwards(one_f_one_b(2, 4)[0])
    ({0: 0}, {0: 3})
    """
    last: dict[int, int] = {}
    for a in actions:
        if a.kind in (ActionKind.BACKWARD, ActionKind.INPUT, ActionKind.WEIGHT):
            last[a.stage] = a.microbatch
    return last


def check_supported(plan: Plan, kind: DataParallelKind) -> None:
    """Refuse what the wrappers cannot do yet, before anything is wrapped."""
    if plan.schedule.splits_backward:
        raise PlanError(
            f"data_parallel={kind.value!r} cannot run the {plan.schedule.value} schedule: its weight pass "
            f"writes .grad with torch.autograd.grad, which neither DDP's nor FSDP's gradient "
            f"hooks see; use schedule='1f1b' or 'gpipe'"
        )
    recomputing = [s.index for s in plan.stages if s.recompute is not Recompute.NONE]
    if recomputing:
        raise PlanError(
            f"data_parallel={kind.value!r} with recompute (stages {recomputing}) is untested and "
            f"refused; plan without recompute (PartitionOptions(recompute='none')) or without a memory limit"
        )


class NoSyncForward:
    """Calls the DDP wrapper under ``no_sync()``: no forward arms the reducer (the last backward
    does), so forwards of later microbatches never start a reduction early."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def __call__(self, *args: Any) -> Any:
        with self.ddp.no_sync():
            return self.ddp(*args)


def _ddp(worker: StageWorker, group: dist.ProcessGroup, last_mb: int) -> None:
    module = worker.program.module
    device = worker.device
    if not any(p.requires_grad for p in module.parameters()):
        return  # a frozen stage has no gradient to average (and DDP refuses such a module)
    # Buffers (BatchNorm statistics) stay per replica rather than rank 0's at every forward.
    # torch >= 2.13 names this forward_sync_buffers and warns about the older broadcast_buffers.
    buffers: dict[str, Any] = {"forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers": False}
    ddp = DistributedDataParallel(
        module,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # no second copy of every gradient
        **buffers,
    )

    def before_backward(mb: int) -> None:
        if mb == last_mb and worker.reduce_grads:
            ddp.reducer.prepare_for_backward([])

    worker.call = NoSyncForward(ddp)
    worker.before_backward = before_backward


def _fsdp(worker: StageWorker, mesh: DeviceMesh, last_mb: int) -> None:
    module = fully_shard(worker.program.module, mesh=mesh, reshard_after_forward=False)
    assert isinstance(module, FSDPModule)

    def before_backward(mb: int) -> None:
        last = mb == last_mb and worker.reduce_grads
        module.set_requires_gradient_sync(last)
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)

    worker.before_backward = before_backward
    worker.call = _without_cast_cache(worker.program.module, worker.device)


def _without_cast_cache(module: torch.nn.Module, device: torch.device) -> Any:
    """Call ``module`` under the caller's autocast but with autocast's weight-cast cache off.

    Autocast caches the low-precision copy of each parameter until the outermost autocast
    exits. FSDP2 hands a stage fresh unsharded parameter tensors when it gathers them again,
    so a forward that reuses a copy cached by an earlier microbatch (1F1B: F0 B0 F1) sends its
    gradient to a tensor FSDP no longer reads, and that microbatch's weight gradients are lost.
    Casting again on every forward costs one cast per weight per microbatch."""

    def call(*args: Any) -> Any:
        if not torch.is_autocast_enabled(device.type):
            return module(*args)
        with torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False):
            return module(*args)

    return call


def replicate(
    workers: Mapping[int, StageWorker],
    actions: Sequence[Action],
    kind: DataParallelKind,
    *,
    group: dist.ProcessGroup,
    mesh: DeviceMesh,
) -> None:
    """Wrap each of this rank's stage modules over its replica group (``mesh``: the 1-D "dp"
    mesh of ``group``), with gradient reduction overlapped with the stage's last backward."""
    last = last_backwards(actions)
    for stage, worker in workers.items():
        if stage not in last:
            raise PlanError(f"stage {stage} has no backward in this rank's schedule {actions}")
        if kind is DataParallelKind.DDP:
            _ddp(worker, group, last[stage])
        else:
            _fsdp(worker, mesh, last[stage])


def average_loss(loss: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The step's loss averaged over replicas, in place (each replica's share is equal)."""
    dist.all_reduce(loss, group=group)
    loss /= dist.get_world_size(group)

