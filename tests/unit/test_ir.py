"""The plan round-trips through JSON and refuses what it cannot trust."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import pipecut
from examples import mlp
from pipecut.assemble.choice import check_fingerprint
from pipecut.core.kinds import NodeOp
from pipecut.errors import PlanError
from pipecut.ir import ChunkedNode, NodeCost, Plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    model, inputs, loss_fn, target = mlp.build()
    return pipecut.plan(
        model, inputs, 3, loss_fn=loss_fn, target=target, microbatches=4,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )


def test_round_trip(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_design_keys_present(plan: Plan) -> None:
    data = json.loads(plan.to_json())
    for key in ("format_version", "fingerprint", "schedule", "microbatches", "nodes", "stages", "edges", "predicted"):
        assert key in data
    assert set(data["nodes"][0]) >= {"name", "op", "target", "forward_ms", "backward_ms", "output_bytes", "param_bytes"}
    assert set(data["stages"][0]) >= {
        "index", "device", "nodes", "parameters", "recompute", "forward_ms", "backward_ms",
        "peak_memory_bytes", "send_bytes", "recv_bytes",
    }
    assert set(data["edges"][0]) >= {"src_node", "src_stage", "dst_stages", "shape", "dtype", "bytes"}
    assert set(data["predicted"]) >= {"step_ms", "bubble_fraction", "bottleneck_stage"}


def test_unknown_version_refused(plan: Plan) -> None:
    data = json.loads(plan.to_json())
    data["format_version"] = 99
    with pytest.raises(PlanError, match="format_version 99 is not supported"):
        Plan.from_json(json.dumps(data))


def test_corrupt_file_refused(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json()[:-40])
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json(path)


def test_bad_field_names_its_path(plan: Plan) -> None:
    data = json.loads(plan.to_json())
    data["stages"][1]["forward_ms"] = "fast"
    with pytest.raises(PlanError, match=r"stages\[1\]\.forward_ms"):
        Plan.from_dict(data)


def test_plan_for_another_model_refused(plan: Plan) -> None:
    with pytest.raises(PlanError, match="made for another model"):
        check_fingerprint(plan, "0123456789abcdef")


def test_summary_lists_every_stage(plan: Plan) -> None:
    text = pipecut.summary(plan)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    assert [line.split()[0] for line in lines[2:5]] == ["0", "1", "2"]
    assert "predicted step" in text


def test_a_plan_without_a_cluster_has_no_headroom_figure(plan: Plan) -> None:
    assert plan.cluster is None and plan.memory_headroom_bytes is None


def test_runs_like_ignores_costs_but_not_the_split(plan: Plan) -> None:
    import dataclasses

    cheaper = tuple(dataclasses.replace(n, forward_ms=n.forward_ms / 2) for n in plan.nodes)
    recosted = dataclasses.replace(plan, nodes=cheaper, predicted=dataclasses.replace(plan.predicted, step_ms=1.0))
    assert recosted.runs_like(plan)
    first, second = plan.stages[0], plan.stages[1]  # the cut moves one node later
    moved_stages = (dataclasses.replace(first, nodes=first.nodes + second.nodes[:1]),
                    dataclasses.replace(second, nodes=second.nodes[1:]), *plan.stages[2:])
    assert not dataclasses.replace(recosted, stages=moved_stages).runs_like(plan)
    assert not dataclasses.replace(plan, microbatches=plan.microbatches * 2).runs_like(plan)
    # the same stages on a graph with a node in row pieces: another graph, another build
    assert not dataclasses.replace(plan, chunked=(ChunkedNode(node="x", pieces=2),)).runs_like(plan)


def test_kept_bytes_are_the_measured_saved_bytes_else_the_whole_output() -> None:
    node = NodeCost(name="n", op=NodeOp.CALL_FUNCTION, target="f", output_bytes=100)
    assert node.kept_bytes == 100
    assert dataclasses.replace(node, saved_bytes=0).kept_bytes == 0
    assert dataclasses.replace(node, saved_bytes=40).kept_bytes == 40
