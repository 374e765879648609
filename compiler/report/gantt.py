"""Timelines as spans: the predicted schedule laid out in time, and a measured Chrome trace.

The predicted spans come from the same simulation that gives the plan its predicted step time
(``pipecut.passes.costs.stages.predicted_timeline``), so the Gantt chart in the HTML report is the
prediction, not a drawing of it: its last end is ``plan.predicted.step_ms``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecut.core.kinds import Recompute
from pipecut.errors import PlanError, ScheduleError
from pipecut.ir import Plan
from pipecut.passes.costs.stages import predicted_timeline
from pipecut.schedules.format import Action, ActionKind, Schedule
from pipecut.schedules.simulate import timeline

__all__ = ["Span", "layout", "load_trace", "predicted_spans", "recompute_ms", "to_trace"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    """One action on one rank, in milliseconds since the step started."""

    rank: int
    action: str
    """``1F3`` style: stage, F or B, microbatch."""
    start: float
    end: float

    @property
    def kind(self) -> ActionKind | None:
        try:
            return Action.parse(self.action).kind
        except ScheduleError:
            return None


def layout(
    schedule: Schedule,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
) -> tuple[Span, ...]:
    """Start and end of every action, by ``schedules.simulate.timeline`` (the simulator's rule),
    each on the rank whose list holds it (any stage-to-rank placement)."""
    rank = {a.stage: r for r, actions in enumerate(schedule) for a in actions}
    return tuple(
        Span(rank=rank[a.stage], action=str(a), start=start, end=end)
        for a, start, end in timeline(schedule, forward_ms, backward_ms, forward_link_ms, backward_link_ms)
    )


def predicted_spans(plan: Plan) -> tuple[Span, ...]:
    """The plan's schedule laid out exactly as the planner predicted its step time.

    Each action is on the rank that runs its stage (:meth:`pipecut.ir.Plan.rank_of`).
    """
    return tuple(
        Span(rank=plan.rank_of(a.stage), action=str(a), start=start, end=end)
        for a, start, end in predicted_timeline(plan)
    )


def recompute_ms(plan: Plan, stage: int) -> float:
    """The part of a stage's backward that re-runs its forward (0 without recompute)."""
    s = plan.stages[stage]
    if s.recompute is Recompute.FULL:
        return s.forward_ms
    if s.recompute is Recompute.SELECTIVE:  # its blocks' share of the stage's forward
        total = sum(plan.node(n).forward_ms for n in s.nodes)
        return s.forward_ms * sum(plan.node(n).forward_ms for n in s.recomputed) / total if total else 0.0
    return 0.0


# --- measured timelines ----------------------------------------------------------------------
def load_trace(path_or_data: str | Path | dict[str, Any] | list[Any]) -> tuple[Span, ...]:
    """Spans from a Chrome trace (``{"traceEvents": [...]}`` or a bare list of events).

    Complete events (``"ph": "X"``, ``ts``/``dur`` in µs) become spans; the rank is the event's
    ``pid`` (or its ``tid`` when every event shares one pid), renumbered 0, 1, … when those are
    not small integers (OS process ids). Processes named "predicted" (as
    ``pipecut.runtime.execution.trace.chrome_trace`` writes next to the measured ranks) are left out. Times are shifted so the earliest
    event starts at 0, and converted to milliseconds.
    """
    data: Any = path_or_data
    if isinstance(path_or_data, (str, Path)):
        try:
            data = json.loads(Path(path_or_data).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PlanError(f"cannot read timeline {path_or_data}: {err}") from err
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise PlanError("a timeline is a Chrome trace: an object with a 'traceEvents' list")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    # Processes named "... (predicted)" (``pipecut.runtime.execution.trace``) hold the simulator's spans,
    # which the report draws from the plan already: keep the measured ones.
    predicted = {e.get("pid") for e in events if isinstance(e, dict) and e.get("ph") == "M"
                 and e.get("name") == "process_name"
                 and "predicted" in str((e.get("args") or {}).get("name", ""))}
    complete = [e for e in complete if e.get("pid") not in predicted] or complete
    for i, e in enumerate(complete):
        missing = [key for key in ("name", "ts", "dur") if key not in e]
        if missing:
            raise PlanError(f"timeline event {i} ({e!r:.80}) lacks {missing}")
    if not complete:
        return ()
    pids = {e.get("pid", 0) for e in complete}
    key = "pid" if len(pids) > 1 else "tid"
    ids = sorted({e.get(key, 0) for e in complete}, key=str)
    small = all(isinstance(r, int) and 0 <= r < 1024 for r in ids)  # ranks, not OS process ids
    rank_of = {r: r if small else i for i, r in enumerate(ids)}
    t0 = min(float(e["ts"]) for e in complete)
    return tuple(
        sorted(
            (
                Span(
                    rank=rank_of[e.get(key, 0)],
                    action=str(e["name"]),
                    start=(float(e["ts"]) - t0) / 1e3,
                    end=(float(e["ts"]) + float(e["dur"]) - t0) / 1e3,
                )
                for e in complete
            ),
            key=lambda s: (s.rank, s.start),
        )
    )


def to_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """Spans as a Chrome trace (one pid per rank), e.g. to open a prediction in Perfetto."""
    return {
        "traceEvents": [
            {"name": s.action, "ph": "X", "ts": s.start * 1e3, "dur": (s.end - s.start) * 1e3,
             "pid": s.rank, "tid": 0}
            for s in spans
        ],
        "displayTimeUnit": "ms",
    }
