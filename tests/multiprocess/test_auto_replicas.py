"""compile(..., data_parallel="auto") on 4 ranks: rank 0 chooses D replicas × K stages, every
rank builds the ("dp", "pp") mesh, and training matches the unsplit model on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import pipecut
from examples import EXAMPLES
from pipecut.errors import InputError
from tests.harness import run_ranks
from tests.multiprocess.test_hybrid import LR, _aliases, _full_grads, _plain_two_steps
from tests.reference import COUNTED, assert_parity

pytestmark = pytest.mark.dist


def _auto(rank: int, world: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = EXAMPLES["gpt"]()  # a global batch of 16
    alias = _aliases(model)
    pipe = pipecut.compile(
        model, inputs, loss_fn=loss_fn, target=target, microbatches=8,
        schedule="1f1b", data_parallel="auto", runtime=pipecut.RuntimeOptions(timeout=60),
        measure=COUNTED,  # D x K and the split from counted costs: the same sums every run
    )
    dp = pipe.plan.data_parallel
    assert dp is not None
    replica = dist.get_rank(pipe.dp_group) if pipe.dp_group is not None else 0
    share = len(target) // dp.replicas
    rows = slice(replica * share, (replica + 1) * share)
    local_inputs, local_target = (inputs[0][rows],), target[rows]
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    steps = []
    for _ in range(2):
        loss = pipe.step(local_inputs, local_target)
        steps.append({"loss": loss, "grads": _full_grads(alias, pipe)})
        opt.step()
        opt.zero_grad()
    dp_size = dist.get_world_size(pipe.dp_group) if pipe.dp_group is not None else 1
    try:  # auto spreads over every rank: a smaller count is refused on every rank, before planning
        pipecut.compile(model, inputs, 2, loss_fn=loss_fn, target=target,
                        microbatches=8, data_parallel="auto")
        refused = "no error"
    except InputError as e:
        refused = str(e)
    return {"refused": refused, "plan": pipe.plan.to_json(), "replica": replica, "dp_size": dp_size,
            "stages": pipe.stages, "steps": steps}


@pytest.mark.timeout(120)
def test_auto_data_parallel_builds_the_chosen_mesh_and_matches_the_whole_batch() -> None:
    results = run_ranks(_auto, 4, timeout=110)
    plans = {r["plan"] for r in results}
    assert len(plans) == 1  # every rank runs rank 0's plan
    plan = pipecut.Plan.from_json(plans.pop())
    dp = plan.data_parallel
    assert dp is not None and dp.replicas * plan.num_ranks == 4
    chosen = [c for c in plan.replica_candidates if c.note == "chosen"]
    assert [(c.replicas, c.stages) for c in chosen] == [(dp.replicas, plan.num_ranks)]
    # a microbatch of 16 / 8 = 2 samples cannot split over 4 replicas: weighed and ruled out
    assert [c.step_ms for c in plan.replica_candidates if (c.replicas, c.stages) == (4, 1)] == [None]
    assert plan.batch_size * dp.replicas == 16  # the plan is one replica's share
    # the mesh: D replica groups of K ranks each, every stage held once per replica
    assert all(r["dp_size"] == dp.replicas for r in results)
    assert sorted(r["replica"] for r in results) == sorted(list(range(dp.replicas)) * plan.num_ranks)
    assert sorted(r["stages"] for r in results) == sorted([(s,) for s in range(plan.num_ranks)] * dp.replicas)
    assert all("process group (4); pass devices=None or devices=4" in r["refused"] for r in results)
    # The reference is the unsplit model on all 16 samples for two SGD steps; step 1 checks that
    # the optimizer saw the replica-averaged gradients. Tolerances as in tests/reference.py
    # (float32; only the summation order differs: per replica, per microbatch, then averaged).
    for step, (ref_loss, ref_grads) in enumerate(_plain_two_steps(LR)):
        try:
            assert_parity(ref_loss, ref_grads, [r["steps"][step] for r in results])
        except AssertionError as e:
            raise AssertionError(f"D={dp.replicas} K={plan.num_ranks} step {step}: {e}") from e
