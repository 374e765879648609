"""Schedules are data: golden action lists, text round trip, validation and simulation."""

from __future__ import annotations

import pytest

from pipecut.core.schedule import Action, format_schedule, parse_schedule, simulate, validate
from pipecut.errors import ScheduleError
from pipecut.passes.schedules import gpipe, one_f_one_b


def test_gpipe_golden() -> None:
    assert format_schedule(gpipe(2, 3)) == "0F0 0F1 0F2 0B2 0B1 0B0\n1F0 1F1 1F2 1B2 1B1 1B0"


def test_one_f_one_b_golden() -> None:
    assert format_schedule(one_f_one_b(3, 4)) == (
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_round_trip_and_valid(make) -> None:  # type: ignore[no-untyped-def]
    sched = make(4, 6)
    assert parse_schedule(format_schedule(sched)) == sched
    validate(sched, 6)


def test_action_parse_errors() -> None:
    assert Action.parse("12B7") == Action.parse(" 12B7 ")
    with pytest.raises(ScheduleError, match="cannot parse action 'X1'"):
        Action.parse("X1")


def test_validate_rejects_backward_before_forward() -> None:
    with pytest.raises(ScheduleError, match="runs before its forward"):
        validate(parse_schedule("0B0 0F0"), 1)


def test_simulator_detects_deadlock() -> None:
    bad = parse_schedule("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(bad, [1, 1], [2, 2])


def test_simulated_fill_drain_time() -> None:
    # K=2, M=3, F=1, B=2, no communication: (M + K - 1) * (F + B) = 12.
    assert simulate(gpipe(2, 3), [1, 1], [2, 2]) == pytest.approx(12.0)
    assert simulate(one_f_one_b(2, 3), [1, 1], [2, 2]) == pytest.approx(12.0)
