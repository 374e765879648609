"""pipecut.runtime.comm.p2p: the order of a rank's sends and receives, derived from its actions."""

from __future__ import annotations

import pytest

from pipecut.core.kinds import LeafKind, ScheduleKind
from pipecut.runtime.comm.p2p import (
    Direction,
    Op,
    StepKind,
    Wiring,
    comm_program,
    format_program,
    receives,
    sends,
    wiring,
)
from pipecut.schedules.format import Action
from pipecut.schedules.standard import build, one_f_one_b
from tests.unit.tiny import mlp_plan


def test_the_documented_1f1b_program():
    """The table in the module docstring, exactly."""
    w = Wiring.uniform(2, 2)
    lines = [format_program(comm_program(one_f_one_b(2, 4), r, w)).replace("@cut1", "") for r in range(2)]
    assert lines == [
        "0F0 [sF0.0] 0F1 [sF1.0] [rB0.0] 0B0 0F2 [rB1.0 sF2.0] 0B1 0F3 [rB2.0 sF3.0] 0B2 [rB3.0] 0B3",
        "[rF0.0] 1F0 [rF1.0] 1B0 [sB0.0] 1F1 1B1 [sB1.0 rF2.0] 1F2 1B2 [sB2.0 rF3.0] 1F3 1B3 [sB3.0]",
    ]


def test_sends_and_receives_of_actions():
    w = Wiring(ranks=3, forward=(2, 1), backward=(1, 1))
    assert w.stages == 3
    got = sends(Action.parse("0F3"), w)
    assert [(t.op, t.peer, t.cut, t.direction, t.microbatch, t.leaf) for t in got] == [
        (Op.SEND, 1, 1, Direction.FORWARD, 3, 0), (Op.SEND, 1, 1, Direction.FORWARD, 3, 1)]
    assert [str(t) for t in receives(Action.parse("1F3"), w)] == ["rF3.0@cut1", "rF3.1@cut1"]
    assert [str(t) for t in receives(Action.parse("1B0"), w)] == ["rB0.0@cut2"]
    assert receives(Action.parse("0F0"), w) == () and sends(Action.parse("2F0"), w) == ()
    assert receives(Action.parse("2B0"), w) == () and sends(Action.parse("0B0"), w) == ()


@pytest.mark.parametrize(("kind", "ranks", "chunks"), [(ScheduleKind.GPIPE, 3, 1), (ScheduleKind.ONE_F_ONE_B, 4, 1),
                                                        (ScheduleKind.INTERLEAVED_1F1B, 2, 2),
                                                        (ScheduleKind.ZERO_BUBBLE, 3, 1),
                                                        (ScheduleKind.ZBV, 3, 2)])
def test_both_ends_of_every_pair_agree_on_the_message_order(kind, ranks, chunks):
    schedule = build(kind, ranks, 4, chunks)
    w = Wiring.uniform(ranks, ranks * chunks, leaves=2, placement=kind.placement)
    programs = [comm_program(schedule, r, w) for r in range(ranks)]
    for r, steps in enumerate(programs):
        assert steps[-1].kind is StepKind.DRAIN
        computed = [s.action for s in steps if s.kind is StepKind.COMPUTE]
        assert computed == list(schedule[r])
    for a in range(ranks):
        for b in range(ranks):
            sent = [t.message for s in programs[a] if s.kind is StepKind.ISSUE
                    for t in s.transfers if t.op is Op.SEND and t.peer == b]
            got = [t.message for s in programs[b] if s.kind is StepKind.ISSUE
                   for t in s.transfers if t.op is Op.RECV and t.peer == a]
            assert sent == got


def test_wiring_of_a_plan_counts_tensor_leaves_per_cut():
    plan = mlp_plan()
    w = wiring(plan)
    assert w.ranks == plan.num_ranks and w.stages == plan.num_stages
    for s, n in enumerate(w.forward):
        leaves = [x for name in plan.stages[s].outputs for x in plan.node(name).leaves if x.kind is LeafKind.TENSOR]
        assert n == len(leaves) >= 1
    assert w.backward == w.forward  # every cut activation of an MLP needs a gradient
