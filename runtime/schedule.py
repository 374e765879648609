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
from typing import TYPE_CHECKING

from pipecut.errors import ScheduleError
from pipecut.plan import ScheduleKind

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "build",
    "format_marked",
    "format_schedule",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_schedule",
    "simulate",
    "timeline",
    "validate",
]

if TYPE_CHECKING:
    from pipecut.runtime.p2p import Wiring


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


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Fill-drain: all forwards, then all backwards in reverse microbatch order."""
    return tuple(
        tuple(Action(s, ActionKind.FORWARD, i) for i in range(microbatches))
        + tuple(Action(s, ActionKind.BACKWARD, i) for i in reversed(range(microbatches)))
        for s in range(stages)
    )


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Warm-up forwards, then alternate one forward and one backward, then drain backwards."""
    return interleaved_1f1b(stages, 1, microbatches)


def interleaved_1f1b(ranks: int, chunks: int, microbatches: int) -> Schedule:
    """1F1B over ``chunks`` virtual stages per rank (stage ``c * ranks + r`` on rank r).

    Forwards go through microbatches in groups of ``ranks``, chunk by chunk; backwards the same
    with the chunks reversed. Rank r first runs ``2 (K - r - 1) + (V - 1) K`` forwards, then
    alternates, which shrinks the bubble by about V against plain 1F1B at the same memory
    order. With one chunk this is plain 1F1B.
    """
    if chunks > 1 and microbatches % ranks:
        raise ScheduleError(
            f"interleaved 1F1B needs the microbatches ({microbatches}) to be a multiple of the "
            f"ranks ({ranks}); change microbatches or use 1f1b"
        )
    total = microbatches * chunks
    group = ranks * chunks

    def nth(rank: int, k: int, kind: ActionKind) -> Action:
        g, pos = divmod(k, group)
        chunk = pos // ranks if kind is ActionKind.FORWARD else chunks - 1 - pos // ranks
        mb = g * ranks + pos % ranks if chunks > 1 else k
        return Action(chunk * ranks + rank, kind, mb)

    schedule = []
    for r in range(ranks):
        warmup = min((ranks - r - 1) * (2 if chunks > 1 else 1) + (chunks - 1) * ranks, total)
        actions = [nth(r, k, ActionKind.FORWARD) for k in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < total:
            if fwd < total:
                actions.append(nth(r, fwd, ActionKind.FORWARD))
                fwd += 1
            actions.append(nth(r, bwd, ActionKind.BACKWARD))
            bwd += 1
        schedule.append(tuple(actions))
    return tuple(schedule)


def build(kind: ScheduleKind, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule of ``kind`` for ``ranks`` ranks holding ``chunks`` stages each."""
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        return interleaved_1f1b(ranks, chunks, microbatches)
    if kind is ScheduleKind.ZERO_BUBBLE and chunks == 1:
        # Without a plan's costs: the order list scheduling gives for F = I = W everywhere
        # (plans use pipecut.passes.stages.plan_schedule, which schedules on their costs).
        from pipecut.runtime.zb_schedule import zero_bubble

        return zero_bubble(ranks, microbatches, [1.0] * ranks, [2.0] * ranks, [1.0] * ranks)
    if chunks != 1:
        raise ScheduleError(f"{kind.value} runs one stage per rank; use interleaved-1f1b for {chunks}")
    if kind is ScheduleKind.GPIPE:
        return gpipe(ranks, microbatches)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(ranks, microbatches)
    raise ScheduleError(f"no generator for schedule {kind}")


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
    nccl: Wiring | None = None,
) -> float:
    """Predicted step time; raises :class:`ScheduleError` if the schedule deadlocks.

    With ``nccl`` (the plan's wiring, :func:`pipecut.runtime.p2p.wiring`), the transfers the
    executor would issue are also replayed under NCCL's rules (:mod:`pipecut.runtime.nccl`:
    no tags, per-pair FIFO, sends complete only when received) and a hang is refused.

    Costs are per stage. A forward of stage s waits for stage s-1's forward of the same
    microbatch plus ``forward_link_ms[s-1]``; a backward waits for stage s+1's backward plus
    ``backward_link_ms[s]`` (defaults to ``forward_link_ms``). Each rank runs its actions in
    order, one at a time. With a split backward, I costs ``backward_ms - weight_ms`` and waits
    like a backward; W costs ``weight_ms`` and waits only for its own I.
    """
    return max((end for _, _, end in timeline(schedule, forward_ms, backward_ms, forward_link_ms,
                                              backward_link_ms, weight_ms, nccl)), default=0.0)


def timeline(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    weight_ms: Sequence[float] = (),
    nccl: Wiring | None = None,
) -> list[tuple[Action, float, float]]:
    """(action, start, end) of every action, in the order the simulation runs them; with
    ``nccl``, first checks the communication under NCCL's rules (see :func:`simulate`)."""
    if nccl is not None:
        from pipecut.runtime.nccl import check_nccl  # it replays this module's timeline

        check_nccl(schedule, nccl)
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
