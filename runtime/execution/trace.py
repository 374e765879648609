"""Chrome trace JSON (opens in Perfetto or chrome://tracing) of measured and predicted steps.

Process ``rank r`` holds the measured actions of rank r; process ``predicted r`` holds the
simulator's prediction for the same rank, so the two read side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipecut.schedules.format import Action

__all__ = ["PREDICTED_PID_OFFSET", "chrome_trace", "write_chrome_trace"]

PREDICTED_PID_OFFSET = 1000


def _event(name: str, pid: int, start_s: float, end_s: float, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "cat": "backward" if "B" in name else "forward",
        "ph": "X",
        "pid": pid,
        "tid": 0,
        "ts": round(start_s * 1e6, 3),
        "dur": round(max(end_s - start_s, 0.0) * 1e6, 3),
        "args": args or {},
    }


def _process_name(pid: int, name: str) -> dict[str, Any]:
    return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


def chrome_trace(
    measured: Sequence[Sequence[tuple[str, float, float]]],
    predicted: Sequence[tuple[Action, float, float]] = (),
) -> dict[str, Any]:
    """``measured[r]``: (action, start s, end s) of rank r; ``predicted``: simulator spans in ms."""
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(measured):
        events.append(_process_name(rank, f"rank {rank} (measured)"))
        events += [_event(name, rank, start, end) for name, start, end in spans]
    stages = sorted({a.stage for a, _, _ in predicted})
    for s in stages:
        events.append(_process_name(PREDICTED_PID_OFFSET + s, f"rank {s} (predicted)"))
    events += [
        _event(str(a), PREDICTED_PID_OFFSET + a.stage, start / 1e3, end / 1e3) for a, start, end in predicted
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, trace: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(trace))
