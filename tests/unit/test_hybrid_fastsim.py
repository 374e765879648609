"""The fast simulator gives the same step (and per-rank end) times as core.schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecut.core.schedule import parse_schedule, simulate, timeline
from pipecut.errors import ScheduleError
from pipecut.passes.fastsim import simulate_kind, simulate_schedule
from pipecut.passes.schedules import build
from pipecut.plan import ScheduleKind

KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B]
times = st.floats(0.0, 5.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 7), st.data(), st.sampled_from(KINDS), st.booleans())
def test_equals_reference_simulator(k, m, data, kind, same_links):
    f = data.draw(st.lists(times, min_size=k, max_size=k))
    b = data.draw(st.lists(times, min_size=k, max_size=k))
    fl = data.draw(st.lists(times, min_size=k - 1, max_size=k - 1))
    bl = [] if same_links else data.draw(st.lists(times, min_size=k - 1, max_size=k - 1))
    schedule = build(kind, k, m)
    ends = [0.0] * k
    for action, _, end in timeline(schedule, f, b, fl, bl):
        ends[action.stage] = max(ends[action.stage], end)
    for result in (simulate_kind(kind, f, b, m, fl, bl), simulate_schedule(schedule, f, b, m, fl, bl)):
        assert result.step_ms == pytest.approx(simulate(schedule, f, b, fl, bl), abs=1e-9)
        assert result.rank_end_ms == pytest.approx(ends, abs=1e-9)


def test_gpipe_closed_form_by_hand():
    # (M + K - 1) * (f + b) for equal stages and free links.
    assert simulate_kind(ScheduleKind.GPIPE, [1.0] * 3, [2.0] * 3, 4).step_ms == 18.0


def test_deadlock_is_reported():
    bad = parse_schedule("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate_schedule(bad, [1.0, 1.0], [1.0, 1.0], 2)


def test_thousand_stages():
    result = simulate_kind(ScheduleKind.ONE_F_ONE_B, [1.0] * 1024, [2.0] * 1024, 8)
    assert result.step_ms == pytest.approx((8 + 1023) * 3.0)
