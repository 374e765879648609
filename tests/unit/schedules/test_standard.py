"""pipecut.schedules.standard: the schedule generators, checked against their tables.

Each row is one rank's actions in order (``1F2``: stage 1, forward, microbatch 2).
"""

from __future__ import annotations

import pytest

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.schedules.format import validate
from pipecut.schedules.standard import build, gpipe, interleaved_1f1b, one_f_one_b


def table(schedule) -> list[str]:
    return [" ".join(str(a) for a in rank) for rank in schedule]


def test_gpipe_fills_then_drains_in_reverse():
    assert table(gpipe(2, 3)) == [
        "0F0 0F1 0F2 0B2 0B1 0B0",
        "1F0 1F1 1F2 1B2 1B1 1B0",
    ]


def test_1f1b_warms_up_k_minus_r_minus_1_forwards():
    assert table(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_interleaved_runs_chunk_c_of_rank_r_as_stage_c_times_ranks_plus_r():
    assert table(interleaved_1f1b(2, 2, 4)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    assert interleaved_1f1b(3, 1, 4) == one_f_one_b(3, 4)
    with pytest.raises(ScheduleError, match=r"microbatches \(5\) to be a multiple of the ranks \(2\)"):
        interleaved_1f1b(2, 2, 5)


@pytest.mark.parametrize(("kind", "chunks"), [(ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1),
                                              (ScheduleKind.INTERLEAVED_1F1B, 2), (ScheduleKind.ZERO_BUBBLE, 1)])
def test_build_gives_valid_schedules_of_every_kind(kind, chunks):
    schedule = build(kind, 3, 6, chunks)
    assert len(schedule) == 3
    validate(schedule, 6)


def test_build_refuses_chunks_for_one_stage_per_rank_schedules():
    with pytest.raises(ScheduleError, match="gpipe runs one stage per rank; use interleaved-1f1b for 2"):
        build(ScheduleKind.GPIPE, 2, 4, 2)
