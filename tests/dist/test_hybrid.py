"""Beyond one stage per rank: interleaved virtual stages, and pipeline x data parallelism."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.device_mesh import init_device_mesh

import pipecut
from examples import EXAMPLES
from tests.harness import run_ranks
from tests.reference import assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


def _interleaved(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in names:
        model, inputs, loss_fn, target = EXAMPLES[name]()
        pipe = pipecut.compile(model, world, example_inputs=inputs, loss_fn=loss_fn, target=target,
                               microbatches=4, schedule="interleaved-1f1b", stages_per_rank=2, timeout=60)
        loss = pipe.step(inputs, target)
        out.append({"loss": loss, "grads": pipeline_grads(model, pipe), "stages": pipe.stages})
    return out


@pytest.mark.timeout(240)
def test_interleaved_virtual_stages_match_the_unsplit_model() -> None:
    names = ["gpt", "mlp"]
    results = run_ranks(_interleaved, 2, names, timeout=220)
    assert results[0][0]["stages"] == (0, 2) and results[1][0]["stages"] == (1, 3)
    for i, name in enumerate(names):
        ref_loss, ref_grads = reference(EXAMPLES[name], 4, per_microbatch=False)
        assert_parity(ref_loss, ref_grads, [r[i] for r in results])


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    model, inputs, loss_fn, target = EXAMPLES["gpt"]()  # the whole batch of 16
    half = slice(8 * replica, 8 * replica + 8)  # each replica trains on its own half
    local_inputs, local_target = (inputs[0][half],), target[half]
    pipe = pipecut.compile(model, mesh, example_inputs=local_inputs, loss_fn=loss_fn,
                           target=local_target, microbatches=4, timeout=60)
    loss = pipe.step(local_inputs, local_target)
    return {"loss": loss, "grads": pipeline_grads(model, pipe), "replica": replica,
            "stage": pipe.stage}


@pytest.mark.timeout(240)
def test_two_stages_times_two_replicas_match_the_whole_batch() -> None:
    results = run_ranks(_hybrid, 4, timeout=220)
    assert sorted((r["replica"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The reference is the unsplit model on all 16 samples; every rank must hold its gradient.
    ref_loss, ref_grads = reference(EXAMPLES["gpt"], 4, per_microbatch=False)
    assert_parity(ref_loss, ref_grads, results)
