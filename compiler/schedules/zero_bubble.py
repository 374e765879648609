"""A zero-bubble schedule (in the spirit of ZB-H1): 1F1B's memory, backward split into I and W.

Each rank keeps at most K - s microbatches in flight, as 1F1B does, but runs each backward as
an input-gradient part ``I`` (which the previous stage waits for) and a weight-gradient part
``W`` (which nobody waits for). The order comes from list scheduling on the plan's costs: every
rank, whenever it is free, starts a ready ``I`` first, else a ready ``F``, else a pending ``W``
(filling what would have been a bubble), else waits for the earliest input to arrive; of the
ranks, the one that can start earliest (then the lowest) goes first, found with a heap in
O(log K) per action (:func:`list_schedule`, which :mod:`pipecut.schedules.zbv` uses for two
stages per rank on a V). The result is an ordinary schedule (per-rank action lists), checked and timed by
:func:`pipecut.schedules.simulate.simulate` like any other; any valid order is correct, the costs
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

from pipecut.errors import ScheduleError
from pipecut.schedules.format import Action, ActionKind, Placement, Schedule, rank_of, stages_on

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
    k, n = ranks, len(forward_ms)
    f_link = list(forward_link_ms) or [0.0] * (n - 1)
    sched = _ListScheduler(
        microbatches, limit,
        owner=[rank_of(s, k, placement) for s in range(n)],
        mine=[stages_on(r, k, n, placement) for r in range(k)],
        times=(forward_ms, [b - w for b, w in zip(backward_ms, weight_ms)], weight_ms),
        links=(f_link, list(backward_link_ms) or f_link),
    )
    for r in range(ranks):
        sched.push(r)
    for _ in range(3 * len(forward_ms) * microbatches):
        start, r, kind, s = sched.pop(what)
        s = sched.run(start, r, kind, s)
        for near in sched.neighbours(s):
            sched.push(near)
    return tuple(tuple(o) for o in sched.orders)


class _ListScheduler:
    """One run of :func:`list_schedule`: per-rank clocks, per-stage counters, completion times,
    and a heap of (start, rank) decisions.

    After an action on stage s only the ranks of s - 1, s and s + 1 can decide differently, so
    a heap of (start, rank) with stale entries skipped finds the earliest (then lowest) rank."""

    def __init__(
        self,
        microbatches: int,
        limit: Sequence[int],
        *,
        owner: list[int],
        mine: list[tuple[int, ...]],
        times: tuple[Sequence[float], Sequence[float], Sequence[float]],
        links: tuple[list[float], list[float]],
    ) -> None:
        """``owner[s]``: the rank of stage s; ``mine[r]``: the stages of rank r; ``times``: per
        stage F, I and W times; ``links``: per cut the forward and backward link times."""
        k, n = len(mine), len(owner)
        self.m, self.n, self.limit, self.owner, self.mine = microbatches, n, limit, owner, mine
        self.forward_ms, self.input_ms, self.weight_ms = times
        self.f_link, self.b_link = links
        self.clock = [0.0] * k
        self.next_f, self.next_i, self.in_flight = [0] * n, [0] * n, [0] * n
        # (stage, mb) per rank, oldest first
        self.weights: list[deque[tuple[int, int]]] = [deque() for _ in range(k)]
        self.f_done: dict[tuple[int, int], float] = {}
        self.i_done: dict[tuple[int, int], float] = {}
        self.orders: list[list[Action]] = [[] for _ in range(k)]
        self.version = [0] * k
        self.heap: list[tuple[float, int, int, ActionKind, int]] = []

    def ready_input(self, s: int) -> float | None:
        mb = self.next_i[s]
        if mb >= self.next_f[s]:
            return None  # its forward has not run yet
        if s == self.n - 1:
            return max(self.clock[self.owner[s]], self.f_done[(s, mb)])
        done = self.i_done.get((s + 1, mb))
        return None if done is None else max(self.clock[self.owner[s]], done + self.b_link[s])

    def ready_forward(self, s: int) -> float | None:
        mb = self.next_f[s]
        if mb >= self.m or self.in_flight[s] >= self.limit[s]:
            return None
        if s == 0:
            return self.clock[self.owner[s]]
        done = self.f_done.get((s - 1, mb))
        return None if done is None else max(self.clock[self.owner[s]], done + self.f_link[s - 1])

    def decide(self, r: int) -> tuple[float, ActionKind, int] | None:
        """(start, kind, stage) of rank r's next action, or None while it has nothing to wait for."""
        options = [
            (t, order, -s, kind, s)
            for s in self.mine[r]
            for order, (t, kind) in enumerate(((self.ready_input(s), ActionKind.INPUT),
                                               (self.ready_forward(s), ActionKind.FORWARD)))
            if t is not None
        ]
        now = [o for o in options if o[0] <= self.clock[r]]
        if now:
            _, _, _, kind, s = min(now, key=lambda o: (o[1], o[0], o[2]))  # I first, earliest, later stage
            return self.clock[r], kind, s
        if self.weights[r]:
            return self.clock[r], ActionKind.WEIGHT, self.weights[r][0][0]
        if not options:
            return None
        t, _, _, kind, s = min(options)
        return t, kind, s

    def push(self, r: int) -> None:
        """Recompute rank r's next action; its older heap entries become stale."""
        self.version[r] += 1
        c = self.decide(r)
        if c is not None:
            heapq.heappush(self.heap, (c[0], r, self.version[r], c[1], c[2]))

    def pop(self, what: str) -> tuple[float, int, ActionKind, int]:
        """(start, rank, kind, stage) of the earliest (then lowest) rank's next action."""
        while self.heap and self.heap[0][2] != self.version[self.heap[0][1]]:
            heapq.heappop(self.heap)
        if not self.heap:
            raise ScheduleError(f"{what} list scheduling found no runnable action")
        start, r, _, kind, s = heapq.heappop(self.heap)
        return start, r, kind, s

    def run(self, start: float, r: int, kind: ActionKind, s: int) -> int:
        """Run the action on rank r from ``start``; return its stage (a W's is its oldest)."""
        if kind is ActionKind.FORWARD:
            mb, cost = self.next_f[s], self.forward_ms[s]
            self.next_f[s] += 1
            self.in_flight[s] += 1
            self.f_done[(s, mb)] = start + cost
        elif kind is ActionKind.INPUT:
            mb, cost = self.next_i[s], self.input_ms[s]
            self.next_i[s] += 1
            self.weights[r].append((s, mb))
            self.i_done[(s, mb)] = start + cost
        else:
            s, mb = self.weights[r].popleft()
            cost = self.weight_ms[s]
            self.in_flight[s] -= 1  # the microbatch's activations are freed after its weight pass
        self.clock[r] = start + cost
        self.orders[r].append(Action(s, kind, mb))
        return s

    def neighbours(self, s: int) -> set[int]:
        """The ranks whose next action can change after one on stage s."""
        return {self.owner[x] for x in (s - 1, s, s + 1) if 0 <= x < self.n}
