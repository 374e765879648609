"""A zero-bubble schedule (in the spirit of ZB-H1): 1F1B's memory, backward split into I and W.

Each rank keeps at most K - s microbatches in flight, as 1F1B does, but runs each backward as
an input-gradient part ``I`` (which the previous stage waits for) and a weight-gradient part
``W`` (which nobody waits for). The order comes from list scheduling on the plan's costs: every
rank, whenever it is free, starts a ready ``I`` first, else a ready ``F``, else a pending ``W``
(filling what would have been a bubble), else waits for the earliest input to arrive; of the
ranks, the one that can start earliest (then the lowest) goes first, found with a heap in
O(log K) per action. The result is an ordinary schedule (per-rank action lists), checked and timed by
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

from pipecut.core.schedule import Action, ActionKind, Schedule
from pipecut.errors import ScheduleError

__all__ = ["zero_bubble"]


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
    k, m = ranks, microbatches
    f_link = list(forward_link_ms) or [0.0] * max(k - 1, 0)
    b_link = list(backward_link_ms) or f_link
    input_ms = [b - w for b, w in zip(backward_ms, weight_ms)]
    clock = [0.0] * k
    next_f = [0] * k
    next_i = [0] * k
    in_flight = [0] * k
    weights: list[deque[int]] = [deque() for _ in range(k)]
    f_done: dict[tuple[int, int], float] = {}
    i_done: dict[tuple[int, int], float] = {}
    orders: list[list[Action]] = [[] for _ in range(k)]

    def ready_input(s: int) -> float | None:
        mb = next_i[s]
        if mb >= next_f[s]:
            return None  # its forward has not run yet
        if s == k - 1:
            return max(clock[s], f_done[(s, mb)])
        done = i_done.get((s + 1, mb))
        return None if done is None else max(clock[s], done + b_link[s])

    def ready_forward(s: int) -> float | None:
        mb = next_f[s]
        if mb >= m or in_flight[s] >= k - s:
            return None
        if s == 0:
            return clock[s]
        done = f_done.get((s - 1, mb))
        return None if done is None else max(clock[s], done + f_link[s - 1])

    def decide(s: int) -> tuple[float, ActionKind] | None:
        options = [(t, kind) for t, kind in ((ready_input(s), ActionKind.INPUT),
                                            (ready_forward(s), ActionKind.FORWARD)) if t is not None]
        now = [kind for t, kind in options if t <= clock[s]]
        if now:
            return clock[s], now[0]  # I before F: the previous stage is waiting for it
        if weights[s]:
            return clock[s], ActionKind.WEIGHT
        return min(options, key=lambda o: o[0]) if options else None

    # Each rank's next decision depends only on its own state and its neighbours' finish
    # times, so after an action on rank s only s - 1, s and s + 1 decide again: a heap of
    # (start, rank) with stale entries skipped gives the earliest (then lowest) rank in
    # O(log K) per action, the same choice as a scan of all ranks.
    version = [0] * k
    heap: list[tuple[float, int, int, ActionKind]] = []

    def push(s: int) -> None:
        version[s] += 1
        c = decide(s)
        if c is not None:
            heapq.heappush(heap, (c[0], s, version[s], c[1]))

    for s in range(k):
        push(s)
    remaining = 3 * k * m
    while remaining:
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            raise ScheduleError("zero-bubble list scheduling found no runnable action")
        start, s, _, kind = heapq.heappop(heap)
        if kind is ActionKind.FORWARD:
            mb, cost = next_f[s], forward_ms[s]
            next_f[s] += 1
            in_flight[s] += 1
            f_done[(s, mb)] = start + cost
        elif kind is ActionKind.INPUT:
            mb, cost = next_i[s], input_ms[s]
            next_i[s] += 1
            weights[s].append(mb)
            i_done[(s, mb)] = start + cost
        else:
            mb, cost = weights[s].popleft(), weight_ms[s]
            in_flight[s] -= 1  # the microbatch's activations are freed after its weight pass
        clock[s] = start + cost
        orders[s].append(Action(s, kind, mb))
        remaining -= 1
        for n in (s - 1, s, s + 1):
            if 0 <= n < k:
                push(n)
    return tuple(tuple(o) for o in orders)
