"""A zero-bubble schedule (in the spirit of ZB-H1): 1F1B's memory, backward split into I and W.

Each rank keeps at most K - s microbatches in flight, as 1F1B does, but runs each backward as
an input-gradient part ``I`` (which the previous stage waits for) and a weight-gradient part
``W`` (which nobody waits for). The order comes from list scheduling on the plan's costs: every
rank, whenever it is free, starts a ready ``I`` first, else a ready ``F``, else a pending ``W``
(filling what would have been a bubble), else waits for the earliest input to arrive; of the
ranks, the one that can start earliest (then the lowest) goes first, found with a heap in
O(log K) per action (:func:`list_schedule`, which :mod:`pipecut.passes.schedules.zbv` uses for two
stages per rank on a V). The result is an ordinary schedule (per-rank action lists), checked and timed by
:func:`pipecut.core.schedule.simulate` like any other; any valid order is correct, the costs
only decide how well the bubbles are filled. Two ranks, four microbatches, F = I = W::

    0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3
    1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2 1F3 1I3 1W3

In simulation with F = I = W this takes 26 time units for K = 2, M = 8 (1F1B: 27) and 30 for
K = 4 (1F1B: 33; no bubble at all would be 24).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from pipecut.core.schedule import Action, ActionKind, Placement, Schedule, rank_of, stages_on
from pipecut.errors import ScheduleError

__all__ = ["list_schedule", "zero_bubble"]


def zero_bubble(
    ranks: int,
    microbatches: int,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    weight_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
) -> Schedule:
    """Per-rank actions for ``ranks`` stages (one per rank); costs per stage, in ms."""
    return list_schedule(ranks, microbatches, Placement.LOOP, [ranks - s for s in range(ranks)],
                         forward_ms, backward_ms, weight_ms, forward_link_ms, backward_link_ms)


def list_schedule(
    ranks: int,
    microbatches: int,
    placement: Placement,
    limit: Sequence[int],
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    weight_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    what: str = "zero-bubble",
) -> Schedule:
    """Per-rank F/I/W actions for ``len(forward_ms)`` stages laid on ``ranks`` ranks as
    ``placement`` says, stage s holding at most ``limit[s]`` microbatches between its F and its
    W. A free rank starts, of its stages, a ready ``I`` (the earlier, then the later stage), else
    a ready ``F``, else its oldest pending ``W``, else waits for the earliest input; of the
    ranks, the one that can start earliest (then the lowest) goes first."""
    k, m, n = ranks, microbatches, len(forward_ms)
    owner = [rank_of(s, k, placement) for s in range(n)]
    mine = [stages_on(r, k, n, placement) for r in range(k)]
    f_link = list(forward_link_ms) or [0.0] * (n - 1)
    b_link = list(backward_link_ms) or f_link
    input_ms = [b - w for b, w in zip(backward_ms, weight_ms)]
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
            raise ScheduleError(f"{what} list scheduling found no runnable action")
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
