"""``microbatches="auto"``: a microbatch count the model cannot run is ruled out with its reason,
never raised; only where no count runs does planning fail, with a pipecut error naming why.

Issue 27: ``plan(..., microbatches="auto", schedule="auto")`` on a BatchNorm model at batch 8
crashed with torch's "ValueError: Expected more than 1 value per channel when training, got
input size torch.Size([1, 16])": the planner profiled microbatches of one sample.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pipecut
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import CaptureError, PartitionError
from pipecut.options import AUTO
from pipecut.planning.autoplan import choose_microbatches_and_schedule
from tests.unit.tiny import mlp_plan

ONE_SAMPLE = "microbatches of 1 sample cannot run: ValueError: Expected more than 1 value per channel"


def _choose(profile_at, batch: int = 8):
    def partition(costs, m, kind):
        return SimpleNamespace(predicted=SimpleNamespace(step_ms=10.0 - m), stages=(), data_parallel=None)

    return choose_microbatches_and_schedule((torch.zeros(batch, 3),), torch.zeros(batch), ranks=2, microbatches=AUTO, schedule=AUTO,
                  stages_per_rank=1, profile_at=profile_at, partition=partition)


def test_a_count_whose_microbatch_fails_is_ruled_out_with_its_reason():
    nodes, profiled = mlp_plan().nodes, []

    def profile_at(first, target):
        size = first[0].shape[0]
        profiled.append(size)
        if size == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size torch.Size([1, 16])")
        return nodes

    m, _, candidates = _choose(profile_at)
    assert m == 4  # the fastest count that runs (8 would be faster)
    assert profiled == [1, 2, 4]  # the smallest microbatch failed: the next smallest stands in
    notes = {(c.microbatches, c.schedule): c.note for c in candidates}
    assert all(notes[(8, k)].startswith(ONE_SAMPLE) for k in ScheduleKind if (8, k) in notes)
    assert {c.microbatches for c in candidates if c.step_ms is None} == {8}
    assert sum(c.note == "chosen" for c in candidates) == 1


def test_where_no_count_runs_the_reasons_are_named():
    def profile_at(first, target):
        raise RuntimeError(f"shape '[{first[0].shape[0]}, -1]' is invalid")

    with pytest.raises(PartitionError, match=r"no microbatch count runs the model on this batch of 8: 2: microbatches "
                                             r"of 4 samples cannot run: RuntimeError: shape '\[4, -1\]' is invalid; 4: "):
        _choose(profile_at)


def test_the_same_pipecut_error_at_every_size_is_raised_as_it_is():
    def profile_at(first, target):
        raise CaptureError("could not capture Net as a graph")

    with pytest.raises(CaptureError, match="could not capture Net as a graph"):
        _choose(profile_at)


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)
        self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.bn(self.a(x))))))


@pytest.mark.parametrize("batch", [4, 8])
def test_auto_plans_a_batchnorm_model_without_one_sample_microbatches(batch: int):
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    plan = pipecut.plan(BatchNormNet(), (x,), devices=2, loss_fn=torch.nn.functional.mse_loss, target=y,
                        microbatches="auto", schedule="auto", measure=pipecut.MeasureOptions(repeats=1, warmup=0))
    assert plan.batch_size // plan.microbatches >= 2
    ruled_out = {(c.microbatches, c.schedule) for c in plan.candidates if c.note.startswith(ONE_SAMPLE)}
    assert ruled_out == {(batch, k) for k in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE,
                                              ScheduleKind.ZBV)}
    text = pipecut.summary(plan)
    assert f"ruled out (4 of {len(plan.candidates)} pairs):" in text
    assert f"  {batch} x gpipe/1f1b/zero-bubble/zbv: {ONE_SAMPLE}" in text
    assert f"lowest predicted step of {len(plan.candidates) - 4} pairs weighed" in text
