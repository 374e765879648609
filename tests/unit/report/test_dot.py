"""pipecut.report.dot: Graphviz export of a plan."""

from __future__ import annotations

import re

from pipecut.report.dot import edge_label, stage_colour, stage_hsv, to_dot
from tests.unit.tiny import mlp_plan


def test_stage_colours_are_distinct_and_stable():
    colours = [stage_colour(s) for s in range(8)]
    assert len(set(colours)) == 8
    assert stage_colour(0) == "hsl(210, 65%, 62%)"
    assert stage_colour(3, lightness=40).endswith("40%)")
    hues = [float(stage_hsv(s).split()[0]) for s in range(8)]
    assert len(set(hues)) == 8 and all(0 <= h < 1 for h in hues)
    assert stage_hsv(0) == "0.583 0.55 0.92"


def test_edge_label():
    assert edge_label((4, 64), "float32", 1024) == "[4, 64] float32 · 1.0 KiB"
    assert edge_label(None, None, 0) == "value · 0 B"
    assert edge_label((), None, 8) == "[] · 8 B"


def test_dot_has_a_cluster_per_stage_every_node_and_bold_cut_edges():
    plan = mlp_plan()
    dot = to_dot(plan)
    assert dot.startswith("digraph plan {") and dot.endswith("}\n")
    assert dot.count("{") == dot.count("}")
    for s in plan.stages:
        assert f"subgraph cluster_stage_{s.index} {{" in dot
        for name in s.nodes:
            assert f'"{name}" [label=' in dot
    bold = re.findall(r'"(\w+)" -> "(\w+)" \[label="([^"]*)", penwidth=2', dot)
    stage_of = plan.stage_of()
    assert bold and all(stage_of[a] != stage_of[b] for a, b, _ in bold)
    cut_sources = {e.src_node for e in plan.edges}
    assert {a for a, _, _ in bold} <= cut_sources
    flat = to_dot(plan, group_by_module=False)
    assert "style=\"dashed\"" in dot and "style=\"dashed\"" not in flat  # module sub-clusters
