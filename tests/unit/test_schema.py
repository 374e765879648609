"""The plan's JSON Schema: in sync with the dataclasses, valid, and checked with exact paths on load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from pipecut import Plan, PlanError, ScheduleKind
from pipecut.schema import REGENERATE, dumps, generate, json_path, schema, validate_plan_dict
from tests.browser.plans import synthetic_plan

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "compiler" / "plan.schema.json"


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    return json.loads(synthetic_plan(layers=2, stages=2).to_json())


def test_committed_schema_is_generated_from_the_dataclasses():
    assert SCHEMA_PATH.read_text() == dumps(generate()), f"stale schema; regenerate: {REGENERATE}"


def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["$schema"].endswith("2020-12/schema")


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


def test_every_plan_file_in_the_repository_validates():
    files = [p for p in (ROOT / "tests").rglob("*.json") if '"format_version"' in p.read_text()]
    for path in files:
        validate_plan_dict(json.loads(path.read_text()))


def test_json_path_formats_keys_and_indices():
    assert json_path(["stages", 1, "forward_ms"]) == "$.stages[1].forward_ms"
    assert json_path([]) == "$"


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("stages", 1, "forward_ms"), "fast", r"\$\.stages\[1\]\.forward_ms"),
        (("stages", 0, "backward_ms"), -1.0, r"\$\.stages\[0\]\.backward_ms: -1\.0 is invalid: .*minimum"),
        (("nodes", 3, "op"), "call_everything", r"\$\.nodes\[3\]\.op"),
        (("edges", 0, "shape"), [2, "x"], r"\$\.edges\[0\]\.shape\[1\]"),
        (("schedule",), "zigzag", r"\$\.schedule: 'zigzag'"),
        (("predicted", "bubble_fraction"), 1.5, r"\$\.predicted\.bubble_fraction"),
        (("devices", 1, "memory_bytes"), "2GiB", r"\$\.devices\[1\]\.memory_bytes"),
        (("microbatches",), 0, r"\$\.microbatches"),
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
    with pytest.raises(PlanError, match=r"\$\.stages\[0\]: .*'colour' was unexpected.*regenerate"):
        Plan.from_dict(data)
    data = copy.deepcopy(plan_dict)
    del data["link"]
    with pytest.raises(PlanError, match=r"\$: 'link' is a required property"):
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
