"""ZBV on real ranks: two stages per rank on a V (rank 0 runs the embedding and the head with
the loss, rank K - 1 the turn of the V), and the loss, every gradient and the clipped norm
equal the unsplit model's, and so does an evaluation step. One fork of K = 2 ranks runs every scenario."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from examples import EXAMPLES
from tests.harness import run_ranks
from tests.reference import COUNTED, RTOL, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist

SCENARIOS = [("gpt", 4), ("gpt", 8), ("mlp", 4)]  # (example, microbatches)


def _scenarios(rank: int, world: int, scenarios: list[tuple[str, int]]) -> list[dict[str, Any]]:
    results = []
    for name, m in scenarios:
        model, inputs, loss_fn, target = EXAMPLES[name]()
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=m,
            schedule="zbv", runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
        )
        loss = pipe.step(inputs, target, record=True)
        ran = sorted({e.action[0] for e in pipe.events})
        grads = pipeline_grads(model, pipe)
        norm = pipe.clip_grad_norm_(float("inf"))  # nothing clipped: the total norm only
        pipe.eval()
        with torch.no_grad():
            val = pipe.step(inputs, target)  # forward only, on the same V
        results.append({
            "loss": loss, "grads": grads, "norm": norm, "val": val, "stages": pipe.stages,
            "ran": ran,
            "num_stages": pipe.plan.num_stages, "schedule": pipe.plan.schedule.value,
        })
    return results


@pytest.mark.timeout(300)
def test_zbv_matches_the_unsplit_model() -> None:
    per_rank = run_ranks(_scenarios, 2, SCENARIOS, timeout=280)
    for i, (name, m) in enumerate(SCENARIOS):
        ref_loss, ref_grads = reference(EXAMPLES[name], m, False)
        results = [rank[i] for rank in per_rank]
        assert [r["stages"] for r in results] == [(0, 3), (1, 2)]  # the V: rank 0 holds first and last
        assert [r["ran"] for r in results] == [["0", "3"], ["1", "2"]]
        assert results[0]["num_stages"] == 4 and results[0]["schedule"] == "zbv"
        assert_parity(ref_loss, ref_grads, results)
        ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
        model, inputs, loss_fn, target = EXAMPLES[name]()
        with torch.no_grad():
            ref_val = loss_fn(model.eval()(**inputs) if isinstance(inputs, dict) else model.eval()(*inputs), target)
        for r in results:
            torch.testing.assert_close(r["norm"], ref_norm, rtol=RTOL, atol=1e-6)
            torch.testing.assert_close(r["val"], ref_val, rtol=RTOL, atol=1e-6)
