"""Dataclass <-> JSON-able dict, driven by type hints.

The plan is made of frozen dataclasses holding tuples, enums, numbers and strings. This codec
turns them into plain dicts and back without any per-class code, so adding a field to the plan
is a one-line change. Unknown keys are rejected on load with the path of the bad field.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from pipecut.errors import PlanError

T = TypeVar("T")


def to_data(obj: Any) -> Any:
    """Turn a dataclass tree into dicts, lists, strings and numbers."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


def from_data(cls: type[T], data: Any, path: str = "$") -> T:
    """Rebuild ``cls`` from :func:`to_data` output; errors name the JSON path of the bad field."""
    return typing.cast(T, _decode(cls, data, path))


def _decode(tp: Any, data: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(option, data, path)
            except PlanError as e:
                errors.append(str(e))
        raise PlanError(f"{path}: {data!r} matches none of {options}: {'; '.join(errors)}")
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"{path}: expected a list, got {type(data).__name__}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], x, f"{path}[{i}]") for i, x in enumerate(data))
        if len(args) != len(data):
            raise PlanError(f"{path}: expected {len(args)} items, got {len(data)}")
        return tuple(_decode(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, data)))
    if origin is dict:
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected an object, got {type(data).__name__}")
        _, vt = get_args(tp)
        return {k: _decode(vt, v, f"{path}.{k}") for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected an object for {tp.__name__}, got {data!r:.60}")
        hints = get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(f"{path}: unknown field(s) {unknown} for {tp.__name__}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"{path}: missing field {f.name!r} of {tp.__name__}")
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as e:
            raise PlanError(f"{path}: invalid {tp.__name__}: {e}") from e
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            valid = [m.value for m in tp]
            raise PlanError(f"{path}: {data!r} is not one of {valid}") from None
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise PlanError(f"{path}: expected a number, got {data!r:.60}")
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
            raise PlanError(f"{path}: expected {tp.__name__}, got {data!r:.60}")
        return data
    raise PlanError(f"{path}: cannot decode type {tp!r}")
