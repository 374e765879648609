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
  only its shard of the state. Between steps every module holds its sharded parameters
  (:meth:`Replication.settle`).
- **DDP over tensor-parallel stages**: DistributedDataParallel does not reduce DTensor
  gradients, so such a stage is wrapped by FSDP2's replicate-only twin (``replicate`` from
  ``torch.distributed._composable.replicate_with_fsdp``), driven exactly as FSDP2 above: whole
  parameters on every replica, gradients all-reduced in the last backward.

Under ``pipe.no_sync()`` (gradient accumulation) no backward of the step is the last one:
gradients accumulate locally, and the next step outside it reduces everything at once, as
DDP's own ``no_sync`` does.

**Freezing between steps** (``requires_grad_`` on ``pipe.named_parameters()`` after compile):
before every training step all ranks check that every copy of a parameter has the same
``requires_grad`` (:func:`trainable_disagreement`: refused alike on every rank otherwise), and
then each wrapper follows the change (:meth:`Replication.refresh`: DDP builds its reducer
again, FSDP2 gathers with the new flags), so frozen parameters get no gradient and the others
are averaged, as in the plain model doing the same freezing.

Both average over replicas, as DDP does. Tied weights (one parameter on two stages of a
replica) are summed over their stages afterwards (``pipecut.runtime.grads.tied``); the two reductions
are linear and act on different groups, so their order does not change the result, but the
tied sum must follow the replica average because only then are the gradients complete.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipecut.core.kinds import DataParallelKind, Recompute
from pipecut.core.torch_private import replicate_with_fsdp
from pipecut.errors import PipelineRuntimeError, PlanError
from pipecut.ir import Plan
from pipecut.runtime.comm.sync import wait_for
from pipecut.runtime.execution.stage import StageWorker
from pipecut.schedules.format import Action, ActionKind

__all__ = ["Replication", "can_replicate_dtensors", "check_supported", "fsdp2_engine", "last_backwards", "replicate", "trainable_disagreement"]

_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def last_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage in ``actions``, the microbatch of its last backward action.

    >>> from pipecut.schedules.format import gpipe, one_f_one_b
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


def _trainable(module: torch.nn.Module) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in module.parameters())


class _DdpStage:
    """One stage module under DDP, wrapped again when the set of its parameters that require
    grad changes. DDP's reducer is built over the parameters that require grad when it is
    made, and expects a gradient for each of them in every reducing backward: a parameter
    frozen later never gets one, so its bucket is never reduced (the step's gradients are not
    averaged) and the next step fails ("Expected to have finished reduction in the prior
    iteration"); one unfrozen later is never averaged at all. ``find_unused_parameters`` would
    cover only the first case, and traverses the graph on every backward; a new reducer costs
    nothing per step. The new wrapper skips DDP's init-time broadcast (``init_sync=False``):
    the replicas' parameters are already equal, and buffers stay per replica."""

    def __init__(self, worker: StageWorker, group: dist.ProcessGroup, last_mb: int) -> None:
        self.worker = worker
        self.group = group
        self.last_mb = last_mb
        self.trainable = _trainable(worker.program.module)
        self.ddp = self._wrap(init_sync=True)
        worker.before_backward = self.before_backward

    def _wrap(self, init_sync: bool) -> DistributedDataParallel | None:
        module = self.worker.program.module
        if not any(self.trainable):  # no gradient to average (and DDP refuses such a module)
            self.worker.call = module
            return None
        device = self.worker.device
        # Buffers (BatchNorm statistics) stay per replica rather than rank 0's at every forward.
        # torch >= 2.13 names this forward_sync_buffers and warns about the older broadcast_buffers.
        buffers: dict[str, Any] = {"forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers": False}
        ddp = DistributedDataParallel(
            module,
            process_group=self.group,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # no second copy of every gradient
            init_sync=init_sync,
            **buffers,
        )
        self.worker.call = NoSyncForward(ddp)
        return ddp

    def before_backward(self, mb: int) -> None:
        if self.ddp is not None and mb == self.last_mb and self.worker.reduce_grads:
            self.ddp.reducer.prepare_for_backward([])

    def settle(self) -> None:
        pass

    def refresh(self) -> None:
        """Wrap the module again if its trainable parameters changed since it was wrapped.
        Gradients accumulated so far are kept: the new reducer copies them into its buckets."""
        now = _trainable(self.worker.program.module)
        if now == self.trainable:
            return
        if self.ddp is not None:  # the old reducer's hooks would still fire in every backward
            self.ddp._remove_autograd_hooks()
        self.trainable = now
        self.ddp = self._wrap(init_sync=False)


def fsdp2_engine(kind: DataParallelKind, tensor_parallel: bool) -> bool:
    """Whether stage modules are wrapped by FSDP2's machinery, which swaps the parameter slots
    of the modules it wraps: ``fully_shard`` for FSDP, and for DDP over tensor-parallel stages
    its replicate-only twin (``torch.distributed._composable.replicate_with_fsdp``), since
    DistributedDataParallel does not reduce DTensor gradients."""
    return kind is DataParallelKind.FSDP or tensor_parallel


def can_replicate_dtensors() -> bool:
    """Whether this torch can run DDP over tensor-parallel stages (see :func:`fsdp2_engine`)."""
    return replicate_with_fsdp() is not None


class _FsdpStage:
    """One stage module under FSDP2 (or, ``shard=False``, FSDP2's replicate-only DDP, for
    tensor-parallel stages: gradients all-reduced over the replicas, DTensors and all). A change
    of the trainable set needs nothing more: FSDP2 reduces only the gradients a backward
    produced, and copies ``requires_grad`` from each sharded parameter to its gathered copy
    whenever it gathers, which every training step does since :meth:`settle` leaves the module
    sharded between steps."""

    def __init__(self, worker: StageWorker, mesh: DeviceMesh, last_mb: int, *, shard: bool = True) -> None:
        if shard:
            module = fully_shard(worker.program.module, mesh=mesh, reshard_after_forward=False)
        else:
            replicate = replicate_with_fsdp()
            assert replicate is not None  # refused before: check_composable
            module = replicate(worker.program.module, mesh=mesh)
        assert isinstance(module, FSDPModule)
        self.module = module
        self.worker = worker
        self.last_mb = last_mb
        worker.before_backward = self.before_backward
        worker.call = _without_cast_cache(worker.program.module, worker.device)

    def before_backward(self, mb: int) -> None:
        last = mb == self.last_mb and self.worker.reduce_grads
        self.module.set_requires_gradient_sync(last)
        self.module.set_is_last_backward(last)
        self.module.set_reshard_after_backward(last)

    def refresh(self) -> None:
        pass

    def settle(self) -> None:
        self.module.reshard()  # local: frees the gathered copies; a no-op where already sharded


class _Stage(Protocol):
    def refresh(self) -> None: ...
    def settle(self) -> None: ...


class Replication:
    """This rank's stage modules, each wrapped over its replica group."""

    def __init__(self, stages: Sequence[_Stage]) -> None:
        self.stages = tuple(stages)

    def settle(self) -> None:
        """After a step: each module holds its sharded parameters again. FSDP2 leaves them
        gathered after a forward-only step (``reshard_after_forward=False``) or a step under
        ``no_sync`` (gradients accumulate unsharded and stay so), and while gathered the
        module's parameters are the gathered copies: ``pipe.parameters()``, ``state_dict()``
        and a ``requires_grad_`` on them would not reach the parameters the optimizer holds
        (a freeze would be undone by the next gathering). Gradients accumulated unsharded
        are kept; the next step gathers again."""
        for stage in self.stages:
            stage.settle()

    def refresh(self) -> None:
        """Follow changes of ``requires_grad`` since the wrappers were made. Call it only once
        every replica has the same trainable parameters (:func:`trainable_disagreement`):
        the wrappers of one stage's replicas reduce together."""
        for stage in self.stages:
            stage.refresh()


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
    tensor_parallel: bool = False,
) -> Replication:
    """Wrap each of this rank's stage modules over its replica group (``mesh``: the 1-D "dp"
    mesh of ``group``), with gradient reduction overlapped with the stage's last backward.
    ``tensor_parallel``: the stages hold DTensor parameters split over a "tp" dimension."""
    last = last_backwards(actions)
    stages: list[_Stage] = []
    for stage, worker in workers.items():
        if stage not in last:
            raise PlanError(f"stage {stage} has no backward in this rank's schedule {actions}")
        if not fsdp2_engine(kind, tensor_parallel):
            stages.append(_DdpStage(worker, group, last[stage]))
        else:
            stages.append(_FsdpStage(worker, mesh, last[stage], shard=kind is DataParallelKind.FSDP))
    return Replication(stages)


def trainable_disagreement(
    held: Iterable[tuple[str, torch.nn.Parameter]],
    names: Sequence[str],
    device: torch.device,
    timeout: datetime.timedelta,
) -> PipelineRuntimeError | None:
    """The error to raise, the same on every rank, if ranks holding copies of one parameter
    disagree on whether it requires grad; None if they all agree. Collective over the default
    group (every rank calls it before every training step where parameters have copies on
    several ranks: data-parallel replicas, tied weights on several stages).

    A user freezes a parameter through ``pipe.named_parameters()`` on each rank; a rank that
    does not (one replica only, one holder of a tied weight only) would make the replicas'
    DDP/FSDP reductions cover different parameters, or a tied weight's sum run on some ranks
    only: garbage or a hang. ``held``: this rank's parameters under the plan's names
    (``names``: every parameter of the plan, in plan order, the same on every rank). One
    all-reduce of two counts per parameter (ranks where it trains, ranks where it is frozen);
    only when some parameter has both are the ranks' flags gathered, to name them."""
    index = {name: i for i, name in enumerate(names)}
    n = len(names)
    flags = [0.0] * (2 * n)
    mine: dict[str, bool] = {}
    for name, p in held:
        if name in index:
            flags[index[name] + (0 if p.requires_grad else n)] = 1.0
            mine[name] = p.requires_grad
    counts = torch.tensor(flags, dtype=torch.float64, device=device)
    wait_for([dist.all_reduce(counts, async_op=True)], "agreeing with every rank on which parameters train", timeout)
    both = [names[i] for i in torch.nonzero((counts[:n] > 0) & (counts[n:] > 0)).flatten().tolist()]
    if not both:
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: mine[name] for name in both if name in mine})
    details = "; ".join(
        f"{name!r} requires_grad=True on ranks {[r for r, f in enumerate(everyone) if f.get(name) is True]}, "
        f"False on ranks {[r for r, f in enumerate(everyone) if f.get(name) is False]}"
        for name in both
    )
    return PipelineRuntimeError(
        f"rank {dist.get_rank()}: the ranks holding a parameter disagree on whether it trains: "
        f"{details}. Its copies (one per data-parallel replica, one per stage of a tied weight) "
        f"must have the same requires_grad, or the replicas would average different gradients "
        f"(or a tied weight be summed on some ranks only). Set it alike on every rank before "
        f"the step, e.g. dict(pipe.named_parameters())[name].requires_grad_(False) on every "
        f"rank that holds it; this step did not run"
    )
