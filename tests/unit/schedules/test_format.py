"""Schedules are data: golden action lists (inline and under tests/golden/), text round trip,
validation and simulation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.schedules.format import Action, format_schedule, parse_schedule, validate
from pipecut.schedules.simulate import StageCosts, simulate
from pipecut.schedules.standard import build, gpipe, one_f_one_b, unit_costs


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


# --- golden text of every generator ---------------------------------------------------------
# tests/golden/<name>.txt holds format_schedule(...) of each case below. After an intended change
# to a generator, regenerate them and review the diff:
#
#     PIPECUT_REGEN_GOLDEN=1 .venv/bin/pytest -q tests/unit/schedules/test_format.py -k golden_file

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
SKEWED = StageCosts(  # three stages, the middle one slow, links not free: zero bubble reorders
    forward=(1.0, 2.0, 1.0), backward=(2.0, 4.0, 3.0), weight=(1.0, 2.0, 1.0),
    forward_link=(0.5, 0.5), backward_link=(0.25, 0.25),
)
G, OFOB, IL, ZB = ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZERO_BUBBLE
ZBV = ScheduleKind.ZBV
SKEWED_V = StageCosts(  # two ranks, four stages on a V; the last stage (head and loss) heavy
    forward=(1.0, 1.0, 1.0, 3.0), backward=(2.0, 2.0, 2.0, 6.0), weight=(1.0, 1.0, 1.0, 1.0),
    forward_link=(0.5, 0.0, 0.5), backward_link=(0.5, 0.0, 0.5),
)
GOLDEN_CASES: dict[str, tuple[ScheduleKind, int, int, int, StageCosts | None]] = {
    # name: (kind, ranks, microbatches, chunks, costs)
    "gpipe_k2_m3": (G, 2, 3, 1, None),
    "gpipe_k3_m4": (G, 3, 4, 1, None),
    "1f1b_k3_m4": (OFOB, 3, 4, 1, None),
    "1f1b_k4_m8": (OFOB, 4, 8, 1, None),
    "1f1b_k4_m2": (OFOB, 4, 2, 1, None),
    "interleaved_k2_v2_m4": (IL, 2, 4, 2, None),
    "interleaved_k4_v2_m8": (IL, 4, 8, 2, None),
    "interleaved_k3_v3_m6": (IL, 3, 6, 3, None),
    "zero_bubble_k2_m4": (ZB, 2, 4, 1, None),
    "zero_bubble_k4_m8": (ZB, 4, 8, 1, None),
    "zero_bubble_k3_m6_skewed": (ZB, 3, 6, 1, SKEWED),
    "zbv_k2_m4": (ZBV, 2, 4, 2, None),
    "zbv_k4_m8": (ZBV, 4, 8, 2, None),
    "zbv_k2_m6_skewed": (ZBV, 2, 6, 2, SKEWED_V),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_generator_matches_golden_file(name: str) -> None:
    kind, ranks, m, chunks, costs = GOLDEN_CASES[name]
    schedule = build(kind, ranks, m, chunks, costs)
    validate(schedule, m, kind.placement)
    text = format_schedule(schedule) + "\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("PIPECUT_REGEN_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text, f"{name}: the generator no longer gives {path}"


def test_golden_files_cover_every_kind_and_nothing_else() -> None:
    assert {kind for kind, *_ in GOLDEN_CASES.values()} == set(ScheduleKind)
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(GOLDEN_CASES)


def test_build_schedules_zero_bubble_on_the_given_costs() -> None:
    skewed = build(ScheduleKind.ZERO_BUBBLE, 3, 6, costs=SKEWED)
    validate(skewed, 6)
    assert skewed != build(ScheduleKind.ZERO_BUBBLE, 3, 6)  # the costs change the order
    assert build(ScheduleKind.ZERO_BUBBLE, 3, 6, costs=unit_costs(3)) == build(ScheduleKind.ZERO_BUBBLE, 3, 6)
    with pytest.raises(ScheduleError, match="costs for 3 stages, but 2 ranks × 1 chunks make 2"):
        build(ScheduleKind.ZERO_BUBBLE, 2, 4, costs=SKEWED)
