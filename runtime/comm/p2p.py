"""The order in which a rank issues its point-to-point transfers: one function, two users.

NCCL ignores tags: between two ranks, the n-th send is delivered to the n-th receive, and a
large send completes only once its receive runs. So the order of sends and receives is part
of a schedule's correctness, and it must be the same order the simulator checks and the
executor runs. :func:`comm_program` derives it from a rank's action list; the executor walks
the steps it returns (:mod:`pipecut.runtime.execution.executor`) and the NCCL checker
(:mod:`pipecut.runtime.comm.nccl`) replays the same steps for every rank.

The order: every message is given a round, the time its producing action ends in a replay of
the schedule; both ends put it in the ``batch_isend_irecv`` of that round, and a rank issues
its rounds in time order, each before the first action starting at or after it, then waits for
an action's receives just before computing it (see :func:`comm_program`). Two ranks, 1F1B,
four microbatches (``[...]``: one batch; ``s``/``r``: send/receive; ``F``/``B``: activations or
gradients, then microbatch.leaf)::

    rank 0: 0F0 [sF0.0] 0F1 [sF1.0] [rB0.0] 0B0 0F2 [rB1.0 sF2.0] 0B1 0F3 [rB2.0 sF3.0] 0B2 [rB3.0] 0B3
    rank 1: [rF0.0] 1F0 [rF1.0] 1B0 [sB0.0] 1F1 1B1 [sB1.0 rF2.0] 1F2 1B2 [sB2.0 rF3.0] 1F3 1B3 [sB3.0]

Skip connections need nothing here: a value used several stages later is relayed by every
stage in between (it is among each intermediate stage's inputs and outputs), so every
transfer is between stage ``s`` and ``s ± 1``, on the ranks :func:`~pipecut.schedules.format.rank_of`
gives them (``s mod K`` in a loop). In a V both ends of the middle cut are one rank: the message
still takes its place in a round, and the executor hands it over without the wire.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.core.kinds import LeafKind
from pipecut.ir import Plan
from pipecut.schedules.format import Action, ActionKind, Placement, Schedule, rank_of
from pipecut.schedules.simulate import timeline

__all__: list[str] = []


class Op(enum.Enum):
    SEND = "s"
    RECV = "r"


class Direction(enum.Enum):
    FORWARD = "F"
    """Activations, stage s-1 to stage s."""
    BACKWARD = "B"
    """Gradients of those activations, stage s to stage s-1."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One tensor sent or received by one stage: leaf ``leaf`` of ``direction`` across ``cut``
    (between stage ``cut - 1`` and stage ``cut``) for ``microbatch``."""

    op: Op
    stage: int
    """The local stage doing it."""
    peer: int
    """The pipeline rank on the other end."""
    cut: int
    direction: Direction
    microbatch: int
    leaf: int

    @property
    def message(self) -> tuple[int, Direction, int, int]:
        """What the sender and receiver must agree on (the tag a tag-less backend can't check)."""
        return (self.cut, self.direction, self.microbatch, self.leaf)

    def __str__(self) -> str:
        return f"{self.op.value}{self.direction.value}{self.microbatch}.{self.leaf}@cut{self.cut}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Wiring:
    """How many tensors cross each cut: all that is needed to derive the transfers."""

    ranks: int
    forward: tuple[int, ...]
    """Per cut ``c`` (index ``c - 1``): tensor leaves stage ``c - 1`` sends to stage ``c``."""
    backward: tuple[int, ...]
    """Per cut: gradient leaves stage ``c`` sends back (the forward leaves that require grad)."""
    placement: Placement = Placement.LOOP
    """Which rank runs each stage (:func:`~pipecut.schedules.format.rank_of`)."""

    @property
    def stages(self) -> int:
        return len(self.forward) + 1

    def rank(self, stage: int) -> int:
        return rank_of(stage, self.ranks, self.placement)

    @classmethod
    def uniform(cls, ranks: int, stages: int, leaves: int = 1, placement: Placement = Placement.LOOP) -> Wiring:
        """Every cut carries ``leaves`` tensors each way (for checking schedules without a plan)."""
        return cls(ranks=ranks, forward=(leaves,) * (stages - 1), backward=(leaves,) * (stages - 1),
                   placement=placement)


def wiring(plan: Plan) -> Wiring:
    """The plan's cuts: stage ``s``'s outputs are stage ``s + 1``'s inputs, in wire order."""
    fwd, bwd = [], []
    for stage in plan.stages[:-1]:
        leaves = [leaf for name in stage.outputs for leaf in plan.node(name).leaves if leaf.kind is LeafKind.TENSOR]
        fwd.append(len(leaves))
        bwd.append(sum(1 for leaf in leaves if leaf.requires_grad))
    return Wiring(ranks=plan.num_ranks, forward=tuple(fwd), backward=tuple(bwd),
                  placement=plan.schedule.placement)


class StepKind(enum.Enum):
    ISSUE = "issue"
    """One ``batch_isend_irecv`` of ``transfers``."""
    WAIT = "wait"
    """Wait for the receives ``transfers`` (issued earlier) before ``action`` computes."""
    COMPUTE = "compute"
    DRAIN = "drain"
    """End of the step: wait for every send still in flight."""


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    action: Action | None = None
    """The action computed, or the one waiting (WAIT); None for ISSUE and DRAIN."""
    transfers: tuple[Transfer, ...] = ()


def receives(action: Action, w: Wiring) -> tuple[Transfer, ...]:
    """The tensors ``action`` must receive before it computes."""
    s = action.stage
    if action.kind is ActionKind.FORWARD and s > 0:
        n, peer, cut, d = w.forward[s - 1], w.rank(s - 1), s, Direction.FORWARD
    elif action.kind in (ActionKind.BACKWARD, ActionKind.INPUT) and s < w.stages - 1:
        n, peer, cut, d = w.backward[s], w.rank(s + 1), s + 1, Direction.BACKWARD
    else:
        return ()
    return tuple(Transfer(Op.RECV, s, peer, cut, d, action.microbatch, i) for i in range(n))


def sends(action: Action, w: Wiring) -> tuple[Transfer, ...]:
    """The tensors ``action`` sends once it has computed."""
    s = action.stage
    if action.kind is ActionKind.FORWARD and s < w.stages - 1:
        n, peer, cut, d = w.forward[s], w.rank(s + 1), s + 1, Direction.FORWARD
    elif action.kind in (ActionKind.BACKWARD, ActionKind.INPUT) and s > 0:
        n, peer, cut, d = w.backward[s - 1], w.rank(s - 1), s, Direction.BACKWARD
    else:
        return ()
    return tuple(Transfer(Op.SEND, s, peer, cut, d, action.microbatch, i) for i in range(n))


def _replay(schedule: Schedule, w: Wiring) -> tuple[dict[Action, float], dict[tuple[int, ActionKind, int], float]]:
    """Start of every action and end of every (stage, F or B, microbatch) in a replay of
    ``schedule`` that respects its dependencies (the costs hardly matter: any such replay
    gives a safe order); an input-gradient part I counts as B, which is what it sends."""
    n = w.stages
    spans = timeline(schedule, [1.0] * n, [2.0] * n, weight_ms=[1.0] * n)
    starts = {a: start for a, start, _ in spans}
    ends: dict[tuple[int, ActionKind, int], float] = {}
    for a, _, end in spans:
        ends[(a.stage, ActionKind.BACKWARD if a.kind is ActionKind.INPUT else a.kind, a.microbatch)] = end
    return starts, ends


def _producer(action: Action) -> tuple[int, ActionKind, int]:
    """The action on the neighbouring stage whose sends ``action`` receives."""
    if action.kind is ActionKind.FORWARD:
        return (action.stage - 1, ActionKind.FORWARD, action.microbatch)
    return (action.stage + 1, ActionKind.BACKWARD, action.microbatch)


def comm_program(schedule: Schedule, rank: int, w: Wiring) -> tuple[Step, ...]:
    """The steps ``rank`` runs for ``schedule``: what it issues, waits for and computes, in order.

    Every message gets a round: the time its producing action ends in a replay of the schedule
    (:func:`pipecut.schedules.simulate.timeline`, the same on every rank). Sender and receiver
    put it in the batch of that round, and each rank issues its rounds in time order, before
    the first action starting at or after them. So both ends of every message sit in the same
    round, each pair's messages go in the same order on both sides (sorted within a round),
    and the earliest unfinished round can always complete: no rank waits on a later one.
    """
    starts, ends = _replay(schedule, w)
    rounds: dict[float, list[Transfer]] = {}
    for action in schedule[rank]:
        kind = ActionKind.BACKWARD if action.kind is ActionKind.INPUT else action.kind
        out = sends(action, w)
        if out:
            rounds.setdefault(ends[(action.stage, kind, action.microbatch)], []).extend(out)
        needed = receives(action, w)
        if needed:
            rounds.setdefault(ends[_producer(action)], []).extend(needed)
    times = sorted(rounds)
    steps: list[Step] = []
    nxt = 0
    for action in schedule[rank]:
        while nxt < len(times) and times[nxt] <= starts[action]:
            steps.append(Step(StepKind.ISSUE, transfers=tuple(sorted(rounds[times[nxt]], key=_order))))
            nxt += 1
        needed = receives(action, w)
        if needed:
            steps.append(Step(StepKind.WAIT, action, needed))
        steps.append(Step(StepKind.COMPUTE, action))
    steps += [Step(StepKind.ISSUE, transfers=tuple(sorted(rounds[t], key=_order))) for t in times[nxt:]]
    steps.append(Step(StepKind.DRAIN))
    return tuple(steps)


def _order(t: Transfer) -> tuple[int, str, int, int]:
    return (t.cut, t.direction.value, t.microbatch, t.leaf)


def format_program(steps: Sequence[Step]) -> str:
    """One line, e.g. ``[rF0.0@cut1] 1F0 1B0 [sB0.0@cut1]``: for golden tests and error messages."""
    out = []
    for step in steps:
        if step.kind is StepKind.ISSUE:
            out.append("[" + " ".join(str(t) for t in step.transfers) + "]")
        elif step.kind is StepKind.COMPUTE:
            out.append(str(step.action))
    return " ".join(out)
