"""``compile(..., microbatches="auto", schedule="auto")`` on a BatchNorm model at batch 4 and 8,
K = 2: the planner rules out one-sample microbatches (issue 27: it crashed on them) and the
pipeline matches the plain model run microbatch by microbatch (BatchNorm normalises each
microbatch by its own statistics and updates its running statistics once per microbatch, in
order): loss, every gradient and every buffer (running mean and variance, batches tracked).

The split is pinned (stage 1 begins at ``b``) so measured times cannot change which stage sums
what; the microbatch count and schedule the planner picks are read from the plan and the
reference follows that count. fp32 tolerances of tests/reference.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from pipecut.core.batching import split_microbatches
from tests.harness import run_ranks
from tests.reference import ATOL, RTOL, assert_parity, pipeline_grads
from tests.unit.planning.test_autoplan_unrunnable import ONE_SAMPLE, BatchNormNet

pytestmark = pytest.mark.dist

BATCHES = (4, 8)


def _built(batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = BatchNormNet()
    torch.manual_seed(batch)
    return model, torch.randn(batch, 8), torch.randn(batch, 4)


def _ranks(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    for batch in BATCHES:
        model, x, y = _built(batch)
        pipe = pipecut.compile(
            model, (x,), world, loss_fn=torch.nn.functional.mse_loss, target=y,
            microbatches="auto", schedule="auto", partition=pipecut.PartitionOptions(split=("b",)),
            measure=pipecut.MeasureOptions(calibration_steps=0, repeats=1, warmup=0),
            runtime=pipecut.RuntimeOptions(timeout=120),
        )
        loss = pipe.step((x,), y)
        out.append({
            "loss": loss, "grads": pipeline_grads(model, pipe),
            "buffers": {n: b.detach().clone() for n, b in pipe.named_buffers()},
            "microbatches": pipe.plan.microbatches, "schedule": pipe.plan.schedule.value,
            "ruled_out": sorted({c.microbatches for c in pipe.plan.candidates if c.note.startswith(ONE_SAMPLE)}),
        })
    return out


def _reference(batch: int, microbatches: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The plain model, microbatch by microbatch: the mean loss, gradients and buffers after."""
    model, x, y = _built(batch)
    xs, ys = split_microbatches((x,), microbatches, batch), split_microbatches(y, microbatches, batch)
    loss = sum(torch.nn.functional.mse_loss(model(*xi), yi) for xi, yi in zip(xs, ys)) / microbatches
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, dict(model.named_buffers())


@pytest.mark.timeout(600)
def test_auto_on_batchnorm_skips_one_sample_microbatches_and_matches_microbatch_by_microbatch() -> None:
    per_rank = run_ranks(_ranks, 2, timeout=580)
    for i, batch in enumerate(BATCHES):
        results = [rank[i] for rank in per_rank]
        m = results[0]["microbatches"]
        assert {r["microbatches"] for r in results} == {m} and {r["schedule"] for r in results} == {results[0]["schedule"]}
        assert batch // m >= 2 and results[0]["ruled_out"] == [batch]  # one-sample microbatches: ruled out
        loss, grads, buffers = _reference(batch, m)
        assert_parity(loss, grads, results)
        merged = {n: b for r in results for n, b in r["buffers"].items()}
        assert merged.keys() == buffers.keys()
        for name, ref in buffers.items():
            torch.testing.assert_close(merged[name], ref, rtol=RTOL, atol=ATOL, msg=lambda msg, n=name, b=batch: f"{b}: {n}: {msg}")
