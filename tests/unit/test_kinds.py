"""pipecut.core.kinds: the kinds plan data names, and their re-export from pipecut.plan."""

from __future__ import annotations

import importlib

from pipecut.core import kinds
from pipecut.core.schedule import Placement


def test_the_plan_reexports_the_very_same_kinds() -> None:
    for name in kinds.__all__:
        assert getattr(importlib.import_module("pipecut.plan"), name) is getattr(kinds, name)


def test_schedule_kinds_say_how_they_run() -> None:
    S = kinds.ScheduleKind
    assert [k for k in S if k.splits_backward] == [S.ZERO_BUBBLE, S.ZBV]
    assert {k: k.placement for k in S}[S.ZBV] is Placement.V
    assert all(k.placement is Placement.LOOP for k in S if k is not S.ZBV)
    assert [k.fixed_stages_per_rank for k in S] == [None, None, None, None, 2]
    assert S("interleaved-1f1b") is S.INTERLEAVED_1F1B
