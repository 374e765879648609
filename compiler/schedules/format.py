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
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.errors import ScheduleError

__all__ = [
    "Action",
    "ActionKind",
    "Placement",
    "Schedule",
    "format_marked",
    "format_schedule",
    "forward_only",
    "parse_schedule",
    "rank_of",
    "stages_on",
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
