"""pipecut.report.diff: which nodes moved between two plans and what it does to the prediction."""

from __future__ import annotations

import dataclasses

from pipecut.report.diff import diff_plans, format_diff
from tests.unit.tiny import mlp_plan


def test_a_plan_against_itself_moves_nothing():
    plan = mlp_plan()
    d = diff_plans(plan, plan)
    assert d.same_graph and d.settings == () and d.moves == () and d.moved_nodes == 0
    assert [s.nodes[0] for s in d.stages] == [len(s.nodes) for s in plan.stages]
    text = format_diff(d)
    assert "no node moved between stages" in text and "(same)" in text
    assert "predicted faster" not in text


def test_a_shifted_cut_is_one_run_of_moves():
    a = mlp_plan()
    stages = list(a.stages)
    # Shift the cut before the first stage that has nodes to spare (3 stages share more than
    # 6 nodes; the split is counted, not timed, so it is the same on every run).
    dst = next(s for s in range(len(stages) - 1) if len(stages[s + 1].nodes) >= 3)
    moved = stages[dst + 1].nodes[:2]
    stages[dst] = dataclasses.replace(stages[dst], nodes=stages[dst].nodes + moved)
    stages[dst + 1] = dataclasses.replace(stages[dst + 1], nodes=stages[dst + 1].nodes[2:])
    predicted = dataclasses.replace(a.predicted, step_ms=a.predicted.step_ms * 2)
    b = dataclasses.replace(a, stages=tuple(stages), predicted=predicted)
    d = diff_plans(a, b)
    assert len(d.moves) == 1
    move = d.moves[0]
    assert (move.src_stage, move.dst_stage, move.nodes) == (dst + 1, dst, moved)
    assert d.moved_nodes == 2
    assert d.stages[dst].nodes == (len(a.stages[dst].nodes), len(a.stages[dst].nodes) + 2)
    text = format_diff(d, names=("old", "new"))
    assert "2 node(s) moved between stages:" in text
    assert f"stage {dst + 1} → {dst}: {', '.join(moved)}" in text
    assert "old is predicted faster (2.00x)" in text


def test_settings_and_a_different_graph_are_reported():
    a = mlp_plan()
    b = dataclasses.replace(a, microbatches=a.microbatches * 2, fingerprint="other")
    d = diff_plans(a, b)
    assert not d.same_graph
    assert ("microbatches", str(a.microbatches), str(2 * a.microbatches)) in d.settings
    text = format_diff(d)
    assert text.startswith("warning: a and b are plans of different graphs")
    assert f"microbatches: {a.microbatches} → {2 * a.microbatches}" in text
