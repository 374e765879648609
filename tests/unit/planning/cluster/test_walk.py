"""Issue 44's walk: the cluster planner hands the cluster and its figures down step by step,
entering each room once, in floor order, and nothing below a step calls back up."""

from __future__ import annotations

from benchmarks.cluster_walk import going_up, walk


def test_the_planner_enters_each_room_once_and_nothing_calls_up() -> None:
    top, edges = walk()
    assert [m.removeprefix("pipecut.planning.cluster.") for m in top] == ["tables", "choose", "run_plan"]
    assert going_up(edges) == []
