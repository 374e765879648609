"""``microbatches="auto"`` and ``schedule="auto"``: the planner picks them by predicted step time.

The graph is profiled at two microbatch sizes (the smallest and the largest candidate), node
times are modelled as affine in the microbatch size (:mod:`pipecut.passes.microbatching`), and
every (microbatches, schedule) pair is partitioned and simulated on the interpolated costs.
Pairs whose plan does not fit memory, or that the runtime cannot run (zero-bubble with
recompute), are ruled out. The winner is planned again for real (profiled at its own size,
calibrated) and the plan records every pair considered with its prediction, so the choice is
auditable. Within 1 % of the best time the pair that keeps fewer activations alive wins (1F1B,
then zero-bubble, then GPipe), then the one with fewer microbatches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.errors import InputError, PartitionError, ScheduleError
from pipecut.passes.microbatching import candidate_microbatches, costs_at
from pipecut.plan import Candidate, NodeCost, Plan, Recompute, ScheduleKind

__all__ = ["AUTO", "choose"]

AUTO = "auto"
_PREFERENCE = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE, ScheduleKind.GPIPE,
               ScheduleKind.INTERLEAVED_1F1B)
_TIE = 0.01


def schedules_to_try(schedule: Any, stages_per_rank: int) -> tuple[ScheduleKind, ...]:
    if schedule != AUTO:
        from pipecut.planner import as_schedule

        return (as_schedule(schedule),)
    if stages_per_rank > 1:
        return (ScheduleKind.INTERLEAVED_1F1B,)
    return (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE)


def choose(
    example_inputs: Any,
    target: Any,
    *,
    ranks: int,
    microbatches: int | str,
    schedule: Any,
    stages_per_rank: int,
    profile_at: Callable[[Any, Any], Sequence[NodeCost]],
    partition: Callable[[Sequence[NodeCost], int, ScheduleKind], Plan],
) -> tuple[int, ScheduleKind, tuple[Candidate, ...]]:
    """The chosen (microbatches, schedule) and every candidate with its prediction.

    ``profile_at(first_inputs, first_target)`` profiles one microbatch; ``partition(costs, m,
    kind)`` plans a cost table for M = m under ``kind``.
    """
    kinds = schedules_to_try(schedule, stages_per_rank)
    size, _ = first_microbatch(example_inputs, 1)
    if microbatches == AUTO:
        counts = sorted({m for k in kinds for m in candidate_microbatches(size, ranks, k)})
    elif isinstance(microbatches, int) and not isinstance(microbatches, bool):
        counts = [microbatches]
    else:
        raise InputError(f"microbatches must be an int or 'auto', got {microbatches!r}")

    def measure(m: int) -> Sequence[NodeCost]:
        _, first = first_microbatch(example_inputs, m)
        first_target = split_microbatches(target, m, size, "target")[0] if target is not None else None
        return profile_at(first, first_target)

    m_small, m_large = max(counts), min(counts)  # many microbatches = small ones
    small = measure(m_small)
    large = measure(m_large) if m_large != m_small else small
    same_graph = [n.name for n in small] == [n.name for n in large]

    candidates: list[Candidate] = []
    for kind in kinds:
        for m in counts:
            if kind is ScheduleKind.INTERLEAVED_1F1B and m % ranks:
                continue
            costs: Sequence[NodeCost]
            if same_graph:
                costs = costs_at(small, large, size // m_small, size // m_large, size // m)
            else:  # the capture is shape-specialised and differs by size: measure this one
                costs = small if m == m_small else large if m == m_large else measure(m)
            try:
                planned = partition(costs, m, kind)
            except (PartitionError, ScheduleError, InputError) as e:
                candidates.append(Candidate(microbatches=m, schedule=kind, step_ms=None, note=str(e)[:200]))
                continue
            if kind is ScheduleKind.ZERO_BUBBLE and any(s.recompute is not Recompute.NONE for s in planned.stages):
                candidates.append(Candidate(microbatches=m, schedule=kind, step_ms=None,
                                            note="needs recompute, which zero-bubble cannot run"))
                continue
            candidates.append(Candidate(microbatches=m, schedule=kind, step_ms=planned.predicted.step_ms))
    feasible = [c for c in candidates if c.step_ms is not None]
    if not feasible:
        reasons = "; ".join(f"{c.microbatches}/{c.schedule.value}: {c.note}" for c in candidates[:4])
        raise PartitionError(f"no microbatch count and schedule fits: {reasons}")
    best = min(c.step_ms for c in feasible)  # type: ignore[type-var]
    near = [c for c in feasible if c.step_ms <= best * (1 + _TIE)]  # type: ignore[operator]
    pick = min(near, key=lambda c: (_PREFERENCE.index(c.schedule), c.microbatches))
    marked = tuple(dataclasses.replace(c, note="chosen") if c is pick else c for c in candidates)
    return pick.microbatches, pick.schedule, marked
