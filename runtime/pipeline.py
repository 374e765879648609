"""The per-rank handle returned by ``pipecut.compile``: ``step``, parameters, state dict."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.batching import batch_size, split_microbatches
from pipecut.capture import Captured, Inputs
from pipecut.errors import InputError
from pipecut.fxutil import canonical_names
from pipecut.passes.stages import predicted_timeline
from pipecut.plan import LeafKind, Plan
from pipecut.runtime.failure import abort
from pipecut.runtime.schedule import Schedule
from pipecut.runtime.stage import Event, StageWorker, reduce_tied_grads, tree_to
from pipecut.runtime.trace import chrome_trace, write_chrome_trace


class Pipeline:
    """This rank's stage of a pipelined model. Every rank calls :meth:`step` with the same batch."""

    def __init__(
        self,
        *,
        plan: Plan,
        captured: Captured,
        worker: StageWorker,
        schedule: Schedule,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        tied_groups: Sequence[tuple[str, dist.ProcessGroup | None]],
    ) -> None:
        self.plan = plan
        self.captured = captured
        self.worker = worker
        self.schedule = schedule
        self.ranks = tuple(ranks)
        self.group = group
        self.tied_groups = tuple(tied_groups)
        self._canonical = canonical_names(captured.gm)

    @property
    def stage(self) -> int:
        return self.worker.stage

    @property
    def module(self) -> torch.nn.Module:
        """This stage's GraphModule; its parameters carry the original model's names."""
        return self.worker.program.module

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self

    @property
    def timeline(self) -> list[Event]:
        """This rank's actions in the last step run with ``record=True``."""
        return list(self.worker.events)

    @property
    def peak_activation_bytes(self) -> int:
        """Peak bytes of activations this stage kept for backward during the last step."""
        return self.worker.meter.peak

    def trace(self, path: str | Path | None = None) -> dict[str, Any] | None:
        """Gather every rank's timeline of the last recorded step; rank 0 returns (and writes)
        Chrome trace JSON with the measured and the predicted schedule side by side."""
        spans = [(e.action, e.start, e.end) for e in self.worker.events]
        gathered: list[Any] = [None] * len(self.ranks) if self.stage == 0 else []
        dist.gather_object(spans, gathered if self.stage == 0 else None, dst=self.ranks[0], group=self.group)
        if self.stage != 0:
            return None
        trace = chrome_trace(gathered, predicted_timeline(self.plan))
        if path is not None:
            write_chrome_trace(path, trace)
        return trace

    def _microbatches(self, inputs: Inputs) -> list[dict[str, Any]]:
        flat = self.captured.flatten_inputs(inputs)
        size = batch_size(flat)
        if size != self.plan.batch_size:
            raise InputError(
                f"step got a batch of {size}, the plan was made for {self.plan.batch_size} "
                f"({self.plan.microbatches} microbatches of {self.plan.batch_size // self.plan.microbatches}); "
                f"pass batches of the planned size or re-plan"
            )
        mbs = split_microbatches(flat, self.plan.microbatches, size)
        names = self.captured.input_names
        for name, value in zip(names, mbs[0]):
            node = self.plan.node(name)
            if isinstance(value, torch.Tensor) and node.leaves and node.leaves[0].kind is LeafKind.TENSOR:
                planned = node.leaves[0].shape
                if tuple(value.shape) != planned:
                    raise InputError(
                        f"input {name!r} has microbatch shape {tuple(value.shape)}, the plan has "
                        f"{planned}; pass inputs of the planned shape or re-plan"
                    )
        device = self.worker.device
        return [dict(zip(names, tree_to(mb, device))) for mb in mbs]

    def step(self, inputs: Inputs, target: Any = None, *, record: bool = False) -> torch.Tensor:
        """Forward and backward one full batch; returns the mean microbatch loss on every rank.

        Gradients accumulate into this stage's parameters' ``.grad`` as with ``loss.backward()``.
        ``record=True`` keeps this rank's action timeline (see :meth:`trace`). If anything fails
        on this rank, the pipeline's process group is torn down so that the other ranks fail
        at once with an error naming this rank, instead of waiting for their timeout.
        """
        try:
            return self._step(inputs, target, record)
        except InputError:
            raise  # raised identically on every rank before any communication
        except BaseException as e:
            raise abort(self.worker.rank, e) from e

    def _step(self, inputs: Inputs, target: Any, record: bool) -> torch.Tensor:
        mb_inputs = self._microbatches(inputs)
        m = self.plan.microbatches
        targets = (
            [tree_to(t, self.worker.device) for t in split_microbatches(target, m, self.plan.batch_size, "target")]
            if target is not None
            else [None] * m
        )
        if record:
            dist.barrier(group=self.group)  # align the ranks' clocks for the timeline
        loss = self.worker.run(self.schedule[self.stage], mb_inputs, targets, record=record)
        reduce_tied_grads(self.module, self._canonical, self.tied_groups)
        out = loss.detach().float() if loss is not None else torch.zeros((), device=self.worker.device)
        dist.broadcast(out, src=self.ranks[-1], group=self.group)
        return out
