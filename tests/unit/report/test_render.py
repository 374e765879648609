"""The HTML report, its charts, the Gantt layout and the DOT export (browser-free checks)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecut
from pipecut.core.kinds import Recompute, ScheduleKind
from pipecut.report.dot import edge_label, to_dot
from pipecut.report.gantt import Span, layout, load_trace, predicted_spans, to_trace
from pipecut.report.render import gantt, graph_data, memory_bars, nice_ticks, render_html, time_bars
from pipecut.schedules.simulate import simulate
from pipecut.schedules.standard import build
from tests.browser.plans import synthetic_plan


@pytest.fixture(scope="module")
def plan() -> pipecut.Plan:
    return synthetic_plan(layers=4, stages=3, microbatches=4)


def test_render_writes_one_self_contained_file(plan, tmp_path):
    out = pipecut.render(plan, tmp_path / "plan.html")
    text = out.read_text()
    assert list(tmp_path.iterdir()) == [out]
    assert text.startswith("<!DOCTYPE html>")
    # nothing fetched: no external scripts, styles, images or fonts
    assert not re.search(r"<(script|img|iframe)[^>]*\bsrc=", text)
    assert not re.search(r"<link[^>]*stylesheet", text)
    assert "@import" not in text and "url(http" not in text
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # the SVG namespace name, never fetched


def test_every_stage_appears_in_legend_graph_bars_and_table(plan):
    text = render_html(plan)
    for s in plan.stages:
        assert f'<li class="stage-key" data-stage="{s.index}">' in text
        assert f'<tr data-stage="{s.index}">' in text
        assert f"stage {s.index}:" in text  # bar tooltips
        assert f"rank {s.index}" in text  # Gantt rows
    data = json.loads(re.search(r'<script id="graph-data" type="application/json">(.*?)</script>',
                                text, re.S).group(1))
    assert [s["index"] for s in data["stages"]] == [0, 1, 2]


def test_graph_data_has_every_partitioned_node_and_labelled_cuts(plan):
    data = graph_data(plan)
    stage_of = plan.stage_of()
    assert [n["name"] for n in data["nodes"]] == [n.name for n in plan.nodes if n.name in stage_of]
    assert all(stage_of[n["name"]] == n["stage"] for n in data["nodes"])
    assert all(0 <= a < b < len(data["nodes"]) for a, b in data["edges"])  # topological order
    assert set(data["cuts"]) == {e.src_node for e in plan.edges}
    for e in plan.edges:
        assert data["cuts"][e.src_node]["label"] == edge_label(e.shape, e.dtype, e.bytes)


def test_edge_label_shows_shape_dtype_and_bytes():
    assert edge_label((4, 64, 128), "float32", 131072) == "[4, 64, 128] float32 · 128.0 KiB"
    assert edge_label(None, None, 0) == "value · 0 B"


def test_html_escapes_names(plan):
    evil = dataclasses.replace(plan, fingerprint="</script><script>alert(1)</script>")
    text = render_html(evil, title="<b>t</b>")
    assert "<script>alert(1)" not in text and "<b>t</b>" not in text


# --- charts -----------------------------------------------------------------------------------
def test_time_bars_split_recompute_out_of_backward(plan):
    stages = list(plan.stages)
    s = stages[1]
    stages[1] = dataclasses.replace(s, recompute=Recompute.FULL, backward_ms=s.backward_ms + s.forward_ms)
    chart = time_bars(dataclasses.replace(plan, stages=tuple(stages)))
    hatch = [r for r in chart.rects if r.css == "hatch"]
    assert len(hatch) == 1 and "stage 1 recompute" in hatch[0].tip
    row1 = [r for r in chart.rects if r.tip.startswith("stage 1 ")]
    assert sum(r.w for r in row1) == pytest.approx(max(r.x + r.w for r in chart.rects))  # widest row
    assert [r.tip.split(":")[0] for r in row1] == [
        "stage 1 forward", "stage 1 backward", "stage 1 recompute", "stage 1 communication"]


def test_memory_bars_mark_capacity_and_flag_overflow():
    plan = synthetic_plan(layers=4, stages=2, memory_bytes=10**9)
    chart = memory_bars(plan)
    assert len(chart.marks) == 2 and all(r.fill != "#d93025" for r in chart.rects)
    tight = dataclasses.replace(plan, devices=tuple(
        dataclasses.replace(d, memory_bytes=plan.stages[0].peak_memory_bytes // 2) for d in plan.devices))
    over = memory_bars(tight)
    assert over.rects[0].fill == "#d93025"
    assert over.marks[0].x < over.rects[0].w


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(1063.1) == [0, 200, 400, 600, 800, 1000]
    assert nice_ticks(0.7) == pytest.approx([0, 0.2, 0.4, 0.6])
    assert nice_ticks(0) == [0.0]


# --- Gantt layout -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from([s for s in ScheduleKind if not s.splits_backward]),  # F/B only
    k=st.integers(1, 5),
    m=st.integers(1, 6),
    data=st.data(),
)
def test_layout_ends_when_simulate_says_and_respects_dependencies(kind, k, m, data):
    times = st.floats(0.0, 10.0, allow_nan=False)
    fwd = data.draw(st.lists(times, min_size=k, max_size=k))
    bwd = data.draw(st.lists(times, min_size=k, max_size=k))
    comm = data.draw(st.lists(times, min_size=k - 1, max_size=k - 1))
    schedule = build(kind, k, m)
    spans = layout(schedule, fwd, bwd, comm)
    assert len(spans) == 2 * k * m
    assert max(s.end for s in spans) == pytest.approx(simulate(schedule, fwd, bwd, comm))
    end = {s.action: s.end for s in spans}
    for s in spans:
        stage, kind_, mb = int(s.action[0]), s.action[1], int(s.action[2:])
        if kind_ == "F" and stage > 0:
            assert s.start >= end[f"{stage - 1}F{mb}"] + comm[stage - 1] - 1e-9
        if kind_ == "B" and stage < k - 1:
            assert s.start >= end[f"{stage + 1}B{mb}"] + comm[stage] - 1e-9
    for rank in range(k):  # one action at a time per rank
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(mine))


def test_predicted_spans_follow_the_plans_schedule(plan):
    spans = predicted_spans(plan)
    assert len(spans) == 2 * plan.num_stages * plan.microbatches
    assert max(s.end for s in spans) == pytest.approx(plan.predicted.step_ms)
    first = [s.action for s in spans if s.rank == plan.num_stages - 1][:2]
    assert first == ["2F0", "2B0"]  # 1F1B: the last stage goes backward at once
    chart = gantt(spans, plan.num_stages)
    assert len(chart.rects) == len(spans)
    assert max(r.x + r.w for r in chart.rects) == pytest.approx(900)


# --- measured timelines -----------------------------------------------------------------------
def test_chrome_trace_round_trips_and_renders(plan, tmp_path):
    spans = predicted_spans(plan)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(to_trace(spans)))
    loaded = load_trace(path)
    assert {s.rank for s in loaded} == set(range(plan.num_stages))
    for a, b in zip(sorted(loaded, key=lambda s: (s.rank, s.start)),
                    sorted(spans, key=lambda s: (s.rank, s.start))):
        assert a.action == b.action and a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end)
    out = pipecut.render(plan, tmp_path / "p.html", timeline=path)
    text = out.read_text()
    assert "Measured timeline" in text and 'id="gantt-measured"' in text


def test_trace_ranks_from_tid_and_os_pids():
    events = [{"name": "0F0", "ph": "X", "ts": 1000, "dur": 500, "pid": 4242, "tid": 0},
              {"name": "1F0", "ph": "X", "ts": 1600, "dur": 500, "pid": 4242, "tid": 1},
              {"name": "meta", "ph": "M", "pid": 4242}]
    spans = load_trace({"traceEvents": events})
    assert spans == (Span(rank=0, action="0F0", start=0.0, end=0.5),
                     Span(rank=1, action="1F0", start=0.6, end=1.1))
    by_pid = load_trace([dict(e, pid=9000 + e["tid"]) for e in events[:2]])
    assert [s.rank for s in by_pid] == [0, 1]


def test_runtime_chrome_trace_keeps_the_measured_ranks(plan):
    from pipecut.passes.costs.stages import predicted_timeline

    chrome_trace = pytest.importorskip("pipecut.runtime.execution.trace").chrome_trace

    measured = [[("0F0", 0.0, 0.002), ("0B0", 0.004, 0.007)], [("1F0", 0.0025, 0.0035), ("1B0", 0.0035, 0.0039)]]
    spans = load_trace(chrome_trace(measured, predicted_timeline(plan)))
    assert [(s.rank, s.action) for s in spans] == [(0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0")]
    assert spans[1].start == pytest.approx(4.0) and spans[1].end == pytest.approx(7.0)


def test_bad_trace_says_what_is_missing(tmp_path):
    with pytest.raises(pipecut.PlanError, match="lacks \\['dur'\\]"):
        load_trace([{"name": "0F0", "ph": "X", "ts": 0}])
    with pytest.raises(pipecut.PlanError, match="traceEvents"):
        load_trace({"events": []})
    with pytest.raises(pipecut.PlanError, match="cannot read timeline"):
        load_trace(tmp_path / "missing.json")


# --- DOT --------------------------------------------------------------------------------------
def test_dot_has_a_cluster_per_stage_and_labelled_cut_edges(plan, tmp_path):
    text = to_dot(plan)
    assert text.count("{") == text.count("}")
    for s in plan.stages:
        assert f"subgraph cluster_stage_{s.index} {{" in text
    for e in plan.edges:
        assert re.search(rf'"{e.src_node}" -> "[^"]+" \[label="{re.escape(edge_label(e.shape, e.dtype, e.bytes))}"', text)
    assert 'subgraph "cluster_s0_layers"' in text
    assert "cluster_s0_layers" not in to_dot(plan, group_by_module=False)
    out = pipecut.render(plan, tmp_path / "plan.dot")
    assert out.read_text() == text
