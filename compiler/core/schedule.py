"""Pipeline schedules as data: per-rank lists of actions with a compact text form.

An action is ``<stage><kind><microbatch>``: ``1F3`` is stage 1's forward of microbatch 3,
``0B2`` stage 0's backward of microbatch 2. Receives and sends are implied by the plan's wiring
(a forward receives from the previous stage and sends to the next; a backward the reverse), so a
schedule only orders computation. GPipe on 3 stages and 4 microbatches (time runs right)::

    stage 0: 0F0 0F1 0F2 0F3                     0B3 0B2 0B1 0B0
    stage 1:     1F0 1F1 1F2 1F3         1B3 1B2 1B1 1B0
    stage 2:         2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0

1F1B keeps at most K - s microbatches in flight on stage s::

    stage 0: 0F0 0F1 0F2         0B0     0F3 0B1     0B2     0B3
    stage 1:     1F0 1F1     1B0     1F2 1B1     1F3 1B2     1B3
    stage 2:         2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3

Which rank runs a stage is :func:`rank_of`'s answer, and only its: a loop (stage s on rank
s mod K) or a V (rank r runs stages r and 2K - 1 - r, so the first and the last stage share
rank 0). Every module that needs a stage's rank asks it, or the plan's ``rank_of``.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.errors import ScheduleError

__all__ = [
    "Action",
    "ActionKind",
    "Placement",
    "Schedule",
    "StageCosts",
    "format_marked",
    "format_schedule",
    "forward_only",
    "parse_schedule",
    "rank_end_ms",
    "rank_of",
    "simulate",
    "stages_on",
    "timeline",
    "validate",
]


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward of a microbatch."""
    INPUT = "I"
    """The input-gradient part of a backward (zero-bubble schedules): sends gradients upstream."""
    WEIGHT = "W"
    """The weight-gradient part, run later, when the rank would otherwise wait."""


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = re.fullmatch(r"(\d+)([FBIW])(\d+)", text.strip())
        if m is None:
            raise ScheduleError(f"cannot parse action {text!r}: expected e.g. '1F3', '0B2', '0I2', '0W2'")
        return cls(int(m.group(1)), ActionKind(m.group(2)), int(m.group(3)))


Schedule = tuple[tuple[Action, ...], ...]
"""One tuple of actions per rank, in execution order."""


class Placement(enum.Enum):
    """How the stages of a pipeline lie on its K ranks, chunk of K stages by chunk."""

    LOOP = "loop"
    """Every chunk runs down the ranks: stage s on rank s mod K (one stage per rank, or
    interleaved 1F1B's virtual stages)."""
    V = "v"
    """Chunks go down and back up: with two chunks rank r runs stages r and 2K - 1 - r (ZBV),
    so the first and the last stage share rank 0 and stages K - 1 and K share rank K - 1."""


def rank_of(stage: int, ranks: int, placement: Placement = Placement.LOOP) -> int:
    """The rank that runs ``stage`` of a pipeline over ``ranks`` ranks.

    >>> [rank_of(s, 3) for s in range(6)], [rank_of(s, 3, Placement.V) for s in range(6)]
    ([0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0])
    """
    chunk, pos = divmod(stage, ranks)
    return ranks - 1 - pos if placement is Placement.V and chunk % 2 else pos


def stages_on(rank: int, ranks: int, stages: int, placement: Placement = Placement.LOOP) -> tuple[int, ...]:
    """The stages ``rank`` runs, in increasing order (the inverse of :func:`rank_of`)."""
    return tuple(s for s in range(stages) if rank_of(s, ranks, placement) == rank)


def forward_only(actions: Sequence[Action]) -> tuple[Action, ...]:
    """A rank's forward actions, in the schedule's order (evaluation: no backward). Dropping
    backwards only removes waits, so a schedule that does not deadlock still does not."""
    return tuple(a for a in actions if a.kind is ActionKind.FORWARD)


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, actions separated by spaces; :func:`parse_schedule` reads it back."""
    return "\n".join(" ".join(str(a) for a in rank) for rank in schedule)


def parse_schedule(text: str) -> Schedule:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return tuple(tuple(Action.parse(tok) for tok in line.split()) for line in lines)


def validate(schedule: Schedule, microbatches: int, placement: Placement = Placement.LOOP) -> None:
    """Rank r runs the stages :func:`rank_of` gives it (r, r + K, … for a loop); each stage runs
    every microbatch's forward once, then either its backward (B) or its input-gradient part (I)
    followed by its weight part (W)."""
    ranks = len(schedule)
    for rank, actions in enumerate(schedule):
        done: set[tuple[int, ActionKind, int]] = set()
        for a in actions:
            owner = rank_of(a.stage, ranks, placement)
            if owner != rank:
                raise ScheduleError(
                    f"rank {rank} holds action {a} of stage {a.stage}, which runs on rank {owner} "
                    f"({placement.value} placement)"
                )
            if not 0 <= a.microbatch < microbatches:
                raise ScheduleError(f"rank {rank}: action {a} is outside microbatches 0..{microbatches - 1}")
            key = (a.stage, a.kind, a.microbatch)
            if key in done:
                raise ScheduleError(f"rank {rank}: action {a} appears twice")
            needs = {
                ActionKind.BACKWARD: ActionKind.FORWARD,
                ActionKind.INPUT: ActionKind.FORWARD,
                ActionKind.WEIGHT: ActionKind.INPUT,
            }.get(a.kind)
            if needs is not None and (a.stage, needs, a.microbatch) not in done:
                raise ScheduleError(f"rank {rank}: {a} runs before its {needs.name.lower()} part")
            if a.kind in (ActionKind.BACKWARD, ActionKind.INPUT):
                other = ActionKind.INPUT if a.kind is ActionKind.BACKWARD else ActionKind.BACKWARD
                if (a.stage, other, a.microbatch) in done:
                    raise ScheduleError(f"rank {rank}: {a} repeats a backward already run")
            done.add(key)
        for stage in {a.stage for a in actions}:
            for mb in range(microbatches):
                kinds = {k for (st, k, m) in done if st == stage and m == mb}
                if kinds not in ({ActionKind.FORWARD, ActionKind.BACKWARD},
                                 {ActionKind.FORWARD, ActionKind.INPUT, ActionKind.WEIGHT}):
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} microbatch {mb} runs {sorted(k.value for k in kinds)}, "
                        f"expected F and B, or F, I and W"
                    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Per-stage costs a schedule is generated from and simulated on (ms per microbatch).

    ``forward``, ``backward`` and ``weight`` have one entry per stage (``weight`` is the part
    of the backward a split backward runs later as W; it may be all zeros); the links one per
    cut between stage s and s + 1.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    forward_link: tuple[float, ...]
    """Per cut between stage s and s + 1: activation transfer."""
    backward_link: tuple[float, ...]
    """Per cut: gradient transfer."""


def simulate(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
) -> float:
    """Predicted step time; raises :class:`ScheduleError` if the schedule deadlocks.

    Costs are per stage; the rank of an action is the index of the list that holds it, so any
    stage-to-rank map works (interleaved: stage ``c * ranks + r`` on rank r). A forward of
    stage s waits for stage s-1's forward of the same microbatch plus ``forward_link_ms[s-1]``;
    a backward waits for stage s+1's backward plus ``backward_link_ms[s]`` (defaults to
    ``forward_link_ms``). Each rank runs its actions in order, one at a time. With a split
    backward, I costs ``backward_ms - weight_ms`` and waits like a backward (and the stage
    before waits for it as for a backward); W costs ``weight_ms`` and waits only for its own I,
    which precedes it on the same rank.
    """
    return max(rank_end_ms(schedule, forward_ms, backward_ms, forward_link_ms, backward_link_ms,
                           weight_ms), default=0.0)


def rank_end_ms(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
) -> tuple[float, ...]:
    """End of each rank's last action (0 for a rank without actions), by :func:`simulate`'s
    rule; the hybrid planner starts each rank's gradient all-reduce there."""
    _, _, _, clock = _run(schedule, forward_ms, backward_ms, forward_link_ms, backward_link_ms,
                          weight_ms)
    return tuple(clock)


def timeline(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
) -> list[tuple[Action, float, float]]:
    """(action, start, end) of every action, in the order the simulation runs them: each
    action after the one before it on its rank and after the action it waits for."""
    starts, ends, order, _ = _run(schedule, forward_ms, backward_ms, forward_link_ms,
                                  backward_link_ms, weight_ms)
    pos = [0] * len(schedule)
    spans = []
    for r in order:
        i = pos[r]
        spans.append((schedule[r][i], starts[r][i], ends[r][i]))
        pos[r] = i + 1
    return spans


def _run(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float],
    backward_link_ms: Sequence[float],
    weight_ms: Sequence[float],
) -> tuple[list[list[float]], list[list[float]], list[int], list[float]]:
    """Event-driven simulation in O(actions): per rank, the start and end of each of its actions
    (aligned with ``schedule[r]``), the ranks in the order their actions ran, and each rank's
    clock at the end.

    A rank runs its actions until the next one waits for an action not yet run; it then parks
    on that action, and finishing it puts the rank back on the ready stack. Finish times live
    in a flat list indexed by ``(stage * M + microbatch) * 2 + (0 forward | 1 backward)``, where
    an I counts as the stage's backward (what the stage before waits for).
    """
    stages = len(forward_ms)
    fwd = [float(x) for x in forward_ms]
    fwd_link = [float(x) for x in forward_link_ms] or [0.0] * max(stages - 1, 0)
    bwd_link = [float(x) for x in backward_link_ms] or fwd_link  # one link time for both directions
    weight = [float(x) for x in weight_ms] or [0.0] * stages
    bwd = [float(x) for x in backward_ms]
    inp = [b - w for b, w in zip(bwd, weight)]
    sim = _Simulation(schedule, (fwd, fwd_link, bwd, bwd_link, inp, weight))
    ready = list(range(len(schedule) - 1, -1, -1))  # rank 0 first
    while ready:
        sim.run_rank(ready.pop(), ready)
    if len(sim.order) != sum(len(actions) for actions in schedule):
        raise _deadlock(schedule, sim.pos)
    return sim.starts, sim.ends, sim.order, sim.clock


_StageTimes = tuple[list[float], list[float], list[float], list[float], list[float], list[float]]


class _Simulation:
    """The state of one :func:`_run`: costs as floats, finish times, parked ranks, and per
    rank its clock, its next action and the spans of the actions it ran."""

    __slots__ = ("clock", "ends", "order", "pos", "schedule", "starts", "state")

    def __init__(self, schedule: Schedule, costs: _StageTimes) -> None:
        """``costs``: per stage forward, forward link, backward, backward link, I and W times."""
        ranks, stages = len(schedule), len(costs[0])
        m = 1 + max((a.microbatch for actions in schedule for a in actions), default=0)
        finish = [_UNSET] * (2 * m * max(stages, 1))  # by (stage * M + mb) * 2 + (0 F | 1 B or I)
        parked: dict[int, list[int]] = {}  # finish index -> the ranks waiting for it
        # what run_rank reads, as one tuple: it runs once per rank wake-up, so it unpacks once
        self.state = (*costs, finish, parked, m, stages - 1)
        self.schedule = schedule
        self.starts: list[list[float]] = [[] for _ in range(ranks)]
        self.ends: list[list[float]] = [[] for _ in range(ranks)]
        self.clock = [0.0] * ranks
        self.pos = [0] * ranks
        self.order: list[int] = []

    def run_rank(self, r: int, ready: list[int]) -> None:
        """Run rank r's actions until the next one waits for an action not yet run (r parks on
        it) or none is left; the ranks parked on the actions it finished go onto ``ready``."""
        forward, backward, weight_kind, unset = _KINDS_AND_UNSET
        fwd, fwd_link, bwd, bwd_link, inp, weight, finish, parked, m, last = self.state
        actions, t, i = self.schedule[r], self.clock[r], self.pos[r]
        run_starts, run_ends, order = self.starts[r], self.ends[r], self.order
        while i < len(actions):
            a = actions[i]
            s, kind, mb = a.stage, a.kind, a.microbatch
            start = t
            if kind is forward:
                if s > 0:
                    done = finish[((s - 1) * m + mb) * 2]
                    if done == unset:
                        parked.setdefault(((s - 1) * m + mb) * 2, []).append(r)
                        break
                    done += fwd_link[s - 1]
                    if done > start:
                        start = done
                me, t = (s * m + mb) * 2, start + fwd[s]
            elif kind is weight_kind:
                me, t = -1, start + weight[s]
            else:  # B or I: gradients come from the next stage's B or I
                if s < last:
                    done = finish[((s + 1) * m + mb) * 2 + 1]
                    if done == unset:
                        parked.setdefault(((s + 1) * m + mb) * 2 + 1, []).append(r)
                        break
                    done += bwd_link[s]
                    if done > start:
                        start = done
                me, t = (s * m + mb) * 2 + 1, start + (bwd[s] if kind is backward else inp[s])
            run_starts.append(start)
            run_ends.append(t)
            order.append(r)
            i += 1
            if me >= 0:
                finish[me] = t
                waiting = parked.pop(me, None)
                if waiting:
                    ready.extend(waiting)
        self.clock[r], self.pos[r] = t, i


_UNSET = -math.inf
"""Finish time of an action not run yet."""
_KINDS_AND_UNSET = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, _UNSET)
"""What :meth:`_Simulation.run_rank` compares with, read once per call (an enum member's
lookup costs about as much as running an action)."""


def _deadlock(schedule: Schedule, pos: Sequence[int]) -> ScheduleError:
    """The error for a schedule whose ranks stopped at ``pos``, each waiting for an action
    that never runs."""
    stuck = {r: schedule[r][pos[r]] for r in range(len(schedule)) if pos[r] < len(schedule[r])}
    where = ", ".join(f"rank {r} stops at {a}" for r, a in stuck.items())
    return ScheduleError(
        f"schedule deadlocks: {where} (each waits for an action that never runs)\n"
        + format_marked(schedule, dict(stuck))
    )


def format_marked(schedule: Schedule, at: dict[int, Action | None]) -> str:
    """The schedule, one line per rank, with "<-- ERROR HERE" after the action where rank r
    stops (``at[r]``; None: at the end of its actions)."""
    rows = []
    for r, actions in enumerate(schedule):
        words = [str(a) + (" <-- ERROR HERE" if r in at and a == at[r] else "") for a in actions]
        if r in at and at[r] is None:
            words.append("<end> <-- ERROR HERE")
        rows.append(f"rank {r}: " + " ".join(words))
    return "\n".join(rows)
