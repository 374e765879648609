"""pipecut.report.gantt: the predicted schedule as spans, and Chrome traces in and out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipecut.core.kinds import Recompute
from pipecut.errors import PlanError
from pipecut.report.gantt import Span, layout, load_trace, predicted_spans, recompute_ms, to_trace
from pipecut.schedules.format import ActionKind
from pipecut.schedules.standard import gpipe
from tests.unit.tiny import mlp_plan


def test_layout_of_gpipe_with_unit_costs():
    spans = layout(gpipe(2, 2), [1.0, 1.0], [2.0, 2.0])
    by = {s.action: s for s in spans}
    assert (by["0F0"].start, by["0F0"].end) == (0.0, 1.0)
    assert (by["1F0"].start, by["1F0"].end) == (1.0, 2.0)  # waits for stage 0's output
    assert max(s.end for s in spans) == pytest.approx(2 + 2 * 2 + 2 + 1 - 1 + 1)  # 8 ms
    assert all(s.rank == int(s.action[0]) for s in spans)


def test_predicted_spans_end_at_the_predicted_step():
    plan = mlp_plan()
    spans = predicted_spans(plan)
    assert len(spans) == 2 * plan.num_stages * plan.microbatches
    assert max(s.end for s in spans) == pytest.approx(plan.predicted.step_ms)
    assert {s.kind for s in spans} == {ActionKind.FORWARD, ActionKind.BACKWARD}
    assert recompute_ms(plan, 0) == 0.0


def test_recompute_ms_is_the_stage_forward_or_its_recomputed_blocks_share():
    plan = mlp_plan()
    s = plan.stages[0]
    full = dataclasses.replace(plan, stages=(dataclasses.replace(s, recompute=Recompute.FULL), *plan.stages[1:]))
    assert recompute_ms(full, 0) == s.forward_ms
    some = s.nodes[: len(s.nodes) // 2]
    part = dataclasses.replace(plan, stages=(dataclasses.replace(s, recompute=Recompute.SELECTIVE, recomputed=some),
                                             *plan.stages[1:]))
    share = sum(plan.node(n).forward_ms for n in some) / sum(plan.node(n).forward_ms for n in s.nodes)
    assert recompute_ms(part, 0) == pytest.approx(s.forward_ms * share) and 0 < share < 1


def test_trace_round_trip(tmp_path):
    spans = (Span(rank=0, action="0F0", start=0.0, end=1.5), Span(rank=1, action="1F0", start=1.5, end=3.0))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(to_trace(spans)))
    assert load_trace(path) == spans
    assert Span(rank=0, action="idle", start=0, end=1).kind is None


def test_predicted_processes_are_dropped_and_os_pids_renumbered():
    events = [
        {"name": "process_name", "ph": "M", "pid": 1000, "args": {"name": "rank 0 (predicted)"}},
        {"name": "0F0", "ph": "X", "pid": 1000, "ts": 0, "dur": 5},
        {"name": "0F0", "ph": "X", "pid": 41234, "ts": 100, "dur": 1000},
        {"name": "1F0", "ph": "X", "pid": 41240, "ts": 1100, "dur": 1000},
    ]
    spans = load_trace({"traceEvents": events})
    assert [(s.rank, s.action, s.start, s.end) for s in spans] == [(0, "0F0", 0.0, 1.0), (1, "1F0", 1.0, 2.0)]


def test_bad_traces_are_refused(tmp_path):
    with pytest.raises(PlanError, match="lacks \\['dur'\\]"):
        load_trace([{"name": "0F0", "ph": "X", "ts": 0}])
    with pytest.raises(PlanError, match="'traceEvents' list"):
        load_trace({"events": []})
    with pytest.raises(PlanError, match="cannot read timeline"):
        load_trace(tmp_path / "missing.json")
    assert load_trace([]) == ()
