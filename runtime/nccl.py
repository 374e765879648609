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

Ranks run the steps :func:`pipecut.runtime.p2p.comm_program` gives (the executor runs the
same), or any other program given explicitly (tests replay the old order with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecut.core.schedule import Action, Schedule, format_marked
from pipecut.errors import ScheduleError
from pipecut.runtime.p2p import Op, Step, StepKind, Transfer, Wiring, comm_program

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
    ranks = len(programs)
    ops: list[_Op] = []
    batches: list[_Batch] = []
    streams: list[deque[int]] = [deque() for _ in range(ranks)]
    sent: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> op indices in issue order
    received: dict[tuple[int, int], list[int]] = {}
    batch_of: list[dict[Transfer, int]] = [{} for _ in range(ranks)]
    pc = [0] * ranks

    def issue(rank: int, transfers: Sequence[Transfer]) -> None:
        b = len(batches)
        batches.append(_Batch(rank))
        for t in transfers:
            i = len(ops)
            pair = (rank, t.peer) if t.op is Op.SEND else (t.peer, rank)
            queue = (sent if t.op is Op.SEND else received).setdefault(pair, [])
            ops.append(_Op(t, rank, b, len(queue)))
            queue.append(i)
            batches[b].pending.add(i)
            batch_of[rank][t] = b
        streams[rank].append(b)

    def host_ready(rank: int, step: Step) -> bool:
        if step.kind is StepKind.WAIT:  # its batches and every batch this rank issued before
            # (a batch's transfers complete only at the head of its stream, so batches complete
            # in issue order: the last one being complete means all before it are)
            return not batches[max(batch_of[rank][t] for t in step.transfers)].pending
        if step.kind is StepKind.DRAIN:
            return not streams[rank]
        return True

    def partner(i: int) -> int | None:
        op = ops[i]
        t = op.transfer
        pair = (op.rank, t.peer) if t.op is Op.SEND else (t.peer, op.rank)
        theirs = received if t.op is Op.SEND else sent
        n = op.position
        other = theirs.get(pair, [])
        if n >= len(other):
            return None
        j = other[n]
        if ops[j].transfer.message != t.message:
            s, r = (op, ops[j]) if t.op is Op.SEND else (ops[j], op)
            raise ScheduleError(
                f"messages mismatch under {RULES}: rank {s.rank}'s send {s.transfer} is the "
                f"receive {r.transfer} on rank {r.rank} (their {n}th message between the two); "
                f"NCCL would deliver the wrong tensor. Sender and receiver must issue the "
                f"messages between them in the same order"
            )
        return j

    while True:
        progressed = False
        for r in range(ranks):  # hosts run until they block
            while pc[r] < len(programs[r]) and host_ready(r, programs[r][pc[r]]):
                step = programs[r][pc[r]]
                if step.kind is StepKind.ISSUE and step.transfers:
                    issue(r, step.transfers)
                pc[r] += 1
                progressed = True
        for r in range(ranks):  # the batch at the head of each stream progresses
            while streams[r]:
                head = batches[streams[r][0]]
                for i in list(head.pending):
                    j = partner(i)
                    if j is not None and streams[ops[j].rank] and streams[ops[j].rank][0] == ops[j].batch:
                        head.pending.discard(i)
                        batches[ops[j].batch].pending.discard(j)
                        progressed = True
                if head.pending:
                    break
                streams[r].popleft()
                progressed = True
        if not progressed:
            break
    stuck = [r for r in range(ranks) if pc[r] < len(programs[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(programs, pc, stuck, ops, batches, streams, schedule))


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
