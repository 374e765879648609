"""Pipeline × data parallelism with the engines users trust: DDP or FSDP2 on each stage module.

ZeRO-1 (``data_parallel="zero1"``) wraps each stage as DDP does (over tensor-parallel stages, as
DDP does there); only its optimizer differs (:mod:`pipecut.runtime.grads.sharded_optimizer`).

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

**Zero-bubble and ZBV** split each backward into an input pass (autograd towards the stage's
inputs only: no parameter gradient, no accumulator runs) and a weight pass later
(:mod:`pipecut.runtime.execution.backward_split`, ending in one ``torch.autograd.backward`` into
the parameters' accumulators). The step's last pass is then a weight pass: DDP's reducer is
armed before it (never before an input pass) and its accumulator hooks reduce bucket by bucket
inside it, overlapped as in an ordinary backward. FSDP2's hooks sit on the stage's inputs and
outputs, which a weight pass never reaches: every input pass runs with reduction off, and after
the step's last weight pass FSDP2's post-backward (reduce-scatter or all-reduce, then reshard)
is run by hand (:func:`pipecut.core.torch_private.fsdp_post_backward`), not overlapped.
Stages of one rank that hold one parameter (a tied weight whose first and last stages ZBV's V
puts on one rank) are one FSDP2 unit, reducing after the last pass of either stage. The last
pass follows each step's own schedule (:meth:`Replication.follow`): a smaller last batch runs
fewer microbatches.

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
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipecut.core.kinds import DataParallelKind
from pipecut.core.torch_private import SUPPORTED_TORCH, fsdp_post_backward, replicate_with_fsdp
from pipecut.errors import PipelineRuntimeError, PlanError
from pipecut.ir import Plan
from pipecut.options import schedule_origin
from pipecut.runtime.comm.sync import wait_for
from pipecut.runtime.execution.stage import StageWorker
from pipecut.schedules.format import Action, ActionKind

__all__ = ["Replication", "can_replicate_dtensors", "check_supported", "fsdp2_engine", "last_backwards", "replicate", "trainable_disagreement"]

_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def last_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage in ``actions``, the microbatch of its last backward pass that writes parameter
    gradients (:func:`_last_pass`).

    >>> from pipecut.schedules.standard import gpipe, one_f_one_b
    >>> last_backwards(gpipe(2, 4)[0]), last_backwards(one_f_one_b(2, 4)[0])
    ({0: 0}, {0: 3})
    """
    stages = dict.fromkeys(a.stage for a in actions if a.kind in _WRITES_GRADS)
    return {s: _last_pass(actions, [s])[1] for s in stages}


def check_supported(plan: Plan, kind: DataParallelKind, tensor_parallel: bool = False, *,
                    engine_origin: str = "") -> None:
    """Refuse what the wrappers cannot do on this torch, before anything is wrapped.
    ``engine_origin``: where ``kind`` came from when the user did not name it ("the default for
    ..."), said after it; the schedule's is read from what the plan records as asked."""
    if plan.schedule.splits_backward and fsdp2_engine(kind, tensor_parallel) and fsdp_post_backward() is None:
        ddp = "" if tensor_parallel else ", or data_parallel='ddp'"  # DDP over split stages is FSDP2's too
        raise PlanError(
            f"data_parallel={kind.value!r}{f' ({engine_origin})' if engine_origin else ''} with the {plan.schedule.value} schedule"
            f"{schedule_origin(plan.options)} needs FSDP2's post-backward to be run by hand after the last "
            f"weight pass, which torch {torch.__version__} does not expose; use schedule='1f1b'{ddp}, or a "
            f"torch in {SUPPORTED_TORCH}"
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

    def __init__(self, worker: StageWorker, group: dist.ProcessGroup, last_mb: int,
                 kind: DataParallelKind = DataParallelKind.DDP) -> None:
        self.worker = worker
        self.group = group
        self.last_mb = last_mb
        self.kind = kind
        """The engine asked for (DDP, or ZeRO-1, whose gradients DDP reduces), for messages."""
        self.trainable = _trainable(worker.program.module)
        self.ddp = self._wrap(init_sync=True)
        worker.grad_sync = self

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

    def before(self, kind: ActionKind, mb: int) -> None:
        # A split backward's input pass writes no parameter gradient (it never reaches an
        # accumulator, so the reducer's hooks do not fire in it): the reducer is armed before
        # the last pass that does, a whole backward or a weight pass.
        if kind is not ActionKind.INPUT and self.ddp is not None and mb == self.last_mb and self.worker.reduce_grads:
            self.ddp.reducer.prepare_for_backward([])

    def after(self, kind: ActionKind, mb: int) -> None:
        """After the reducing pass: a parameter the reducer waits for that got no gradient in
        the whole step (computed, but not on the loss's path: CLIP's ``post_layernorm`` under
        its classification head) leaves its bucket unreduced, and DDP says nothing until the
        next step. Refused here instead of training on gradients that differ per replica."""
        if kind is ActionKind.INPUT or self.ddp is None or mb != self.last_mb or not self.worker.reduce_grads:
            return
        unused = [n for n, p in self.worker.program.module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            raise PipelineRuntimeError(
                f"stage {self.worker.stage}: data_parallel={self.kind.value!r} cannot average this stage's gradients: "
                f"{', '.join(unused[:4])}{' …' if len(unused) > 4 else ''} got no gradient in the step (not on "
                f"the loss's path), so DDP's reducer never completes their buckets and the replicas' "
                f"gradients differ. Freeze them (requires_grad_(False) on pipe.named_parameters()), or use "
                f"data_parallel='fsdp'")

    def settle(self) -> None:
        pass

    def follow(self, actions: Sequence[Action]) -> None:
        self.last_mb = _last_pass(actions, [self.worker.stage])[1]

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
    """This rank's stage modules that share parameters (one module, or the stages of a tied
    weight that one rank holds, as ZBV's V places a model's first and last stages) under FSDP2,
    as one unit (or, ``shard=False``, FSDP2's replicate-only DDP, for tensor-parallel stages:
    gradients all-reduced over the replicas, DTensors and all). Wrapped one by one, such stages
    would each shard a copy of the shared parameter of their own, and the copies would get
    different gradients. The unit reduces once, at the end of its stages' last backward pass
    in the rank's schedule (``last``: that stage and microbatch). A change of the trainable
    set needs nothing more: FSDP2 reduces only the gradients a backward produced, and copies
    ``requires_grad`` from each sharded parameter to its gathered copy whenever it gathers,
    which every training step does since :meth:`settle` leaves the module sharded between
    steps."""

    def __init__(self, workers: Sequence[StageWorker], mesh: DeviceMesh, last: tuple[int, int], *,
                 shard: bool = True) -> None:
        one = len(workers) == 1
        root = workers[0].program.module if one else _Stages([w.program.module for w in workers])
        if shard:
            module = fully_shard(root, mesh=mesh, reshard_after_forward=False)
        else:
            replicate = replicate_with_fsdp()
            assert replicate is not None  # refused before: check_composable
            module = replicate(root, mesh=mesh)
        assert isinstance(module, FSDPModule)
        self.module = module
        self.root = root
        """The same object as ``module``, typed as the ``nn.Module`` it is."""
        self.workers = tuple(workers)
        self.last = last
        for i, worker in enumerate(workers):
            worker.grad_sync = _StageSync(self, worker.stage)
            worker.call = _without_cast_cache(root if one else functools.partial(root, i), worker.device)

    def _ends(self, stage: int, mb: int) -> bool:
        return (stage, mb) == self.last and self.workers[0].reduce_grads

    def _last(self, last: bool) -> None:
        """Tell the unit whether the backward pass about to end is the one that ends its step,
        at which it reduces the gradients and reshards."""
        self.module.set_requires_gradient_sync(last)
        self.module.set_is_last_backward(last)
        self.module.set_reshard_after_backward(last)

    def before(self, stage: int, kind: ActionKind, mb: int) -> None:
        # FSDP2's hooks run at the end of the autograd call that reaches the stage's inputs:
        # a whole backward, or a split backward's input pass, after which the weight pass has
        # still to write the gradients. Only a whole backward may end the step there.
        self._last(kind is ActionKind.BACKWARD and self._ends(stage, mb))

    def after(self, stage: int, kind: ActionKind, mb: int) -> None:
        if kind is ActionKind.WEIGHT and self._ends(stage, mb):
            self._last(True)
            run = fsdp_post_backward()
            assert run is not None  # refused before: check_supported
            run(self.root)

    def refresh(self) -> None:
        pass

    def follow(self, actions: Sequence[Action]) -> None:
        self.last = _last_pass(actions, [w.stage for w in self.workers])

    def settle(self) -> None:
        self.module.reshard()  # local: frees the gathered copies; a no-op where already sharded


class _Stages(torch.nn.Module):
    """Stage modules under one FSDP2 root: FSDP2 wants a single root module per unit, and runs
    its hooks around the root's forward, so each stage is called through it (``index``: which)."""

    def __init__(self, stages: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    def forward(self, index: int, *args: Any) -> Any:
        return self.stages[index](*args)


class _StageSync:
    """One stage's view of the FSDP2 unit that holds it."""

    def __init__(self, unit: _FsdpStage, stage: int) -> None:
        self.unit = unit
        self.stage = stage

    def before(self, kind: ActionKind, mb: int) -> None:
        self.unit.before(self.stage, kind, mb)

    def after(self, kind: ActionKind, mb: int) -> None:
        self.unit.after(self.stage, kind, mb)


def _sharing(workers: Mapping[int, StageWorker]) -> list[list[int]]:
    """This rank's stages, grouped where they hold one parameter object (transitively)."""
    groups: list[tuple[set[int], list[int]]] = []
    for stage, worker in sorted(workers.items()):
        ids = {id(p) for p in worker.program.module.parameters()}
        joined = [g for g in groups if g[0] & ids]
        merged = (ids.union(*(g[0] for g in joined)), sorted([stage, *(s for g in joined for s in g[1])]))
        groups = [g for g in groups if not g[0] & ids] + [merged]
    return sorted(stages for _, stages in groups)


class _Stage(Protocol):
    def refresh(self) -> None: ...
    def settle(self) -> None: ...
    def follow(self, actions: Sequence[Action]) -> None: ...


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

    def follow(self, actions: Sequence[Action]) -> None:
        """Before a training step: the rank's actions in it, whose last backward pass per
        wrapper reduces (a smaller last batch runs fewer microbatches than planned, and then
        another schedule)."""
        for stage in self.stages:
            stage.follow(actions)

    def refresh(self) -> None:
        """Follow changes of ``requires_grad`` since the wrappers were made. Call it only once
        every replica has the same trainable parameters (:func:`trainable_disagreement`):
        the wrappers of one stage's replicas reduce together."""
        for stage in self.stages:
            stage.refresh()


def _without_cast_cache(module: Callable[..., Any], device: torch.device) -> Any:
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
    missing = sorted(set(workers) - set(last_backwards(actions)))
    if missing:
        raise PlanError(f"stages {missing} have no backward in this rank's schedule {actions}")
    if not fsdp2_engine(kind, tensor_parallel):
        return Replication([_DdpStage(worker, group, _last_pass(actions, [stage])[1], kind)
                            for stage, worker in workers.items()])
    return Replication([
        _FsdpStage([workers[s] for s in unit], mesh, _last_pass(actions, unit), shard=kind is DataParallelKind.FSDP)
        for unit in _sharing(workers)
    ])


_WRITES_GRADS = (ActionKind.BACKWARD, ActionKind.WEIGHT)
"""The backward passes that write parameter gradients (a split backward's input pass writes none)."""


def _last_pass(actions: Sequence[Action], stages: Sequence[int]) -> tuple[int, int]:
    """The stage and microbatch of the last backward pass among ``stages`` that writes
    parameter gradients, where the wrappers of those stages reduce."""
    return [(a.stage, a.microbatch) for a in actions if a.stage in stages and a.kind in _WRITES_GRADS][-1]


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
