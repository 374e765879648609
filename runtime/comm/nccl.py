"""Replay every rank's communication under NCCL's rules and refuse an order that would hang.

The rules modelled (the strictest NCCL can apply; gloo is looser, so what passes here passes
there):

- **No tags.** Between two ranks, the n-th tensor one sends is matched with the n-th receive
  the other posts from it. If their messages differ (cut, direction, microbatch, leaf), NCCL
  would deliver the wrong tensor: refused as a mismatch.
- **One stream per rank.** The batches a rank issues run one after the other: a batch starts
  only when the batch issued before it has completed.
- **Rendezvous.** A send and its receive complete together, once both their batches run. A
  batch completes when all of its transfers have (``batch_isend_irecv`` is one group).
- **Blocking host.** A rank's host waits for an action's receives, and every batch it issued
  before them, before computing it; and for every send at the end of the step.

Ranks run the steps :func:`pipecut.runtime.comm.p2p.comm_program` gives (the executor runs the
same), or any other program given explicitly (tests replay the old order with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecut.errors import ScheduleError
from pipecut.runtime.comm.p2p import Op, Step, StepKind, Transfer, Wiring, comm_program
from pipecut.schedules.format import Action, Schedule, format_marked

__all__: list[str] = []

RULES = "NCCL rules: no tags, per-pair FIFO, one stream per rank, sends complete only when received"


@dataclass
class _Batch:
    rank: int
    pending: set[int] = field(default_factory=set)
    """Indices (into the global op table) of its transfers not yet complete."""


@dataclass
class _Op:
    transfer: Transfer
    rank: int
    batch: int
    position: int = 0
    """Its place among the messages from the sender to the receiver (sends) or the reverse."""


def check_nccl(schedule: Schedule, w: Wiring) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` would hang or mismatch under NCCL's rules."""
    check_programs([comm_program(schedule, r, w) for r in range(len(schedule))], schedule)


def check_programs(programs: Sequence[Sequence[Step]], schedule: Schedule | None = None) -> None:
    """Replay per-rank step lists (see the module docstring); ``schedule`` is printed on error."""
    replay = _Replay(programs)
    progressed = True
    while progressed:
        progressed = replay.run_hosts()
        progressed = replay.run_streams() or progressed
    stuck = [r for r in range(len(programs)) if replay.pc[r] < len(programs[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(programs, replay.pc, stuck, replay.ops,
                                              replay.batches, replay.streams, schedule))


class _Replay:
    """The state of one replay: every op issued, the batches, each rank's stream of batches
    not yet complete, the messages per pair in issue order, and each host's next step."""

    def __init__(self, programs: Sequence[Sequence[Step]]) -> None:
        ranks = len(programs)
        self.programs = programs
        self.ops: list[_Op] = []
        self.batches: list[_Batch] = []
        self.streams: list[deque[int]] = [deque() for _ in range(ranks)]
        self.sent: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> op indices in issue order
        self.received: dict[tuple[int, int], list[int]] = {}
        self.batch_of: list[dict[Transfer, int]] = [{} for _ in range(ranks)]
        self.pc = [0] * ranks

    def run_hosts(self) -> bool:
        """Run every host until it blocks; True if any ran a step."""
        progressed = False
        for r, program in enumerate(self.programs):
            while self.pc[r] < len(program) and self.host_ready(r, program[self.pc[r]]):
                step = program[self.pc[r]]
                if step.kind is StepKind.ISSUE and step.transfers:
                    self.issue(r, step.transfers)
                self.pc[r] += 1
                progressed = True
        return progressed

    def run_streams(self) -> bool:
        """Complete what the batch at the head of each stream can; True if anything did."""
        ops, batches, progressed = self.ops, self.batches, False
        for stream in self.streams:
            while stream:
                head = batches[stream[0]]
                for i in list(head.pending):
                    j = self.partner(i)
                    theirs = self.streams[ops[j].rank] if j is not None else None
                    if j is not None and theirs and theirs[0] == ops[j].batch:
                        head.pending.discard(i)
                        batches[ops[j].batch].pending.discard(j)
                        progressed = True
                if head.pending:
                    break
                stream.popleft()
                progressed = True
        return progressed

    def issue(self, rank: int, transfers: Sequence[Transfer]) -> None:
        b = len(self.batches)
        self.batches.append(_Batch(rank))
        for t in transfers:
            i = len(self.ops)
            pair = (rank, t.peer) if t.op is Op.SEND else (t.peer, rank)
            queue = (self.sent if t.op is Op.SEND else self.received).setdefault(pair, [])
            self.ops.append(_Op(t, rank, b, len(queue)))
            queue.append(i)
            self.batches[b].pending.add(i)
            self.batch_of[rank][t] = b
        self.streams[rank].append(b)

    def host_ready(self, rank: int, step: Step) -> bool:
        if step.kind is StepKind.WAIT:  # its batches and every batch this rank issued before
            # (a batch's transfers complete only at the head of its stream, so batches complete
            # in issue order: the last one being complete means all before it are)
            return not self.batches[max(self.batch_of[rank][t] for t in step.transfers)].pending
        if step.kind is StepKind.DRAIN:
            return not self.streams[rank]
        return True

    def partner(self, i: int) -> int | None:
        """The op matched with op i (the same message the other way), or None while the peer
        has not issued it; a different message there is a mismatch."""
        op = self.ops[i]
        t = op.transfer
        pair = (op.rank, t.peer) if t.op is Op.SEND else (t.peer, op.rank)
        theirs = self.received if t.op is Op.SEND else self.sent
        n = op.position
        other = theirs.get(pair, [])
        if n >= len(other):
            return None
        j = other[n]
        if self.ops[j].transfer.message != t.message:
            s, r = (op, self.ops[j]) if t.op is Op.SEND else (self.ops[j], op)
            raise ScheduleError(
                f"messages mismatch under {RULES}: rank {s.rank}'s send {s.transfer} is the "
                f"receive {r.transfer} on rank {r.rank} (their {n}th message between the two); "
                f"NCCL would deliver the wrong tensor. Sender and receiver must issue the "
                f"messages between them in the same order"
            )
        return j


def _where(program: Sequence[Step], pc: int) -> Action | None:
    """The action a rank stopped at: the one it waits to compute (None: end of the step)."""
    for step in program[pc:]:
        if step.action is not None:
            return step.action
    return None


def _deadlock_message(
    programs: Sequence[Sequence[Step]], pc: list[int], stuck: list[int], ops: list[_Op],
    batches: list[_Batch], streams: list[deque[int]], schedule: Schedule | None,
) -> str:
    lines = []
    for r in stuck:
        at = _where(programs[r], pc[r])
        blocked = [str(ops[i].transfer) for i in sorted(batches[streams[r][0]].pending)] if streams[r] else []
        lines.append(
            f"rank {r} stops {'at ' + str(at) if at else 'at the end of the step'}"
            + (f", its stream stuck on {' '.join(blocked)}" if blocked else "")
        )
    text = f"schedule deadlocks under {RULES}: " + "; ".join(lines)
    if schedule is not None:
        text += "\n" + format_marked(schedule, {r: _where(programs[r], pc[r]) for r in stuck})
    return text + "\nUse a shipped schedule, or order the actions so each rank's peer posts the matching receive first"
