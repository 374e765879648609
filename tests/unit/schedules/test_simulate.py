"""The one schedule simulator (``schedules.simulate.timeline``/``simulate``/``rank_end_ms``).

The runtime runs each rank's actions in list order and orders its messages by ``timeline``
(``runtime.p2p.comm_program``), so the simulator must (1) run every rank's actions in the
schedule's order and (2) give each action the earliest start its rank and its input allow. The
property test checks both against a brute-force longest path over the dependency graph, for
every generator, on random costs.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.schedules.format import Action, ActionKind, Schedule, parse_schedule, validate
from pipecut.schedules.simulate import StageCosts, rank_end_ms, simulate, timeline
from pipecut.schedules.standard import build

F, B, IN, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.INPUT, ActionKind.WEIGHT
times = st.floats(0.0, 5.0, allow_nan=False)


def longest_path(
    schedule: Schedule, f: list[float], b: list[float], fl: list[float], bl: list[float], w: list[float],
) -> dict[Action, tuple[float, float]]:
    """Start and end of every action as the longest path over the dependency graph, by
    relaxation to a fixed point (no event order, no ready queue): an action starts after the
    one before it on its rank, and after its input plus the link (a forward: the previous
    stage's forward; a B or I: the next stage's B or I); W waits only for its rank."""
    stages = len(f)
    grad_of = {(a.stage, a.microbatch): a for rank in schedule for a in rank if a.kind in (B, IN)}
    end = {a: 0.0 for rank in schedule for a in rank}
    start = dict(end)
    for _ in range(len(end) + 1):
        changed = False
        for rank in schedule:
            for i, a in enumerate(rank):
                ready = end[rank[i - 1]] if i else 0.0
                if a.kind is F and a.stage > 0:
                    ready = max(ready, end[Action(a.stage - 1, F, a.microbatch)] + fl[a.stage - 1])
                elif a.kind in (B, IN) and a.stage < stages - 1:
                    ready = max(ready, end[grad_of[(a.stage + 1, a.microbatch)]] + bl[a.stage])
                cost = {F: f, B: b, W: w}[a.kind][a.stage] if a.kind is not IN else b[a.stage] - w[a.stage]
                if (ready, ready + cost) != (start[a], end[a]):
                    start[a], end[a], changed = ready, ready + cost, True
        if not changed:
            return {a: (start[a], end[a]) for a in end}
    raise AssertionError("the dependency graph has a cycle")


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    kind = draw(st.sampled_from(list(ScheduleKind)))
    ranks = draw(st.integers(1, 4))
    chunks = draw(st.integers(1, 3)) if kind is ScheduleKind.INTERLEAVED_1F1B else kind.fixed_stages_per_rank or 1
    m = ranks * draw(st.integers(1, 3)) if kind is ScheduleKind.INTERLEAVED_1F1B and chunks > 1 else draw(st.integers(1, 7))
    n = ranks * chunks
    f = draw(st.lists(times, min_size=n, max_size=n))
    w = draw(st.lists(times, min_size=n, max_size=n)) if kind.splits_backward else [0.0] * n
    b = [wi + x for wi, x in zip(w, draw(st.lists(times, min_size=n, max_size=n)))]  # B ≥ W
    fl = draw(st.lists(times, min_size=n - 1, max_size=n - 1))
    bl = draw(st.lists(times, min_size=n - 1, max_size=n - 1))
    costs = StageCosts(forward=tuple(f), backward=tuple(b), weight=tuple(w), forward_link=tuple(fl),
                       backward_link=tuple(bl))
    return build(kind, ranks, m, chunks, costs), m, (f, b, fl, bl, w), kind.placement


@settings(max_examples=150, deadline=None)
@given(cases())
def test_simulator_equals_the_runtime_order_and_the_longest_path(case) -> None:  # type: ignore[no-untyped-def]
    schedule, m, (f, b, fl, bl, w), placement = case
    validate(schedule, m, placement)
    spans = timeline(schedule, f, b, fl, bl, w)
    rank_of = {a: r for r, rank in enumerate(schedule) for a in rank}
    # Each rank's actions run in the schedule's order, one at a time, as the runtime runs them.
    for r, rank in enumerate(schedule):
        mine = [(a, s, e) for a, s, e in spans if rank_of[a] == r]
        assert tuple(a for a, _, _ in mine) == rank
        assert all(s >= prev_end for (_, _, prev_end), (_, s, _) in itertools.pairwise(mine))
    # And each at the earliest time its dependencies allow.
    want = longest_path(schedule, f, b, fl, bl, w)
    assert len(spans) == len(want)
    for a, s, e in spans:
        assert (s, e) == pytest.approx(want[a], abs=1e-9), a
    assert simulate(schedule, f, b, fl, bl, w) == pytest.approx(max(e for _, e in want.values()), abs=1e-9)
    ends = rank_end_ms(schedule, f, b, fl, bl, w)
    assert ends == pytest.approx([want[rank[-1]][1] if rank else 0.0 for rank in schedule], abs=1e-9)


def test_zero_bubble_with_split_backward() -> None:
    # K=2, M=4, F = I = W = 1 (B = 2). The deleted passes/fastsim ran I and W as forwards: 16.
    zb = build(ScheduleKind.ZERO_BUBBLE, 2, 4)
    assert simulate(zb, [1, 1], [2, 2], weight_ms=[1, 1]) == 14.0


def test_interleaved_stages_on_their_ranks() -> None:
    # K=2 ranks, V=2 chunks (stage c*2 + r on rank r), M=4, F=1, B=2. The deleted
    # passes/fastsim took stage s to be rank s: 42.
    sched = build(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2)
    assert simulate(sched, [1] * 4, [2] * 4) == 27.0
    assert rank_end_ms(sched, [1] * 4, [2] * 4) == (27.0, 25.0)


def test_gpipe_closed_form_by_hand() -> None:
    # (M + K - 1) * (f + b) for equal stages and free links.
    assert simulate(build(ScheduleKind.GPIPE, 3, 4), [1.0] * 3, [2.0] * 3) == 18.0


def test_deadlock_is_reported_where_each_rank_stops() -> None:
    bad = parse_schedule("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        simulate(bad, [1.0, 1.0], [1.0, 1.0])
    assert "rank 0 stops at 0B0, rank 1 stops at 1F1" in str(err.value)
    assert "rank 0: 0F0 0B0 <-- ERROR HERE 0F1 0B1\nrank 1: 1F1 <-- ERROR HERE 1F0 1B0 1B1" in str(err.value)


def test_thousand_stages() -> None:
    ends = rank_end_ms(build(ScheduleKind.ONE_F_ONE_B, 1024, 8), [1.0] * 1024, [2.0] * 1024)
    assert max(ends) == pytest.approx((8 + 1023) * 3.0)
    assert ends[-1] == pytest.approx((8 + 1023) * 3.0 - 1023 * 2.0)  # last stage: its last B
