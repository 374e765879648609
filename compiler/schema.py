"""The plan's JSON Schema: generated from the plan dataclasses, kept in the repo, checked on load.

The dataclasses in :mod:`pipecut.plan` are the source of truth; ``plan.schema.json`` beside this
file is generated from their type hints and field docstrings (draft 2020-12), so tools in other
languages can read plans without pipecut. Regenerate it after changing a plan dataclass::

    python -m pipecut.schema > compiler/plan.schema.json

``tests/unit/test_schema.py`` fails, with that command, when the file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import json
import types
import typing
from importlib import resources
from typing import Any, get_args, get_origin, get_type_hints

import jsonschema

from pipecut.errors import PlanError
from pipecut.plan import FORMAT_VERSION, Plan

SCHEMA_FILE = "plan.schema.json"
REGENERATE = "python -m pipecut.schema > compiler/plan.schema.json"

_NON_NEGATIVE = ("_ms", "_bytes", "bytes", "microbatches", "batch_size", "index")
"""Field-name endings whose values are sizes, times or counts: never negative."""
_POSITIVE = ("microbatches", "batch_size")


# --- generation ------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right under a field) of a dataclass."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(tp)
    if tp is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        inner = _type_schema(options[0], defs) if len(options) == 1 else {
            "anyOf": [_type_schema(a, defs) for a in options]}
        if type(None) in get_args(tp):
            if set(inner) == {"type"}:  # a list of types validates much faster than anyOf
                return {"type": [inner["type"], "null"]}
            return {"anyOf": [inner, {"type": "null"}]}
        return inner
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], defs)}
        return {"type": "array", "prefixItems": [_type_schema(a, defs) for a in args],
                "minItems": len(args), "maxItems": len(args)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(tp)[1], defs)}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # reserve the name first: dataclasses may nest recursively
            defs[tp.__name__] = _dataclass_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {"enum": [m.value for m in tp]}
            if tp.__doc__:
                defs[tp.__name__]["description"] = " ".join(tp.__doc__.split())
        return {"$ref": f"#/$defs/{tp.__name__}"}
    simple = {float: "number", int: "integer", str: "string", bool: "boolean"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no JSON Schema for type {tp!r}")


def _dataclass_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    props: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue  # private caches (Plan._index) are never written
        prop = _type_schema(hints[f.name], defs)
        if f.name.endswith(_NON_NEGATIVE) and hints[f.name] in (int, float):
            prop = {**prop, "minimum": 1 if f.name in _POSITIVE else 0}
        if f.name in docs:
            prop = {**prop, "description": docs[f.name]}
        props[f.name] = prop
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object"}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        out["description"] = " ".join(cls.__doc__.split())
    out.update(properties=props, required=required, additionalProperties=False)
    return out


def generate() -> dict[str, Any]:
    """The schema of ``Plan.to_dict()`` output, from the plan dataclasses."""
    defs: dict[str, Any] = {}
    root = _dataclass_schema(Plan, defs)
    root["properties"]["format_version"] = {
        "const": FORMAT_VERSION,
        "description": "Version of this file format; a pipecut refuses versions it does not read.",
    }
    root["properties"]["predicted"] = {
        "$ref": "#/$defs/Predicted",
        "description": "Predicted step time (ms), bubble fraction and bottleneck stage.",
    }
    defs["Predicted"]["properties"]["bubble_fraction"]["maximum"] = 1
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pipecut partition plan",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=False) + "\n"


# --- validation ------------------------------------------------------------------------------
@functools.cache
def schema() -> dict[str, Any]:
    """The schema shipped with the package (``plan.schema.json``)."""
    return json.loads(resources.files("pipecut").joinpath(SCHEMA_FILE).read_text())


def inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """The schema with every ``$ref`` to ``$defs`` replaced by its target (ours are acyclic).

    Validating against it gives the same verdicts and paths, about twice as fast: resolving
    references dominates jsonschema's time on a plan with thousands of nodes.
    """
    if isinstance(node, dict):
        if "$ref" in node:
            target = inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
            return {**target, **{k: inline_refs(v, defs) for k, v in node.items() if k != "$ref"}}
        return {k: inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [inline_refs(v, defs) for v in node]
    return node


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema())
    return cls(inline_refs(schema(), schema()["$defs"]))


def json_path(path: typing.Iterable[str | int]) -> str:
    """``["stages", 1, "forward_ms"]`` → ``$.stages[1].forward_ms``."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _describe(error: jsonschema.ValidationError) -> str:
    where = json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        return (f"{where}: {error.message}; allowed fields are {allowed} (if you added a field "
                f"to pipecut.plan, regenerate the schema: {REGENERATE})")
    if error.validator == "required":
        return f"{where}: {error.message}"
    if error.validator in ("enum", "const"):
        return (f"{where}: {error.instance!r:.80} is invalid: {error.message} (if you added a "
                f"value to an enum of pipecut.plan, regenerate the schema: {REGENERATE})")
    return f"{where}: {error.instance!r:.80} is invalid: {error.message}"


def validate_plan_dict(data: Any) -> None:
    """Check a plan's JSON data against the schema; :class:`PlanError` names the bad field's path.

    >>> validate_plan_dict({"format_version": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipecut.errors.PlanError: plan does not match its schema: $: 'batch_size' is a required ...
    """
    if _validator().is_valid(data):
        return
    errors = sorted(_validator().iter_errors(data), key=lambda e: (list(map(str, e.absolute_path)), str(e.validator)))
    best = jsonschema.exceptions.best_match(errors)
    # anyOf errors (nullable fields) hide the useful message one level down
    while best.context:
        best = jsonschema.exceptions.best_match(best.context)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    raise PlanError(f"plan does not match its schema: {_describe(best)}{more}")


if __name__ == "__main__":
    print(dumps(generate()), end="")
