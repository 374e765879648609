"""The per-rank handle returned by ``pipecut.compile``: ``step``, parameters, state dict."""

from __future__ import annotations

import contextlib
import datetime
import itertools
from collections.abc import Generator, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.core.batching import batch_size, split_by_sizes
from pipecut.core.program import Captured, Inputs
from pipecut.core.shapes import (
    AutocastState,
    Signature,
    check_microbatch,
    loss_weights,
    microbatch_sizes,
    planned_signature,
    signature,
)
from pipecut.errors import InputError, PipecutError, PipelineRuntimeError
from pipecut.ir import NodeCost, Plan
from pipecut.runtime.built import BuiltPipeline, Timeline
from pipecut.runtime.comm.failure import abort
from pipecut.runtime.comm.nccl import check_nccl
from pipecut.runtime.comm.p2p import Step, comm_program, wiring
from pipecut.runtime.execution.compiled import CompileStats
from pipecut.runtime.execution.executor import Event, run_actions
from pipecut.runtime.execution.forward import ModeSwitch, collecting, concat_microbatches
from pipecut.runtime.execution.stage import StageWorker, tree_to
from pipecut.runtime.execution.trace import chrome_trace, write_chrome_trace
from pipecut.runtime.grads.collective import (
    LossReduction,
    clip_grad_norm_,
    loss_divisor,
    replica_share,
    scale_loss_fn,
    sharded_grad_scaler,
    share_loss,
)
from pipecut.runtime.grads.data_parallel import Replication, trainable_disagreement
from pipecut.runtime.grads.sharded_optimizer import make_optimizer
from pipecut.runtime.grads.tied import TiedGrads
from pipecut.runtime.state.export import export
from pipecut.schedules.format import Schedule, forward_only

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's stage(s) of a pipelined model.

    Every rank of a pipeline calls :meth:`step` with the same batch; with data parallelism
    (a ``("dp", "pp")`` DeviceMesh), the ranks of each replica pass that replica's own share.
    """

    def __init__(self, built: BuiltPipeline) -> None:
        self.built = built
        """What the build made: stages, wiring, schedule, groups, replication (frozen)."""
        self.tied = TiedGrads(built.groups.tied)
        """Tied weights' gradients, summed over their stages once per contribution."""
        self._reduce = True
        """Whether steps reduce gradients across ranks (False inside :meth:`no_sync`)."""
        self._copies = self.dp_group is not None or any(
            len({self.plan.rank_of(s) for s in t.stages}) > 1 for t in self.plan.tied)
        """Whether some parameter has copies on several ranks (replicas, tied weights), which
        must agree on ``requires_grad`` before every training step; the same on every rank."""
        self.events: list[Event] = []
        self._programs: dict[tuple[bool, bool, int], tuple[Step, ...]] = {}
        """This rank's sends, receives and actions in order, per (mode, backward or not,
        microbatches): checked under NCCL's rules when first built (see :meth:`_program`)."""
        self._device = next(iter(self.workers.values())).device
        self._modes = built.modes
        self.training = built.modes.captured_training if built.modes is not None else True
        """The mode :meth:`step` runs in (the model's mode at compile until changed)."""

    # What the build made, read-only: a changed pipeline is a new one (pipecut.runtime.built).
    @property
    def plan(self) -> Plan:
        return self.built.plan

    @property
    def captured(self) -> Captured:
        return self.built.captured

    @property
    def workers(self) -> Mapping[int, StageWorker]:
        """This rank's stages in the captured mode, by stage index."""
        return self.built.workers

    @property
    def schedule(self) -> Schedule:
        return self.built.schedule

    @property
    def rank(self) -> int:
        """This rank's index in the pipeline group."""
        return self.built.rank

    @property
    def ranks(self) -> tuple[int, ...]:
        """The pipeline group's global ranks, by pipeline rank."""
        return self.built.ranks

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.built.groups.pipeline

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's stages in the other replicas, or None."""
        return self.built.groups.data_parallel

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split this rank's stages between them (a "tp" dimension), or None."""
        return self.built.groups.tensor

    @property
    def state_group(self) -> dist.ProcessGroup | None:
        """With tensor parallelism: the ranks holding one copy of the model, over which
        checkpoints are written and read; None: the pipeline group."""
        return self.built.groups.state

    @property
    def replication(self) -> Replication | None:
        """The data-parallel wrappers of this rank's stages, or None."""
        return self.built.replication

    @property
    def timeout(self) -> datetime.timedelta:
        return self.built.timeout

    @property
    def loss_reduction(self) -> LossReduction:
        return self.built.loss_reduction

    @property
    def predicted(self) -> Timeline:
        """The plan's predicted (action, start ms, end ms), shown beside a measured trace."""
        return self.built.predicted

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank runs (several with an interleaved schedule)."""
        return tuple(sorted(self.workers))

    @property
    def stage(self) -> int:
        """This rank's (first) stage."""
        return self.stages[0]

    @property
    def modules(self) -> tuple[torch.nn.Module, ...]:
        """This rank's stage GraphModules; their parameters carry the original model's names."""
        return tuple(self.workers[s].program.module for s in self.stages)

    @property
    def compile_stats(self) -> list[CompileStats]:
        """With ``compile_stages``: per stage of this rank and per mode built (train, and eval
        where its graph differs), the graphs compiled and the seconds it took; else empty."""
        return [w.compiled for w in self.built_workers() if w.compiled is not None]

    @property
    def modes(self) -> ModeSwitch | None:
        """This rank's train and eval stage programs (None: one set of programs for both)."""
        return self._modes

    def built_workers(self) -> list[StageWorker]:
        """This rank's stage workers of every mode built (train, and eval where its graph differs)."""
        workers = {id(w): w for w in self.workers.values()}
        for mode in (True, False) if self._modes is not None else ():
            with contextlib.suppress(PipecutError):  # a mode this model cannot run has none
                workers.update({id(w): w for w in self._modes.workers(mode).values()})  # type: ignore[union-attr]
        return list(workers.values())

    @property
    def module(self) -> torch.nn.Module:
        """This rank's stage GraphModule (one stage per rank; see :attr:`modules` otherwise)."""
        if len(self.workers) != 1:
            raise AttributeError(
                f"rank {self.rank} runs stages {self.stages}: use pipe.modules, "
                f"pipe.named_parameters() or pipe.state_dict()"
            )
        return self.modules[0]

    def _public(self, name: str) -> str | None:
        """The user's model's name for a stage tensor (None: the model has no such tensor)."""
        names = self.captured.names
        return name if names is None else names.public(name)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under the model's own names (a tied weight: its first name,
        as ``model.named_parameters()`` gives it), each once."""
        seen: set[int] = set()
        for name, p in itertools.chain.from_iterable(m.named_parameters() for m in self.modules):
            if id(p) not in seen:
                seen.add(id(p))
                yield self._public(name) or name, p

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None,
                  **defaults: Any) -> torch.optim.Optimizer:
        """This rank's optimizer: ``optimizer_class(params, **defaults)`` over
        :meth:`parameters` (or ``params``: tensors or param groups of them), except under
        ``data_parallel="zero1"``, where its state is sharded over the replicas (torch's
        ``ZeroRedundancyOptimizer``, :mod:`pipecut.runtime.grads.sharded_optimizer`); there an
        optimizer built by hand would hold the whole state on every replica.

        >>> opt = pipe.optimizer(torch.optim.AdamW, lr=3e-4)  # doctest: +SKIP
        """
        dp = self.plan.data_parallel
        kind = dp.resolved_kind if dp is not None and dp.is_resolved else None
        return make_optimizer(self.parameters() if params is None else params, optimizer_class, kind,
                              self.dp_group, **defaults)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers that the model has, under the model's names, each once (constants
        that torch.export lifted into buffers are left out)."""
        seen: set[int] = set()
        for name, b in itertools.chain.from_iterable(m.named_buffers() for m in self.modules):
            public = self._public(name)
            if id(b) not in seen and public is not None:
                seen.add(id(b))
                yield public, b

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of ``model.state_dict()``: its keys (every alias of a tied weight,
        no non-persistent buffer or lifted constant), so the ranks' dicts merged load into the
        plain model with ``strict=True``."""
        names = self.captured.names
        out: dict[str, Any] = {}
        for m in self.modules:
            for name, t in m.state_dict().items():
                for key in (name,) if names is None else names.state.get(name, ()):
                    out[key] = t
        return out

    def train(self, mode: bool = True) -> Pipeline:
        """Train (or, ``False``, eval) mode for every later step, as ``model.train(mode)``:
        dropout, BatchNorm statistics and ``self.training`` branches behave as in the plain
        model, on both capture paths (the graph of each mode is derived at compile). Raises,
        changing nothing, if this model cannot run in that mode pipelined."""
        if self._modes is None:
            for m in self.modules:
                m.train(mode)
        else:
            self._modes.workers(mode)  # raises (alike on every rank) if the mode cannot run
            self._modes.set(mode)
        self.training = mode
        return self

    def eval(self) -> Pipeline:
        """``train(False)``."""
        return self.train(False)

    def _active(self) -> Mapping[int, StageWorker]:
        return self._modes.workers(self.training) if self._modes is not None else self.workers

    @property
    def timeline(self) -> list[Event]:
        """This rank's actions in the last step run with ``record=True``."""
        return list(self.events)

    @property
    def peak_activation_bytes(self) -> int:
        """Peak bytes of activations this rank's stages kept for backward in the last step."""
        return sum(w.meter.peak for w in self._active().values())

    def trace(self, path: str | Path | None = None) -> dict[str, Any] | None:
        """Gather every rank's timeline of the last recorded step; pipeline rank 0 returns (and
        writes) Chrome trace JSON with the measured and the predicted schedule side by side."""
        spans = [(e.action, e.start, e.end) for e in self.events]
        gathered: list[Any] = [None] * len(self.ranks) if self.rank == 0 else []
        dist.gather_object(spans, gathered if self.rank == 0 else None, dst=self.ranks[0], group=self.group)
        if self.rank != 0:
            return None
        trace = chrome_trace(gathered, list(self.predicted))
        if path is not None:
            write_chrome_trace(path, trace)
        return trace

    def _microbatches(
        self, inputs: Inputs
    ) -> tuple[list[dict[str, Any]], tuple[Fraction, ...], tuple[int, ...], list[Mapping[str, NodeCost] | None]]:
        """Microbatches, the factor of each one's loss, their sizes, and each one's wire specs.
        Everything here depends only on the batch (and, with replicas, the other replicas'
        batch sizes) and the autocast state, so it is the same on every rank of a pipeline,
        and any refusal (an InputError) happens on every rank before anything is sent."""
        flat = self.captured.flatten_inputs(inputs, "step")
        size = batch_size(flat)
        share = replica_share(size, self.dp_group, self._device, self.timeout) if self.dp_group is not None else 1
        sizes = microbatch_sizes(size, self.plan)
        mbs = split_by_sizes(flat, sizes)
        names = self.captured.input_names
        autocast = AutocastState.current(self._device.type)
        wire: list[Mapping[str, NodeCost] | None] = []
        for mb in mbs:
            check_microbatch(self.plan, names, mb)
            wire.append(self._resolve(signature(mb, autocast), mb))
        weights = tuple(w * share for w in loss_weights(sizes))
        return [dict(zip(names, tree_to(mb, self._device))) for mb in mbs], weights, sizes, wire

    def _resolve(self, sig: Signature, mb: Sequence[Any]) -> Mapping[str, NodeCost] | None:
        # the mode's own graph names its cut values itself (an export graph's other mode)
        wire = (self._modes.wire(self.training) if self._modes is not None else None) or self.built.wire
        if wire is not None:
            return wire(sig, mb)  # type: ignore[no-any-return]
        planned = planned_signature(self.plan)
        if sig.autocast.enabled or [p for p in sig.inputs if isinstance(p, tuple)] != [
            p for p in planned.inputs if isinstance(p, tuple)
        ]:
            raise InputError(
                f"this pipeline was built without a wire resolver, so it runs only the planned "
                f"microbatch shapes {planned.inputs} without autocast; got {sig}; build it with "
                f"pipecut.compile"
            )
        return None

    def step(
        self,
        inputs: Inputs,
        target: Any = None,
        *,
        record: bool = False,
        return_outputs: bool = False,
        all_ranks: bool = False,
        compute_loss: bool | None = None,
        scaler: Any = None,
        normalizer: Any = None,
    ) -> Any:
        """Forward and backward one full batch; returns the step's loss on every rank.

        The batch may be smaller than planned (a last batch) and its non-batch dimensions
        shorter, within ``plan.accepts``; microbatch losses are weighted by their sizes, so the
        result is the whole batch's mean loss even when microbatches are uneven. Under
        ``torch.autocast`` cut tensors travel in the dtypes autocast gives them.

        Gradients accumulate into this rank's parameters' ``.grad`` as with ``loss.backward()``.
        The loss is the mean of the microbatch losses, or with ``loss_reduction="sum"`` their
        sum divided by ``normalizer`` (counted over the whole batch, the same on every rank).
        ``scaler`` (from :meth:`grad_scaler`): backward starts from ``scaler.scale(loss)``, as
        ``scaler.scale(loss).backward()`` does; the loss returned is unscaled.
        Under ``torch.no_grad()`` only the forward runs (see :meth:`eval_step`): no backward, no
        ``.grad`` written, no gradient reduction. ``return_outputs=True`` returns ``(loss,
        outputs)``: the model's outputs for the whole batch (microbatches concatenated along
        dimension 0, in the model's output structure, detached) on the last stage's rank, None
        elsewhere, or on every rank with ``all_ranks=True``. ``compute_loss`` (forward only)
        defaults to True unless only outputs are asked for (``return_outputs`` and no target);
        without a loss, None is returned in its place. ``record=True`` keeps this rank's
        action timeline (see :meth:`trace`). If anything fails on this rank, its process groups
        are torn down so that the other ranks fail at once with an error naming this rank,
        instead of waiting for their timeout.

        Args:
            inputs: One full batch, as ``example_inputs`` were given.
            target: The batch's target for ``loss_fn``.
            record: Keep this rank's action timeline.
            return_outputs: Return ``(loss, outputs)``.
            all_ranks: With ``return_outputs``, the outputs on every rank.
            compute_loss: Forward only: compute the loss (default: unless only outputs are
                asked for).
            scaler: A :meth:`grad_scaler`; backward starts from the scaled loss.
            normalizer: With ``loss_reduction="sum"``, what the summed loss is divided by.

        Returns:
            The step's loss (a scalar tensor, the same on every rank; None without a loss), or
            ``(loss, outputs)`` with ``return_outputs``.

        Raises:
            InputError: The batch does not fit the plan (shapes, microbatches), or a training
                step without its loss; raised on every rank before any communication.
            PipelineRuntimeError: This rank or another failed during the step.
        """
        training = torch.is_grad_enabled()
        if compute_loss is None:
            compute_loss = target is not None or not return_outputs
        if training and not compute_loss:
            raise InputError(
                "a training step needs the loss (compute_loss=False was given with gradients "
                "enabled); run it under torch.no_grad() or use pipe.eval_step for outputs only"
            )
        if self._modes is not None:
            self._modes.check(self.training)
        try:
            refused = self._follow_trainable() if training else None
            if refused is None:
                self._weigh_loss(scaler, normalizer)
                return self._step(inputs, target, record, training, return_outputs, all_ranks, compute_loss)
        except InputError:
            raise  # raised identically on every rank before any communication
        except BaseException as e:
            raise abort(dist.get_rank(), e) from e
        raise refused  # the same on every rank, before anything of the step ran: the groups stay up

    def eval_step(
        self,
        inputs: Inputs,
        target: Any = None,
        *,
        record: bool = False,
        return_outputs: bool = False,
        all_ranks: bool = False,
        compute_loss: bool | None = None,
    ) -> Any:
        """:meth:`step` under ``torch.no_grad()``: forward only, in the pipeline's current mode
        (call :meth:`eval` first for dropout off and BatchNorm running statistics).

        Args:
            inputs: One full batch, as ``example_inputs`` were given.
            target: The batch's target for ``loss_fn``.
            record: Keep this rank's action timeline.
            return_outputs: Return ``(loss, outputs)``.
            all_ranks: With ``return_outputs``, the outputs on every rank.
            compute_loss: Compute the loss (default: unless only outputs are asked for).

        Returns:
            The loss (None without one), or ``(loss, outputs)`` with ``return_outputs``.

        Raises:
            InputError: The batch does not fit the plan.
            PipelineRuntimeError: This rank or another failed during the step.
        """
        with torch.no_grad():
            return self.step(inputs, target, record=record, return_outputs=return_outputs,
                             all_ranks=all_ranks, compute_loss=compute_loss)

    def _step(
        self, inputs: Inputs, target: Any, record: bool, training: bool, return_outputs: bool,
        all_ranks: bool, compute_loss: bool,
    ) -> Any:
        mb_inputs, weights, sizes, wire = self._microbatches(inputs)
        m = len(sizes)
        targets = (
            [tree_to(t, self._device) for t in split_by_sizes(target, sizes, "target")]
            if target is not None
            else [None] * m
        )
        schedule = self.schedule
        if m != self.plan.microbatches:
            if self.built.schedule_for is None:
                raise InputError(
                    f"a batch of {sum(sizes)} needs {m} microbatches; this pipeline runs only the "
                    f"planned {self.plan.microbatches}: build it with pipecut.compile"
                )
            schedule = self.built.schedule_for(m)
        workers = self._active()
        program = self._program(schedule, workers, training, m)
        last = workers.get(self.plan.num_stages - 1)
        for w in workers.values():
            w.prepare(wire, weights)
            w.reduce_grads = self._reduce
        if training and self.replication is not None:
            self.replication.follow(schedule[self.rank])
        if training:
            self.tied.begin(self._canonical_parameters())
        if record:
            dist.barrier(group=self.group)  # align the ranks' clocks for the timeline
        with contextlib.ExitStack() as stack:
            outputs: list[Any] = []
            if last is not None:
                outputs = stack.enter_context(
                    collecting(last, keep_outputs=return_outputs, compute_loss=compute_loss))
            loss, events = run_actions(workers, program, mb_inputs, targets, record)
        if self.replication is not None:
            self.replication.settle()
        self.events = events
        if training:
            self.tied.end(self._canonical_parameters(), reduce=self._reduce)
        result: torch.Tensor | None = None
        if compute_loss:  # in the loss's dtype on every rank (see share_loss)
            result = share_loss(loss, src=self.ranks[self.plan.rank_of(self.plan.num_stages - 1)],
                                group=self.group, dp_group=self.dp_group, device=self._device)
        if not return_outputs:
            return result
        whole = concat_microbatches(outputs, sizes) if outputs else None
        if all_ranks:
            box = [tree_to(whole, torch.device("cpu"))]
            dist.broadcast_object_list(box, src=self.ranks[self.plan.rank_of(self.plan.num_stages - 1)],
                                       group=self.group)
            whole = tree_to(box[0], self._device)
        return result, whole

    def _follow_trainable(self) -> PipelineRuntimeError | None:
        """Before a training step: where parameters have copies on several ranks, every rank
        agrees on which require grad (else the error every rank raises), and the data-parallel
        wrappers follow a change since the last step (freezing between steps)."""
        if not self._copies:
            return None
        names = list(dict.fromkeys(fqn for s in self.plan.stages for fqn in s.parameters))
        refused = trainable_disagreement(self._canonical_parameters(), names, self._device, self.timeout)
        if refused is None and self.replication is not None:
            self.replication.refresh()
        return refused

    def _canonical_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters, each once, under the captured graph's first name for it
        (the names the plan's tied groups use)."""
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for m in self.modules:
            for name, p in m.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), (self.built.aliases.get(name, name), p))
        return list(seen.values())

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation without communication, as DDP's ``no_sync``: steps inside
        reduce no gradient across ranks (data-parallel replicas, tied weights' stages); their
        gradients accumulate locally, and the first step after the block reduces everything
        at once. Run the last step of an accumulation window outside the block::

            with pipe.no_sync():
                pipe.step(batch_1, target_1)
            pipe.step(batch_2, target_2)   # reduces both steps' gradients
            opt.step(); opt.zero_grad()

        Accumulating without ``no_sync`` is exact too, only slower. Until the reducing step,
        ``.grad`` of a tied weight holds this stage's own contributions only, and clipping is
        refused."""
        previous = self._reduce
        self._reduce = False
        try:
            yield
        finally:
            self._reduce = previous

    def _program(
        self, schedule: Schedule, workers: Mapping[int, StageWorker], training: bool, m: int
    ) -> tuple[Step, ...]:
        """The communication program of this step's variant: the active mode's graph (its
        plan's wiring), forward only under no_grad, ``m`` microbatches (a smaller last batch).
        Built once per variant, identically on every rank, and refused before anything is sent
        if it could hang under NCCL's rules."""
        key = (self.training, training, m)
        if key not in self._programs:
            variant = schedule if training else tuple(forward_only(r) for r in schedule)
            cuts = wiring(next(iter(workers.values())).plan)
            check_nccl(variant, cuts)
            self._programs[key] = comm_program(variant, self.rank, cuts)
        return self._programs[key]

    def _weigh_loss(self, scaler: Any, normalizer: Any) -> None:
        """Tell the stages what each microbatch's loss is divided by and how it is scaled."""
        replicas = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        divisor = loss_divisor(self.loss_reduction, self.plan.microbatches, normalizer, replicas)
        scale = scale_loss_fn(scaler, self.ranks, self._device)
        for w in self._active().values():
            # A mean is weighted by microbatch sizes instead (uneven last batches; see prepare).
            w.loss_divisor = None if self.loss_reduction is LossReduction.MEAN else divisor
            w.scale_loss = scale

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole model: the total norm over all
        stages (a tied weight counted once), the same on every rank, every rank's gradients
        scaled by the same coefficient. Collective over the pipeline group; with data
        parallelism, replicas hold equal gradients after ``step``, so each replica reduces
        over its own pipeline group only."""
        if self.tied.pending or not self._reduce:
            raise PipelineRuntimeError(
                f"rank {self.rank}: clip_grad_norm_ after steps under no_sync(), whose gradients "
                f"are not reduced across ranks yet; run the window's last step outside "
                f"no_sync() first, then clip"
            )
        named = [(self.built.aliases.get(n, n), p) for n, p in self.named_parameters()]
        return clip_grad_norm_(named, self.plan, self.rank, self.group, self._device, max_norm,
                               norm_type, error_if_nonfinite, foreach)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """A ``ShardedGradScaler`` over the pipeline group, for ``step(..., scaler=)``: every
        rank skips the same steps and updates the scale identically. ``kwargs``: init_scale,
        growth_factor, backoff_factor, growth_interval, enabled."""
        return sharded_grad_scaler(self._device, self.group, **kwargs)

    def save_pretrained(self, directory: str | Path, model: torch.nn.Module | None = None) -> Path:
        """Write the model's weights into ``directory`` as Hugging Face does: one safetensors
        shard per rank with its stage's tensors under the model's names (a tied weight once),
        ``model.safetensors.index.json``, and ``config.json`` when the model compiled has a
        config. ``model`` (optional: the model given to compile, on meta or not) adds its class
        to the config's ``architectures``. ``from_pretrained``, ``load_state_dict`` and
        ``compile(..., weights=directory)`` read it. Collective: every rank calls it; with data
        parallelism replica 0 writes. See :func:`pipecut.runtime.state.export.export`.

        Args:
            directory: Where to write (created if needed).
            model: The model given to compile, for its class name in ``config.json``.

        Returns:
            ``directory`` as a :class:`~pathlib.Path`.

        Raises:
            InputError: ``directory`` holds a pipecut checkpoint (``.metadata``).
            PipelineRuntimeError: Another rank failed while writing.
        """
        return export(self, directory, model)
