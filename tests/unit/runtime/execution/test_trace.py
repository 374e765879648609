"""pipecut.runtime.execution.trace: measured and predicted spans as one Chrome trace."""

from __future__ import annotations

import json

from pipecut.report.gantt import load_trace
from pipecut.runtime.execution.trace import PREDICTED_PID_OFFSET, chrome_trace, write_chrome_trace
from pipecut.schedules.format import Action


def test_measured_ranks_and_predicted_processes_side_by_side(tmp_path):
    measured = [[("0F0", 10.0, 10.002), ("0B0", 10.004, 10.008)], [("1F0", 10.002, 10.004)]]
    predicted = [(Action.parse("0F0"), 0.0, 2.0), (Action.parse("1F0"), 2.0, 4.0)]
    trace = chrome_trace(measured, predicted)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "rank 0 (measured)", 1: "rank 1 (measured)",
                     PREDICTED_PID_OFFSET: "rank 0 (predicted)", PREDICTED_PID_OFFSET + 1: "rank 1 (predicted)"}
    spans = [e for e in events if e["ph"] == "X"]
    b = next(e for e in spans if e["name"] == "0B0")
    assert (b["cat"], b["ts"], b["dur"]) == ("backward", 10004000.0, 4000.0)
    p = next(e for e in spans if e["pid"] == PREDICTED_PID_OFFSET + 1)
    assert (p["name"], p["cat"], p["ts"], p["dur"]) == ("1F0", "forward", 2000.0, 2000.0)
    path = tmp_path / "trace.json"
    write_chrome_trace(path, trace)
    assert json.loads(path.read_text()) == trace
    # The report reads back the measured ranks only, from time 0.
    again = load_trace(path)
    assert [(s.rank, s.action) for s in again] == [(0, "0F0"), (0, "0B0"), (1, "1F0")]
    assert again[0].start == 0.0


def test_negative_durations_are_clamped():
    trace = chrome_trace([[("0F0", 2.0, 1.0)]])
    assert trace["traceEvents"][-1]["dur"] == 0.0
