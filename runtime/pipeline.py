"""The per-rank handle returned by ``pipecut.compile``: ``step``, parameters, state dict."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
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
from pipecut.runtime.executor import Event, run_actions
from pipecut.runtime.failure import abort
from pipecut.runtime.p2p import comm_program, wiring
from pipecut.runtime.schedule import Schedule
from pipecut.runtime.stage import StageWorker, reduce_tied_grads, tree_to
from pipecut.runtime.trace import chrome_trace, write_chrome_trace


class Pipeline:
    """This rank's stage(s) of a pipelined model.

    Every rank of a pipeline calls :meth:`step` with the same batch; with data parallelism
    (a ``("dp", "pp")`` DeviceMesh), the ranks of each replica pass that replica's own share.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        captured: Captured,
        workers: Mapping[int, StageWorker],
        schedule: Schedule,
        rank: int,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        tied_groups: Sequence[tuple[str, dist.ProcessGroup | None]],
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan = plan
        self.captured = captured
        self.workers = dict(workers)
        self.schedule = schedule
        self.rank = rank
        """This rank's index in the pipeline group."""
        self.ranks = tuple(ranks)
        self.group = group
        self.tied_groups = tuple(tied_groups)
        self.dp_group = dp_group
        self.events: list[Event] = []
        self._canonical = canonical_names(captured.gm)
        self._program = comm_program(schedule, rank, wiring(plan))
        """This rank's sends, receives and actions in order (checked under NCCL's rules in compile)."""
        self._device = next(iter(self.workers.values())).device

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
    def module(self) -> torch.nn.Module:
        """This rank's stage GraphModule (one stage per rank; see :attr:`modules` otherwise)."""
        if len(self.workers) != 1:
            raise AttributeError(
                f"rank {self.rank} runs stages {self.stages}: use pipe.modules, "
                f"pipe.named_parameters() or pipe.state_dict()"
            )
        return self.modules[0]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        seen: set[int] = set()
        for name, p in itertools.chain.from_iterable(m.named_parameters() for m in self.modules):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, b in itertools.chain.from_iterable(m.named_buffers() for m in self.modules):
            if id(b) not in seen:
                seen.add(id(b))
                yield name, b

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and persistent buffers under their original names."""
        out: dict[str, Any] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def train(self, mode: bool = True) -> Pipeline:
        for m in self.modules:
            m.train(mode)
        return self

    @property
    def timeline(self) -> list[Event]:
        """This rank's actions in the last step run with ``record=True``."""
        return list(self.events)

    @property
    def peak_activation_bytes(self) -> int:
        """Peak bytes of activations this rank's stages kept for backward in the last step."""
        return sum(w.meter.peak for w in self.workers.values())

    def trace(self, path: str | Path | None = None) -> dict[str, Any] | None:
        """Gather every rank's timeline of the last recorded step; pipeline rank 0 returns (and
        writes) Chrome trace JSON with the measured and the predicted schedule side by side."""
        spans = [(e.action, e.start, e.end) for e in self.events]
        gathered: list[Any] = [None] * len(self.ranks) if self.rank == 0 else []
        dist.gather_object(spans, gathered if self.rank == 0 else None, dst=self.ranks[0], group=self.group)
        if self.rank != 0:
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
        return [dict(zip(names, tree_to(mb, self._device))) for mb in mbs]

    def step(self, inputs: Inputs, target: Any = None, *, record: bool = False) -> torch.Tensor:
        """Forward and backward one full batch; returns the mean microbatch loss on every rank.

        Gradients accumulate into this rank's parameters' ``.grad`` as with ``loss.backward()``.
        ``record=True`` keeps this rank's action timeline (see :meth:`trace`). If anything fails
        on this rank, its process groups are torn down so that the other ranks fail at once
        with an error naming this rank, instead of waiting for their timeout.
        """
        try:
            return self._step(inputs, target, record)
        except InputError:
            raise  # raised identically on every rank before any communication
        except BaseException as e:
            raise abort(dist.get_rank(), e) from e

    def _step(self, inputs: Inputs, target: Any, record: bool) -> torch.Tensor:
        mb_inputs = self._microbatches(inputs)
        m = self.plan.microbatches
        targets = (
            [tree_to(t, self._device) for t in split_microbatches(target, m, self.plan.batch_size, "target")]
            if target is not None
            else [None] * m
        )
        if record:
            dist.barrier(group=self.group)  # align the ranks' clocks for the timeline
        loss, events = run_actions(self.workers, self._program, mb_inputs, targets, record)
        self.events = events
        reduce_tied_grads(self.parameters(), self._canonical, self.tied_groups)
        out = loss.detach().float() if loss is not None else torch.zeros((), device=self._device)
        dist.broadcast(out, src=self.ranks[-1], group=self.group)
        if self.dp_group is not None:
            self._average_over_replicas(out)
        return out

    def _average_over_replicas(self, loss: torch.Tensor) -> None:
        """Data parallelism: average gradients (and the loss) over the replicas of this stage."""
        replicas = dist.get_world_size(self.dp_group)
        grads = []
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
        dist.all_reduce(flat, group=self.dp_group)  # one message for the whole stage
        flat /= replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        loss.copy_(flat[-1])
