"""A user's choice among an enum's values: the enum itself, or its value as a string in any case.

Every option that takes a kind (``schedule``, ``solver``, ``data_parallel``, ...) is parsed
here, so each refuses a typo the same way: an :class:`~pipecut.errors.InputError` naming the
option, what was given and the values there are.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from pipecut.errors import InputError

__all__ = ["enum_choice"]

E = TypeVar("E", bound=enum.Enum)


def enum_choice(kind: type[E], value: Any, option: str, *, auto: bool = False) -> E:
    """``value`` as a member of ``kind``: the member itself, or its value in any case.
    ``auto``: the option also takes "auto" (handled by the caller), named among the choices."""
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value).lower())
    except ValueError:
        valid = [k.value for k in kind] + (["auto"] if auto else [])
        raise InputError(f"unknown {option} {value!r}; choose one of {valid}") from None
