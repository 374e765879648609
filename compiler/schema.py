"""The plan's JSON codec and JSON Schema, both from pydantic over the plan dataclasses.

The frozen dataclasses in :mod:`pipecut.ir` are the source of truth. A pydantic v2
``TypeAdapter`` over :class:`~pipecut.ir.Plan` reads, checks and writes plan JSON in one pass
(pydantic-core, in Rust: a 10,000-node plan loads in well under a second), with no per-class or
per-field code, so a field added to a plan dataclass needs nothing here. Strict mode (set on
``Plan.__pydantic_config__`` and inherited by the nested dataclasses) keeps the JSON types
exact: no "3" for 3, no ``true`` for 1, no unknown fields.

A few range rules go by field name, as they did before pydantic: a number named ``*_ms``,
``*bytes`` or ``index`` is never negative, ``microbatches`` and ``batch_size`` are at least 1,
``*_fraction`` lies in [0, 1]. They are added to pydantic's core schema, so they hold on load
and appear in the JSON Schema. Fields whose names start with ``_`` (``Plan._index``) are
caches: never read from or written to JSON.

``plan.schema.json`` beside this file is that JSON Schema (draft 2020-12), kept in the repo so
tools in other languages can read plans without pipecut. Regenerate it after changing a plan
dataclass::

    python -m pipecut.schema > compiler/plan.schema.json

``tests/unit/test_schema.py`` fails, with that command, when the file is stale.
"""

from __future__ import annotations

import functools
import json
import re
import typing
from collections.abc import Iterable
from dataclasses import fields, is_dataclass
from importlib import resources
from typing import Any, get_args, get_type_hints

import pydantic
import pydantic_core
from pydantic.json_schema import GenerateJsonSchema

from pipecut.errors import PlanError
from pipecut.ir import FORMAT_VERSION, Plan

__all__ = [
    "REGENERATE",
    "dump_plan",
    "dumps",
    "generate",
    "json_path",
    "load_plan",
    "plan_data",
    "schema",
    "validate_plan_dict",
]

SCHEMA_FILE = "plan.schema.json"
REGENERATE = "python -m pipecut.schema > compiler/plan.schema.json"


# --- the core schema: pydantic's, plus the range rules by field name -----------------------------
def _bounds(name: str) -> dict[str, float]:
    if name in ("microbatches", "batch_size"):
        return {"ge": 1}
    if name.endswith("_fraction"):
        return {"ge": 0, "le": 1}
    if name.endswith(("_ms", "bytes", "index")):
        return {"ge": 0}
    return {}


def _constrain(schema: Any, bounds: dict[str, float]) -> Any:
    """``schema`` with ``bounds`` on its number, also under a default or a ``| None``."""
    kind = schema.get("type")
    if kind in ("int", "float"):
        return {**schema, **bounds}
    if kind in ("default", "nullable"):
        return {**schema, "schema": _constrain(schema["schema"], bounds)}
    return schema


def _rewrite(node: Any) -> Any:
    """A copy of a core schema with the field-name rules applied and private fields hidden."""
    if isinstance(node, list):
        return [_rewrite(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite(v) for k, v in node.items()}
    if out.get("type") == "dataclass-field":
        if out["name"].startswith("_"):  # a cache filled by __post_init__, never in JSON
            out.update(init=False, serialization_exclude=True)
        else:
            out["schema"] = _constrain(out["schema"], _bounds(out["name"]))
    return out


@functools.cache
def _core_schema() -> Any:
    return _rewrite(pydantic.TypeAdapter(Plan).core_schema)


def _config(node: Any) -> Any:
    """The plan's core config: at the top, or inside the dataclass schema when pydantic wraps
    the schema in shared ``definitions`` (a type used twice, e.g. ScheduleKind)."""
    if isinstance(node, dict):
        if isinstance(node.get("config"), dict):
            return node["config"]
        children: Any = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    return next((c for c in map(_config, children) if c is not None), None)


@functools.cache
def _validator() -> pydantic_core.SchemaValidator:
    return pydantic_core.SchemaValidator(_core_schema(), _config(_core_schema()))


@functools.cache
def _serializer() -> pydantic_core.SchemaSerializer:
    # The config again at the top: without it, an inf inside an ``Any`` leaf value is written
    # as null although ``Plan.__pydantic_config__`` says "constants" (pydantic-core 2.50).
    return pydantic_core.SchemaSerializer(_core_schema(), _config(_core_schema()))


# --- reading and writing ----------------------------------------------------------------------
def plan_data(plan: Plan) -> dict[str, Any]:
    """The plan as JSON data: dicts, lists, strings, numbers (enums as their values)."""
    return typing.cast(dict[str, Any], _serializer().to_python(plan, mode="json"))


def dump_plan(plan: Plan) -> str:
    """The plan as JSON text: keys sorted, indented, so that two plans diff line by line."""
    return json.dumps(plan_data(plan), sort_keys=True, indent=1)


def load_plan(text: str | bytes) -> Plan:
    """Parse, check and build a plan from JSON text in one pass; :class:`PlanError` names the
    JSON path of a bad field. A plan of version 1 to 5 is read as version 6 (:func:`upgraded`)."""
    text = upgraded(text)
    try:
        return typing.cast(Plan, _validator().validate_json(text))
    except pydantic_core.ValidationError as e:
        raise PlanError(_describe(e, text)) from None


_OLD_VERSION = re.compile(rb'"format_version"\s*:\s*[12345]\b')
_RECOMPUTE_2 = {None: "auto", True: "full", False: "none"}
"""Version 2 recorded ``PartitionOptions.recompute`` as None (auto), True or False."""


def upgraded(text: str | bytes) -> str | bytes:
    """A plan of format version 1 to 5 as version 6. Version 2 added ``options`` (what was
    asked; absent, None, in a version 1 plan); version 3 records the options' recompute as the
    ``Recompute`` level or "auto" instead of None/True/False; version 4 moves the microbatches
    and schedule asked out of ``options.scheduling`` (``microbatches``, ``kind``) to
    ``options.microbatches`` and ``options.schedule``; version 5 writes "auto" for the capture
    method and the partitioner where they were null; version 6 writes "unbounded" for the
    capture time limit where it was null (None only ever means "not given"). Other text is
    returned as it is.

    >>> import json
    >>> json.loads(upgraded('{"format_version": 1, "microbatches": 4}'))
    {'format_version': 6, 'microbatches': 4}
    >>> upgraded('{"format_version": 2, "options": {"partition": {"recompute": true}}}')
    '{"format_version": 6, "options": {"partition": {"recompute": "full"}}}'
    >>> upgraded('{"format_version": 3, "options": {"scheduling": {"kind": "1f1b", "microbatches": 4}}}')
    '{"format_version": 6, "options": {"scheduling": {}, "schedule": "1f1b", "microbatches": 4}}'
    >>> upgraded('{"format_version": 4, "options": {"capture": {"method": null}, "partition": {"partitioner": null}}}')
    '{"format_version": 6, "options": {"capture": {"method": "auto"}, "partition": {"partitioner": "auto"}}}'
    >>> upgraded('{"format_version": 5, "options": {"capture": {"time_limit": null}}}')
    '{"format_version": 6, "options": {"capture": {"time_limit": "unbounded"}}}'
    """
    if not _OLD_VERSION.search(text if isinstance(text, bytes) else text.encode()):
        return text  # the current version: no second parse of a large plan
    try:
        data = json.loads(text)
    except ValueError:
        return text  # the validator says what is wrong with it
    if not isinstance(data, dict) or data.get("format_version") not in (1, 2, 3, 4, 5):
        return text
    options = data.get("options") or {}
    partition = options.get("partition")
    if data["format_version"] < 3 and isinstance(partition, dict) and partition.get("recompute") in _RECOMPUTE_2:
        partition["recompute"] = _RECOMPUTE_2[partition["recompute"]]
    scheduling = options.get("scheduling")
    if isinstance(scheduling, dict):
        for old, new in (("kind", "schedule"), ("microbatches", "microbatches")):
            if old in scheduling:
                options[new] = scheduling.pop(old)
    for group, field in (("capture", "method"), ("partition", "partitioner")):
        values = options.get(group)
        if isinstance(values, dict) and field in values and values[field] is None:
            values[field] = "auto"
    capture = options.get("capture")
    if isinstance(capture, dict) and "time_limit" in capture and capture["time_limit"] is None:
        capture["time_limit"] = "unbounded"
    return json.dumps({**data, "format_version": FORMAT_VERSION})


def validate_plan_dict(data: Any) -> Plan:
    """Check (and build) a plan from already-parsed JSON data, as :func:`load_plan` does.

    >>> validate_plan_dict({"format_version": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipecut.errors.PlanError: plan does not match its schema: $: required field 'fingerprint' ...
    """
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as e:
        raise PlanError(f"plan data is not JSON data: {e}") from None
    return load_plan(text)


# --- errors -----------------------------------------------------------------------------------
def json_path(path: Iterable[str | int]) -> str:
    """``["stages", 1, "forward_ms"]`` → ``$.stages[1].forward_ms``."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _class_at(loc: tuple[str | int, ...]) -> Any:
    """The plan dataclass that holds the value at ``loc`` (for listing its fields)."""
    tp: Any = Plan
    for part in loc:
        if isinstance(part, int):
            args = [a for a in get_args(tp) if a is not type(None)]
            tp = args[0] if args else None
        elif is_dataclass(tp):
            tp = get_type_hints(tp).get(part)
        else:
            return None
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and not is_dataclass(tp):  # X | None
            tp = args[0]
    return tp if is_dataclass(tp) else None


def _version_error(text: str | bytes) -> str | None:
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"plan is not valid JSON ({e}); re-plan or restore the file"
    if not isinstance(data, dict):
        return f"a plan is a JSON object, got {type(data).__name__}"
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        return (f"plan format_version {version!r} is not supported (this pipecut reads "
                f"{FORMAT_VERSION}); re-plan with pipecut.plan(...) or `pipecut plan`")
    return None


def _describe(error: pydantic_core.ValidationError, text: str | bytes) -> str:
    # A plan of another format version or no JSON at all gets that said first: its other
    # errors are consequences. This runs only on failure, so the happy path parses once.
    early = _version_error(text)
    if early is not None:
        return early
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    where = json_path(loc)
    kind, msg = first["type"], first["msg"]
    if kind == "missing":
        where = json_path(loc[:-1])
        message = f"{where}: required field {loc[-1]!r} is missing"
    elif kind == "unexpected_keyword_argument":
        cls = _class_at(loc[:-1])
        allowed = sorted(f.name for f in fields(cls) if not f.name.startswith("_")) if cls else []
        message = (f"{json_path(loc[:-1])}: unknown field {loc[-1]!r}"
                   + (f" for {cls.__name__}; allowed fields are {allowed}" if cls else "")
                   + " (a plan written by a newer pipecut? re-plan with this one)")
    elif kind == "value_error":  # raised by a dataclass's __post_init__
        message = f"{where}: {msg.removeprefix('Value error, ')}"
    else:
        message = f"{where}: {first['input']!r:.80} is invalid: {msg}"
    more = error.error_count() - 1
    return f"plan does not match its schema: {message}" + (f" (and {more} more)" if more else "")


# --- the JSON Schema --------------------------------------------------------------------------
def generate() -> dict[str, Any]:
    """The JSON Schema of :func:`dump_plan` output, from the plan dataclasses (via pydantic)."""
    body = GenerateJsonSchema().generate(_core_schema(), mode="validation")
    for obj in (body, *body.get("$defs", {}).values()):  # private caches are not in the JSON
        for name in [n for n in obj.get("properties", {}) if n.startswith("_")]:
            del obj["properties"][name]
    props = body["properties"]
    props["format_version"] = {
        "const": FORMAT_VERSION,
        "description": "Version of this file format; a pipecut refuses versions it does not read.",
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pipecut partition plan",
        **{k: v for k, v in body.items() if k != "title"},
    }


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


@functools.cache
def schema() -> dict[str, Any]:
    """The schema shipped with the package (``plan.schema.json``)."""
    return typing.cast(
        dict[str, Any], json.loads(resources.files("pipecut").joinpath(SCHEMA_FILE).read_text())
    )


if __name__ == "__main__":
    print(dumps(generate()), end="")
