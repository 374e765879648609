"""Run one rank's communication program over the stage workers it holds (one, or several).

The program (:func:`pipecut.runtime.comm.p2p.comm_program`, the order the NCCL checker proved safe)
says when to issue each ``batch_isend_irecv``, which receives to wait for before an action, and
when to compute. Sent tensors are dropped once their batch is known complete (NCCL reports it;
gloo only once waited, which happens one receive-wait later: see :meth:`_Wire.wait`), so a
stage holds what it sends for a few actions, not until the end of the step. Each action runs
inside ``record_function("pipecut.<action>")`` (and an NVTX range on CUDA), so profiler
traces show the pipeline's actions.

A cut whose two stages run on this very rank (the middle of a V: stages K - 1 and K) is no
message: in the batch where both ends sit (the same round, by construction) the receive buffer
is filled from the send, and only the other transfers go to ``batch_isend_irecv`` (gloo cannot
send to itself).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecut.errors import PipelineRuntimeError
from pipecut.runtime.comm.p2p import Op, Step, StepKind, Transfer
from pipecut.runtime.comm.wire import Peer
from pipecut.runtime.execution.stage import StageWorker
from pipecut.schedules.format import Action, ActionKind

__all__ = ["Event", "run_actions"]


@dataclass(frozen=True, slots=True)
class Event:
    """One action's span on this rank, in seconds since the step started."""

    action: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class _Batch:
    works: list[Any]
    transfers: tuple[Transfer, ...]
    sent: list[torch.Tensor]
    """The tensors being sent, kept alive until the batch completes."""
    index: int
    """Its place in this rank's issue order."""


@contextlib.contextmanager
def _labelled(action: Action, device: torch.device) -> Iterator[None]:
    name = f"pipecut.{action}"
    with torch.profiler.record_function(name):
        if device.type == "cuda":
            with torch.cuda.nvtx.range(name):
                yield
        else:
            yield


class _Wire:
    """This rank's batches in flight, and the waits on them."""

    def __init__(self, workers: Mapping[int, StageWorker]) -> None:
        self.workers = workers
        self.of: dict[Transfer, _Batch] = {}
        self.sending: list[_Batch] = []
        self.issued: list[_Batch] = []
        self.lagging = -1
        """The newest batch waited for at the previous wait."""
        self.waited: set[int] = set()
        """Batches ``issued[:done]`` have been waited for."""
        """Batches with sends, in issue order, until they are known complete."""

    def issue(self, transfers: Sequence[Transfer]) -> None:
        ops = [self.workers[t.stage].p2p_op(t) for t in transfers]
        local = [self._local(t) for t in transfers]
        _hand_over([(op, t) for op, t, here in zip(ops, transfers, local) if here])
        remote = [(op, t) for op, t, here in zip(ops, transfers, local) if not here]
        works = dist.batch_isend_irecv([op for op, _ in remote]) if remote else []
        batch = _Batch(works, tuple(t for _, t in remote),
                       [op.tensor for op, t in remote if t.op is Op.SEND], len(self.issued))
        self.issued.append(batch)
        for t in transfers:
            if t.op is Op.RECV:
                self.of[t] = batch
        if batch.sent:
            self.sending.append(batch)
            sent_by = [t.stage for _, t in remote if t.op is Op.SEND]
            for w in self.workers.values():
                w.meter.hold(id(batch), [x for x, s in zip(batch.sent, sent_by) if s == w.stage])

    def _local(self, t: Transfer) -> bool:
        """Whether the stage at the other end of ``t``'s cut also runs on this rank."""
        other = t.cut - 1 if t.cut == t.stage else t.cut
        return other in self.workers

    def wait(self, transfers: Sequence[Transfer]) -> None:
        """Wait for the batches holding ``transfers``; then for, and drop, the sends issued
        before the previous wait. On NCCL those completed before the batches just waited for
        (one stream, in order; the checker models exactly this). On gloo a send completes only
        once waited, and waiting for the newest sends too would tie each rank to its peers'
        progress (measured: 1F1B ~20% slower on CPU), so sends are waited one wait late, when
        they are long done: the buffers of at most two waits' sends are alive at once."""
        batches = {id(b): b for b in (self.of.pop(t) for t in transfers)}.values()
        for batch in batches:
            self._wait(batch)
        self.release_sent(upto=self.lagging)
        self.lagging = max(self.lagging, max(b.index for b in batches))

    def release_sent(self, upto: int = -1, block: bool = False) -> None:
        """Drop the send buffers of batches reported complete, and (after waiting for them) of
        batches issued up to ``upto``, or of all with ``block``."""
        left = []
        for batch in self.sending:
            if block or batch.index <= upto:
                self._wait(batch)
            elif not all(w.is_completed() for w in batch.works):
                left.append(batch)
                continue
            for w in self.workers.values():
                w.meter.drop(id(batch))
        self.sending = left

    def _wait(self, batch: _Batch) -> None:
        if batch.index in self.waited:
            return  # waiting twice on a gloo send waits for a second send that never comes
        self.waited.add(batch.index)
        if not batch.works:
            return  # every transfer of the batch was handed over on this rank
        peers = [self._peer(t) for t in batch.transfers]
        names = " and ".join(f"rank {r}" for r in sorted({p.rank for p in peers}))
        timeout = peers[0].timeout
        for work in batch.works:
            try:
                work.wait(timeout=timeout)
            except RuntimeError as e:
                raise PipelineRuntimeError(
                    f"rank {peers[0].me}: failed exchanging {' '.join(str(x) for x in batch.transfers)} "
                    f"with {names} (timeout {timeout.total_seconds():.0f} s): "
                    f"{str(e).splitlines()[0][:300]}. {names.capitalize()} probably failed; see its log."
                ) from e

    def _peer(self, t: Transfer) -> Peer:
        worker = self.workers[t.stage]
        peer = worker.prev if t.cut == worker.stage else worker.next
        assert peer is not None
        return peer


def _hand_over(pairs: Sequence[tuple[dist.P2POp, Transfer]]) -> None:
    """Fill each local receive's buffer from the local send of the same message."""
    sends = {t.message: op.tensor for op, t in pairs if t.op is Op.SEND}
    for op, t in pairs:
        if t.op is Op.RECV:
            sent = sends.pop(t.message, None)
            if sent is None:
                raise PipelineRuntimeError(
                    f"stage {t.stage} receives {t} from a stage on this rank, which does not send "
                    f"it in the same batch; the communication program is wrong (a pipecut bug)"
                )
            op.tensor.copy_(sent)
    if sends:
        left = ", ".join(f"cut {c} {d.value}{mb}.{leaf}" for c, d, mb, leaf in sends)
        raise PipelineRuntimeError(f"sent on this rank but never received in the same batch: {left}")


def _gpu_mark() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def run_actions(
    workers: Mapping[int, StageWorker],
    program: Sequence[Step],
    inputs: Sequence[dict[str, Any]],
    targets: Sequence[Any],
    record: bool = False,
) -> tuple[torch.Tensor | None, list[Event]]:
    """Execute this rank's ``program``. Returns its share of the loss (None off the last stage)."""
    for w in workers.values():
        w.begin()
    wire = _Wire(workers)
    device = next(iter(workers.values())).device
    events: list[Event] = []
    on_gpu = record and device.type == "cuda"  # the GPU's clock: the host's times launches
    marks: list[tuple[str, Any, Any]] = []
    origin = _gpu_mark() if on_gpu else None
    t0 = time.perf_counter()
    for step in program:
        if step.kind is StepKind.ISSUE:
            wire.issue(step.transfers)
        elif step.kind is StepKind.WAIT:
            wire.wait(step.transfers)
        elif step.kind is StepKind.DRAIN:
            wire.release_sent(block=True)
        else:
            action = step.action
            assert action is not None
            worker = workers[action.stage]
            start = time.perf_counter()
            begin = _gpu_mark() if on_gpu else None
            with _labelled(action, device):
                if action.kind is ActionKind.FORWARD:
                    worker.forward(action.microbatch, inputs[action.microbatch], targets[action.microbatch])
                elif action.kind is ActionKind.BACKWARD:
                    worker.backward(action.microbatch)
                elif action.kind is ActionKind.INPUT:
                    worker.backward(action.microbatch, weights_later=True)
                else:
                    worker.backward_weight(action.microbatch)
            if on_gpu:
                marks.append((str(action), begin, _gpu_mark()))
            elif record:
                events.append(Event(str(action), start - t0, time.perf_counter() - t0))
            wire.release_sent()
    for w in workers.values():
        w.check_all_sent()
    if origin is not None:
        torch.cuda.synchronize(device)
        events = [Event(name, origin.elapsed_time(b) / 1e3, origin.elapsed_time(e) / 1e3) for name, b, e in marks]
    losses = [loss for w in workers.values() if (loss := w.loss()) is not None]
    return (losses[0] if losses else None), events
