"""Schedule generators: GPipe, 1F1B and interleaved 1F1B as per-rank action lists.

The schedule IR they produce (:class:`~pipecut.schedules.format.Action`, its text form and the
timing rule) lives in :mod:`pipecut.schedules.format`; the zero-bubble orders, which are list
scheduled on the stages' costs, in :mod:`pipecut.schedules.zero_bubble` (one stage per rank) and
:mod:`pipecut.schedules.zbv` (two per rank, on a V). :func:`build` is the one
door to all of them: plans call it with their :class:`~pipecut.schedules.simulate.StageCosts`
(``pipecut.passes.costs.stages.plan_schedule``). The text of every generator's output for a few
sizes is kept under ``tests/golden/``.
"""

from __future__ import annotations

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.schedules.format import Action, ActionKind, Schedule
from pipecut.schedules.simulate import StageCosts
from pipecut.schedules.zbv import zbv
from pipecut.schedules.zero_bubble import zero_bubble

__all__ = ["build", "gpipe", "interleaved_1f1b", "one_f_one_b", "unit_costs"]


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


def unit_costs(stages: int) -> StageCosts:
    """F = I = W = 1 on every stage, free links: the costs :func:`build` schedules zero bubble on
    when it is given none."""
    return StageCosts(forward=(1.0,) * stages, backward=(2.0,) * stages, weight=(1.0,) * stages,
                      forward_link=(0.0,) * max(stages - 1, 0), backward_link=(0.0,) * max(stages - 1, 0))


def build(
    kind: ScheduleKind,
    ranks: int,
    microbatches: int,
    chunks: int = 1,
    costs: StageCosts | None = None,
) -> Schedule:
    """The schedule of ``kind`` for ``ranks`` ranks holding ``chunks`` stages each.

    ``costs`` (per stage, ``ranks * chunks`` of them) only change a zero-bubble order, which is
    list scheduled on them; without them it is scheduled on :func:`unit_costs`. GPipe, 1F1B and
    interleaved 1F1B are fixed orders. ZBV always runs two chunks (``chunks`` 1, the default,
    or 2).
    """
    fixed = kind.fixed_stages_per_rank
    if fixed is not None:
        if chunks not in (1, fixed):
            raise ScheduleError(f"{kind.value} runs {fixed} stages per rank, not {chunks}")
        chunks = fixed
    if costs is not None and len(costs.forward) != ranks * chunks:
        raise ScheduleError(
            f"costs for {len(costs.forward)} stages, but {ranks} ranks × {chunks} chunks make "
            f"{ranks * chunks} stages; pass one cost per stage"
        )
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        return interleaved_1f1b(ranks, chunks, microbatches)
    if kind is ScheduleKind.ZBV:
        c = costs if costs is not None else unit_costs(ranks * chunks)
        return zbv(ranks, microbatches, c.forward, c.backward, c.weight, c.forward_link, c.backward_link)
    if chunks != 1:
        raise ScheduleError(f"{kind.value} runs one stage per rank; use interleaved-1f1b for {chunks}")
    if kind is ScheduleKind.GPIPE:
        return gpipe(ranks, microbatches)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(ranks, microbatches)
    if kind is ScheduleKind.ZERO_BUBBLE:
        c = costs if costs is not None else unit_costs(ranks)
        return zero_bubble(ranks, microbatches, c.forward, c.backward, c.weight, c.forward_link,
                           c.backward_link)
    raise ScheduleError(f"no generator for schedule {kind}")
