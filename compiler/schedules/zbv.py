"""ZBV, zero bubble on a V: two stages per rank, backward split into I and W (after ZB-V).

The graph is cut into 2K stages laid as a V (:data:`~pipecut.schedules.format.Placement.V`): rank
r runs stage r on the way down and stage 2K - 1 - r on the way back up, so rank 0 holds both the
first stage (the embedding) and the last (the head and the loss), and a microbatch's forward
turns round on rank K - 1 without leaving it. Each stage's backward is an input-gradient part
``I`` (which the stage before waits for) and a weight part ``W`` (which nobody waits for).

The order is list scheduled on the stages' costs by the scheduler of
:mod:`pipecut.schedules.zero_bubble` (:func:`~pipecut.schedules.zero_bubble.list_schedule`): whenever a rank is free it starts, of its two stages, a ready ``I`` (the
stage with the earlier ready time, then the later stage), else a ready ``F`` (likewise), else
its oldest pending ``W`` (filling what would have been a bubble), else waits for the earliest
input; of the ranks, the one that can start earliest (then the lowest) goes first. A stage s
keeps at most ``min(M, 2K - s)`` microbatches between its ``F`` and its ``W`` (the in-flight
count :func:`pipecut.passes.costs.stages.inflight_microbatches` charges memory for), which bounds
rank r's activations to ``2K + 1`` half-size stages, about 1F1B's first rank. Two ranks, four
microbatches, F = I = W::

    0F0 0F1 0F2 3F0 3I0 0F3 3W0 0I0 3F1 3I1 0W0 3W1 0I1 3F2 3I2 0W1 3W2 0I2 3F3 3I3 0W2 3W3 0I3 0W3
    1F0 2F0 1F1 2F1 2I0 1I0 1F2 2W0 2F2 2I1 1I1 1W0 1F3 2W1 2I2 1I2 2F3 1W1 2W2 2I3 1I3 1W2 2W3 1W3

In simulation with F = I = W = 1 per (half-size) stage this takes 49 units for K = 2, M = 8 and
51 for K = 4 (no bubble at all: 48); on the same model cut into K stages (F = I = W = 2),
zero-bubble takes 52 and 60, interleaved 1F1B (V = 2) 51 and 57, 1F1B 54 and 66.

The result is an ordinary schedule, checked and timed by :func:`pipecut.schedules.simulate.simulate`
like every other (any valid order is correct; the costs only decide how well bubbles fill).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecut.errors import ScheduleError
from pipecut.schedules.format import Placement, Schedule
from pipecut.schedules.zero_bubble import list_schedule

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
    return list_schedule(k, m, Placement.V, zbv_inflight(n, m), forward_ms, backward_ms, weight_ms,
                         forward_link_ms, backward_link_ms, what="zbv")
