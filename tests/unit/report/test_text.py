"""pipecut.report.text: human byte sizes and the summary table."""

from __future__ import annotations

import pytest

from pipecut.report.text import human_bytes, summary
from tests.unit.tiny import mlp_plan


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (1536 * 1024, "1.5 MiB"), (3 * 1024**3, "3.0 GiB"),
                                         (5 * 1024**4, "5120.0 GiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_summary_has_a_row_per_stage_and_the_prediction():
    plan = mlp_plan()
    lines = summary(plan).splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    assert set(lines[1]) <= {"-", " "}
    rows = lines[2:2 + plan.num_stages]
    assert [r.split()[0] for r in rows] == [str(s.index) for s in plan.stages]
    assert [int(r.split()[2]) for r in rows] == [len(s.nodes) for s in plan.stages]
    tail = lines[2 + plan.num_stages]
    assert f"schedule 1f1b, {plan.microbatches} microbatches of {plan.batch_size // plan.microbatches}" in tail
    assert f"predicted step {plan.predicted.step_ms:.2f} ms" in tail
    assert f"bottleneck stage {plan.predicted.bottleneck_stage}" in tail
