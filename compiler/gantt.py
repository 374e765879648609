"""Timelines as spans: the predicted schedule laid out in time, and a measured Chrome trace.

:func:`layout` is the timing rule of ``pipecut.runtime.schedule.simulate`` written out span by
span (its last end equals ``simulate``'s step time), so the Gantt chart in the HTML report is
the prediction, not a drawing of it. A forward of microbatch i on stage s starts when stage s is
free and stage s-1's forward of i has arrived (its end plus the link time); a backward waits
for stage s+1's backward of i the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecut.errors import PlanError, ScheduleError
from pipecut.plan import Plan, Recompute
from pipecut.runtime.schedule import Action, ActionKind, Schedule, build


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
    comm_ms: Sequence[float] = (),
    grad_comm_ms: Sequence[float] | None = None,
) -> tuple[Span, ...]:
    """Start and end of every action; raises :class:`ScheduleError` if the schedule deadlocks.

    ``comm_ms[s]`` is the time to send activations from stage s to s+1, ``grad_comm_ms[s]`` the
    time to send gradients back from s+1 to s (defaults to ``comm_ms``, as in ``simulate``).
    """
    k = len(schedule)
    comm = list(comm_ms) or [0.0] * max(k - 1, 0)
    grad = list(grad_comm_ms) if grad_comm_ms is not None else comm
    finish: dict[tuple[int, ActionKind, int], float] = {}
    clock = [0.0] * k
    pos = [0] * k
    spans: list[Span] = []
    remaining = sum(len(r) for r in schedule)
    while remaining:
        progressed = False
        for s in range(k):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if a.kind is ActionKind.FORWARD:
                    dep = (s - 1, ActionKind.FORWARD, a.microbatch) if s > 0 else None
                    link, cost = (comm[s - 1] if s > 0 else 0.0), forward_ms[s]
                else:
                    dep = (s + 1, ActionKind.BACKWARD, a.microbatch) if s < k - 1 else None
                    link, cost = (grad[s] if s < k - 1 else 0.0), backward_ms[s]
                if dep is not None and dep not in finish:
                    break
                start = max(clock[s], finish[dep] + link if dep is not None else 0.0)
                clock[s] = start + cost
                finish[(s, a.kind, a.microbatch)] = clock[s]
                spans.append(Span(rank=s, action=str(a), start=start, end=clock[s]))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(schedule[s][pos[s]]) for s in range(k) if pos[s] < len(schedule[s])]
            raise ScheduleError(f"schedule deadlocks: ranks wait at {stuck}")
    return tuple(spans)


def link_ms(plan: Plan) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One-way link times between stage s and s+1: (activations forward, gradients backward).

    A stage's ``comm_ms`` is the round trip over both of its cuts, so the cuts' round trips
    are recovered by peeling them off from stage 0; the forward share is the activation bytes
    over the link, the rest is the gradients'.
    """
    fwd, grad = [], []
    before = 0.0
    for s in plan.stages[:-1]:
        round_trip = max(s.comm_ms - before, 0.0)
        forward = min(plan.link.transfer_ms(s.send_bytes), round_trip)
        fwd.append(forward)
        grad.append(round_trip - forward)
        before = round_trip
    return tuple(fwd), tuple(grad)


def predicted_spans(plan: Plan) -> tuple[Span, ...]:
    """The plan's schedule laid out with its per-stage forward, backward and link times."""
    k = plan.num_stages
    schedule = build(plan.schedule, k, plan.microbatches)
    fwd, grad = link_ms(plan)
    return layout(
        schedule,
        [s.forward_ms for s in plan.stages],
        [s.backward_ms for s in plan.stages],
        fwd,
        grad,
    )


def recompute_ms(plan: Plan, stage: int) -> float:
    """The part of a stage's backward that re-runs its forward (0 without recompute)."""
    s = plan.stages[stage]
    return s.forward_ms if s.recompute is Recompute.FULL else 0.0


# --- measured timelines ----------------------------------------------------------------------
def load_trace(path_or_data: str | Path | dict[str, Any] | list[Any]) -> tuple[Span, ...]:
    """Spans from a Chrome trace (``{"traceEvents": [...]}`` or a bare list of events).

    Complete events (``"ph": "X"``, ``ts``/``dur`` in µs) become spans; the rank is the event's
    ``pid`` (or its ``tid`` when every event shares one pid), renumbered 0, 1, … when those are
    not small integers (OS process ids). Times are shifted so the earliest
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
