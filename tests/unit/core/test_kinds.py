"""pipecut.core.kinds: the kinds plan data names, their one home (pipecut re-exports them)."""

from __future__ import annotations

import importlib

from pipecut.core import kinds
from pipecut.schedules.format import Placement


def test_the_public_surface_reexports_the_very_same_kinds() -> None:
    public = importlib.import_module("pipecut")
    for name in ("CaptureMethod", "Partitioner", "Recompute", "ScheduleKind"):
        assert getattr(public, name) is getattr(kinds, name)
    assert not set(kinds.__all__) & set(importlib.import_module("pipecut.ir").__all__)  # no hub


def test_schedule_kinds_say_how_they_run() -> None:
    S = kinds.ScheduleKind
    assert [k for k in S if k.splits_backward] == [S.ZERO_BUBBLE, S.ZBV]
    assert {k: k.placement for k in S}[S.ZBV] is Placement.V
    assert all(k.placement is Placement.LOOP for k in S if k is not S.ZBV)
    assert [k.fixed_stages_per_rank for k in S] == [None, None, None, None, 2]
    assert S("interleaved-1f1b") is S.INTERLEAVED_1F1B
