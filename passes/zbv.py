"""ZBV, zero bubble on a V: two stages per rank, backward split into I and W (after ZB-V).

The graph is cut into 2K stages laid as a V (:data:`~pipecut.core.schedule.Placement.V`): rank
r runs stage r on the way down and stage 2K - 1 - r on the way back up, so rank 0 holds both the
first stage (the embedding) and the last (the head and the loss), and a microbatch's forward
turns round on rank K - 1 without leaving it. Each stage's backward is an input-gradient part
``I`` (which the stage before waits for) and a weight part ``W`` (which nobody waits for).

The order is list scheduled on the stages' costs, as :mod:`pipecut.passes.zero_bubble` does for
one stage per rank: whenever a rank is free it starts, of its two stages, a ready ``I`` (the
stage with the earlier ready time, then the later stage), else a ready ``F`` (likewise), else
its oldest pending ``W`` (filling what would have been a bubble), else waits for the earliest
input; of the ranks, the one that can start earliest (then the lowest) goes first. A stage s
keeps at most ``min(M, 2K - s)`` microbatches between its ``F`` and its ``W`` (the in-flight
count :func:`pipecut.passes.stages.inflight_microbatches` charges memory for), which bounds
rank r's activations to ``2K + 1`` half-size stages, about 1F1B's first rank. Two ranks, four
microbatches, F = I = W::

    0F0 0F1 0F2 3F0 3I0 0F3 3W0 0I0 3F1 3I1 0W0 3W1 0I1 3F2 3I2 0W1 3W2 0I2 3F3 3I3 0W2 3W3 0I3 0W3
    1F0 2F0 1F1 2F1 2I0 1I0 1F2 2W0 2F2 2I1 1I1 1W0 1F3 2W1 2I2 1I2 2F3 1W1 2W2 2I3 1I3 1W2 2W3 1W3

In simulation with F = I = W = 1 per (half-size) stage this takes 49 units for K = 2, M = 8 and
51 for K = 4 (no bubble at all: 48); on the same model cut into K stages (F = I = W = 2),
zero-bubble takes 52 and 60, interleaved 1F1B (V = 2) 51 and 57, 1F1B 54 and 66.

The result is an ordinary schedule, checked and timed by :func:`pipecut.core.schedule.simulate`
like every other (any valid order is correct; the costs only decide how well bubbles fill).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from pipecut.core.schedule import Action, ActionKind, Placement, Schedule, rank_of, stages_on
from pipecut.errors import ScheduleError

__all__ = ["zbv", "zbv_inflight"]


def zbv_inflight(stages: int, microbatches: int) -> list[int]:
    """The most microbatches stage s holds between its F and its W: ``min(M, 2K - s)``."""
    return [min(microbatches, stages - s) for s in range(stages)]


def zbv(
    ranks: int,
    microbatches: int,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    weight_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
) -> Schedule:
    """Per-rank actions for ``2 * ranks`` stages on a V; costs per stage, in ms."""
    k, m, n = ranks, microbatches, 2 * ranks
    if len(forward_ms) != n:
        raise ScheduleError(f"zbv on {k} ranks runs {n} stages; got costs for {len(forward_ms)}")
    owner = [rank_of(s, k, Placement.V) for s in range(n)]
    mine = [stages_on(r, k, n, Placement.V) for r in range(k)]
    f_link = list(forward_link_ms) or [0.0] * (n - 1)
    b_link = list(backward_link_ms) or f_link
    input_ms = [b - w for b, w in zip(backward_ms, weight_ms)]
    limit = zbv_inflight(n, m)
    clock = [0.0] * k
    next_f, next_i, in_flight = [0] * n, [0] * n, [0] * n
    weights: list[deque[tuple[int, int]]] = [deque() for _ in range(k)]  # (stage, mb), oldest first
    f_done: dict[tuple[int, int], float] = {}
    i_done: dict[tuple[int, int], float] = {}
    orders: list[list[Action]] = [[] for _ in range(k)]

    def ready_input(s: int) -> float | None:
        mb = next_i[s]
        if mb >= next_f[s]:
            return None  # its forward has not run yet
        if s == n - 1:
            return max(clock[owner[s]], f_done[(s, mb)])
        done = i_done.get((s + 1, mb))
        return None if done is None else max(clock[owner[s]], done + b_link[s])

    def ready_forward(s: int) -> float | None:
        mb = next_f[s]
        if mb >= m or in_flight[s] >= limit[s]:
            return None
        if s == 0:
            return clock[owner[s]]
        done = f_done.get((s - 1, mb))
        return None if done is None else max(clock[owner[s]], done + f_link[s - 1])

    def decide(r: int) -> tuple[float, ActionKind, int] | None:
        """(start, kind, stage) of rank r's next action, or None while it has nothing to wait for."""
        options = [
            (t, order, -s, kind, s)
            for s in mine[r]
            for order, (t, kind) in enumerate(((ready_input(s), ActionKind.INPUT),
                                               (ready_forward(s), ActionKind.FORWARD)))
            if t is not None
        ]
        now = [o for o in options if o[0] <= clock[r]]
        if now:
            _, _, _, kind, s = min(now, key=lambda o: (o[1], o[0], o[2]))  # I first, earliest, later stage
            return clock[r], kind, s
        if weights[r]:
            return clock[r], ActionKind.WEIGHT, weights[r][0][0]
        if not options:
            return None
        t, _, _, kind, s = min(options)
        return t, kind, s

    # After an action on stage s only the ranks of s - 1, s and s + 1 can decide differently, so
    # a heap of (start, rank) with stale entries skipped finds the earliest (then lowest) rank.
    version = [0] * k
    heap: list[tuple[float, int, int, ActionKind, int]] = []

    def push(r: int) -> None:
        version[r] += 1
        c = decide(r)
        if c is not None:
            heapq.heappush(heap, (c[0], r, version[r], c[1], c[2]))

    for r in range(k):
        push(r)
    remaining = 3 * n * m
    while remaining:
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            raise ScheduleError("zbv list scheduling found no runnable action")
        start, r, _, kind, s = heapq.heappop(heap)
        if kind is ActionKind.FORWARD:
            mb, cost = next_f[s], forward_ms[s]
            next_f[s] += 1
            in_flight[s] += 1
            f_done[(s, mb)] = start + cost
        elif kind is ActionKind.INPUT:
            mb, cost = next_i[s], input_ms[s]
            next_i[s] += 1
            weights[r].append((s, mb))
            i_done[(s, mb)] = start + cost
        else:
            s, mb = weights[r].popleft()
            cost = weight_ms[s]
            in_flight[s] -= 1  # the microbatch's activations are freed after its weight pass
        clock[r] = start + cost
        orders[r].append(Action(s, kind, mb))
        remaining -= 1
        for near in {owner[x] for x in (s - 1, s, s + 1) if 0 <= x < n}:
            push(near)
    return tuple(tuple(o) for o in orders)
