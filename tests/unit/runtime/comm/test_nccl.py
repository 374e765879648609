"""Communication order under NCCL's rules (no tags, per-pair FIFO, one stream per rank,
rendezvous): every shipped schedule passes, the old order is caught, errors point at the step.

Regenerate the golden programs with::

    .venv/bin/python -c "from pipecut.schedules.format import one_f_one_b as s; \\
      from pipecut.runtime.comm.p2p import Wiring, comm_program as c, format_program as f; \\
      [print(f(c(s(2, 4), r, Wiring.uniform(2, 2)))) for r in range(2)]"
"""

from __future__ import annotations

import pytest

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import ScheduleError
from pipecut.runtime.comm.nccl import check_nccl, check_programs
from pipecut.runtime.comm.p2p import (
    Direction,
    Op,
    Step,
    StepKind,
    Transfer,
    Wiring,
    comm_program,
    format_program,
    receives,
    sends,
)
from pipecut.schedules.format import Action, Placement, Schedule, parse_schedule
from pipecut.schedules.simulate import simulate
from pipecut.schedules.standard import build, gpipe, interleaved_1f1b, one_f_one_b


def _shipped() -> list[tuple[str, Schedule, int, int, Placement]]:
    """(name, schedule, ranks, stages, placement) for every generator, K up to 8, several M."""
    loop, v_shape = Placement.LOOP, Placement.V
    out = []
    for k in range(2, 9):
        for m in sorted({1, 3, k, 2 * k + 1}):
            out += [(f"gpipe K={k} M={m}", gpipe(k, m), k, k, loop),
                    (f"1f1b K={k} M={m}", one_f_one_b(k, m), k, k, loop),
                    (f"zero-bubble K={k} M={m}", build(ScheduleKind.ZERO_BUBBLE, k, m), k, k, loop),
                    (f"zbv K={k} M={m}", build(ScheduleKind.ZBV, k, m), k, 2 * k, v_shape)]
        for v in (2, 3):
            for m in (k, 2 * k):
                out.append((f"interleaved K={k} V={v} M={m}", interleaved_1f1b(k, v, m), k, k * v, loop))
    return out


def test_every_shipped_schedule_passes_under_nccl_rules() -> None:
    shipped = _shipped()
    assert {name.split()[0] for name, *_ in shipped} == {"gpipe", "1f1b", "zero-bubble", "zbv", "interleaved"}
    assert len(ScheduleKind) == 5  # a new kind of schedule is added to _shipped too
    for i, (name, schedule, k, stages, placement) in enumerate(shipped):
        leaves = 1 + i % 3  # 1 to 3 tensors per cut: each is its own message
        check_nccl(schedule, Wiring.uniform(k, stages, leaves, placement))  # raises with the name below
        assert name


def test_a_v_hands_its_middle_cut_over_within_one_batch() -> None:
    """Stages K - 1 and K share rank K - 1: each message across that cut is sent and received by
    that rank in one batch, which the executor fills without the wire."""
    k, m = 3, 5
    w = Wiring.uniform(k, 2 * k, 2, Placement.V)
    schedule = build(ScheduleKind.ZBV, k, m)
    for r in range(k):
        local = [step.transfers for step in comm_program(schedule, r, w)
                 if step.kind is StepKind.ISSUE and any(t.peer == r for t in step.transfers)]
        assert bool(local) == (r == k - 1)
        for transfers in local:
            mine = [t for t in transfers if t.peer == r]
            assert all(t.cut == k for t in mine)
            sent = sorted(t.message for t in mine if t.op is Op.SEND)
            assert sent == sorted(t.message for t in mine if t.op is Op.RECV) and sent


def _old_program(actions: tuple[Action, ...], w: Wiring) -> tuple[Step, ...]:
    """The order before batching: one isend/irecv per tensor, receives posted one action ahead."""
    steps: list[Step] = []
    posted: set[Transfer] = set()
    for i, action in enumerate(actions):
        for ahead in actions[i : i + 2]:
            for t in receives(ahead, w):
                if t not in posted:
                    posted.add(t)
                    steps.append(Step(StepKind.ISSUE, transfers=(t,)))
        if receives(action, w):
            steps.append(Step(StepKind.WAIT, action, receives(action, w)))
        steps.append(Step(StepKind.COMPUTE, action))
        steps += [Step(StepKind.ISSUE, transfers=(t,)) for t in sends(action, w)]
    return (*steps, Step(StepKind.DRAIN))


@pytest.mark.parametrize(("schedule", "stages"), [
    (gpipe(2, 4), 2), (one_f_one_b(2, 4), 2), (one_f_one_b(4, 8), 4), (interleaved_1f1b(2, 2, 4), 4),
])
def test_the_old_order_deadlocks_and_the_new_one_does_not(schedule: Schedule, stages: int) -> None:
    w = Wiring.uniform(len(schedule), stages)
    with pytest.raises(ScheduleError, match=r"deadlocks under NCCL rules.*rank \d stops at \d[FB]\d"):
        check_programs([_old_program(actions, w) for actions in schedule], schedule)
    check_nccl(schedule, w)


def test_deadlock_error_marks_where_each_rank_stops() -> None:
    schedule = gpipe(2, 4)
    w = Wiring.uniform(2, 2)
    with pytest.raises(ScheduleError) as info:
        check_programs([_old_program(actions, w) for actions in schedule], schedule)
    text = str(info.value)
    # rank 0 posted the receive of B3 one action ahead, before 0F3's send, and waits for it at
    # 0B3; its send of F3 is queued behind it, and rank 1 waits for F3 at 1F3.
    assert "rank 0 stops at 0B3, its stream stuck on rB3.0@cut1" in text, text
    assert "rank 1 stops at 1F3, its stream stuck on rF3.0@cut1" in text, text
    assert "rank 0: 0F0 0F1 0F2 0F3 0B3 <-- ERROR HERE 0B2" in text, text
    assert "rank 1: 1F0 1F1 1F2 1F3 <-- ERROR HERE 1B3" in text, text


def test_a_schedule_that_hangs_across_ranks_is_refused_with_a_marker() -> None:
    bad = parse_schedule("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    w = Wiring.uniform(2, 2)
    for run in (lambda: check_nccl(bad, w), lambda: simulate(bad, [1.0, 1.0], [1.0, 1.0])):
        with pytest.raises(ScheduleError, match=r"rank 0 stops at 0B0, rank 1 stops at 1F1") as info:
            run()
        assert "rank 0: 0F0 0B0 <-- ERROR HERE 0F1" in str(info.value)
        assert "rank 1: 1F1 <-- ERROR HERE 1B1" in str(info.value)


def test_messages_in_different_orders_are_a_mismatch_not_a_lucky_tag() -> None:
    def t(op: Op, mb: int, stage: int, peer: int) -> Transfer:
        return Transfer(op, stage, peer, 1, Direction.FORWARD, mb, 0)

    sender = (Step(StepKind.ISSUE, transfers=(t(Op.SEND, 0, 0, 1),)),
              Step(StepKind.ISSUE, transfers=(t(Op.SEND, 1, 0, 1),)), Step(StepKind.DRAIN))
    receiver = (Step(StepKind.ISSUE, transfers=(t(Op.RECV, 1, 1, 0), t(Op.RECV, 0, 1, 0))),
                Step(StepKind.DRAIN))
    with pytest.raises(ScheduleError, match=r"rank 0's send sF0.0@cut1 is the receive rF1.0@cut1 on rank 1"):
        check_programs([sender, receiver])


def test_a_schedule_that_simulates_also_passes_the_nccl_check() -> None:
    schedule = one_f_one_b(4, 8)
    costs = ([1.0, 2.0, 1.0, 1.0], [2.0, 3.0, 2.0, 2.0], [0.5] * 3)
    check_nccl(schedule, Wiring.uniform(4, 4, 2))  # raises on a hang
    assert simulate(schedule, *costs) > 0


GOLDEN_1F1B = """\
0F0 [sF0.0@cut1] 0F1 [sF1.0@cut1] [rB0.0@cut1] 0B0 0F2 [rB1.0@cut1 sF2.0@cut1] 0B1 0F3 [rB2.0@cut1 sF3.0@cut1] 0B2 [rB3.0@cut1] 0B3
[rF0.0@cut1] 1F0 [rF1.0@cut1] 1B0 [sB0.0@cut1] 1F1 1B1 [sB1.0@cut1 rF2.0@cut1] 1F2 1B2 [sB2.0@cut1 rF3.0@cut1] 1F3 1B3 [sB3.0@cut1]"""

GOLDEN_INTERLEAVED_RANK1 = (
    "[rF0.0@cut1] 1F0 [rF1.0@cut1 sF0.0@cut2] 1F1 [sF1.0@cut2 rF0.0@cut3] 3F0 [rF1.0@cut3] 3B0 "
    "[rF2.0@cut1] [sB0.0@cut3] 3F1 3B1 [rB0.0@cut2] [rF3.0@cut1 sB1.0@cut3] 1F2 [sF2.0@cut2] 1B0 "
    "[rB1.0@cut2] [sB0.0@cut1 rF2.0@cut3] 1F3 [sF3.0@cut2] 1B1 [sB1.0@cut1 rF3.0@cut3] 3F2 3B2 "
    "[sB2.0@cut3] 3F3 3B3 [rB2.0@cut2] [sB3.0@cut3] 1B2 [sB2.0@cut1 rB3.0@cut2] 1B3 [sB3.0@cut1]"
)


def test_golden_communication_order() -> None:
    """``[...]`` is one batch_isend_irecv; ``s``/``r`` send/receive, ``F``/``B`` activations or
    gradients, then microbatch.leaf and the cut. Each batch pairs with the peer's batch of the
    same round, so rank 1's 3F0 (last stage, virtual chunk 1) receives from rank 0's 2F0."""
    assert "\n".join(format_program(comm_program(one_f_one_b(2, 4), r, Wiring.uniform(2, 2)))
                     for r in range(2)) == GOLDEN_1F1B
    assert format_program(comm_program(interleaved_1f1b(2, 2, 4), 1, Wiring.uniform(2, 4))) == GOLDEN_INTERLEAVED_RANK1


def test_the_program_waits_for_what_each_action_receives_and_sends_everything() -> None:
    w = Wiring(ranks=2, forward=(2, 3, 1), backward=(1, 0, 1))  # some cuts carry no gradient
    schedule = interleaved_1f1b(2, 2, 4)
    check_nccl(schedule, w)
    for r, actions in enumerate(schedule):
        program = comm_program(schedule, r, w)
        issued = [t for s in program if s.kind is StepKind.ISSUE for t in s.transfers]
        assert sorted(map(str, issued)) == sorted(
            str(t) for a in actions for t in receives(a, w) + sends(a, w)
        )
        assert not any(t.direction is Direction.BACKWARD and t.cut == 2 for t in issued)
        for i, step in enumerate(program):
            if step.kind is StepKind.COMPUTE and step.action is not None and receives(step.action, w):
                assert program[i - 1] == Step(StepKind.WAIT, step.action, receives(step.action, w))
