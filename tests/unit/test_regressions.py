"""Bugs fixed, one test each, with what was seen before the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/unit/test_regressions.py``.
"""

from __future__ import annotations

import torch

import pipecut
from pipecut.core.kinds import CaptureMethod
from pipecut.passes.partition.chain import boundary_bytes, liveness
from tests.multiprocess.test_eval import M, frozen
from tests.stateful import counts_calls


def test_no_cut_between_a_no_grad_node_and_the_detach_that_closes_its_block() -> None:
    """Seen when merging the eval and partitioner work (tests/multiprocess/test_eval.py, 1 run in 3):

        assert all(r["frozen_untouched"] for r in results)   ->   assert False

    symbolic_trace marks a ``with torch.no_grad():`` block by detaching its values in separate
    nodes. A cut between ``frozen`` and its ``detach_tree_1`` sent ``frozen``'s output with
    requires_grad=True; the next stage detached it and sent back zeros, so ``frozen.weight``
    got a zero ``.grad`` where the plain model has None (AdamW would then decay it)."""
    model, inputs, loss_fn, target = frozen()
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=M,
        capture=pipecut.CaptureOptions(method=CaptureMethod.SYMBOLIC_TRACE),
        measure=pipecut.MeasureOptions(calibrate=False, repeats=1, warmup=0),
    )
    live = liveness(plan.nodes)
    _, _, allowed = boundary_bytes(plan.nodes, live)
    blocked = {live.units[b] for b in range(len(live.units)) if not allowed[b]}
    # No cut before the detaches that close the block (after frozen and after tanh_2).
    assert blocked == {"detach_tree_1", "detach_tree_2"}, blocked
    assert not plan.node("frozen").cuttable and not plan.node("tanh_2").cuttable
    assert all(plan.node(s.nodes[-1]).cuttable for s in plan.stages[:-1])


def test_calibration_does_not_make_a_buffer_require_grad() -> None:
    """Seen when merging (tests/multiprocess/test_model_state.py, every run):

        PipelineRuntimeError: stage 0: value 'add_' (leaf 0) requires grad, but the plan was
        made when it did not: a parameter's requires_grad changed after pipecut.compile.

    ``self.calls += 1`` under torch.export sends the buffer's value to the next stage, which
    writes it back with ``copy_``. Calibration received every float as a tensor requiring
    grad, so that ``copy_`` made the user's buffer require grad. It now follows the plan's
    ``Leaf.requires_grad``, as the runtime does."""
    model, inputs, loss_fn, target = counts_calls()
    before = model.calls.clone()
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    assert plan.capture is CaptureMethod.EXPORT and "calibrated" in plan.solver.detail
    assert not model.calls.requires_grad and torch.equal(model.calls, before)


def test_gantt_layout_puts_virtual_stages_on_their_ranks() -> None:
    # layout() drew stage s on row s, so an interleaved schedule (stage c * ranks + r on rank r)
    # showed rows for ranks that do not exist.
    from pipecut.core.kinds import ScheduleKind
    from pipecut.report.gantt import layout
    from pipecut.schedules.standard import build

    schedule = build(ScheduleKind.INTERLEAVED_1F1B, 2, 4, chunks=2)
    spans = layout(schedule, [1.0] * 4, [2.0] * 4)
    assert {s.rank for s in spans} == {0, 1}
    assert all(s.rank == int(s.action.split("F")[0].split("B")[0]) % 2 for s in spans)
