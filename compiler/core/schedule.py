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
    "Schedule",
    "format_marked",
    "format_schedule",
    "forward_only",
    "parse_schedule",
    "simulate",
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


def validate(schedule: Schedule, microbatches: int) -> None:
    """Rank r runs stages r, r + K, …; each stage runs every microbatch's forward once, then
    either its backward (B) or its input-gradient part (I) followed by its weight part (W)."""
    ranks = len(schedule)
    for rank, actions in enumerate(schedule):
        done: set[tuple[int, ActionKind, int]] = set()
        for a in actions:
            if a.stage % ranks != rank:
                raise ScheduleError(f"rank {rank} holds action {a} of stage {a.stage} (rank {a.stage % ranks})")
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


def simulate(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
) -> float:
    """Predicted step time; raises :class:`ScheduleError` if the schedule deadlocks.

    Costs are per stage. A forward of stage s waits for stage s-1's forward of the same
    microbatch plus ``forward_link_ms[s-1]``; a backward waits for stage s+1's backward plus
    ``backward_link_ms[s]`` (defaults to ``forward_link_ms``). Each rank runs its actions in
    order, one at a time. With a split backward, I costs ``backward_ms - weight_ms`` and waits
    like a backward; W costs ``weight_ms`` and waits only for its own I.
    """
    return max((end for _, _, end in timeline(schedule, forward_ms, backward_ms, forward_link_ms,
                                              backward_link_ms, weight_ms)), default=0.0)


def timeline(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
) -> list[tuple[Action, float, float]]:
    """(action, start, end) of every action, in the order the simulation runs them."""
    ranks = len(schedule)
    last = len(forward_ms) - 1
    fwd_link = list(forward_link_ms) or [0.0] * max(last, 0)
    bwd_link = list(backward_link_ms) or fwd_link  # one link time for both directions
    weight = list(weight_ms) or [0.0] * len(forward_ms)
    finish: dict[tuple[int, ActionKind, int], float] = {}
    clock = [0.0] * ranks
    pos = [0] * ranks
    spans: list[tuple[Action, float, float]] = []
    remaining = sum(len(r) for r in schedule)
    while remaining:
        progressed = False
        for r in range(ranks):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                s = a.stage
                if a.kind is ActionKind.FORWARD:
                    dep = (s - 1, ActionKind.FORWARD, a.microbatch) if s > 0 else None
                    link = fwd_link[s - 1] if s > 0 else 0.0
                    cost = forward_ms[s]
                elif a.kind is ActionKind.WEIGHT:
                    dep, link, cost = None, 0.0, weight[s]
                else:  # B or I: gradients come from the next stage (recorded as B either way)
                    dep = (s + 1, ActionKind.BACKWARD, a.microbatch) if s < last else None
                    link = bwd_link[s] if s < last else 0.0
                    cost = backward_ms[s] - (weight[s] if a.kind is ActionKind.INPUT else 0.0)
                if dep is not None and dep not in finish:
                    break
                start = max(clock[r], finish[dep] + link if dep is not None else 0.0)
                clock[r] = start + cost
                kind = ActionKind.BACKWARD if a.kind is ActionKind.INPUT else a.kind
                finish[(s, kind, a.microbatch)] = clock[r]
                spans.append((a, start, clock[r]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][pos[r]] for r in range(ranks) if pos[r] < len(schedule[r])}
            where = ", ".join(f"rank {r} stops at {a}" for r, a in stuck.items())
            raise ScheduleError(
                f"schedule deadlocks: {where} (each waits for an action that never runs)\n"
                + format_marked(schedule, dict(stuck))
            )
    return spans


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
