"""core.choices: every enum option parsed one way, typos refused with the choices."""

from __future__ import annotations

import pytest

from pipecut.core.choices import enum_choice
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import InputError


def test_members_and_their_values_in_any_case() -> None:
    assert enum_choice(ScheduleKind, ScheduleKind.GPIPE, "schedule") is ScheduleKind.GPIPE
    assert enum_choice(ScheduleKind, "1F1B", "schedule") is ScheduleKind.ONE_F_ONE_B


def test_a_typo_names_the_option_and_the_choices() -> None:
    with pytest.raises(InputError, match=r"unknown schedule '1f2b'; choose one of \['gpipe', '1f1b'"):
        enum_choice(ScheduleKind, "1f2b", "schedule")
