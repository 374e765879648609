"""The one schedule simulator: a step's timeline and time predicted from per-stage costs.

Every user of a predicted time asks here: the partitioner's objective, the schedule generators
(zero-bubble places W where the simulation says a rank would wait), the hybrid planner (each
rank's end, where its gradient all-reduce starts), the runtime's recorded-vs-predicted trace and
the NCCL replay's round order. A schedule that deadlocks raises :class:`ScheduleError` with the
schedule printed and "<-- ERROR HERE" where each rank stops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.errors import ScheduleError
from pipecut.schedules.format import Action, ActionKind, Schedule, format_marked

__all__ = ["StageCosts", "rank_end_ms", "simulate", "timeline"]


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
