"""The plan's JSON codec and Schema (pydantic): in sync with the dataclasses, exact round trips,
and bad fields reported with their JSON paths on load."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from pathlib import Path

import jsonschema
import pytest

from pipecut import Link, Plan, PlanError, ScheduleKind
from pipecut.core.kinds import LeafKind, Recompute
from pipecut.ir import Leaf
from pipecut.schema import REGENERATE, dumps, generate, json_path, schema, validate_plan_dict
from tests.browser.plans import synthetic_plan
from tests.golden_plans import FOLDER, PLANS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "compiler" / "plan.schema.json"


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    return json.loads(synthetic_plan(layers=2, stages=2).to_json())


def test_committed_schema_is_generated_from_the_dataclasses():
    assert SCHEMA_PATH.read_text() == dumps(generate()), f"stale schema; regenerate: {REGENERATE}"


def test_schema_is_valid_draft_2020_12():
    # jsonschema is a test-only dependency: pipecut itself validates with pydantic
    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["$schema"].endswith("2020-12/schema")


def test_the_published_schema_accepts_written_plans_and_refuses_bad_ones(plan_dict):
    """Tools in other languages read plans with the committed schema: it must agree with us."""
    validator = jsonschema.Draft202012Validator(schema())
    validator.validate(plan_dict)
    bad = copy.deepcopy(plan_dict)
    bad["stages"][0]["backward_ms"] = -1.0
    bad["schedule"] = "zigzag"
    bad["stages"][1]["colour"] = "red"
    assert {e.validator for e in validator.iter_errors(bad)} == {"minimum", "enum", "additionalProperties"}


def test_schema_documents_fields_from_their_docstrings():
    props = schema()["$defs"]["NodeCost"]["properties"]
    assert "Module path" in props["module"]["description"]
    assert schema()["$defs"]["ScheduleKind"]["enum"] == [s.value for s in ScheduleKind]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": 2, "stages": 1},
        {"layers": 3, "stages": 3, "schedule": "gpipe"},
        {"layers": 4, "stages": 4, "memory_bytes": 2**30, "microbatches": 8},
    ],
)
def test_written_plans_validate_and_round_trip(kwargs, tmp_path):
    plan = synthetic_plan(**kwargs)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    validate_plan_dict(json.loads(path.read_text()))
    assert Plan.from_json(path) == plan
    assert Plan.from_json(path).to_json() == path.read_text().removesuffix("\n")


def test_enums_tuples_and_any_leaf_values_round_trip_exactly():
    """Every float bit, every enum, tuples (not lists) and arbitrary JSON leaf values survive."""
    plan = synthetic_plan(layers=2, stages=2)
    rng = random.Random(0)
    values = [None, True, 3, -0.0, 1e-310, math.inf, -math.inf, "x\u00e9\n",
              {"t": "slice", "v": [{"t": "int", "v": 1}, None]}, [1, [2.5, None, [False]]],
              *(rng.uniform(-1e6, 1e6) for _ in range(50))]
    leaves = tuple(Leaf(kind=LeafKind.CONSTANT, value=v) for v in values)
    nodes = (dataclasses.replace(plan.nodes[1], leaves=leaves,
                                 forward_ms=rng.random(), backward_ms=1 / 3),)
    stages = tuple(dataclasses.replace(s, recompute=Recompute.FULL) for s in plan.stages)
    plan = dataclasses.replace(
        plan, nodes=(plan.nodes[0], *nodes, *plan.nodes[2:]), stages=stages,
        link=Link(bandwidth_bytes_per_ms=math.inf, latency_ms=0.1 + 0.2), _index={},
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert [leaf.value for leaf in again.nodes[1].leaves] == values
    assert isinstance(again.stages[0].nodes, tuple) and again.stages[0].recompute is Recompute.FULL
    assert again.nodes[1].leaves[3].value == -0.0 and math.copysign(1, again.nodes[1].leaves[3].value) == -1
    assert again.to_json() == plan.to_json()


SKIPPED = {".git", ".venv", "build", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis"}
"""Directories of the checkout that are not the repository's files (environments, outputs)."""


def _plan_files() -> list[Path]:
    """Every JSON file of the repository whose top level is a plan (it has a format_version)."""
    found = []
    for path in sorted(ROOT.rglob("*.json")):
        if SKIPPED & set(path.relative_to(ROOT).parts[:-1]) or any(
                part.startswith(".venv") for part in path.relative_to(ROOT).parts):
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "format_version" in data:
            found.append(path)
    return found


def test_every_plan_file_in_the_repository_validates():
    files = _plan_files()
    # The committed golden plans (tests/golden_plans.py) at least: a glob that finds nothing
    # would make this test pass without checking a plan.
    golden = {FOLDER / f"{name}.json" for name in PLANS}
    assert golden <= set(files), f"plan files found: {files}; regenerate: python -m tests.golden_plans"
    for path in files:
        validate_plan_dict(json.loads(path.read_text()))
        Plan.from_json(path.read_text())  # and the codec reads it back


def test_json_path_formats_keys_and_indices():
    assert json_path(["stages", 1, "forward_ms"]) == "$.stages[1].forward_ms"
    assert json_path([]) == "$"


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("stages", 1, "forward_ms"), "fast", r"\$\.stages\[1\]\.forward_ms"),
        (("stages", 0, "backward_ms"), -1.0, r"\$\.stages\[0\]\.backward_ms: -1\.0 is invalid: .*greater than or equal to 0"),
        (("nodes", 3, "op"), "call_everything", r"\$\.nodes\[3\]\.op"),
        (("edges", 0, "shape"), [2, "x"], r"\$\.edges\[0\]\.shape\[1\]"),
        (("schedule",), "zigzag", r"\$\.schedule: 'zigzag'"),
        (("predicted", "bubble_fraction"), 1.5, r"\$\.predicted\.bubble_fraction"),
        (("devices", 1, "memory_bytes"), "2GiB", r"\$\.devices\[1\]\.memory_bytes"),
        (("microbatches",), 0, r"\$\.microbatches"),
        (("stages", 0, "index"), True, r"\$\.stages\[0\]\.index: True is invalid: .*valid integer"),
        (("batch_size",), "8", r"\$\.batch_size: '8' is invalid"),
        (("nodes", 1, "forward_ms"), -2.0, r"\$\.nodes\[1\]\.forward_ms"),
        (("stages", 0, "nodes"), ["nowhere"], r"\$: stage 0 lists node 'nowhere', not in the cost table"),
    ],
)
def test_a_bad_field_is_reported_with_its_json_path(plan_dict, path, value, where):
    data = copy.deepcopy(plan_dict)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(PlanError, match=where):
        validate_plan_dict(data)
    with pytest.raises(PlanError, match=where):
        Plan.from_dict(data)


def test_unknown_and_missing_fields_name_the_object_and_the_fix(plan_dict):
    data = copy.deepcopy(plan_dict)
    data["stages"][0]["colour"] = "red"
    with pytest.raises(PlanError, match=r"\$\.stages\[0\]: unknown field 'colour' for Stage; allowed fields are \[.*'weight_ms'\].*re-plan"):
        Plan.from_dict(data)
    data = copy.deepcopy(plan_dict)
    del data["link"]
    with pytest.raises(PlanError, match=r"\$: required field 'link' is missing"):
        Plan.from_dict(data)
    data = copy.deepcopy(plan_dict)
    data["_index"] = {}
    with pytest.raises(PlanError, match=r"\$: unknown field '_index'"):
        Plan.from_dict(data)


def test_loading_a_file_reports_the_path_of_the_bad_field(plan_dict, tmp_path):
    data = copy.deepcopy(plan_dict)
    data["stages"][1]["peak_memory_bytes"] = 1.5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"\$\.stages\[1\]\.peak_memory_bytes"):
        Plan.from_json(path)


def test_unknown_format_version_is_refused_before_the_schema(plan_dict):
    data = dict(plan_dict, format_version=99)
    with pytest.raises(PlanError, match="format_version 99 is not supported"):
        Plan.from_dict(data)


def test_a_plan_that_is_not_an_object_or_not_json_is_refused(tmp_path):
    with pytest.raises(PlanError, match="a plan is a JSON object, got list"):
        Plan.from_dict([1, 2])
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json('{"format_version": 1,')
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.from_json(tmp_path / "missing.json")
